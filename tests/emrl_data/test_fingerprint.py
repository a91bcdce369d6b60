"""The CT fingerprint and the overlaps it finds: the same CT as AbdomenAtlas Mini writes it (cropped to the body, int16,
clipped) and as MSD releases it (full grid, LPS, another dtype, unclipped air) matches slice for slice; different CTs,
two seeds of one generator included, share no slice."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from emrl_data.config import CurateConfig
from emrl_data.labeling.case_store import CaseStore
from emrl_data.labeling.curate import CaseResult, curate_case
from emrl_data.labeling.fingerprint import (
    FINGERPRINT_VERSION,
    NO_HASH,
    CtFingerprint,
    ct_fingerprint,
    hashed_slices,
    slice_hash,
)
from emrl_data.outcome import Rejection, RejectReason
from emrl_data.reading.atlas import discover_cases
from emrl_data.reading.case_images import open_case
from emrl_data.reading.placement import mini_body_box
from emrl_data.synthetic import CaseSpec, LesionSpec, write_atlas
from emrl_data.synthetic.label_map_kits import KitCase, write_kit
from emrl_data.synthetic.nifti_writer import write_gzip
from emrl_data.tables.overlaps import (
    FINGERPRINT_FILE,
    FingerprintRow,
    Overlap,
    exclude_overlapping_tests,
    find_overlaps,
    read_fingerprints,
    write_fingerprints,
)
from emrl_data.types import Organ, Split


SHAPE = (96, 80, 32)
LIVER_LESION = (LesionSpec(Organ.LIVER, "5", (12.0, 10.0, 8.0), "hypo"),)


def mini_cropped_atlas(root: Path, specs: list[CaseSpec]) -> dict[str, tuple[slice, slice, slice]]:
    """An AbdomenAtlas-layout atlas whose CTs and masks are cropped to the body box with their affines unchanged, as
    AbdomenAtlas Mini saves them; returns each case's box on the full grid."""
    write_atlas(root, specs, metadata_csv=False)
    boxes = {}
    for spec in specs:
        ct_path = root / "image_only" / spec.case_id / "ct.nii.gz"
        box = mini_body_box(np.asarray(nib.load(ct_path).dataobj))
        assert box is not None
        boxes[spec.case_id] = box
        for path in [ct_path, *sorted((root / "mask_only" / spec.case_id / "segmentations").glob("*.nii.gz"))]:
            image = nib.load(path)
            data = np.asarray(image.dataobj)[box]
            nib.save(nib.Nifti1Image(data, image.affine), path)
    return boxes


def msd_repack(root: Path, specs: list[CaseSpec], dtype: str) -> None:
    """MSD Task03 cases of the same phantoms: full grid, stored LPS, air at -1024 HU (not clipped), and the CT stored
    as float32 or as uint16 with scl_slope 1 and scl_inter -1024."""
    write_kit(root, "msd-task03", [KitCase(spec, storage="LPS") for spec in specs])
    for n in range(len(specs)):
        path = root / "imagesTr" / f"liver_{n}.nii.gz"
        image = nib.load(path)
        hu = np.asarray(image.dataobj).astype(np.int32)
        hu[hu == -1000] = -1024
        if dtype == "float32":
            data, inter = hu.astype(np.float32), 0.0
        else:
            data, inter = (hu + 1024).astype(np.uint16), -1024.0
        header = nib.Nifti1Image(data, image.affine).header
        header.set_data_offset(352)
        header["scl_slope"], header["scl_inter"] = 1.0, inter
        write_gzip(path, [header.binaryblock + b"\x00" * 4, np.asfortranarray(data).T.tobytes()])


def _fingerprints(root: Path) -> dict[str, CtFingerprint]:
    return {ref.case_id: ct_fingerprint(open_case(ref).ct_hu) for ref in discover_cases(root).refs}


def _row(case_id: str, split: str | None, hashes: list[int]) -> FingerprintRow:
    return FingerprintRow(case_id, split, np.asarray(hashes, dtype=np.uint64))


@pytest.mark.parametrize("dtype", ["float32", "uint16_scaled"])
def test_the_same_ct_cropped_reoriented_and_cast_has_the_same_slice_hashes(tmp_path: Path, dtype: str) -> None:
    spec = CaseSpec("BDMAP_00000001", shape=SHAPE, lesions=LIVER_LESION, seed=1)
    boxes = mini_cropped_atlas(tmp_path / "atlas", [spec])
    msd_repack(tmp_path / "msd", [spec], dtype)
    atlas_ct = open_case(discover_cases(tmp_path / "atlas").refs[0]).ct_hu
    msd_ct = open_case(discover_cases(tmp_path / "msd").refs[0]).ct_hu
    assert atlas_ct.shape == (84, 58, 32) and msd_ct.shape == SHAPE  # the crop took rows and columns away
    assert (boxes["BDMAP_00000001"][0].start, boxes["BDMAP_00000001"][1].start) == (6, 11)
    assert msd_ct.min() == -1024 and atlas_ct.min() == -1000  # MSD keeps the air the atlas clips

    atlas_print, msd_print = ct_fingerprint(atlas_ct), ct_fingerprint(msd_ct)

    assert atlas_print.slice_hashes == msd_print.slice_hashes
    assert len(set(atlas_print.slice_hashes)) == 32 and NO_HASH not in atlas_print.slice_hashes
    pairs = find_overlaps(
        [_row("BDMAP_00000001", "test", list(atlas_print.slice_hashes))],
        [_row("liver_0", "train", list(msd_print.slice_hashes))],
    )
    assert pairs == [Overlap("BDMAP_00000001", "test", "liver_0", "train", 32, 0, 0)]


def test_different_cts_share_no_slice_even_from_one_generator(tmp_path: Path) -> None:
    specs = [CaseSpec("BDMAP_00000001", shape=SHAPE, seed=1), CaseSpec("BDMAP_00000002", shape=SHAPE, seed=2)]
    write_atlas(tmp_path / "atlas", specs, metadata_csv=False)
    prints = _fingerprints(tmp_path / "atlas")
    one, two = prints["BDMAP_00000001"].slice_hashes, prints["BDMAP_00000002"].slice_hashes
    assert set(one) & set(two) == set()
    rows = [_row(case_id, "train", list(p.slice_hashes)) for case_id, p in prints.items()]
    assert find_overlaps(rows[:1], rows[1:]) == []
    assert find_overlaps(rows, rows) == [  # each case is itself
        Overlap("BDMAP_00000001", "train", "BDMAP_00000001", "train", 32, 0, 0),
        Overlap("BDMAP_00000002", "train", "BDMAP_00000002", "train", 32, 0, 0),
    ]


def test_a_slice_hash_is_its_body_window_and_a_thin_or_unhashed_slice_has_none() -> None:
    ct = np.full((40, 40, 3), -1000, dtype=np.int16)
    ct[10:30, 5:25, :] = 40  # a 20 x 20 body on every slice
    ct[0:40, 35:37, 0] = 50  # a table under it on slice 0: a smaller region, not in the window
    ct[12, 7, 1] = 41
    ct[10:30, 5:25, 2] = -1000
    ct[10:14, 5:9, 2] = 40  # slice 2: a 4 x 4 body, under MIN_WINDOW_VOXELS
    print_ = ct_fingerprint(ct)
    assert print_.slice_hashes[0] == slice_hash(ct[10:30, 5:25, 0])
    assert print_.slice_hashes[1] == slice_hash(ct[10:30, 5:25, 1]) != print_.slice_hashes[0]
    assert print_.slice_hashes[2] == NO_HASH
    assert ct_fingerprint(np.full((8, 8, 2), -1000, np.int16)).slice_hashes == (NO_HASH, NO_HASH)
    assert slice_hash(np.zeros((2, 3), np.int16)) != slice_hash(np.zeros((3, 2), np.int16))
    assert (hashed_slices(300), hashed_slices(33), hashed_slices(10)) == (range(134, 166), range(0, 32), range(10))
    tall = np.repeat(ct[:, :, :1], 40, axis=2)
    assert [z for z, h in enumerate(ct_fingerprint(tall).slice_hashes) if h != NO_HASH] == list(range(4, 36))


def test_overlaps_need_a_run_of_consecutive_slices_at_one_offset() -> None:
    a = [_row("a1", "test", [1, 2, 3, 4, 5, 6, 0]), _row("a2", "test", [7, 8, 99, 9, 10])]
    b = [
        _row("b1", "train", [50, 2, 3, 4, 5, 51]),  # a1 z 1..4 = b1 z 1..4: a run of 4
        _row("b2", "train", [0, 0, 7, 8, 60, 9, 10]),  # a2: runs of 2 at offset -2: not enough
        _row("b3", "train", [6, 1, 2, 3]),  # a1 z 0..2 = b3 z 1..3 (run of 3, offset -1); z 5 = b3 z 0 alone
    ]
    assert find_overlaps(a, b) == [
        Overlap("a1", "test", "b1", "train", 4, 1, 1),
        Overlap("a1", "test", "b3", "train", 3, 0, 1),
    ]
    assert find_overlaps(a, b, min_run_slices=2)[-1] == Overlap("a2", "test", "b2", "train", 2, 0, 2)
    assert find_overlaps(a, []) == [] and find_overlaps([], b) == []


def test_the_fingerprint_table_reads_back_and_refuses_other_versions(tmp_path: Path) -> None:
    rows = [_row("liver_0", "train", [2**64 - 1, 0, 5]), _row("liver_1", None, [])]
    path = write_fingerprints(tmp_path, rows)
    first = path.read_bytes()
    back = read_fingerprints(tmp_path)
    assert [(r.case_id, r.split, r.slice_hashes.tolist()) for r in back] == [
        ("liver_0", "train", [2**64 - 1, 0, 5]),
        ("liver_1", None, []),
    ]
    assert write_fingerprints(tmp_path, back).read_bytes() == first  # same rows, same bytes
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'none' / FINGERPRINT_FILE}: no fingerprint table"):
        read_fingerprints(tmp_path / "none")
    other_version = {
        "case_id": ["x"],
        "split": ["train"],
        "fingerprint_version": pa.array([99], pa.int32()),
        "slice_hashes": pa.array([[1]], pa.list_(pa.uint64())),
    }
    pq.write_table(pa.table(other_version), tmp_path / FINGERPRINT_FILE)
    with pytest.raises(ValueError, match=f"fingerprint version \\[99\\], this code writes {FINGERPRINT_VERSION}"):
        read_fingerprints(tmp_path)


def test_a_test_case_that_is_a_training_ct_elsewhere_becomes_a_rejection() -> None:
    here = [_row("t1", "test", [1, 2, 3]), _row("t2", "test", [4, 5, 6]), _row("r1", "train", [7, 8, 9])]
    other = [_row("x1", "train", [1, 2, 3]), _row("x2", "test", [4, 5, 6]), _row("x3", "train", [7, 8, 9])]
    rows = [{"case_id": c, "organ": "liver"} for c in ("r1", "t1", "t2")]

    kept, rejections = exclude_overlapping_tests(rows, here, other, "other-out")

    assert kept == [{"case_id": "r1", "organ": "liver"}, {"case_id": "t2", "organ": "liver"}]
    detail = (
        "t1: a test case that is the same CT as the training case(s) x1 (3 slices) of other-out: a train/test "
        "leak; the case is not used"
    )
    assert rejections == [Rejection("t1", None, "overlaps", RejectReason.OVERLAPS_TRAINING_CT, detail)]


def test_curation_stores_the_fingerprint_and_an_old_entry_gains_one(tmp_path: Path) -> None:
    spec = CaseSpec("BDMAP_00000001", shape=SHAPE, lesions=LIVER_LESION, seed=1, split=Split.TEST)
    write_atlas(tmp_path / "atlas", [spec], metadata_csv=False)
    ref = discover_cases(tmp_path / "atlas").refs[0]
    result = curate_case(ref, split="test", cfg=CurateConfig())
    assert result.fingerprint == ct_fingerprint(open_case(ref).ct_hu)
    store = CaseStore(tmp_path / "store")
    store.save("k", result)
    loaded = store.load_rows("k")
    assert loaded is not None and loaded.fingerprint == result.fingerprint

    old = CaseResult(result.case_id, result.rows, result.rejections, result.file_digests)
    store.save("old", old)
    assert store.load_rows("old").fingerprint is None  # type: ignore[union-attr]
    assert store.add_fingerprint("old", result.fingerprint)  # type: ignore[arg-type]
    again = store.load_rows("old")
    assert again is not None and again.fingerprint == result.fingerprint and again.rows == loaded.rows
    assert store.load_frames("old") == store.load_frames("k")
    assert not store.add_fingerprint("missing", result.fingerprint)  # type: ignore[arg-type]
