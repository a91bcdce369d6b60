"""Ground truth of the synthetic atlas: what was written and what a correct pipeline must find, and how it is computed.

The truth of an organ is an `emrl_data.labeling.labels.OrganLabels` (one definition of an organ row's labels),
computed by plain numpy/scipy code on the canonical arrays before they are written, independent of
`emrl_data.labeling.labels.label_organ`: 26-connected components (`scipy.ndimage.label`), components under 10 mm^3
dropped, key slice = maximum area of the largest component (`np.argmax`, ties lowest z), its 2-D box on that slice,
the longest-diameter slice (scipy convex hull of the voxel corners per slice, ties lowest z), the organ's and the
lesion's 3-D boxes, location = parts holding > 10 % of its voxels that lie in any part (`single_location` organs such
as the kidney: the majority part, ties to the first), attenuation by RadGPT's rule, long/short axis analytic from the
lesion ellipsoid's in-plane radii (2 max(rx, ry), 2 min(rx, ry)).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
from scipy import ndimage
from scipy.spatial import ConvexHull

from emrl_data.config import LabelConfig
from emrl_data.labeling.labels import OrganLabels
from emrl_data.organs import LOCATION_NAMES, ORGAN_STRUCTURES, organ_spec
from emrl_data.outcome import RejectReason
from emrl_data.synthetic.geometry import union_box
from emrl_data.synthetic.phantom import Phantom
from emrl_data.types import Attenuation, Organ, row_values


TRUTH_JSON_NAME = "synthetic_truth.json"
TRUTH_FORMAT_VERSION = 2  # 2: organ truth is an `OrganLabels` (adds max_diameter_z_vox and the 3-D boxes)


def _truth_to_dict(truth: OrganLabels) -> dict[str, Any]:
    """Return an organ's truth as a JSON-ready dict (its columns and its organ)."""
    return {"organ": str(truth.organ), **row_values(truth)}


def _truth_from_dict(data: dict[str, Any]) -> OrganLabels:
    """Inverse of `_truth_to_dict`."""
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    values["organ"] = Organ(data["organ"])
    return OrganLabels(**values)


@dataclass(frozen=True, slots=True)
class ExpectedRejection:
    """A rejection a correct pipeline must record for a defective case.

    Attributes:
        reason: the reason code.
        organ: the organ whose file carries the defect, or None when the whole case is affected (CT defects,
            invalid id, metadata row). A driver may reject the whole case for `mask_grid_mismatch` (docs/contract.md#input):
            match on (case, reason) first.
        path: the offending file or folder, relative to the atlas root (posix).
    """

    reason: RejectReason
    organ: Organ | None
    path: str | None

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {"reason": str(self.reason), "organ": str(self.organ) if self.organ else None, "path": self.path}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExpectedRejection:
        """Inverse of `to_dict`."""
        organ = data["organ"]
        return cls(RejectReason(data["reason"]), Organ(organ) if organ else None, data["path"])


@dataclass(frozen=True, slots=True)
class CaseTruth:
    """What was written for one case and what a correct pipeline must find.

    Attributes:
        case_id: the spec's id (the folder may differ, see `folder_name`).
        folder_name: the case folder's name on disk.
        layout: "split" or "combined".
        split: "train"/"test" as listed in the split files, or None when no split files were written.
        shape: canonical grid (X, Y, Z) of the CT.
        spacing_mm: canonical voxel size (x, y, z) in mm as stored in the headers (float32 values).
        storage: "RAS" or "LPS".
        quirks: sorted quirk names.
        defect: the defect name or None.
        ct_path: the CT file, relative to the atlas root (may be absent on disk: `missing_ct`).
        mask_dir: the `segmentations/` folder, relative to the atlas root.
        organs: organ -> truth (an `OrganLabels`, computed here independently of `emrl_data.labeling.labels`), for every
            registered organ (also for organs a defect makes unusable).
        expected_rejections: what the defect must produce (empty for clean cases).
    """

    case_id: str
    folder_name: str
    layout: str
    split: str | None
    shape: tuple[int, int, int]
    spacing_mm: tuple[float, float, float]
    storage: str
    quirks: tuple[str, ...]
    defect: str | None
    ct_path: str
    mask_dir: str
    organs: dict[Organ, OrganLabels]
    expected_rejections: tuple[ExpectedRejection, ...] = ()

    def expects_row(self, organ: Organ) -> bool:
        """Return True when a correct pipeline produces the organ row of this case.

        A rejection of the whole case (organ None) removes every row, except `bad_metadata_row`, which only
        flags the CSV values; an organ-level rejection removes that organ's row.
        """
        for rejection in self.expected_rejections:
            if rejection.reason is RejectReason.BAD_METADATA_ROW:
                continue
            if rejection.organ is None or rejection.organ is Organ(organ):
                return False
        return True

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {
            "case_id": self.case_id,
            "folder_name": self.folder_name,
            "layout": self.layout,
            "split": self.split,
            "shape": list(self.shape),
            "spacing_mm": list(self.spacing_mm),
            "storage": self.storage,
            "quirks": list(self.quirks),
            "defect": self.defect,
            "ct_path": self.ct_path,
            "mask_dir": self.mask_dir,
            "organs": {str(organ): _truth_to_dict(truth) for organ, truth in self.organs.items()},
            "expected_rejections": [r.to_dict() for r in self.expected_rejections],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CaseTruth:
        """Inverse of `to_dict`."""
        return cls(
            case_id=data["case_id"],
            folder_name=data["folder_name"],
            layout=data["layout"],
            split=data["split"],
            shape=cast("tuple[int, int, int]", tuple(int(n) for n in data["shape"])),
            spacing_mm=cast("tuple[float, float, float]", tuple(float(s) for s in data["spacing_mm"])),
            storage=data["storage"],
            quirks=tuple(data["quirks"]),
            defect=data["defect"],
            ct_path=data["ct_path"],
            mask_dir=data["mask_dir"],
            organs={Organ(k): _truth_from_dict(v) for k, v in data["organs"].items()},
            expected_rejections=tuple(ExpectedRejection.from_dict(r) for r in data["expected_rejections"]),
        )


@dataclass(frozen=True, slots=True)
class AtlasTruth:
    """Ground truth of a whole synthetic atlas, in the order the cases were given.

    Attributes:
        layout: "split" or "combined".
        cases: one `CaseTruth` per spec.
        metadata_csv: the metadata CSV file relative to the root, or None when not written.
        split_files: the split files relative to the root (empty when not written).
    """

    layout: str
    cases: tuple[CaseTruth, ...]
    metadata_csv: str | None = None
    split_files: tuple[str, ...] = ()

    def case(self, case_id: str) -> CaseTruth:
        """Return the truth of `case_id` (KeyError when absent)."""
        for truth in self.cases:
            if truth.case_id == case_id:
                return truth
        raise KeyError(case_id)

    def to_json(self) -> str:
        """Return the truth as JSON text (sorted keys; floats round-trip exactly)."""
        data = {
            "format_version": TRUTH_FORMAT_VERSION,
            "layout": self.layout,
            "metadata_csv": self.metadata_csv,
            "split_files": list(self.split_files),
            "cases": [c.to_dict() for c in self.cases],
        }
        return json.dumps(data, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> AtlasTruth:
        """Parse `to_json` output.

        Raises:
            ValueError: on another format version.
        """
        data = json.loads(text)
        if data.get("format_version") != TRUTH_FORMAT_VERSION:
            raise ValueError(f"format_version={data.get('format_version')} is not {TRUTH_FORMAT_VERSION}.")
        return cls(
            layout=data["layout"],
            cases=tuple(CaseTruth.from_dict(c) for c in data["cases"]),
            metadata_csv=data["metadata_csv"],
            split_files=tuple(data["split_files"]),
        )


def phantom_truth(phantom: Phantom, spacing_mm: tuple[float, float, float]) -> dict[Organ, OrganLabels]:
    """Return the truth of every registered organ of a phantom (`spacing_mm`: as a reader gets it from the header)."""
    return {organ: organ_truth(organ, phantom, spacing_mm) for organ in Organ}


def organ_truth(organ: Organ, phantom: Phantom, spacing_mm: tuple[float, float, float]) -> OrganLabels:
    """Compute an organ's truth with plain scipy/numpy on a box covering the organ and its lesions."""
    voxel_mm3 = float(np.prod(spacing_mm))
    structures = organ_spec(organ)
    organ_parts = [phantom.masks[s] for s in structures.organ_masks]
    lesion = phantom.masks.get(structures.lesion_mask)
    start, shape = union_box(organ_parts + ([lesion] if lesion is not None else []))
    organ_mask = np.zeros(shape, dtype=bool)
    for m in organ_parts:
        organ_mask |= m.embed(start, shape)
    lesion_mask = lesion.embed(start, shape) if lesion is not None else np.zeros(shape, dtype=bool)
    box = tuple(slice(a, a + n) for a, n in zip(start, shape, strict=True))
    ct = np.ascontiguousarray(phantom.ct[box]).astype(np.float64)

    parenchyma = organ_mask & ~lesion_mask
    negative = OrganLabels.negative(
        organ,
        organ_volume_mm3=float(np.count_nonzero(organ_mask)) * voxel_mm3,
        parenchyma_mean_hu=float(ct[parenchyma].mean()),
        parenchyma_sd_hu=float(ct[parenchyma].std()),
        organ_box_xyzxyz_vox=_tight_box(organ_mask, start),
    )
    labels, n = ndimage.label(lesion_mask, structure=np.ones((3, 3, 3), dtype=bool))
    sizes = np.bincount(labels.ravel(), minlength=n + 1)[1:]
    min_voxels = LabelConfig().min_lesion_volume_mm3 / voxel_mm3
    surviving = [i + 1 for i, size in enumerate(sizes) if size >= min_voxels]
    if not surviving:
        return negative
    # Largest by volume; ties -> lowest label = first voxel in C order of (x, y, z).
    largest = max(surviving, key=lambda lab: (sizes[lab - 1], -lab))
    comp = labels == largest
    return replace(
        negative,
        has_lesion=True,
        lesion_count=len(surviving),
        volume_mm3=float(sizes[largest - 1]) * voxel_mm3,
        total_lesion_volume_mm3=float(sum(sizes[lab - 1] for lab in surviving)) * voxel_mm3,
        location=_truth_location(organ, comp, start, shape, phantom),
        **_lesion_truth(organ, comp, ct, start, phantom, spacing_mm, negative),
    )


def _lesion_truth(
    organ: Organ,
    comp: np.ndarray,
    ct: np.ndarray,
    start: tuple[int, ...],
    phantom: Phantom,
    spacing_mm: tuple[float, float, float],
    organ_truth: OrganLabels,
) -> dict[str, Any]:
    """The largest lesion's key slice, boxes, HU, attenuation and (analytic) axes; `comp` is its mask in the box."""
    per_slice = comp.sum(axis=(0, 1))
    key_local = int(np.argmax(per_slice))  # first maximum = lowest z
    xs, ys = np.nonzero(comp[:, :, key_local])
    lesion_mean = float(ct[comp].mean())
    par_mean, par_sd = organ_truth.parenchyma_mean_hu, organ_truth.parenchyma_sd_hu
    if abs(lesion_mean - par_mean) < LabelConfig().iso_sd_fraction * par_sd:
        attenuation = Attenuation.ISO.value
    elif lesion_mean < par_mean:
        attenuation = Attenuation.HYPO.value
    else:
        attenuation = Attenuation.HYPER.value
    # Analytic axes from the placed ellipsoid that overlaps the component most.
    best = max(
        (le for le in phantom.lesions if le.organ is organ),
        key=lambda le: int(np.count_nonzero(le.mask.embed(start, comp.shape) & comp)),
    )
    return {
        "long_axis_mm": 2.0 * max(best.radii_mm[0], best.radii_mm[1]),
        "short_axis_mm": 2.0 * min(best.radii_mm[0], best.radii_mm[1]),
        "attenuation": attenuation,
        "lesion_mean_hu": lesion_mean,
        "key_slice_z_vox": key_local + start[2],
        "max_diameter_z_vox": _longest_diameter_slice(comp, spacing_mm) + start[2],
        "bbox_xyxy_vox": (
            int(xs.min()) + start[0],
            int(ys.min()) + start[1],
            int(xs.max()) + 1 + start[0],
            int(ys.max()) + 1 + start[1],
        ),
        "lesion_box_xyzxyz_vox": _tight_box(comp, start),
    }


def _tight_box(mask: np.ndarray, start: Sequence[int]) -> tuple[int, int, int, int, int, int]:
    """Return the half-open box `(x0, y0, z0, x1, y1, z1)` of a non-empty mask whose voxel 0 is canonical `start`."""
    idx = np.argwhere(mask)
    lo, hi = idx.min(axis=0) + np.asarray(start), idx.max(axis=0) + 1 + np.asarray(start)
    return cast("tuple[int, int, int, int, int, int]", tuple(int(v) for v in (*lo, *hi)))


def _longest_diameter_slice(comp: np.ndarray, spacing_mm: Sequence[float]) -> int:
    """Return the z (in `comp`'s frame) of the longest in-plane outer Feret diameter; ties -> lowest z.

    Brute force with scipy's convex hull over the corners of every voxel of each slice (voxel `(x, y)` covers
    `[x, x+1) x [y, y+1)`), distances from integer corner differences times the spacing.
    """
    scale = np.asarray(spacing_mm[:2], dtype=np.float64)
    best_d2, best_z = -1.0, 0
    for z in range(comp.shape[2]):
        xs, ys = np.nonzero(comp[:, :, z])
        if xs.size == 0:
            continue
        corners = np.unique(
            np.concatenate([np.stack([xs + dx, ys + dy], 1) for dx in (0, 1) for dy in (0, 1)]), axis=0
        ).astype(np.int64)
        hull = corners[ConvexHull(corners).vertices]
        diff = (hull[:, None, :] - hull[None, :, :]) * scale
        d2 = float(np.einsum("ijk,ijk->ij", diff, diff).max())
        if d2 > best_d2:
            best_d2, best_z = d2, z
    return best_z


def _truth_location(
    organ: Organ, comp: np.ndarray, start: tuple[int, ...], shape: tuple[int, ...], phantom: Phantom
) -> tuple[str, ...]:
    """Parts holding > 10 % of the component's part-labelled voxels (`single_location`: the majority part)."""
    counts: dict[str, int] = {}
    any_part = np.zeros(shape, dtype=bool)
    for stem, name in ORGAN_STRUCTURES[organ].parts:
        part = phantom.masks[stem].embed(start, shape)
        counts[name] = int(np.count_nonzero(comp & part))
        any_part |= part
    denominator = int(np.count_nonzero(comp & any_part))
    if denominator == 0:
        return ()
    if organ_spec(organ).single_location:  # the majority part; max keeps the first of equals (kidney: left)
        return (max(LOCATION_NAMES[organ], key=lambda name: counts[name]),)
    threshold = LabelConfig().location_min_fraction
    return tuple(name for name in LOCATION_NAMES[organ] if counts[name] / denominator > threshold)
