"""The AbdomenAtlas 3.0 layout on disk: the only module that knows file names and folder layouts (SPEC §2).

Two layouts are supported:

* split (as released): `image_only/<id>/ct.nii.gz` + `mask_only/<id>/segmentations/<structure>.nii.gz`
* combined (RadGPT's): `<id>/ct.nii.gz` + `<id>/segmentations/<structure>.nii.gz`

Files may also be uncompressed `.nii`. Structure names are spelled as released (notes/atlas.md §1.3).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from emrl_data.types import Organ


@dataclass(frozen=True, slots=True)
class OrganStructures:
    """The mask files of one organ row.

    Attributes:
        organ_masks: files whose union is the organ (both kidneys for `kidney`).
        lesion_mask: the organ's lesion file; absent file + present organ = no lesion.
        parts: sub-structure file -> location name used in `location` (liver segments, pancreas parts, kidney side).
    """

    organ_masks: tuple[str, ...]
    lesion_mask: str
    parts: tuple[tuple[str, str], ...]


ORGAN_STRUCTURES: dict[Organ, OrganStructures] = {
    Organ.LIVER: OrganStructures(
        organ_masks=("liver",),
        lesion_mask="liver_lesion",
        parts=tuple((f"liver_segment_{i}", str(i)) for i in range(1, 9)),
    ),
    Organ.PANCREAS: OrganStructures(
        organ_masks=("pancreas",),
        lesion_mask="pancreatic_lesion",
        parts=(("pancreas_head", "head"), ("pancreas_body", "body"), ("pancreas_tail", "tail")),
    ),
    Organ.KIDNEY: OrganStructures(
        organ_masks=("kidney_left", "kidney_right"),
        lesion_mask="kidney_lesion",
        parts=(("kidney_left", "left"), ("kidney_right", "right")),
    ),
}

# Location vocabulary per organ, in report order.
LOCATION_NAMES: dict[Organ, tuple[str, ...]] = {organ: tuple(n for _, n in s.parts) for organ, s in ORGAN_STRUCTURES.items()}

CT_FILE_STEM = "ct"
NIFTI_SUFFIXES = (".nii.gz", ".nii")


@dataclass(frozen=True, slots=True)
class CaseRef:
    """Where one case's files are. Paths are absolute; `root` is the atlas root they are relative to."""

    case_id: str
    root: Path
    ct_path: Path  # may not exist (-> missing_ct rejection)
    mask_dir: Path  # the `segmentations/` folder (may not exist)

    def structure_path(self, structure: str) -> Path | None:
        """Return the file of `structure` (`.nii.gz` preferred, then `.nii`), or None when neither exists."""
        for suffix in NIFTI_SUFFIXES:
            path = self.mask_dir / f"{structure}{suffix}"
            if path.is_file():
                return path
        return None

    def relative(self, path: Path) -> str:
        """Return `path` relative to the atlas root (for messages and tables), or as given when outside it."""
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)
