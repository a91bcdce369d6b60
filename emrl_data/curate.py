"""Curate one case: load -> labels -> frames -> report rows, or rejections. The per-case driver.

`curate_case` is what a flow task (or the CLI, or a benchmark) calls for each case. Data defects arrive as
`CaseDataError` from deep code and leave as `Rejection`s here; any other exception is a bug and is recorded as
`unexpected_error` (with the traceback in the detail) so one bad case never stops a run of thousands; the flow fails
at the end when there are more than it tolerates.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import threading
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from emrl_data import __version__
from emrl_data.atlas import ORGAN_STRUCTURES, AtlasOrganMeta, CaseRef
from emrl_data.config import CurateConfig
from emrl_data.frames import build_frames
from emrl_data.labels import OrganLabels, label_organ
from emrl_data.nifti import CaseImages, open_case
from emrl_data.outcome import CaseDataError, Rejection, RejectReason
from emrl_data.report import (
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


def curate_case(
    ref: CaseRef,
    *,
    split: str,
    cfg: CurateConfig,
    metadata: Mapping[Organ, AtlasOrganMeta] | None = None,
) -> CaseResult:
    """Curate one case into up to three organ rows; never raises for a problem of this case's data.

    Args:
        ref: where the case's files are.
        split: "train" or "test".
        cfg: the curation config.
        metadata: the metadata CSV's weak labels for this case (None when there is no CSV row).

    Returns:
        The rows (one per organ that could be labelled) and the rejections (whole case, or per organ).
    """
    result = CaseResult(ref.case_id)
    try:
        images = open_case(ref, cfg=cfg.load)
    except CaseDataError as err:
        result.rejections.append(_rejection(ref, None, "load", err))
        return result
    except Exception as err:  # a bug: recorded per case, fails the flow at the end
        result.rejections.append(_unexpected(ref, None, "load", err))
        return result
    for organ in Organ:
        try:
            labels = label_organ(images, organ, cfg=cfg.labels)
        except CaseDataError as err:
            if err.reason == RejectReason.MASK_GRID_MISMATCH:
                # SPEC §2: a mask that cannot be placed on the CT grid rejects the whole case (its other masks
                # share the same provenance and cannot be trusted either).
                result.rows.clear()
                result.rejections = [r for r in result.rejections if r.reason == RejectReason.UNEXPECTED_ERROR] + [
                    _rejection(ref, None, "load", err, keep_organ=False)
                ]
                return result
            result.rejections.append(_rejection(ref, organ, "labels", err))
            continue
        except Exception as err:
            result.rejections.append(_unexpected(ref, organ, "labels", err))
            continue
        try:
            result.rows.append(_organ_row(ref, images, labels, split=split, cfg=cfg, meta=(metadata or {}).get(organ)))
        except CaseDataError as err:
            result.rejections.append(_rejection(ref, organ, "frames", err))
        except Exception as err:
            result.rejections.append(_unexpected(ref, organ, "frames", err))
    result.file_digests = dict(images.file_digests)
    return result


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
    # Column values come from the dataclasses that declare the columns (`emrl_data.records`); the rest from here.
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
    """The metadata CSV's values beside ours, and whether they agree (SPEC §4: kept, never silently preferred).

    Agreement: same lesion count and, for positives, long axis within max(0.5 cm, 20 %) (the size rule of SPEC §7),
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
    ref: CaseRef, organ: Organ | None, step: str, err: CaseDataError, *, keep_organ: bool = True
) -> Rejection:
    organ_name = err.organ if err.organ is not None else (None if organ is None else str(organ))
    organ_name = str(organ_name) if keep_organ and organ_name is not None else None
    detail, path = err.detail, err.path
    if path is None and organ is not None:  # label errors know the organ, not the file: name the file here
        structures = ORGAN_STRUCTURES[organ]
        names = [structures.lesion_mask] if err.reason == RejectReason.LESION_OUTSIDE_ORGAN else structures.organ_masks
        path = ", ".join(ref.relative(ref.structure_path(n) or ref.mask_dir / f"{n}.nii.gz") for n in names)
        detail = f"{detail} [{path}]"
    return Rejection(ref.case_id, organ_name, step, err.reason, detail, path)


def _unexpected(ref: CaseRef, organ: Organ | None, step: str, err: Exception) -> Rejection:
    logger.exception("unexpected error on %s (%s, %s)", ref.case_id, organ, step)
    tb = "".join(traceback.format_exception_only(type(err), err)).strip()
    where = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    detail = f"{tb}" + (f" at {Path(where.filename).name}:{where.lineno}" if where else "")
    return Rejection(ref.case_id, None if organ is None else str(organ), step, RejectReason.UNEXPECTED_ERROR, detail)


# --------------------------------------------------------------------------------------------------------------------
# Resumability: a content key per case


def case_cache_key(ref: CaseRef, cfg: CurateConfig, split: str, metadata_key: str = "") -> str:
    """Return a key that changes when any of the case's files, the config, the split or the code version changes.

    It is keyed on file CONTENT, cheaply: per file its name, size, the sha256 of its first 64 KiB and its last
    8 bytes (for gzip: the CRC32 and size of the whole uncompressed payload). Paths do not enter the key, so a moved
    atlas reuses its cache.
    """
    digest = hashlib.sha256()
    digest.update(f"{__version__}|{cfg.fingerprint()}|{ref.case_id}|{split}|{metadata_key}".encode())
    files = [ref.ct_path] if ref.ct_path.is_file() else []
    if ref.mask_dir.is_dir():
        files += sorted(p for p in ref.mask_dir.iterdir() if p.is_file())
    for path in files:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(65536)
            fh.seek(max(size - 8, 0))
            tail = fh.read(8)
        rel = "ct" if path == ref.ct_path else path.name
        digest.update(f"|{rel}|{size}|".encode() + hashlib.sha256(head).digest() + tail)
    return digest.hexdigest()[:32]


# --------------------------------------------------------------------------------------------------------------------
# The per-case work store: what makes runs resumable


class CaseStore:
    """Finished cases on disk, one entry per content key: `<key>.rows.pkl` (rows without frames, rejections,
    digests) and `<key>.frames.pkl` (frames per organ). Written atomically; an entry exists only when complete.

    Pickle is fine here: the store is a private cache of this pipeline, never published or read from elsewhere.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def has(self, key: str) -> bool:
        """True when the case with this key is finished."""
        return (self.root / f"{key}.rows.pkl").is_file()

    def save(self, key: str, result: CaseResult) -> None:
        """Store a finished case (frames first, so the rows file marks completion)."""
        frames = {row["organ"]: row["frames"] for row in result.rows}
        light = CaseResult(
            result.case_id,
            rows=[
                {**{k: v for k, v in row.items() if k != "frames"}, "frames_bytes": _frame_bytes(row)}
                for row in result.rows
            ],
            rejections=list(result.rejections),
            file_digests=dict(result.file_digests),
        )
        _dump_atomic(frames, self.root / f"{key}.frames.pkl")
        _dump_atomic(light, self.root / f"{key}.rows.pkl")

    def load_rows(self, key: str) -> CaseResult:
        """Return the case without frames (each row has `frames_bytes`, the PNG bytes of its frames)."""
        with (self.root / f"{key}.rows.pkl").open("rb") as fh:
            result: CaseResult = pickle.load(fh)
        return result

    def load_frames(self, key: str) -> dict[str, list[dict[str, Any]]]:
        """Return the frames of a case per organ."""
        with (self.root / f"{key}.frames.pkl").open("rb") as fh:
            frames: dict[str, list[dict[str, Any]]] = pickle.load(fh)
        return frames


def _frame_bytes(row: Mapping[str, Any]) -> int:
    return sum(len(f["bytes"]) for f in row["frames"])


def _dump_atomic(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with tmp.open("wb") as fh:
        pickle.dump(obj, fh, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)
