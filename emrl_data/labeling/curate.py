"""Curate one case: load -> labels -> frames -> report rows, or rejections. The per-case driver.

`curate_case` is what a flow task (or the CLI, or a benchmark) calls for each case. Data defects arrive as
`CaseDataError` from deep code and leave as `Rejection`s here; any other exception is a bug and is recorded as
`unexpected_error` (with the traceback in the detail) so one bad case never stops a run of thousands; the flow fails
at the end when there are more than it tolerates.
"""

from __future__ import annotations

import errno
import logging
import os
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from emrl_data import __version__
from emrl_data.config import CurateConfig
from emrl_data.labeling.fingerprint import CtFingerprint, ct_fingerprint
from emrl_data.labeling.frames import build_frames
from emrl_data.labeling.labels import OrganLabels, label_organ
from emrl_data.organs import PLAUSIBLE_ORGAN_VOLUME_CM3  # noqa: F401 - re-exported (flows, qa)
from emrl_data.outcome import CaseDataError, Rejection, RejectReason
from emrl_data.reading.atlas import (
    ORGAN_STRUCTURES,
    AtlasOrganMeta,
    CaseRef,
    lesion_files,
    printable,
    probe_file,
    special_entries,
    unrecognised_lesion_files,
)
from emrl_data.reading.case_images import CaseImages, open_case
from emrl_data.reading.fileio import FileChangedError, NotRegularFileError
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
    fingerprint: CtFingerprint | None = None  # the CT's slice hashes (None: the CT could not be read)


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
    try:
        result.fingerprint = ct_fingerprint(images.ct_hu)
    except Exception as err:  # a bug: recorded per case, fails the flow at the end
        result.rejections.append(_unexpected(ref, None, "fingerprint", err))
    for organ in [o for o in Organ if ref.annotates(o)]:  # an organ the dataset does not annotate is unknown: no row
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


def fingerprint_case(ref: CaseRef, *, cfg: CurateConfig) -> CtFingerprint | None:
    """The fingerprint of a case's CT alone (a case store entry written without one), or None when it cannot be read."""
    try:
        return ct_fingerprint(open_case(ref, cfg=cfg.load).ct_hu)
    except (CaseDataError, OSError) as err:
        logger.warning("%s: no fingerprint, the CT cannot be read (%s)", ref.case_id, err)
        return None


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
