"""`build-sft-set` on the Hub release: one Prefect task per part pair, within a scratch budget, resumable, incremental.

Per pair (`curate_part_task`): skip it when the part ledger knows it (same part checksums, config, splits and
metadata, every case in the store), else download the mask part (verified, resumable) and unpack it, then download the
image part and stream its CTs out one at a time, curating each case as soon as its CT is on disk and deleting it
after (docs/decisions.md#hub-parts-streamed-not-unpacked). A part that fails its sha256 twice turns its cases
into `part_checksum_mismatch` rejections. Parts run on any task runner; how many at once follows from the budget.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed

from emrl_data import __version__
from emrl_data.config import CurateConfig
from emrl_data.labeling.curate import CaseResult, CaseStore
from emrl_data.outcome import Rejection, RejectReason
from emrl_data.reading.archive import IMAGE_KIND, MASK_KIND, PartReading, ScratchMeter, finish_broken, read_part
from emrl_data.reading.atlas import (
    CT_FILE_STEM,
    AtlasOrganMeta,
    AtlasPlan,
    CaseRef,
    hash_split,
    nifti_path,
    plan_metadata,
    read_split_files,
)
from emrl_data.reading.release import HubFile, PartPair, format_size, plan_concurrency, side_files
from emrl_data.types import Organ, is_valid_case_id
from flows._common import Progress
from flows.hub_atlas import HubRelease, PartLedger, download_verified, resolve_release
from flows.runners import check_cluster, make_task_runner


@dataclass(frozen=True)
class PartJob:
    """Everything one part task needs (picklable: it may run in another process or on another machine)."""

    pair: PartPair
    urls: dict[str, str]  # kind (image_only / mask_only) -> download URL of that part at the pinned commit
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

    def ledger_key(self) -> str:
        """A key that changes with anything the pair's cases depend on: part checksums, config, splits, metadata."""
        files = [(f.path, f.size, f.sha256) for f in (self.pair.image, self.pair.mask) if f is not None]
        meta = sorted((c, sorted((str(o), repr(m)) for o, m in v.items())) for c, v in self.metadata.items())
        parts = [__version__, CurateConfig.from_dict(self.cfg_dict).fingerprint(), files, sorted(self.splits.items())]
        parts += [sorted(self.conflicts.items()), meta, self.test_fraction, self.last_case]
        return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]

    def split_of(self, case_id: str) -> str:
        """The case's split: the split files' when they list it, else the case-id hash split (as on disk)."""
        return self.splits.get(case_id) or str(hash_split(case_id, test_fraction=self.test_fraction))

    def wanted(self, case_id: str) -> bool:
        """False for a case past `last_case` (`limit`)."""
        return self.last_case is None or int(case_id[6:]) <= self.last_case


@dataclass
class PartOutcome:
    """What one part task did: the store key of each case, warnings, and its cost."""

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


class PartProgress:
    """Two progress artifacts of one part: bytes downloaded and cases curated (updated every 10 %)."""

    def __init__(self, job: PartJob) -> None:
        self.total_bytes = max(job.pair.bytes, 1)
        self.total_cases = job.pair.end - job.pair.start + 1
        self.bytes = self.cases = 0
        self._marks = [0.0, 0.0]
        self._ids = [
            create_progress_artifact(0.0, description=f"{job.pair.name}: bytes downloaded"),
            create_progress_artifact(0.0, description=f"{job.pair.name}: cases curated"),
        ]

    def add_bytes(self, n: int) -> None:
        """Count `n` bytes downloaded."""
        self.bytes += n
        self._update(0, 100.0 * self.bytes / self.total_bytes)

    def add_case(self) -> None:
        """Count one case curated."""
        self.cases += 1
        self._update(1, 100.0 * self.cases / self.total_cases)

    def finish(self) -> None:
        """Both at 100 %."""
        self._update(0, 100.0, force=True)
        self._update(1, 100.0, force=True)

    def _update(self, which: int, pct: float, force: bool = False) -> None:
        if force or pct >= self._marks[which] + 10.0:
            self._marks[which] = pct
            update_progress_artifact(artifact_id=self._ids[which], progress=min(pct, 100.0))


CurateOne = Callable[..., tuple[str, str, bool]]  # `flows.build_sft_set.curate_bounded`: one case into the store


@task(cache_policy=NO_CACHE)
def curate_part_task(job: PartJob, curate_one: CurateOne) -> PartOutcome:
    """Curate one part pair into the case store (or find it in the part ledger); see the module docstring.

    `curate_one` curates one case under the per-case time bound (`flows.build_sft_set.curate_bounded`, handed in
    by the flow: the flow module imports this one).
    """
    started = time.perf_counter()
    store, ledger, key = CaseStore(Path(job.store_dir)), PartLedger(Path(job.ledger_dir)), job.ledger_key()
    entry = ledger.get(key)
    if entry is not None and all(store.has(k) for _, k in entry["cases"]):
        get_run_logger().info("%s: in the part ledger, no byte read", job.pair.name)
        done = [(c, k, True) for c, k in entry["cases"]]
        return PartOutcome(job.pair.name, done, list(entry["warnings"]), from_ledger=True)
    work = Path(job.scratch_dir) / job.pair.name
    for kind in (IMAGE_KIND, MASK_KIND):  # what an interrupted run unpacked; its partial downloads stay
        shutil.rmtree(work / kind, ignore_errors=True)
    meter, progress = ScratchMeter(job.allowance_bytes), PartProgress(job)
    outcome = PartOutcome(job.pair.name)
    try:
        _read_pair(job, key, work, meter, store, progress, outcome, curate_one)
    finally:
        for kind in (IMAGE_KIND, MASK_KIND):
            shutil.rmtree(work / kind, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    outcome.seconds, outcome.peak_scratch_bytes = time.perf_counter() - started, meter.peak_bytes
    if outcome.verified and not any(k.startswith("timeout-") for _, k, _ in outcome.done):
        ledger.put(
            key, {"part": job.pair.name, "cases": [[c, k] for c, k, _ in outcome.done], "warnings": outcome.warnings}
        )
    progress.finish()
    return outcome


def _read_pair(
    job: PartJob,
    key: str,
    work: Path,
    meter: ScratchMeter,
    store: CaseStore,
    progress: PartProgress,
    outcome: PartOutcome,
    curate_bounded: CurateOne,
) -> None:
    """Masks first (unpacked whole: small), then the image part's CTs one by one, each case curated as it lands."""
    cfg, pair = CurateConfig.from_dict(job.cfg_dict), job.pair
    readings: dict[str, PartReading] = {}
    finished: dict[str, tuple[str, str, bool]] = {}
    case_bytes: dict[str, int] = {}

    def on_mask(case_id: str, path: Path) -> None:
        case_bytes[case_id] = case_bytes.get(case_id, 0) + path.stat().st_size

    def curate(case_id: str, path: Path | None = None) -> None:
        masks = readings.get(MASK_KIND)
        if masks is not None and masks.broken and case_id not in masks.cases:
            masks.reject(case_id, RejectReason.CORRUPT_ARCHIVE, f"{masks.archive} broke before this case's masks")
        if job.wanted(case_id) and not any(case_id in r.rejected for r in readings.values()):
            if case_id in job.conflicts:
                finished[case_id] = _store_rejection(store, key, _conflict(case_id, job.conflicts[case_id]))
            else:
                ref, meta = _case_ref(work, case_id), job.metadata.get(case_id)
                finished[case_id] = curate_bounded(ref, job.split_of(case_id), meta, cfg, store, job.case_timeout_s)
            progress.add_case()
        held = case_bytes.pop(case_id, 0) + (path.stat().st_size if path is not None else 0)
        for kind in (IMAGE_KIND, MASK_KIND):
            shutil.rmtree(work / kind / case_id, ignore_errors=True)
        meter.release(held)

    for kind, part, on_file in ((MASK_KIND, pair.mask, on_mask), (IMAGE_KIND, pair.image, curate)):
        if part is None:
            continue
        path = _fetch(job, kind, part, work, meter, progress, outcome)
        if path is None:  # failed its checksum twice: every case of the range is out
            _reject_part(job, key, store, part, outcome)
            return
        readings[kind] = PartReading(part.path)
        with path.open("rb") as fh:
            read_part(fh, name=part.path, kind=kind, dest=work, case_range=(pair.start, pair.end), meter=meter,
                      on_file=on_file, reading=readings[kind])  # fmt: skip
        path.unlink()
        meter.release(part.size)
    known = list(dict.fromkeys(c for r in readings.values() for c in r.cases))
    for reading in readings.values():
        finish_broken(reading, known, set(finished))
    for case_id in (c for c in known if c not in finished):
        curate(case_id)  # masks without a CT: curated as on disk (missing_ct)
    for reading in readings.values():
        outcome.warnings += reading.warnings()
        for case_id, rejection in sorted(reading.rejected.items()):
            if not is_valid_case_id(case_id) or job.wanted(case_id):
                finished[case_id] = _store_rejection(store, key, rejection)
    outcome.done = [finished[c] for c in sorted(finished)]


def _fetch(
    job: PartJob,
    kind: str,
    part: HubFile,
    work: Path,
    meter: ScratchMeter,
    progress: PartProgress,
    outcome: PartOutcome,
) -> Path | None:
    """Download one part into the scratch folder (its bytes reserved first); None when it failed verification twice."""
    meter.reserve(part.size, part.path)
    done, read, mismatch = download_verified(
        job.urls[kind], work / f"{kind}.tar.gz", part, on_bytes=progress.add_bytes
    )
    outcome.bytes_read += read
    if done is None:
        meter.release(part.size)
        outcome.verified = False
        outcome.warnings.append(f"{part.path}: {mismatch}; fetched twice, its cases are rejected")
        return None
    return done.path


def _reject_part(job: PartJob, key: str, store: CaseStore, part: HubFile, outcome: PartOutcome) -> None:
    detail = f"{part.path} does not match the sha256 the Hub lists for it, fetched twice; the case was not read"
    outcome.done = [
        _store_rejection(
            store, key, Rejection(c, None, "fetch", RejectReason.PART_CHECKSUM_MISMATCH, detail, part.path)
        )
        for c in job.pair.case_ids()
        if job.wanted(c)
    ]


def _case_ref(root: Path, case_id: str) -> CaseRef:
    """The case as `discover_cases` would see it in the split layout under `root` (the pair's scratch folder)."""
    ct = nifti_path(root / IMAGE_KIND / case_id / CT_FILE_STEM)
    return CaseRef(case_id, root, ct, root / MASK_KIND / case_id / "segmentations")


def _conflict(case_id: str, files: list[str]) -> Rejection:
    detail = f"{case_id} is listed in {' and '.join(files)}: a train/test leak; the case is not used"
    return Rejection(case_id, None, "discover", RejectReason.SPLIT_CONFLICT, detail, files[0])


def _store_rejection(store: CaseStore, part_key: str, rejection: Rejection) -> tuple[str, str, bool]:
    """Store a case the archive (or the split files) ruled out; its key is the part's, so a changed part retries it."""
    key = (
        f"part-{part_key[:16]}-{hashlib.sha256(rejection.case_id.encode('utf-8', 'surrogateescape')).hexdigest()[:16]}"
    )
    store.save(key, CaseResult(rejection.case_id, rejections=[rejection]))
    return rejection.case_id, key, False


# --------------------------------------------------------------------------------------------------------------------
# The flow side: plan the parts, run them, gather


@dataclass
class HubCuration:
    """What the Hub path hands back to the flow: a plan (splits, metadata, warnings), the cases and their keys."""

    plan: AtlasPlan
    case_ids: list[str]
    keys: dict[str, str]
    n_cached: int
    release: HubRelease
    summary: dict[str, Any]


@dataclass(frozen=True)
class HubOptions:
    """The Hub path's settings."""

    revision: str | None
    scratch_dir: Path
    scratch_budget_bytes: int


def curate_release(
    repo_id: str,
    options: HubOptions,
    *,
    out: Path,
    cfg: CurateConfig,
    store: CaseStore,
    test_fraction: float,
    limit: int | None,
    runner: tuple[str, str | None, int],
    case_timeout_s: float | None,
    curate_one: CurateOne,
) -> HubCuration:
    """Resolve the revision, read the side files, run one task per part pair, and gather the cases."""
    logger = get_run_logger()
    release = resolve_release(repo_id, options.revision)
    logger.info(
        "%s: revision %s is commit %s, %d part pairs", repo_id, release.revision, release.sha, len(release.pairs)
    )
    meta_root = out / ".work" / "hub" / release.sha
    for side in side_files(release.files):
        done, _, mismatch = download_verified(release.url(side.path), meta_root / side.path, side)
        if done is None:
            raise RuntimeError(f"{side.path} of {release.source}: {mismatch}; fetched twice")
    listing = read_split_files(meta_root)
    warnings = list(release.warnings)
    if listing is not None:
        warnings += [*listing.warnings, *(problem for _, problem in listing.problems)]
    wanted = {c for p in release.pairs for c in p.case_ids()}
    metadata, meta_rejections = plan_metadata(meta_root, wanted, warnings)
    pairs, last_case = _limited(release.pairs, limit)
    concurrency, allowance = plan_concurrency(pairs, options.scratch_budget_bytes, runner[2])
    logger.info("scratch budget %s: %d part pair(s) at once, %s each", format_size(options.scratch_budget_bytes),
                concurrency, format_size(allowance))  # fmt: skip
    jobs = [
        PartJob(
            pair=p,
            urls={k: release.url(f.path) for k, f in ((IMAGE_KIND, p.image), (MASK_KIND, p.mask)) if f is not None},
            splits={c: str(s) for c, s in (listing.splits.items() if listing else ()) if p.holds(c)},
            conflicts={c: list(f) for c, f in (listing.conflicts.items() if listing else ()) if p.holds(c)},
            metadata={c: m for c, m in metadata.items() if p.holds(c)},
            test_fraction=test_fraction,
            cfg_dict=cfg.to_dict(),
            store_dir=str(store.root),
            ledger_dir=str(out / ".work" / "parts"),
            scratch_dir=str(options.scratch_dir),
            allowance_bytes=allowance,
            case_timeout_s=case_timeout_s,
            last_case=last_case,
        )
        for p in pairs
    ]
    outcomes = _run_parts(jobs, concurrency, runner[0], runner[1], store, curate_one)
    return _gather(release, listing is not None, metadata, meta_rejections, warnings, outcomes, options, concurrency)


def _limited(pairs: tuple[PartPair, ...], limit: int | None) -> tuple[list[PartPair], int | None]:
    """The pairs holding the first `limit` case numbers of the release, and the last case number kept."""
    if limit is None:
        return list(pairs), None
    kept, left = [], limit
    for p in pairs:
        if left <= 0:
            break
        kept.append(p)
        last, left = min(p.end, p.start + left - 1), left - (p.end - p.start + 1)
    return kept, last


def _run_parts(
    jobs: list[PartJob], concurrency: int, kind: str, address: str | None, store: CaseStore, curate_one: CurateOne
) -> list[PartOutcome]:
    """Run the part tasks, at most `concurrency` at once (a window, whatever the runner's own size)."""
    check_cluster(kind, address, store.root)
    progress = Progress(len(jobs), "curating part pairs", unit="parts")
    outcomes: list[PartOutcome] = []
    queue = list(jobs)
    with make_task_runner(kind, concurrency, address=address) as runner:
        pending: dict[Any, PartJob] = {}
        while queue or pending:
            while queue and len(pending) < concurrency:
                job = queue.pop(0)
                pending[runner.submit(curate_part_task, parameters={"job": job, "curate_one": curate_one})] = job
            future = next(iter(as_completed(list(pending))))
            del pending[future]
            outcome = future.result()
            outcomes.append(outcome)
            progress.advance(1, resumed=int(outcome.from_ledger))
    return sorted(outcomes, key=lambda o: o.part)


def _gather(
    release: HubRelease,
    has_listing: bool,
    metadata: Mapping[str, dict[Organ, AtlasOrganMeta]],
    meta_rejections: list[Rejection],
    warnings: list[str],
    outcomes: list[PartOutcome],
    options: HubOptions,
    concurrency: int,
) -> HubCuration:
    keys = {c: k for o in outcomes for c, k, _ in o.done}
    case_ids = sorted(keys)
    seen = set(case_ids)
    rejections = tuple(r for r in meta_rejections if r.case_id in seen or not is_valid_case_id(r.case_id))
    warnings = [*warnings, *(w for o in outcomes for w in o.warnings)]
    split_source = "IID split files" if has_listing else "case-id hash"
    plan = AtlasPlan(
        "split",
        (),
        {},
        split_source,
        {c: dict(m) for c, m in metadata.items() if c in seen},
        rejections,
        tuple(warnings),
    )
    rows = [o.row() for o in outcomes]
    summary = {
        "repo": release.repo_id,
        "revision": release.revision,
        "sha": release.sha,
        "source": release.source,
        "part_pairs": len(outcomes),
        "parts_read": sum(not o.from_ledger for o in outcomes),
        "parts_from_ledger": sum(o.from_ledger for o in outcomes),
        "parts_failed_verification": sum(not o.verified for o in outcomes),
        "bytes_read": sum(o.bytes_read for o in outcomes),
        "scratch_budget_bytes": options.scratch_budget_bytes,
        "parts_at_once": concurrency,
        "peak_scratch_bytes_per_part": max((o.peak_scratch_bytes for o in outcomes), default=0),
        "per_part": rows,
    }
    create_table_artifact(key="build-sft-set-hub-parts", table=rows, description=f"part pairs of {release.source}")
    n_cached = sum(cached for o in outcomes for _, _, cached in o.done)
    return HubCuration(plan, case_ids, keys, n_cached, release, summary)


def hub_summary_lines(hub: Mapping[str, Any]) -> list[str]:
    """The summary.md lines of a Hub run: the pinned revision, parts read or skipped, bytes and time per part."""
    lines = [
        f"- atlas: `{hub['source']}` (revision `{hub['revision']}`)",
        f"- part pairs: {hub['part_pairs']} ({hub['parts_read']} read, {hub['parts_from_ledger']} already curated, "
        f"{hub['parts_failed_verification']} failed verification); {format_size(hub['bytes_read'])} read; "
        f"{hub['parts_at_once']} at once within a scratch budget of {format_size(hub['scratch_budget_bytes'])}",
    ]
    per_part: Callable[[dict[str, Any]], str] = lambda r: (  # noqa: E731
        f"{r['part']} {format_size(r['bytes_read'])} {r['seconds']} s"
    )
    return lines + ["- per part: " + "; ".join(per_part(r) for r in hub["per_part"])]
