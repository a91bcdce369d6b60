"""Sub-structure masks are value-checked where labelling reads them: inside the largest lesion's box.

The file is still inflated whole (CRC32 and size checked); a value other than 0/1 inside the box rejects the organ
with `bad_mask_values` naming the file, one outside the box cannot change the row and is not read.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from emrl_data.config import CurateConfig
from emrl_data.labeling.curate import curate_case
from emrl_data.outcome import CaseDataError, RejectReason
from emrl_data.reading.atlas import plan_atlas
from emrl_data.reading.case_images import _Orientation, open_case
from emrl_data.synthetic import CaseSpec, LesionSpec, write_atlas
from emrl_data.types import Organ


CFG = CurateConfig()
CASE = "BDMAP_00000001"
SEGMENT = "liver_segment_5"
LESIONS = (LesionSpec(Organ.LIVER, "5", (12.0, 10.0, 10.0), "hypo"),)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A case with a liver lesion in segment 5, and its clean liver row."""
    root = tmp_path_factory.mktemp("parts") / "atlas"
    write_atlas(root, [CaseSpec(CASE, shape=(96, 80, 32), lesions=LESIONS)], metadata_csv=False)
    (ref,) = plan_atlas(root).refs
    result = curate_case(ref, split="train", cfg=CFG)
    (liver,) = [r for r in result.rows if r["organ"] == "liver"]
    assert "5" in liver["location"] and not result.rejections
    return root, liver


def _plant(src_root: Path, dst_root: Path, voxel_ras: tuple[int, int, int], value: int) -> Path:
    """Copy the atlas and set one canonical voxel of the segment-5 mask (uint8, gzip) to `value`."""
    shutil.copytree(src_root, dst_root)
    (ref,) = plan_atlas(dst_root).refs
    path = ref.structure_path(SEGMENT)
    assert path is not None
    img = nib.load(path)
    stored = np.asarray(img.dataobj).astype(np.uint8)
    assert set(np.unique(stored)) <= {0, 1}
    canonical = _Orientation.from_affine(img.affine, stored.shape).apply(stored)  # a writable view of `stored`
    canonical[voxel_ras] = value
    out = nib.Nifti1Image(stored, img.affine, img.header)
    out.set_data_dtype(np.uint8)
    nib.save(out, path)
    return path


def _curate(root: Path) -> tuple[list[dict], list]:
    (ref,) = plan_atlas(root).refs
    result = curate_case(ref, split="train", cfg=CFG)
    return result.rows, result.rejections


def test_bad_value_inside_the_lesion_box_rejects_the_organ(clean, tmp_path: Path) -> None:
    root, liver = clean
    x0, y0, z0, x1, y1, z1 = liver["lesion_box_xyzxyz_vox"]
    _plant(root, tmp_path / "atlas", (x1 - 1, y0, (z0 + z1) // 2), 2)
    rows, rejections = _curate(tmp_path / "atlas")
    assert [r["organ"] for r in rows] == ["pancreas", "kidney"]
    (rej,) = rejections
    assert (rej.organ, str(rej.reason)) == ("liver", "bad_mask_values")
    assert rej.path.endswith(f"{SEGMENT}.nii.gz")
    assert "found values [0, 1, 2]" in rej.detail
    assert f"inside the box {x0}:{x1}, {y0}:{y1}, {z0}:{z1} that labelling reads" in rej.detail


def test_bad_value_outside_the_lesion_box_leaves_the_row_unchanged(clean, tmp_path: Path) -> None:
    root, liver = clean
    x0, _, _, _, _, _ = liver["lesion_box_xyzxyz_vox"]
    assert x0 > 0
    path = _plant(root, tmp_path / "atlas", (0, 0, 0), 7)
    rows, rejections = _curate(tmp_path / "atlas")
    assert not rejections
    (row,) = [r for r in rows if r["organ"] == "liver"]
    # The same row but for the manifest of file digests (the planted file's bytes changed).
    assert {k: v for k, v in row.items() if k != "source_sha256"} == {
        k: v for k, v in liver.items() if k != "source_sha256"
    }
    # The full read (`CaseImages.mask`) still refuses the file.
    (ref,) = plan_atlas(tmp_path / "atlas").refs
    with pytest.raises(CaseDataError) as err:
        open_case(ref).mask(SEGMENT)
    assert err.value.reason == RejectReason.BAD_MASK_VALUES and str(err.value.path).endswith(path.name)


def test_mask_crop_of_a_corrupt_gzip_is_still_refused(clean, tmp_path: Path) -> None:
    """The crop path inflates the whole file: a flipped byte near the end fails the CRC32 check."""
    root, liver = clean
    shutil.copytree(root, tmp_path / "atlas")
    (ref,) = plan_atlas(tmp_path / "atlas").refs
    path = ref.structure_path(SEGMENT)
    assert path is not None
    raw = bytearray(path.read_bytes())
    raw[-9] ^= 0xFF  # last byte of the deflate stream, just before the CRC32 trailer
    path.write_bytes(bytes(raw))
    x0, y0, z0, x1, y1, z1 = liver["lesion_box_xyzxyz_vox"]
    with pytest.raises(CaseDataError) as err:
        open_case(ref).mask_crop(SEGMENT, (slice(x0, x1), slice(y0, y1), slice(z0, z1)))
    assert err.value.reason == RejectReason.CORRUPT_GZIP


@pytest.mark.parametrize("n_voxels", [1, 7, 40, 3000])  # few voxels: the sample grid gets finer, down to every voxel
def test_organ_evidence_sampled_in_the_box_is_the_same(n_voxels: int) -> None:
    """`BodyEvidence.score` with the mask's tight box reads only the box and gives exactly the full-volume score."""
    from emrl_data.reading.placement import BodyEvidence

    rng = np.random.default_rng(n_voxels)
    shape = (203, 170, 131)  # sample grid stride (3, 2, 2)
    ct = np.full(shape, -1000, dtype=np.int16, order="F")
    ct[8:190, 6:160, :] = rng.integers(-100, 200, size=(182, 154, 131), dtype=np.int16)
    affine = np.diag([0.8, 0.8, 2.5, 1.0])
    evidence = BodyEvidence(ct, affine)
    mask = np.zeros(shape, dtype=np.bool_, order="F")
    lo, hi = np.array([37, 41, 17]), np.array([121, 97, 88])
    for v in rng.integers(lo, hi, size=(n_voxels, 3)):
        mask[tuple(v)] = True
    nz = np.nonzero(mask)
    box = tuple(slice(int(a.min()), int(a.max()) + 1) for a in nz)
    for flip in (None, 0, 1, 2):
        assert evidence.score(mask, flip, box=box) == evidence.score(mask, flip)  # type: ignore[arg-type]
    assert evidence.stride == (3, 2, 2) and evidence.score(mask, box=box) is not None
