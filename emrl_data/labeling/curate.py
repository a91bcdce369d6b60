"""Curate one case: load -> labels -> frames -> report rows, or rejections. The per-case driver.

`curate_case` is what a flow task (or the CLI, or a benchmark) calls for each case. Data defects arrive as
`CaseDataError` from deep code and leave as `Rejection`s here; any other exception is a bug and is recorded as
`unexpected_error` (with the traceback in the detail) so one bad case never stops a run of thousands; the flow fails
at the end when there are more than it tolerates.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import shutil
import struct
import traceback
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import xxhash

from emrl_data import __version__
from emrl_data.atomic_write import write_bytes_atomic
from emrl_data.config import CurateConfig
from emrl_data.labeling.frames import build_frames
from emrl_data.labeling.labels import OrganLabels, label_organ
from emrl_data.organs import PLAUSIBLE_ORGAN_VOLUME_CM3  # noqa: F401 - re-exported (flows, qa)
from emrl_data.outcome import CaseDataError, Rejection, RejectReason
from emrl_data.reading.atlas import (
    ORGAN_STRUCTURES,
    USED_STRUCTURES,
    AtlasOrganMeta,
    CaseRef,
    lesion_files,
    printable,
    probe_file,
    special_entries,
    structure_of,
    unrecognised_lesion_files,
)
from emrl_data.reading.case_images import CaseImages, open_case
from emrl_data.reading.fileio import (
    FileChangedError,
    NotRegularFileError,
    check_unchanged,
    open_regular,
    read_regular_bytes,
)
from emrl_data.text.report import (
    render_evidence,
    render_findings,
    render_impression,
    render_prompt,
    render_report,
)
from emrl_data.types import Organ, row_values


logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CaseResult:
    """Everything one case produced: organ rows (with frames) and rejections."""

    case_id: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    file_digests: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # case-level notes for the run's warnings (special files)


# Reasons that condemn the whole case when raised without an organ: the grid or geometry itself is wrong, so every
# mask of the case is suspect (docs/contract.md#input). With `organ` set, any reason costs only that organ's row.
_CASE_LEVEL_REASONS = frozenset(
    {"mask_grid_mismatch", "mask_orientation_conflict", "geometry_conflict", "implausible_spacing"}
)


def curate_case(
    ref: CaseRef,
    *,
    split: str,
    cfg: CurateConfig,
    metadata: Mapping[Organ, AtlasOrganMeta] | None = None,
) -> CaseResult:
    """Curate one case into up to three organ rows; never raises for a problem of this case's data or files.

    The error boundary: a `CaseDataError` becomes a rejection (of its organ when it names one, of the whole case for
    a grid/geometry reason without an organ, else of the organ being labelled); an `OSError` on a case file becomes
    `unreadable_file` naming the file; any other exception is a bug (`unexpected_error`).

    Args:
        ref: where the case's files are.
        split: "train" or "test".
        cfg: the curation config.
        metadata: the metadata CSV's weak labels for this case (None when there is no CSV row).

    A named pipe, socket or device (or a symlink to one) in the case's folders that no rejection names (no row
    needed it) is named in `CaseResult.warnings` instead: it was never opened.

    Returns:
        The rows (one per organ that could be labelled) and the rejections (whole case, or per organ).
    """
    result = _curate(ref, split=split, cfg=cfg, metadata=metadata)
    rejected = {r.path for r in result.rejections}
    result.warnings = [
        f"{rel}: {kind}, not read (no row uses it)" for rel, kind in special_entries(ref) if rel not in rejected
    ]
    for message in result.warnings:
        logger.warning("%s: %s", ref.case_id, message)
    return result


def _curate(
    ref: CaseRef, *, split: str, cfg: CurateConfig, metadata: Mapping[Organ, AtlasOrganMeta] | None
) -> CaseResult:
    result = CaseResult(ref.case_id)
    try:
        probe_file(ref.ct_path, ref.relative(ref.ct_path))
        images = open_case(ref, cfg=cfg.load)
    except CaseDataError as err:
        result.rejections.append(_rejection(ref, None, "load", err))
        return result
    except OSError as err:
        result.rejections.append(_unreadable(ref, None, "load", err))
        return result
    except Exception as err:  # a bug: recorded per case, fails the flow at the end
        result.rejections.append(_unexpected(ref, None, "load", err))
        return result
    for organ in Organ:
        step, files = "labels", tuple[str, ...]()
        try:
            files = lesion_files(ref, organ)
            labels = label_organ(_OrganSource(images, organ, files), organ, cfg=cfg.labels)
            step = "frames"
            row = _organ_row(ref, images, labels, split=split, cfg=cfg, meta=(metadata or {}).get(organ))
            extra, warnings = _lesion_columns(ref, organ, files, labels)
            result.rows.append({**row, **extra, "warnings": row["warnings"] + warnings})
        except CaseDataError as err:
            if err.organ is None and str(err.reason) in _CASE_LEVEL_REASONS:
                result.rows.clear()
                result.rejections = [r for r in result.rejections if r.reason == RejectReason.UNEXPECTED_ERROR]
                result.rejections.append(_rejection(ref, None, "load", err))
                break
            result.rejections.append(_rejection(ref, organ, step, err, files))
        except OSError as err:
            result.rejections.append(_unreadable(ref, organ, step, err))
        except Exception as err:
            result.rejections.append(_unexpected(ref, organ, step, err))
    result.file_digests = dict(images.file_digests)
    return result


class _OrganSource:
    """The case's images as `label_organ` reads them, with the organ's lesion mask made by the lesion-file rule."""

    def __init__(self, images: CaseImages, organ: Organ, files: tuple[str, ...]) -> None:
        self._images = images
        self._lesion = ORGAN_STRUCTURES[organ].lesion_mask
        self._files = files

    @property
    def ct_hu(self) -> np.ndarray:
        return self._images.ct_hu

    @property
    def spacing_mm(self) -> tuple[float, float, float]:
        return self._images.spacing_mm

    def has(self, structure: str) -> bool:
        return bool(self._files) if structure == self._lesion else self._images.has(structure)

    def mask(self, structure: str) -> np.ndarray | None:
        if structure != self._lesion:
            return self._images.mask(structure)
        union: np.ndarray | None = None
        for name in self._files:
            part = self._images.mask(name)
            if part is not None:
                union = part if union is None else np.logical_or(union, part)
        return union

    def mask_crop(self, structure: str, box: tuple[slice, slice, slice]) -> np.ndarray | None:
        """`CaseImages.mask_crop` (values checked inside `box` only); the lesion: its union mask, cropped."""
        if structure != self._lesion:
            return self._images.mask_crop(structure, box)
        full = self.mask(structure)
        return None if full is None else full[box]

    def mask_box(self, structure: str) -> tuple[tuple[slice, slice, slice] | None] | None:
        """The box `CaseImages.mask_box` found for `structure` (the lesion: the union over its files), or None."""
        if structure != self._lesion:
            return self._images.mask_box(structure)
        boxes = []
        for name in self._files:
            if not self._images.has(name):
                continue
            known = self._images.mask_box(name)
            if known is None:
                return None
            if known[0] is not None:
                boxes.append(known[0])
        if not boxes:
            return (None,)
        return (tuple(slice(min(b[i].start for b in boxes), max(b[i].stop for b in boxes)) for i in range(3)),)  # type: ignore[return-value]


def _lesion_columns(
    ref: CaseRef, organ: Organ, files: tuple[str, ...], labels: OrganLabels
) -> tuple[dict[str, Any], list[str]]:
    """(`lesion_files` and `qa_flags` columns, warnings about lesion-like files no rule reads)."""
    unknown = unrecognised_lesion_files(ref, organ)
    flags = []
    low, high = PLAUSIBLE_ORGAN_VOLUME_CM3[organ]
    volume_cm3 = labels.organ_volume_mm3 / 1000.0
    if volume_cm3 < low:
        flags.append("organ_volume_low")
    elif volume_cm3 > high:
        flags.append("organ_volume_high")
    warnings = []
    if unknown:
        flags.append("unrecognised_lesion_file")
        used = ", ".join(files) if files else "none (the row says no lesion)"
        names = ", ".join(f"{n}.nii*" for n in unknown)
        warnings.append(f"{names}: lesion-like file(s) no rule reads, not used; lesion files used: {used}")
    return {"lesion_files": list(files), "qa_flags": flags}, warnings


def _organ_row(
    ref: CaseRef,
    images: CaseImages,
    labels: OrganLabels,
    *,
    split: str,
    cfg: CurateConfig,
    meta: AtlasOrganMeta | None,
) -> dict[str, Any]:
    frames = build_frames(
        images.ct_hu,
        images.spacing_mm,
        labels.organ_box_xyzxyz_vox,
        labels.key_slice_z_vox,
        labels.bbox_xyxy_vox,
        cfg=cfg.frames,
    )
    organ = labels.organ
    findings = render_findings(
        organ,
        has_lesion=labels.has_lesion,
        lesion_count=labels.lesion_count,
        long_axis_mm=labels.long_axis_mm,
        short_axis_mm=labels.short_axis_mm,
        volume_mm3=labels.volume_mm3,
        location=labels.location,
        attenuation=labels.attenuation,
    )
    impression = render_impression(
        organ,
        has_lesion=labels.has_lesion,
        lesion_count=labels.lesion_count,
        long_axis_mm=labels.long_axis_mm,
        location=labels.location,
        attenuation=labels.attenuation,
    )
    evidence = None
    if labels.has_lesion:
        assert frames.key_slice_frame is not None and frames.bbox_qwen is not None
        evidence = render_evidence(frames.key_slice_frame, frames.bbox_qwen)
    # Column values come from the dataclasses that declare the columns (`emrl_data.tables.records`); the rest from here.
    return {
        "case_id": ref.case_id,
        "organ": str(organ),
        "split": split,
        **row_values(labels),
        "spacing_mm": [float(s) for s in images.spacing_mm],
        "shape_vox": [int(s) for s in images.ct_hu.shape],
        **row_values(frames),
        "findings": findings,
        "impression": impression,
        "report": render_report(findings, impression, evidence),
        "prompt": render_prompt(organ, frames.n_frames),
        **_atlas_columns(labels, meta, cfg),
        "warnings": list(images.warnings),
        "pipeline_version": __version__,
        "config_fingerprint": cfg.fingerprint(),
        "frames": [
            {"bytes": png, "path": f"{ref.case_id}_{organ}_{i:02d}.png"} for i, png in enumerate(frames.pngs, start=1)
        ],
    }


def _atlas_columns(labels: OrganLabels, meta: AtlasOrganMeta | None, cfg: CurateConfig) -> dict[str, Any]:
    """The metadata CSV's values beside ours, and whether they agree (docs/contract.md#labels: kept, never silently preferred).

    Agreement: same lesion count and, for positives, long axis within max(0.5 cm, 20 %) (the size rule of docs/contract.md#scoring),
    same location set and same attenuation wherever the CSV states them.
    """
    if meta is None:
        return {
            "atlas_lesion_count": None,
            "atlas_long_axis_cm": None,
            "atlas_location": None,
            "atlas_attenuation": None,
            "atlas_organ_volume_cm3": None,
            "atlas_agreement": None,
        }
    agree = True
    if meta.lesion_count is not None:
        agree &= meta.lesion_count == labels.lesion_count
    if labels.has_lesion and labels.long_axis_mm is not None:
        if meta.long_axis_cm is not None:
            ours_cm = labels.long_axis_mm / 10.0
            agree &= abs(ours_cm - meta.long_axis_cm) <= max(0.5, 0.2 * meta.long_axis_cm)
        if meta.location is not None:
            agree &= tuple(meta.location) == tuple(labels.location)
        if meta.attenuation is not None:
            agree &= meta.attenuation == labels.attenuation
    return {
        "atlas_lesion_count": meta.lesion_count,
        "atlas_long_axis_cm": meta.long_axis_cm,
        "atlas_location": None if meta.location is None else list(meta.location),
        "atlas_attenuation": meta.attenuation,
        "atlas_organ_volume_cm3": meta.organ_volume_cm3,
        "atlas_agreement": bool(agree),
    }


def _rejection(
    ref: CaseRef, organ: Organ | None, step: str, err: CaseDataError, lesion: tuple[str, ...] = ()
) -> Rejection:
    """The rejection of `err`: of `err.organ` when set, else of `organ` (None = the whole case), naming the file."""
    organ_name = err.organ if err.organ is not None else (None if organ is None else str(organ))
    detail, path = err.detail, err.path
    if path is None and organ_name in {str(o) for o in Organ}:  # label errors know the organ, not the file
        structures = ORGAN_STRUCTURES[Organ(organ_name)]
        if err.reason == RejectReason.LESION_OUTSIDE_ORGAN:
            names: tuple[str, ...] = lesion or (structures.lesion_mask,)
        else:
            names = structures.organ_masks
        path = ", ".join(_structure_rel(ref, n) for n in names)
        detail = f"{detail} [{path}]"
    return Rejection(ref.case_id, organ_name, step, err.reason, detail, path)


def _structure_rel(ref: CaseRef, structure: str) -> str:
    try:
        path = ref.structure_path(structure)
    except CaseDataError as err:
        return err.path or structure
    return ref.relative(path or ref.mask_dir / f"{structure}.nii.gz")


def _unreadable(ref: CaseRef, organ: Organ | None, step: str, err: OSError) -> Rejection:
    """`unreadable_file` for an OSError met while reading a case file (permission, I/O error, vanished file)."""
    name = err.filename if isinstance(err.filename, str | bytes | os.PathLike) else None
    rel = printable(ref.relative(Path(os.fsdecode(name)))) if name is not None else ref.case_id
    code = errno.errorcode.get(err.errno or 0)
    reason = f"{err.strerror or err}" + (f", {code}" if code else "")
    detail = f"{rel}: cannot be read ({reason})"
    if isinstance(err, NotRegularFileError | FileChangedError):  # the kind or the change says it all
        detail = f"{rel}: {err.strerror}"
    organ_name = None if organ is None else str(organ)
    return Rejection(ref.case_id, organ_name, step, RejectReason.UNREADABLE_FILE, detail, rel if name else None)


def _unexpected(ref: CaseRef, organ: Organ | None, step: str, err: Exception) -> Rejection:
    logger.exception("unexpected error on %s (%s, %s)", ref.case_id, organ, step)
    tb = "".join(traceback.format_exception_only(type(err), err)).strip()
    where = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    detail = printable(f"{tb}" + (f" at {Path(where.filename).name}:{where.lineno}" if where else ""))
    return Rejection(ref.case_id, None if organ is None else str(organ), step, RejectReason.UNEXPECTED_ERROR, detail)


# --------------------------------------------------------------------------------------------------------------------
# Resumability: a content key per case


def case_cache_key(ref: CaseRef, cfg: CurateConfig, split: str, metadata_key: str = "") -> str:
    """Return a key that changes when any file a row reads, the config, the split or the code version changes.

    Per file a row may read (the CT and every mask-folder file of a structure in `USED_STRUCTURES`) a real checksum
    of its content (`file_checksum`); every other entry of the mask folder enters by its name alone and is never
    opened (a stray huge file or a named pipe costs nothing; its name stays in the key because the rows' warnings
    name lesion-like files no rule reads). Paths do not enter the key, so a moved atlas reuses its cache. Never
    raises for a file problem: an unreadable file, a special file (named pipe, device) or a folder enters the key as
    its error, so the case is curated (and rejected as `unreadable_file`) and is curated again once it is fixed.
    """
    digest = hashlib.sha256()
    digest.update(f"{__version__}|{cfg.fingerprint()}|{ref.case_id}|{split}|{metadata_key}".encode())
    entries: list[tuple[str, Path | None]] = [("ct", ref.ct_path)]
    try:
        names = sorted(os.listdir(ref.mask_dir))
    except (FileNotFoundError, NotADirectoryError):
        names = []
    except OSError as err:
        names = []
        digest.update(f"|segmentations/|error {err.errno}".encode())
    entries += [(name, ref.mask_dir / name if structure_of(name) in USED_STRUCTURES else None) for name in names]
    for rel, path in entries:
        if path is None:
            fingerprint = "name only"
        else:
            try:
                fingerprint = file_checksum(path) if os.path.lexists(path) else "absent"
            except NotRegularFileError as err:
                fingerprint = f"not a regular file: {err.kind}"
            except OSError as err:
                fingerprint = f"error {err.errno}"
        digest.update(f"|{rel}|{fingerprint}".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()[:32]


_HEAD_BYTES = 65536
_CHUNK_BYTES = 1 << 20


def file_checksum(path: Path) -> str:
    """Return a checksum of a file's content: `gz:`-prefixed for a trusted gzip trailer, else `xxh3:` of every byte.

    A gzip file's trailer (CRC32 and ISIZE of its payload) is a checksum of the payload when the file is ONE gzip
    member: the loader verifies that CRC while inflating, so the trailer cannot disagree with what is read. It is
    used (with the size and the sha256 of the first 64 KiB) only when ISIZE equals the payload size the NIfTI header
    in the first bytes implies; a multi-member stream, trailing padding or any other doubt falls back to xxh3-128 of
    the whole file, as does every uncompressed file.

    Only a regular file is opened (`open_regular`), and never more than the size `stat` reported at the start is read.

    Raises:
        NotRegularFileError: a named pipe, socket, device or folder (never opened, never read).
        FileChangedError: the file changed size or was rewritten while it was read.
        OSError: the file cannot be read.
    """
    with open_regular(path) as fh:
        before = os.fstat(fh.fileno())
        size = before.st_size
        head = fh.read(min(_HEAD_BYTES, size))
        if head[:2] == b"\x1f\x8b" and size >= 18:
            fh.seek(size - 8)
            tail = fh.read(8)
            expected = _nifti_payload_size(head)
            if len(tail) == 8 and expected is not None and struct.unpack("<I", tail[4:])[0] == expected % 2**32:
                check_unchanged(fh, before, path)
                return f"gz:{size}:{hashlib.sha256(head).hexdigest()}:{tail.hex()}"
        fh.seek(0)
        hasher = xxhash.xxh3_128()
        left = size
        while left > 0 and (chunk := fh.read(min(_CHUNK_BYTES, left))):
            hasher.update(chunk)
            left -= len(chunk)
        if left:
            raise FileChangedError(path, f"{size} bytes at the start, {size - left} could be read")
        check_unchanged(fh, before, path)
    return f"xxh3:{size}:{hasher.hexdigest()}"


def _nifti_payload_size(head: bytes) -> int | None:
    """The uncompressed size (vox_offset + voxel bytes) the NIfTI-1/2 header in a gzip head implies; None if unsure."""
    try:
        header = zlib.decompressobj(wbits=31).decompress(head, 544)
    except zlib.error:
        return None
    for endian in "<>":
        if len(header) >= 348 and struct.unpack(f"{endian}i", header[:4])[0] == 348:
            dims = struct.unpack(f"{endian}8h", header[40:56])
            bitpix, vox_offset = (
                struct.unpack(f"{endian}h", header[72:74])[0],
                struct.unpack(f"{endian}f", header[108:112])[0],
            )
        elif len(header) >= 540 and struct.unpack(f"{endian}i", header[:4])[0] == 540:
            dims = struct.unpack(f"{endian}8q", header[16:80])
            bitpix, vox_offset = (
                struct.unpack(f"{endian}h", header[14:16])[0],
                struct.unpack(f"{endian}q", header[168:176])[0],
            )
        else:
            continue
        ndim = dims[0]
        if not 1 <= ndim <= 7 or bitpix <= 0 or bitpix % 8 or not math.isfinite(vox_offset) or vox_offset < 0:
            return None
        if any(d <= 0 for d in dims[1 : ndim + 1]):
            return None
        return int(vox_offset) + math.prod(dims[1 : ndim + 1]) * bitpix // 8
    return None


# --------------------------------------------------------------------------------------------------------------------
# The per-case work store: what makes runs resumable


STORE_FORMAT = 1


class CaseStore:
    """Finished cases on disk, one entry per content key; a format that cannot run code.

    `<key>.frames.arrow` (Arrow IPC: organ, index, PNG bytes, path per frame) is written first, then
    `<key>.case.json` (rows without frames, rejections, digests, the sha256 of the frames file, and the sha256 of its
    own payload), which marks completion. Both are written atomically. An entry that is missing, truncated, empty or
    fails a checksum is "not there" (`load_rows` returns None, with a warning), so the case is curated again.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _json(self, key: str) -> Path:
        return self.root / f"{key}.case.json"

    def _arrow(self, key: str) -> Path:
        return self.root / f"{key}.frames.arrow"

    def has(self, key: str) -> bool:
        """True when the case with this key is finished and its entry passes its checksums."""
        return self.load_rows(key) is not None

    def save(self, key: str, result: CaseResult) -> None:
        """Store a finished case (frames first, so the JSON file marks completion)."""
        frames = pa.table(
            {
                "organ": pa.array([row["organ"] for row in result.rows for _ in row["frames"]], pa.string()),
                "bytes": pa.array([f["bytes"] for row in result.rows for f in row["frames"]], pa.binary()),
                "path": pa.array([f["path"] for row in result.rows for f in row["frames"]], pa.string()),
            }
        )
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, frames.schema) as writer:
            writer.write_table(frames)
        arrow_bytes = sink.getvalue().to_pybytes()
        payload = {
            "format": STORE_FORMAT,
            "case_id": result.case_id,
            "rows": [
                {**{k: v for k, v in row.items() if k != "frames"}, "frames_bytes": _frame_bytes(row)}
                for row in result.rows
            ],
            "rejections": [r.to_row() for r in result.rejections],
            "file_digests": dict(result.file_digests),
            "frames_sha256": hashlib.sha256(arrow_bytes).hexdigest(),
        }
        if result.warnings:  # only then: entries of cases without special files stay as they were
            payload["warnings"] = list(result.warnings)
        body = json.dumps(payload, sort_keys=True, allow_nan=True, default=_json_scalar)
        document = json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), "payload": body})
        _write_atomic(arrow_bytes, self._arrow(key))
        _write_atomic(document.encode(), self._json(key))

    def load_rows(self, key: str) -> CaseResult | None:
        """Return the case without frames (each row has `frames_bytes`), or None when the entry is absent or broken."""
        found = self._payload(key)
        if found is None:
            return None
        payload = found[0]
        rejections = [
            Rejection(r["case_id"], r["organ"], r["step"], RejectReason(r["reason"]), r["detail"], r["path"])
            for r in payload["rejections"]
        ]
        return CaseResult(
            payload["case_id"],
            list(payload["rows"]),
            rejections,
            dict(payload["file_digests"]),
            list(payload.get("warnings", [])),
        )

    def _payload(self, key: str) -> tuple[dict[str, Any], bytes] | None:
        path = self._json(key)
        if not path.is_file():
            return None
        try:
            document = json.loads(_read_bounded(path, _MAX_JSON_BYTES))
            body = document["payload"]
            if hashlib.sha256(body.encode()).hexdigest() != document["sha256"]:
                raise ValueError("checksum mismatch")
            payload: dict[str, Any] = json.loads(body)
            if payload.get("format") != STORE_FORMAT:
                raise ValueError(f"format {payload.get('format')!r}, expected {STORE_FORMAT}")
            arrow = _read_bounded(self._arrow(key), _MAX_ARROW_BYTES)
            if hashlib.sha256(arrow).hexdigest() != payload["frames_sha256"]:
                raise ValueError(f"{self._arrow(key).name}: checksum mismatch")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            logger.warning("case store entry %s is unusable (%s): the case is curated again", path.name, err)
            return None
        return payload, arrow

    def load_frames(self, key: str) -> dict[str, list[dict[str, Any]]]:
        """Return the frames of a case per organ.

        Raises:
            ValueError: the frames file does not match the checksum its entry recorded (changed since `has`).
        """
        found = self._payload(key)
        if found is None:
            raise ValueError(f"case store entry {key} is missing or corrupt")
        payload, arrow = found
        table = pa.ipc.open_file(pa.py_buffer(arrow)).read_all()
        frames: dict[str, list[dict[str, Any]]] = {row["organ"]: [] for row in payload["rows"]}
        for organ, data, name in zip(
            table["organ"].to_pylist(), table["bytes"].to_pylist(), table["path"].to_pylist(), strict=True
        ):
            frames[organ].append({"bytes": data, "path": name})
        return frames


def _json_scalar(value: Any) -> Any:
    """numpy scalars and arrays in a row -> Python values (what the Parquet writer would store anyway)."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable in a case store row")


def _frame_bytes(row: Mapping[str, Any]) -> int:
    return sum(len(f["bytes"]) for f in row["frames"])


_MAX_JSON_BYTES = 64 << 20  # rows of one case without frames: a few KiB
_MAX_ARROW_BYTES = 4 << 30  # frames of one case: a few MiB


def _read_bounded(path: Path, limit: int) -> bytes:
    """Read a store file that must be a regular file of at most `limit` bytes (a planted named pipe, link to a
    device or huge file is refused before it is opened or read)."""
    try:
        return read_regular_bytes(path, limit)
    except NotRegularFileError as err:
        raise ValueError(f"{path.name}: {err.strerror}") from None


def _write_atomic(data: bytes, path: Path) -> None:
    if path.is_dir() and not path.is_symlink():  # something planted where an entry belongs: replace it
        logger.warning("case store: %s is a folder where an entry belongs; replaced", path)
        shutil.rmtree(path)
    write_bytes_atomic(data, path)  # no room: `OutputWriteError` naming the entry, no temporary file left
