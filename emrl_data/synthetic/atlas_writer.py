"""Writing a synthetic atlas in the released layout: case files (with their quirks and defects), the metadata CSV,
the IID split files and `synthetic_truth.json`.

Layouts: `split` (`image_only/<id>/ct.nii.gz` + `mask_only/<id>/segmentations/<s>.nii.gz`) or `combined`
(`<id>/ct.nii.gz` + `<id>/segmentations/<s>.nii.gz`); int16 CT, int8 0/1 masks, one file per structure.
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import math
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import nibabel as nib
import numpy as np

from emrl_data.organs import ORGAN_STRUCTURES, defect_files, organ_spec
from emrl_data.outcome import RejectReason
from emrl_data.reading.atlas_metadata import METADATA_FILE
from emrl_data.reading.atlas_splits import SPLIT_DIR
from emrl_data.synthetic.geometry import BoxMask, Grid, shape_of, union_box
from emrl_data.synthetic.nifti_writer import (
    LPS_FLIP,
    canonical_affine,
    nifti_header_block,
    storage_affine,
    to_storage,
    translate,
    write_gzip,
    write_nifti_gz,
)
from emrl_data.synthetic.phantom import Phantom, build_phantom
from emrl_data.synthetic.specs import DEFECTS, CaseSpec, header_spacing_mm
from emrl_data.synthetic.truth import TRUTH_JSON_NAME, AtlasTruth, CaseTruth, ExpectedRejection, phantom_truth
from emrl_data.types import Organ, Split


logger = logging.getLogger(__name__)

# Mask defects that reject the whole case rather than the organ row of the file they break.
_CASE_LEVEL = frozenset({"mask_grid_mismatch"})
_CASE_CSV_COLUMNS = ("BDMAP ID", "sex", "age", "shape", "spacing")
_CSV_ATTENUATION_WORD = {"hypo": "hypoattenuating", "iso": "isoattenuating", "hyper": "hyperattenuating"}


def _case_paths(root: Path, folder: str, layout: str) -> tuple[Path, Path]:
    """Return (ct file, segmentations folder) of a case folder in `layout`."""
    if layout == "split":
        return root / "image_only" / folder / "ct.nii.gz", root / "mask_only" / folder / "segmentations"
    if layout == "combined":
        return root / folder / "ct.nii.gz", root / folder / "segmentations"
    raise ValueError(f"layout={layout!r} must be 'split' or 'combined'.")


def _write_ct(path: Path, spec: CaseSpec, ct: np.ndarray, affine: np.ndarray) -> None:
    """Write the CT file as `spec.defect` wants it (no file for `missing_ct`).

    Args:
        path: the CT file.
        spec: the case.
        ct: int16 (X, Y, Z) canonical RAS HU.
        affine: (4, 4) RAS affine of the canonical grid.
    """
    if spec.defect == "implausible_organ_hu":
        ct = _painted_organ(spec, spec.defect, ct, hu=400)
    stored, stored_affine = to_storage(ct, affine, spec.storage)
    defect = spec.defect
    if defect == "missing_ct":
        return
    if defect in ("implausible_spacing", "geometry_conflict"):
        _write_ct_geometry_defect(path, defect, stored, stored_affine)
        return
    if defect == "not_nifti":
        write_gzip(path, [b"This is not a NIfTI image; it is a text file named ct.nii.gz.\n" * 64])
    elif defect == "ct_2d":
        write_nifti_gz(path, stored[:, :, stored.shape[2] // 2], stored_affine)
    elif defect == "ct_4d":
        write_nifti_gz(path, np.stack([stored] * 3, axis=-1), stored_affine)
    elif defect == "nan_voxels":
        data = np.asfortranarray(stored, dtype=np.float32)
        cx, cy, cz = (n // 2 for n in data.shape)
        data[cx - 1 : cx + 2, cy - 1 : cy + 2, cz] = np.nan
        write_nifti_gz(path, data, stored_affine)
    elif defect == "absurd_header":
        write_nifti_gz(path, stored, stored_affine, claimed_shape=(30000, 30000, 30000))
    else:
        write_nifti_gz(path, stored, stored_affine)
    if defect == "truncated_gzip":
        compressed = path.read_bytes()
        path.write_bytes(compressed[: len(compressed) * 6 // 10])
    elif defect == "corrupt_gzip":
        corrupted = bytearray(path.read_bytes())
        middle = len(corrupted) // 2
        if middle < 4096:
            raise ValueError(f"CT of {spec.case_id} compresses to {len(corrupted)} bytes: too small to corrupt.")
        for i in range(middle, middle + 16):
            corrupted[i] ^= 0xFF
        path.write_bytes(bytes(corrupted))
    elif defect == "unreadable_file":
        path.unlink()
        path.symlink_to(path.name)  # ELOOP on open: an OSError that chmod 000 cannot give a root user


def _defect_target(defect: str) -> tuple[Organ, str]:
    """The organ and file stem a defect or quirk acts on, from the registry (`OrganAnatomy.defect_files`)."""
    try:
        return defect_files()[defect]
    except KeyError:
        raise ValueError(
            f"{defect}: no registered organ's anatomy.defect_files names it (emrl_data/organs.py)."
        ) from None


def _is_target(name: str, structure: str) -> bool:
    """True when the defect or quirk `name` acts on the mask file `structure`."""
    target = defect_files().get(name)
    return target is not None and target[1] == structure


def _painted_organ(spec: CaseSpec, defect: str, ct: np.ndarray, *, hu: int) -> np.ndarray:
    """A copy of the canonical CT with the base ellipsoid of the organ mask `defect` acts on painted at `hu`."""
    grid = Grid(spec.shape, spec.spacing_mm)
    centre, semi = shape_of(*_defect_target(defect))
    organ = grid.ellipsoid(grid.uvw_to_vox(centre), np.asarray(semi) * grid.body_units_mm)
    painted = ct.copy(order="F")
    painted[organ.slices()][organ.data] = hu
    return painted


def _write_ct_geometry_defect(path: Path, defect: str, stored: np.ndarray, affine: np.ndarray) -> None:
    """Write the CT with a 1000x voxel size (`implausible_spacing`) or pixdim 10x its sform (`geometry_conflict`)."""
    if defect == "implausible_spacing":
        scaled = affine.copy()
        scaled[:3, :3] *= 1000.0
        write_nifti_gz(path, stored, scaled)
        return
    block = bytearray(nifti_header_block(stored, affine))
    header = nib.Nifti1Header(bytes(block[:348]))
    pixdim = header["pixdim"].copy()
    pixdim[1:4] *= 10.0
    header["pixdim"] = pixdim
    block[:348] = header.binaryblock
    data = np.asfortranarray(stored)
    write_gzip(path, [bytes(block), data.T.data.cast("B")])


def _mask_grid(spec: CaseSpec, phantom: Phantom) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Return (start, shape) of the masks' canonical grid: the CT grid, or the cropped grid of `mask_cropped_grid`."""
    if "mask_cropped_grid" not in spec.quirks:
        return (0, 0, 0), spec.shape
    start, shape = union_box(list(phantom.masks.values()))
    stop = [a + n for a, n in zip(start, shape, strict=True)]
    (bx0, bx1), (by0, by1) = phantom.body_box
    x0, x1 = min(start[0], bx0), max(stop[0], bx1)
    y0, y1 = min(start[1], by0), max(stop[1], by1)
    z0, z1 = max(start[2] - 1, 0), min(stop[2] + 1, spec.shape[2])
    return (x0, y0, z0), (x1 - x0, y1 - y0, z1 - z0)


def _paste(volume: np.ndarray, mask: BoxMask, volume_start: Sequence[int]) -> None:
    """Set `volume` to 1 where `mask` is set; `volume` covers canonical voxels from `volume_start` (crop only)."""
    src, dst = [], []
    for a, b, s, n in zip(mask.start, mask.stop, volume_start, volume.shape, strict=True):
        lo, hi = max(a, s), min(b, s + n)
        if hi <= lo:
            return
        src.append(slice(lo - a, hi - a))
        dst.append(slice(lo - s, hi - s))
    volume[tuple(dst)][mask.data[tuple(src)]] = 1


def _write_mask(
    path: Path,
    spec: CaseSpec,
    structure: str,
    mask: BoxMask,
    grid_start: tuple[int, int, int],
    grid_shape: tuple[int, int, int],
    ct_affine: np.ndarray,
) -> None:
    """Write one mask file (int8 0/1), honouring the quirks and the mask defects.

    Args:
        path: the mask file.
        spec: the case.
        structure: the file stem (e.g. "kidney_right").
        mask: the structure in canonical voxels.
        grid_start: canonical voxel of the mask grid's voxel 0 (non-zero for `mask_cropped_grid`).
        grid_shape: canonical (X, Y, Z) size of the mask grid.
        ct_affine: (4, 4) RAS affine of the canonical CT grid.
    """
    if spec.defect == "mask_grid_mismatch" and _is_target(spec.defect, structure):
        # Its own bounding-box grid and an affine rotated 10 degrees about z: not placeable on the CT grid.
        angle = math.radians(10.0)
        rotation = np.eye(4)
        rotation[:2, :2] = [[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]]
        stored, stored_affine = to_storage(
            mask.data.astype(np.int8), rotation @ translate(ct_affine, mask.start), spec.storage
        )
        write_nifti_gz(path, stored, stored_affine)
        return

    stored_affine = storage_affine(translate(ct_affine, grid_start), grid_shape, spec.storage)
    data = np.zeros(grid_shape, dtype=np.int8, order="F")  # storage order; `canonical` is a view of it
    canonical = data[::-1, ::-1] if spec.storage == "LPS" else data
    if not (spec.defect == "empty_organ_mask" and _is_target(spec.defect, structure)):
        _paste(canonical, mask, grid_start)
    if spec.defect == "mask_values" and _is_target(spec.defect, structure):
        idx = np.argwhere(canonical)
        x, y, z = idx[len(idx) // 2]
        canonical[x : x + 2, y : y + 2, z] = 2
    if spec.defect == "mask_orientation_conflict" and _is_target(spec.defect, structure):
        canonical[...] = canonical[::-1].copy()  # mirrored voxels under the correct affine
    if "flipped_affine_mask" in spec.quirks and _is_target("flipped_affine_mask", structure):
        write_nifti_gz(path, data, LPS_FLIP @ stored_affine, code=1)
    else:
        write_nifti_gz(path, data, stored_affine)


def _expected_rejections(spec: CaseSpec, ct_rel: str, mask_rel: str, folder_rel: str) -> tuple[ExpectedRejection, ...]:
    if spec.defect is None:
        return ()
    reason = DEFECTS[spec.defect]
    target = defect_files().get(spec.defect)
    if target is not None and spec.defect != "bad_metadata_row":
        organ, file = target
        # docs/contract.md#input: a mask off the CT grid rejects the whole case, not one organ row
        return (ExpectedRejection(reason, None if spec.defect in _CASE_LEVEL else organ, f"{mask_rel}/{file}.nii.gz"),)
    where = {
        "invalid_case_id": folder_rel,
        "bad_metadata_row": METADATA_FILE,
        "split_conflict": f"{SPLIT_DIR}/IID_train.csv",
        "not_a_case": folder_rel,
    }
    return (ExpectedRejection(reason, None, where.get(spec.defect, ct_rel)),)


def write_case(root: Path, spec: CaseSpec, *, layout: str = "split") -> CaseTruth:
    """Draw the phantom of `spec` and write its files under `root` in `layout`.

    Args:
        root: the atlas root (created when missing).
        spec: the case.
        layout: "split" (`image_only/` + `mask_only/`, as released) or "combined" (`<id>/ct.nii.gz` +
            `<id>/segmentations/`).

    Returns:
        The case's truth; `split` is None (only `write_atlas` writes split files).

    Raises:
        ValueError: on an unknown layout or a lesion that does not fit the grid.
    """
    root = Path(root)
    folder = spec.folder_name
    ct_path, mask_dir = _case_paths(root, folder, layout)
    phantom = build_phantom(spec)
    organs = phantom_truth(phantom, header_spacing_mm(spec))  # before any write: from the arrays drawn
    ct_affine = canonical_affine(spec.shape, spec.spacing_mm)

    ct_path.parent.mkdir(parents=True, exist_ok=True)
    _write_ct(ct_path, spec, phantom.ct, ct_affine)

    mask_dir.mkdir(parents=True, exist_ok=True)
    grid_start, grid_shape = _mask_grid(spec, phantom)
    structures = dict(phantom.masks)
    if "empty_lesion_files" in spec.quirks:
        for organ in Organ:
            stem = ORGAN_STRUCTURES[organ].lesion_mask
            if stem not in structures:
                structures[stem] = BoxMask((0, 0, 0), np.zeros((1, 1, 1), dtype=bool))
    for structure in sorted(structures):
        if spec.defect == "missing_organ_mask" and _is_target(spec.defect, structure):
            continue
        path = mask_dir / f"{structure}.nii.gz"
        _write_mask(path, spec, structure, structures[structure], grid_start, grid_shape, ct_affine)

    def rel(path: Path) -> str:
        return path.relative_to(root).as_posix()

    if spec.defect == "not_a_case":  # a regular file where the case's (image) folder belongs
        shutil.rmtree(ct_path.parent)
        ct_path.parent.write_bytes(b"not a case folder\n")
    folder_rel = rel(ct_path.parent)
    truth = CaseTruth(
        case_id=spec.case_id,
        folder_name=folder,
        layout=layout,
        split=None,
        shape=spec.shape,
        spacing_mm=header_spacing_mm(spec),
        storage=spec.storage,
        quirks=tuple(sorted(spec.quirks)),
        defect=spec.defect,
        ct_path=rel(ct_path),
        mask_dir=rel(mask_dir),
        organs=organs,
        expected_rejections=_expected_rejections(spec, rel(ct_path), rel(mask_dir), folder_rel),
    )
    logger.debug("Wrote synthetic case %s (%s layout) under %s.", spec.case_id, layout, root)
    return truth


def _fmt1(value: float) -> str:
    return f"{value:.1f}"


def metadata_columns() -> tuple[str, ...]:
    """Return the metadata CSV's columns: the case columns and every registered organ's, in a deliberately
    NON-canonical order (sorted by a hash of the name), as readers must parse by name (docs/contract.md#input)."""
    names = [*_CASE_CSV_COLUMNS, *(c for spec in ORGAN_STRUCTURES.values() for c in spec.csv.as_dict().values())]
    return tuple(sorted(names, key=lambda name: hashlib.sha256(name.encode()).hexdigest()))


def _metadata_row(spec: CaseSpec, truth: CaseTruth) -> dict[str, str]:
    """The case's metadata CSV row in the release's conventions (1 decimal, NaN -> 0 for lesion numbers)."""
    rng = np.random.default_rng([spec.seed, 1])
    row = {
        "BDMAP ID": spec.case_id,
        "spacing": str(np.asarray(spec.spacing_mm, dtype=np.float32)),
        "shape": str(np.asarray(spec.shape, dtype=np.int64)),
        "sex": "F" if rng.integers(2) == 0 else "M",
        "age": str(int(rng.integers(25, 86))),
    }
    for organ, ot in truth.organs.items():
        columns = organ_spec(organ).csv
        row[columns.organ_volume_cm3] = _fmt1(ot.organ_volume_mm3 / 1000.0)
        # pandas writes a NaN-filled float column: counts appear as "2.0".
        row[columns.count] = _fmt1(float(ot.lesion_count))
        row[columns.diameter_cm] = _fmt1(ot.long_axis_mm / 10.0) if ot.long_axis_mm else "0.0"
        row[columns.location] = ",".join(ot.location)
        row[columns.attenuation] = _CSV_ATTENUATION_WORD.get(ot.attenuation or "", "")
    if spec.defect == "bad_metadata_row":
        row[organ_spec(_defect_target("bad_metadata_row")[0]).csv.count] = "abc"
    return row


def write_atlas(
    root: Path,
    specs: Sequence[CaseSpec],
    *,
    layout: str = "split",
    metadata_csv: bool = True,
    split_files: bool = True,
) -> AtlasTruth:
    """Write every case, the metadata CSV, the IID split files and `synthetic_truth.json` under `root`.

    Cases with the `invalid_case_id` defect are left out of the CSV and the split files (their folder is a stray).
    Without `metadata_csv`, a `bad_metadata_row` defect has nothing to break and expects no rejection.

    Args:
        root: the atlas root (created when missing).
        specs: the cases; ids must be unique.
        layout: "split" or "combined".
        metadata_csv: write `AbdomenAtlas3.0MiniWithMeta.csv` (columns by name, non-canonical order).
        split_files: write `TrainTestIDS/IID_train.csv` and `IID_test.csv` (column `BDMAP ID`) from `spec.split`.

    Returns:
        The atlas truth (also written to `root/synthetic_truth.json`).

    Raises:
        ValueError: on duplicate case ids or an unknown layout.
    """
    root = Path(root)
    ids = [s.case_id for s in specs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"Duplicate case ids in specs: {sorted({i for i in ids if ids.count(i) > 1})}.")
    root.mkdir(parents=True, exist_ok=True)
    truths: list[CaseTruth] = []
    for spec in specs:
        truth = write_case(root, spec, layout=layout)
        listed = spec.defect != "invalid_case_id"
        rejections = truth.expected_rejections
        if not metadata_csv:
            rejections = tuple(r for r in rejections if r.reason is not RejectReason.BAD_METADATA_ROW)
        if not split_files:
            rejections = tuple(r for r in rejections if r.reason is not RejectReason.SPLIT_CONFLICT)
        split = spec.split.value if (split_files and listed) else None
        truths.append(replace(truth, split=split, expected_rejections=rejections))

    listed_pairs = [(s, t) for s, t in zip(specs, truths, strict=True) if s.defect != "invalid_case_id"]
    csv_rel: str | None = None
    if metadata_csv:
        csv_rel = METADATA_FILE
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(metadata_columns()), lineterminator="\n")
        writer.writeheader()
        for spec, truth in listed_pairs:
            writer.writerow(_metadata_row(spec, truth))
        (root / csv_rel).write_text(buffer.getvalue(), encoding="utf-8")
    split_rels: tuple[str, ...] = ()
    if split_files:
        (root / SPLIT_DIR).mkdir(exist_ok=True)
        for split in (Split.TRAIN, Split.TEST):
            rel_path = f"{SPLIT_DIR}/IID_{split.value}.csv"
            lines = ["BDMAP ID"] + [
                s.case_id for s, _ in listed_pairs if s.split is split or s.defect == "split_conflict"
            ]
            (root / rel_path).write_text("\n".join(lines) + "\n", encoding="utf-8")
            split_rels += (rel_path,)
    atlas = AtlasTruth(layout=layout, cases=tuple(truths), metadata_csv=csv_rel, split_files=split_rels)
    (root / TRUTH_JSON_NAME).write_text(atlas.to_json(), encoding="utf-8")
    logger.info("Wrote a synthetic atlas of %d cases (%s layout) under %s.", len(truths), layout, root)
    return atlas
