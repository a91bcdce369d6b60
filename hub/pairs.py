"""One part pair of the release into the case store: the algorithm behind the `build-sft-set` part task, Prefect-free.

`read_pair(job, curate_one, ...)`: skip the pair when the part ledger knows it (same part checksums, config, splits
and metadata, every case in the store); else download the mask part (verified, resumable) and unpack it, then
download the image part and stream its CTs out one at a time, curating each case as soon as its CT is on disk and
deleting it after (docs/decisions.md#hub-parts-streamed-not-unpacked). The image part is read while it downloads
(`hub.download.GrowingFile`): curation overlaps the download, and the pair counts (ledger) only once the part is
verified; a part that fails verification read that way is read again from a verified download, its earlier cases
discarded. A part that fails its sha256 twice turns its cases into `part_checksum_mismatch` rejections.

Scratch is named by content: the pair works in `SCRATCH/pair-<hash of both parts' sha256>/` (its own folder: pairs
running at once never touch each other's), each verified part is kept there as `<sha256>.tar.gz` until every case of
the pair is in the store (a crash while reading it never downloads it again), and the parts unpack into its
`image_only/` and `mask_only/`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

from emrl_data import __version__
from emrl_data.config import CurateConfig
from emrl_data.labeling.case_store import CaseStore
from emrl_data.labeling.curate import CaseResult
from emrl_data.outcome import Rejection, RejectReason
from emrl_data.reading.archive import (
    IMAGE_KIND,
    INFLATE_RATIO,
    INFLATE_SLACK_BYTES,
    MASK_KIND,
    PartReading,
    ScratchMeter,
    finish_broken,
    read_part,
)
from emrl_data.reading.atlas import CT_FILE_STEM, AtlasOrganMeta, CaseRef, hash_split, nifti_path
from emrl_data.reading.release import HubFile, PartPair
from emrl_data.types import Organ, is_valid_case_id
from hub.download import ChecksumMismatchError, DownloadStoppedError, GrowingFile, download_file, download_verified
from hub.ledger import PartLedger
from hub.listing import HubCommit, cached_blob


CurateOne = Callable[..., tuple[str, str, bool]]  # one case into the store: (case id, store key, was cached)


@dataclass(frozen=True)
class PartJob:
    """Everything one part pair needs (picklable: it may run in another process or on another machine)."""

    pair: PartPair
    commit: HubCommit
    splits: dict[str, str]  # case id -> split, for the range's cases the split files list
    conflicts: dict[str, list[str]]  # case id -> the split files that both list it
    metadata: dict[str, dict[Organ, AtlasOrganMeta]]
    test_fraction: float
    cfg_dict: dict[str, Any]
    store_dir: str
    ledger_dir: str
    scratch_dir: str
    allowance_bytes: int
    case_timeout_s: float | None = None
    last_case: int | None = None  # `limit`: cases after this number are not read
    local_root: str | None = None  # a folder of parts read in place (nothing downloaded)

    def ledger_key(self) -> str:
        """A key that changes with anything the pair's cases depend on: part checksums, config, splits, metadata."""
        files = [(f.path, f.size, f.sha256 or f.blob_id) for f in (self.pair.image, self.pair.mask) if f is not None]
        meta = sorted((c, sorted((str(o), repr(m)) for o, m in v.items())) for c, v in self.metadata.items())
        parts: list[Any] = [
            __version__,
            CurateConfig.from_dict(self.cfg_dict).fingerprint(),
            files,
            sorted(self.splits.items()),
        ]
        parts += [sorted(self.conflicts.items()), meta, self.test_fraction, self.last_case]
        return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]

    def split_of(self, case_id: str) -> str:
        """The case's split: the split files' when they list it, else the case-id hash split (as on disk)."""
        return self.splits.get(case_id) or str(hash_split(case_id, test_fraction=self.test_fraction))

    def wanted(self, case_id: str) -> bool:
        """False for a case past `last_case` (`limit`)."""
        return self.last_case is None or int(case_id[6:]) <= self.last_case


def content_name(part: HubFile) -> str:
    """The part's scratch name: its sha256 (else its git blob id, else path and size hashed)."""
    return part.sha256 or part.blob_id or hashlib.sha256(f"{part.path}\0{part.size}".encode()).hexdigest()


def pair_folder(scratch: Path, pair: PartPair) -> Path:
    """`SCRATCH/pair-<hash>`: where a pair unpacks, named by both parts' content."""
    names = [content_name(f) if f is not None else "-" for f in (pair.image, pair.mask)]
    return scratch / f"pair-{hashlib.sha256('/'.join(names).encode()).hexdigest()[:24]}"


def archive_path(scratch: Path, pair: PartPair, part: HubFile) -> Path:
    """`SCRATCH/pair-<hash>/<sha256>.tar.gz`: a verified part, kept until its pair's cases are in the store."""
    return pair_folder(scratch, pair) / f"{content_name(part)}.tar.gz"


def _clear_unpacked(work: Path) -> None:
    """Remove what a pair unpacked (an interrupted run's too); its verified archives stay."""
    for kind in (IMAGE_KIND, MASK_KIND):
        shutil.rmtree(work / kind, ignore_errors=True)


@dataclass
class PartOutcome:
    """What one part pair did: the store key of each case, warnings, and its cost."""

    part: str
    done: list[tuple[str, str, bool]] = field(default_factory=list)  # (case id, store key, was cached)
    warnings: list[str] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0
    peak_scratch_bytes: int = 0
    from_ledger: bool = False
    verified: bool = True

    def row(self) -> dict[str, Any]:
        """The part's row of the summary and its table artifact."""
        return {
            "part": self.part,
            "cases": len(self.done),
            "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 2),
            "peak_scratch_bytes": self.peak_scratch_bytes,
            "from_ledger": self.from_ledger,
            "verified": self.verified,
        }


def read_pair(
    job: PartJob,
    curate_one: CurateOne,
    *,
    on_bytes: Callable[[int], None] | None = None,
    on_case: Callable[[], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> PartOutcome:
    """Curate one part pair into the case store (or find it in the part ledger); see the module docstring.

    `curate_one(ref, split, meta, cfg, store, timeout_s)` curates one case under the per-case time bound;
    `on_bytes` counts bytes downloaded, `on_case` cases curated (progress).
    """
    started = time.perf_counter()
    store, ledger, key = CaseStore(Path(job.store_dir)), PartLedger(Path(job.ledger_dir)), job.ledger_key()
    entry = ledger.get(key)
    if entry is not None and all(store.has(k) for _, k in entry["cases"]):
        if log is not None:
            log(f"{job.pair.name}: in the part ledger, no byte read")
        done = [(c, k, True) for c, k in entry["cases"]]
        return PartOutcome(job.pair.name, done, list(entry["warnings"]), from_ledger=True)
    scratch = Path(job.scratch_dir)
    work = pair_folder(scratch, job.pair)
    _clear_unpacked(work)
    reader = _PairReader(job, key, work, ScratchMeter(job.allowance_bytes), store, curate_one, on_bytes, on_case)
    peak = 0
    try:
        try:
            reader.run(stream=True)
        except _ReadAgainError as again:  # the part read while downloading failed verification: from disk now
            if log is not None:
                log(f"{job.pair.name}: {again}; read again from a verified download")
            _clear_unpacked(work)
            read, peak = reader.outcome.bytes_read, reader.meter.peak_bytes
            meter = ScratchMeter(job.allowance_bytes)
            reader = _PairReader(job, key, work, meter, store, curate_one, on_bytes, on_case, tries=again.tries)
            reader.outcome.bytes_read = read
            reader.run(stream=False)
    finally:
        _clear_unpacked(work)
    outcome = reader.outcome
    outcome.seconds, outcome.peak_scratch_bytes = time.perf_counter() - started, max(peak, reader.meter.peak_bytes)
    if outcome.verified and not any(k.startswith("timeout-") for _, k, _ in outcome.done):
        ledger.put(
            key, {"part": job.pair.name, "cases": [[c, k] for c, k, _ in outcome.done], "warnings": outcome.warnings}
        )
    shutil.rmtree(work, ignore_errors=True)  # every case is in the store: the archives have served
    return outcome


class _ReadAgainError(Exception):
    """The image part read while it downloaded did not end verified: read the pair again from a verified download."""

    def __init__(self, why: str, tries: int) -> None:
        super().__init__(why)
        self.tries = tries  # downloads left for `download_verified`


class _PairReader:
    """The state of one pair being read: what each part found, the cases finished, the bytes each case holds."""

    def __init__(
        self,
        job: PartJob,
        key: str,
        work: Path,
        meter: ScratchMeter,
        store: CaseStore,
        curate_one: CurateOne,
        on_bytes: Callable[[int], None] | None,
        on_case: Callable[[], None] | None,
        tries: int = 2,
    ) -> None:
        self.job, self.key, self.work, self.meter, self.store, self.tries = job, key, work, meter, store, tries
        self.curate_one, self.on_bytes, self.on_case = curate_one, on_bytes, on_case
        self.cfg = CurateConfig.from_dict(job.cfg_dict)
        self.readings: dict[str, PartReading] = {}
        self.finished: dict[str, tuple[str, str, bool]] = {}
        self.case_bytes: dict[str, int] = {}
        self.outcome = PartOutcome(job.pair.name)

    def run(self, *, stream: bool) -> None:
        """Masks first (unpacked whole: small), then the image part's CTs one by one, each case curated as it lands
        (`stream`: while the image part downloads)."""
        pair = self.job.pair
        steps = ((MASK_KIND, pair.mask, self.on_mask), (IMAGE_KIND, pair.image, self.curate))
        for kind, part, on_file in steps:
            if part is None:
                continue
            path = self.in_place(part)
            if path is None and stream and kind == IMAGE_KIND and not self.verified_on_disk(part):
                self.read_while_downloading(kind, part, on_file)
                continue
            path = path or self.fetch(part)
            if path is None:  # failed its checksum twice: every case of the range is out
                self.reject_part(part)
                return
            self.readings[kind] = PartReading(part.path)
            with path.open("rb") as fh:
                read_part(
                    fh,
                    name=part.path,
                    kind=kind,
                    dest=self.work,
                    case_range=(pair.start, pair.end),
                    meter=self.meter,
                    on_file=on_file,
                    reading=self.readings[kind],
                )
        known = list(dict.fromkeys(c for r in self.readings.values() for c in r.cases))
        for reading in self.readings.values():
            finish_broken(reading, known, set(self.finished))
        for case_id in (c for c in known if c not in self.finished):
            self.curate(case_id)  # masks without a CT: curated as on disk (missing_ct)
        for reading in self.readings.values():
            self.outcome.warnings += reading.warnings()
            for case_id, rejection in sorted(reading.rejected.items()):
                if not is_valid_case_id(case_id) or self.job.wanted(case_id):
                    self.finished[case_id] = self.store_rejection(rejection)
        self.outcome.done = [self.finished[c] for c in sorted(self.finished)]

    def on_mask(self, case_id: str, path: Path) -> None:
        """A mask file is on disk: count its bytes against its case."""
        self.case_bytes[case_id] = self.case_bytes.get(case_id, 0) + path.stat().st_size

    def curate(self, case_id: str, path: Path | None = None) -> None:
        """A case's CT is on disk (or the part ended without one): curate it, then delete its files."""
        job = self.job
        masks = self.readings.get(MASK_KIND)
        if masks is not None and masks.broken and case_id not in masks.cases:
            masks.reject(case_id, RejectReason.CORRUPT_ARCHIVE, f"{masks.archive} broke before this case's masks")
        if job.wanted(case_id) and not any(case_id in r.rejected for r in self.readings.values()):
            if case_id in job.conflicts:
                self.finished[case_id] = self.store_rejection(_conflict(case_id, job.conflicts[case_id]))
            else:
                ref, meta = _case_ref(self.work, case_id), job.metadata.get(case_id)
                split = job.split_of(case_id)
                self.finished[case_id] = self.curate_one(ref, split, meta, self.cfg, self.store, job.case_timeout_s)
            if self.on_case is not None:
                self.on_case()
        held = self.case_bytes.pop(case_id, 0) + (path.stat().st_size if path is not None else 0)
        for kind in (IMAGE_KIND, MASK_KIND):
            shutil.rmtree(self.work / kind / case_id, ignore_errors=True)
        self.meter.release(held)

    def in_place(self, part: HubFile) -> Path | None:
        """The part where it already is, read without a download or a copy: in the folder of parts the run was given,
        or in the Hugging Face cache with the listed sha256."""
        if self.job.local_root is not None:
            return Path(self.job.local_root) / part.path
        return cached_blob(self.job.commit.repo_id, part)

    def verified_on_disk(self, part: HubFile) -> bool:
        """A verified copy of the part is in the scratch folder (renamed there only once verified)."""
        dest = archive_path(Path(self.job.scratch_dir), self.job.pair, part)
        return dest.is_file() and dest.stat().st_size == part.size

    def read_while_downloading(self, kind: str, part: HubFile, on_file: Callable[[str, Path], None]) -> None:
        """Download the part in a thread and read it as it lands; raise `_ReadAgainError` unless it ends verified and
        read to its last byte."""
        self.meter.reserve(part.size, part.path)
        dest = archive_path(Path(self.job.scratch_dir), self.job.pair, part)
        partial = dest.with_name(dest.name + ".incomplete")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if partial.exists() and partial.stat().st_size > part.size:
            partial.unlink()  # before the reader can open it
        growing = GrowingFile(partial, dest, part.size, on_read=self.on_bytes)
        result: dict[str, Any] = {}

        def download() -> None:
            try:
                result["done"] = download_file(self.job.commit, part.path, dest, part)
                growing.finish(None)
            except BaseException as err:  # noqa: BLE001 (handed to the reader)
                result["error"] = err
                growing.finish(err)

        thread = threading.Thread(target=download, name=f"download-{part.path}", daemon=True)
        thread.start()
        self.readings[kind] = PartReading(part.path)
        pair, cap = self.job.pair, INFLATE_RATIO * part.size + INFLATE_SLACK_BYTES
        stopped = None
        try:
            with growing:
                read_part(
                    cast(IO[bytes], growing),
                    name=part.path,
                    kind=kind,
                    dest=self.work,
                    case_range=(pair.start, pair.end),
                    meter=self.meter,
                    on_file=on_file,
                    reading=self.readings[kind],
                    max_inflated_bytes=cap,
                )
        except DownloadStoppedError as err:
            stopped = err
        thread.join()
        error, done = result.get("error"), result.get("done")
        self.outcome.bytes_read += done.bytes_read if done is not None else 0
        if isinstance(error, ChecksumMismatchError):
            self.outcome.bytes_read += part.size
            raise _ReadAgainError(str(error), tries=1)
        if error is not None:
            raise error
        if stopped is not None or growing.offset != part.size:
            raise _ReadAgainError(f"{part.path}: {stopped or 'not read to its end'}", tries=2)

    def fetch(self, part: HubFile) -> Path | None:
        """The verified part in the scratch folder (downloaded unless a verified copy is there already; its bytes
        reserved first); None when it failed verification (`tries` downloads)."""
        self.meter.reserve(part.size, part.path)
        dest = archive_path(Path(self.job.scratch_dir), self.job.pair, part)
        if self.verified_on_disk(part):
            return dest
        done, read, mismatch = download_verified(
            self.job.commit, part.path, dest, part, on_bytes=self.on_bytes, tries=self.tries
        )
        self.outcome.bytes_read += read
        if done is None:
            self.meter.release(part.size)
            self.outcome.verified = False
            self.outcome.warnings.append(f"{part.path}: {mismatch}; fetched twice, its cases are rejected")
            return None
        return done.path

    def reject_part(self, part: HubFile) -> None:
        """Every wanted case of the range: `part_checksum_mismatch`."""
        detail = f"{part.path} does not match the sha256 the Hub lists for it, fetched twice; the case was not read"
        self.outcome.done = [
            self.store_rejection(Rejection(c, None, "fetch", RejectReason.PART_CHECKSUM_MISMATCH, detail, part.path))
            for c in self.job.pair.case_ids()
            if self.job.wanted(c)
        ]

    def store_rejection(self, rejection: Rejection) -> tuple[str, str, bool]:
        """Store a case the archive (or the split files) ruled out; its key is the part's, so a changed part retries
        it."""
        digest = hashlib.sha256(rejection.case_id.encode("utf-8", "surrogateescape")).hexdigest()[:16]
        key = f"part-{self.key[:16]}-{digest}"
        self.store.save(key, CaseResult(rejection.case_id, rejections=[rejection]))
        return rejection.case_id, key, False


def _case_ref(root: Path, case_id: str) -> CaseRef:
    """The case as `discover_cases` would see it in the split layout under `root` (the pair's scratch folder)."""
    ct = nifti_path(root / IMAGE_KIND / case_id / CT_FILE_STEM)
    return CaseRef(case_id, root, ct, root / MASK_KIND / case_id / "segmentations")


def _conflict(case_id: str, files: list[str]) -> Rejection:
    detail = f"{case_id} is listed in {' and '.join(files)}: a train/test leak; the case is not used"
    return Rejection(case_id, None, "discover", RejectReason.SPLIT_CONFLICT, detail, files[0])
