"""Tests of emrl_data.reading.nifti: validated reading, canonical orientation, mask placement (docs/contract.md#input, docs/contract.md#conventions)."""

from __future__ import annotations

import gzip
import hashlib
import tracemalloc
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from nibabel.orientations import apply_orientation, io_orientation

from emrl_data.config import LoadConfig
from emrl_data.outcome import CaseDataError, RejectReason
from emrl_data.reading.atlas import CaseRef
from emrl_data.reading.case_images import CaseImages, open_case
from emrl_data.reading.nifti import NiftiVolume, read_nifti


CASE_ID = "BDMAP_00000042"
SHAPE = (6, 5, 4)  # non-cubic on purpose: a swapped axis changes the shape
ZOOMS = (0.8, 0.7, 2.5)  # anisotropic on purpose
ORIGIN = (-100.0, 50.0, -300.0)


def _affine(rot: np.ndarray, origin: tuple[float, float, float] = ORIGIN) -> np.ndarray:
    """4x4 affine with the given 3x3 part (columns = stored axes in world mm) and translation."""
    a = np.eye(4)
    a[:3, :3] = rot
    a[:3, 3] = origin
    return a


RAS = _affine(np.diag(ZOOMS))
LPS = _affine(np.diag([-ZOOMS[0], -ZOOMS[1], ZOOMS[2]]))
# Stored axes (S, P, R): stored axis 0 -> +z, axis 1 -> -y, axis 2 -> +x.
SPR = _affine(np.array([[0.0, 0.0, ZOOMS[0]], [0.0, -ZOOMS[1], 0.0], [ZOOMS[2], 0.0, 0.0]]))


def _volume(shape: tuple[int, ...] = SHAPE, dtype: type = np.int16) -> np.ndarray:
    """Distinct values per voxel (so any flip or transpose shows), in the given dtype."""
    return (np.arange(np.prod(shape)).reshape(shape) - 60).astype(dtype)


def _save(path: Path, data: np.ndarray, affine: np.ndarray = RAS, **header_fields: object) -> Path:
    """Write `data` with nibabel (sform code 2) as .nii.gz or .nii, setting extra header fields."""
    path.parent.mkdir(parents=True, exist_ok=True)
    img = nib.Nifti1Image(data, affine)
    for key, value in header_fields.items():
        img.header[key] = value
    img.to_filename(path)
    return path


def _save_raw(path: Path, hdr: nib.Nifti1Header, payload: bytes, *, compress: bool = True) -> Path:
    """Write header bytes + extension flag + payload verbatim (bypasses nibabel's scaling and shape checks)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    hdr["vox_offset"] = hdr.sizeof_hdr + 4
    blob = hdr.binaryblock + b"\x00" * 4 + payload
    path.write_bytes(gzip.compress(blob) if compress else blob)
    return path


def _header(shape: tuple[int, ...], dtype: type, affine: np.ndarray = RAS, cls: type = nib.Nifti1Header, **kw):
    hdr = cls(**kw)
    hdr.set_data_shape(shape)
    hdr.set_data_dtype(dtype)
    hdr.set_sform(affine, code=2)
    hdr.set_zooms(tuple(float(z) for z in np.sqrt((affine[:3, :3] ** 2).sum(axis=0)))[: len(shape)])
    return hdr


def _ref(root: Path) -> CaseRef:
    """A case in the split layout under `root` (files may or may not exist)."""
    return CaseRef(
        case_id=CASE_ID,
        root=root,
        ct_path=root / "image_only" / CASE_ID / "ct.nii.gz",
        mask_dir=root / "mask_only" / CASE_ID / "segmentations",
    )


def _case(root: Path, ct: np.ndarray | None = None, affine: np.ndarray = RAS, **header_fields: object) -> CaseRef:
    ref = _ref(root)
    _save(ref.ct_path, _volume() if ct is None else ct, affine, **header_fields)
    return ref


def _save_mask(ref: CaseRef, name: str, data: np.ndarray, affine: np.ndarray = RAS, **header_fields: object) -> Path:
    return _save(ref.mask_dir / f"{name}.nii.gz", data.astype(np.int8), affine, **header_fields)


def _assert_rejected(excinfo: pytest.ExceptionInfo[CaseDataError], reason: RejectReason, file_name: str) -> None:
    err = excinfo.value
    assert err.reason == reason
    assert file_name in str(err)
    assert file_name in err.detail
    assert err.path is not None and file_name in err.path


# --- read_nifti: happy paths -----------------------------------------------------------------------------------


def test_read_nifti_int16_ct_is_zero_copy_fortran_view(tmp_path: Path) -> None:
    data = _volume()
    path = _save(tmp_path / "ct.nii.gz", data)

    vol = read_nifti(path, role="ct")

    assert isinstance(vol, NiftiVolume)
    assert vol.data.dtype == np.int16
    np.testing.assert_array_equal(vol.data, data)
    assert vol.data.flags.f_contiguous and not vol.data.flags.owndata and not vol.data.flags.writeable
    np.testing.assert_allclose(vol.affine, RAS)
    assert vol.affine.dtype == np.float64 and vol.affine.shape == (4, 4)
    assert vol.zooms_mm == pytest.approx(ZOOMS)
    assert vol.path == path


def test_read_nifti_reads_plain_nii(tmp_path: Path) -> None:
    data = _volume()
    vol = read_nifti(_save(tmp_path / "ct.nii", data), role="ct")
    np.testing.assert_array_equal(vol.data, data)
    assert not vol.data.flags.owndata


def test_read_nifti_4d_with_one_time_point_is_3d(tmp_path: Path) -> None:
    data = _volume()
    vol = read_nifti(_save(tmp_path / "ct.nii.gz", data[..., None]), role="ct")
    assert vol.data.shape == SHAPE
    np.testing.assert_array_equal(vol.data, data)


@pytest.mark.parametrize(
    ("stored", "expected"),
    [
        # int8 widens exactly
        (np.array([-5, 0, 7], np.int8), [-5, 0, 7]),
        # uint16 above int16 range clips to 32767
        (np.array([0, 1000, 40000], np.uint16), [0, 1000, 32767]),
        # int32 outside the range clips at both ends
        (np.array([-40000, -1000, 40000], np.int32), [-32768, -1000, 32767]),
        # float32 rounds half to even
        (np.array([1.4, 1.5, 2.5, -1.5], np.float32), [1, 2, 2, -2]),
        # float64 rounds and clips
        (np.array([-1e6, 39.6, 1e6], np.float64), [-32768, 40, 32767]),
    ],
)
def test_read_nifti_ct_converts_to_int16(tmp_path: Path, stored: np.ndarray, expected: list[int]) -> None:
    path = _save_raw(tmp_path / "ct.nii.gz", _header((len(stored), 1, 1), stored.dtype.type), stored.tobytes())
    vol = read_nifti(path, role="ct")
    assert vol.data.dtype == np.int16
    assert vol.data[:, 0, 0].tolist() == expected


@pytest.mark.parametrize(
    ("slope", "inter", "expected", "zero_copy"),
    [
        # slope 2, intercept -1024: applied
        (2.0, -1024.0, [-1024, -1022, 976], False),
        # (1, 0) is "no scaling": stays a zero-copy view
        (1.0, 0.0, [0, 1, 1000], True),
        # slope 0 means "not set" in NIfTI: ignored
        (0.0, 5.0, [0, 1, 1000], True),
        # NaN slope means "not set": ignored
        (float("nan"), float("nan"), [0, 1, 1000], True),
        # fractional slope on int data rounds
        (0.5, 0.0, [0, 0, 500], False),
    ],
)
def test_read_nifti_applies_scl_slope_inter_only_when_set(
    tmp_path: Path, slope: float, inter: float, expected: list[int], zero_copy: bool
) -> None:
    hdr = _header((3, 1, 1), np.int16)
    hdr["scl_slope"], hdr["scl_inter"] = slope, inter
    path = _save_raw(tmp_path / "ct.nii.gz", hdr, np.array([0, 1, 1000], np.int16).tobytes())
    vol = read_nifti(path, role="ct")
    assert vol.data[:, 0, 0].tolist() == expected
    assert (not vol.data.flags.owndata) == zero_copy


def test_read_nifti_big_endian_int16_becomes_native(tmp_path: Path) -> None:
    data = _volume()
    hdr = _header(SHAPE, np.int16, endianness=">")
    path = _save_raw(tmp_path / "ct.nii.gz", hdr, data.astype(">i2").tobytes(order="F"))
    vol = read_nifti(path, role="ct")
    assert vol.data.dtype == np.dtype(np.int16) and vol.data.dtype.isnative
    np.testing.assert_array_equal(vol.data, data)


def test_read_nifti_reads_nifti2(tmp_path: Path) -> None:
    data = _volume()
    hdr = _header(SHAPE, np.int16, cls=nib.Nifti2Header)
    vol = read_nifti(_save_raw(tmp_path / "ct.nii.gz", hdr, data.tobytes(order="F")), role="ct")
    np.testing.assert_array_equal(vol.data, data)
    np.testing.assert_allclose(vol.affine, RAS)


@pytest.mark.parametrize(
    ("unit_code", "factor"),
    [
        # 0 = unknown: taken as mm (as ITK does)
        (0, 1.0),
        # 2 = mm
        (2, 1.0),
        # 1 = metre: converted to mm (values stored in metres, so the mm spacing is the same)
        (1, 1000.0),
        # 3 = micron: converted to mm
        (3, 0.001),
    ],
)
def test_read_nifti_converts_spatial_units_to_mm(tmp_path: Path, unit_code: int, factor: float) -> None:
    stored = RAS.copy()
    stored[:3, :] /= factor  # the same grid, written in the header's unit
    hdr = _header(SHAPE, np.int16, stored)
    hdr["xyzt_units"] = unit_code
    vol = read_nifti(_save_raw(tmp_path / "ct.nii.gz", hdr, _volume().tobytes(order="F")), role="ct")
    assert vol.zooms_mm == pytest.approx(ZOOMS)
    expected = RAS
    np.testing.assert_allclose(vol.affine, expected)


def test_read_nifti_affine_falls_back_to_qform_then_zooms(tmp_path: Path) -> None:
    hdr = _header(SHAPE, np.int16)
    hdr.set_sform(None, code=0)
    hdr.set_qform(LPS, code=1)
    vol = read_nifti(_save_raw(tmp_path / "q.nii.gz", hdr, _volume().tobytes(order="F")), role="ct")
    np.testing.assert_allclose(vol.affine, LPS, atol=1e-5)

    hdr.set_qform(None, code=0)
    vol = read_nifti(_save_raw(tmp_path / "z.nii.gz", hdr, _volume().tobytes(order="F")), role="ct")
    np.testing.assert_allclose(vol.affine, np.diag([*ZOOMS, 1.0]), atol=1e-6)


@pytest.mark.parametrize(
    ("dtype", "zero_copy"),
    [
        # int8 (the Mini releases): zero-copy bool view
        (np.int8, True),
        # uint8: zero-copy bool view
        (np.uint8, True),
        # int16: converted
        (np.int16, False),
        # float32 0.0/1.0: converted
        (np.float32, False),
    ],
)
def test_read_nifti_mask_returns_bool(tmp_path: Path, dtype: type, zero_copy: bool) -> None:
    data = (_volume() % 3 == 0).astype(dtype)
    vol = read_nifti(_save(tmp_path / "m.nii.gz", data), role="mask")
    assert vol.data.dtype == np.bool_
    np.testing.assert_array_equal(vol.data, data.astype(bool))
    assert (not vol.data.flags.owndata) == zero_copy
    assert not vol.data.flags.writeable


# --- read_nifti: rejections ------------------------------------------------------------------------------------


def test_read_nifti_text_file_named_nii_gz_is_not_nifti(tmp_path: Path) -> None:
    path = tmp_path / "ct.nii.gz"
    path.write_text("this is not an image\n")
    with pytest.raises(CaseDataError) as excinfo:
        read_nifti(path, role="ct")
    _assert_rejected(excinfo, RejectReason.NOT_NIFTI, "ct.nii.gz")
    assert "not a gzip stream" in excinfo.value.detail


@pytest.mark.parametrize(
    "payload",
    [
        # short text
        b"hello world",
        # 1 KB of zeros: long enough, but sizeof_hdr is 0
        bytes(1024),
        # right sizeof_hdr, wrong magic
        np.int32(348).tobytes() + bytes(600),
    ],
)
def test_read_nifti_gzip_of_non_nifti_bytes_is_not_nifti(tmp_path: Path, payload: bytes) -> None:
    path = tmp_path / "liver.nii.gz"
    path.write_bytes(gzip.compress(payload))
    with pytest.raises(CaseDataError) as excinfo:
        read_nifti(path, role="mask")
    _assert_rejected(excinfo, RejectReason.NOT_NIFTI, "liver.nii.gz")


@pytest.mark.parametrize(
    "raw",
    [
        # gzip magic, then fewer bytes than a gzip member header + trailer
        b"\x1f\x8b\x08\x00abc",
        # gzip magic, unknown compression method (not 8 = deflate)
        b"\x1f\x8b\x07\x00" + bytes(60),
    ],
)
def test_read_nifti_broken_gzip_member_header_is_corrupt(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "ct.nii.gz"
    path.write_bytes(raw)
    with pytest.raises(CaseDataError) as excinfo:
        read_nifti(path, role="ct")
    _assert_rejected(excinfo, RejectReason.CORRUPT_GZIP, "ct.nii.gz")


def _break_nifti2_magic(hdr: nib.Nifti1Header) -> None:
    hdr["magic"] = b"n+3"


def _zero_zoom(hdr: nib.Nifti1Header) -> None:
    hdr["pixdim"][2] = 0.0


def _complex_datatype(hdr: nib.Nifti1Header) -> None:
    hdr.set_data_dtype(np.complex64)


def _rgb_datatype(hdr: nib.Nifti1Header) -> None:
    hdr["datatype"] = 128  # RGB24


def _nan_sform(hdr: nib.Nifti1Header) -> None:
    hdr["srow_x"][0] = np.nan


@pytest.mark.parametrize(
    ("cls", "breaker"),
    [
        # NIfTI-2 header with a bad magic
        (nib.Nifti2Header, _break_nifti2_magic),
        # zero voxel size
        (nib.Nifti1Header, _zero_zoom),
        # complex voxels
        (nib.Nifti1Header, _complex_datatype),
        # RGB voxels
        (nib.Nifti1Header, _rgb_datatype),
        # NaN in the sform
        (nib.Nifti1Header, _nan_sform),
    ],
)
def test_read_nifti_malformed_header_is_not_nifti(tmp_path: Path, cls: type, breaker) -> None:
    hdr = _header((2, 2, 2), np.int16, cls=cls)
    breaker(hdr)
    path = _save_raw(tmp_path / "ct.nii.gz", hdr, bytes(64))
    with pytest.raises(CaseDataError) as excinfo:
        read_nifti(path, role="ct")
    _assert_rejected(excinfo, RejectReason.NOT_NIFTI, "ct.nii.gz")


def test_read_nifti_vox_offset_inside_header_is_not_nifti(tmp_path: Path) -> None:
    hdr = _header((2, 2, 2), np.int16)
    blob = bytearray(hdr.binaryblock + bytes(4) + bytes(16))
    blob[108:112] = np.float32(100.0).tobytes()  # vox_offset field
    path = tmp_path / "ct.nii.gz"
    path.write_bytes(gzip.compress(bytes(blob)))
    with pytest.raises(CaseDataError) as excinfo:
        read_nifti(path, role="ct")
    _assert_rejected(excinfo, RejectReason.NOT_NIFTI, "ct.nii.gz")


def test_read_nifti_zero_dim0_is_bad_ndim(tmp_path: Path) -> None:
    hdr = _header((2, 2, 2), np.int16)
    hdr["dim"][0] = 0
    path = _save_raw(tmp_path / "ct.nii.gz", hdr, bytes(16))
    with pytest.raises(CaseDataError) as excinfo:
        read_nifti(path, role="ct")
    _assert_rejected(excinfo, RejectReason.BAD_NDIM, "ct.nii.gz")


def test_read_nifti_qfac_zero_is_read_as_one(tmp_path: Path) -> None:
    hdr = _header(SHAPE, np.int16)
    hdr.set_sform(None, code=0)
    hdr.set_qform(RAS, code=1)
    hdr["pixdim"][0] = 0.0  # written by some tools; the standard says treat as 1
    vol = read_nifti(_save_raw(tmp_path / "ct.nii.gz", hdr, _volume().tobytes(order="F")), role="ct")
    np.testing.assert_allclose(vol.affine, RAS, atol=1e-5)


def _noisy_ct(tmp_path: Path) -> Path:
    """A CT whose gzip stream is long enough to cut and corrupt in the middle."""
    data = np.random.default_rng(0).integers(-1000, 1000, size=(32, 32, 16), dtype=np.int16)
    return _save(tmp_path / "ct.nii.gz", data)


@pytest.mark.parametrize(
    "cut",
    [
        # cut in half: ISIZE is read from compressed bytes and disagrees with the header
        lambda raw: raw[: len(raw) // 2],
        # cut in half but the true ISIZE kept at the end: the inflate itself finds the truncation
        lambda raw: raw[: len(raw) // 2] + raw[-4:],
        # only the trailer lost
        lambda raw: raw[:-8],
    ],
)
def test_read_nifti_truncated_gzip_is_corrupt(tmp_path: Path, cut) -> None:
    path = _noisy_ct(tmp_path)
    path.write_bytes(cut(path.read_bytes()))
    with pytest.raises(CaseDataError) as excinfo:
        read_nifti(path, role="ct")
    _assert_rejected(excinfo, RejectReason.CORRUPT_GZIP, "ct.nii.gz")


@pytest.mark.parametrize(
    "offset_from_end",
    [
        # flip bytes mid-stream
        None,
        # flip the CRC32 in the trailer: a pure checksum error
        8,
    ],
)
def test_read_nifti_corrupt_gzip_is_rejected(tmp_path: Path, offset_from_end: int | None) -> None:
    path = _noisy_ct(tmp_path)
    raw = bytearray(path.read_bytes())
    at = len(raw) // 2 if offset_from_end is None else len(raw) - offset_from_end
    for i in range(at, at + 4):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CaseDataError) as excinfo:
        read_nifti(path, role="ct")
    _assert_rejected(excinfo, RejectReason.CORRUPT_GZIP, "ct.nii.gz")


def test_read_nifti_truncated_plain_nii_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path / "ct.nii", _volume())
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CaseDataError) as excinfo:
        read_nifti(path, role="ct")
    _assert_rejected(excinfo, RejectReason.ABSURD_SIZE, "ct.nii")


@pytest.mark.parametrize(
    "shape",
    [
        # 2-D
        (6, 5),
        # real 4-D (t = 3)
        (6, 5, 4, 3),
        # 5-D with a non-1 fifth dimension
        (6, 5, 4, 1, 2),
    ],
)
def test_read_nifti_non_3d_is_bad_ndim(tmp_path: Path, shape: tuple[int, ...]) -> None:
    path = _save(tmp_path / "ct.nii.gz", _volume(shape))
    with pytest.raises(CaseDataError) as excinfo:
        read_nifti(path, role="ct")
    _assert_rejected(excinfo, RejectReason.BAD_NDIM, "ct.nii.gz")


def test_read_nifti_absurd_dims_refused_before_allocating(tmp_path: Path) -> None:
    hdr = _header((100000, 100000, 100000), np.int16, cls=nib.Nifti2Header)
    path = _save_raw(tmp_path / "ct.nii.gz", hdr, bytes(64))
    tracemalloc.start()
    try:
        with pytest.raises(CaseDataError) as excinfo:
            read_nifti(path, role="ct")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000  # refused from the header: nothing near the claimed 2 TB was allocated
    _assert_rejected(excinfo, RejectReason.ABSURD_SIZE, "ct.nii.gz")


def test_read_nifti_voxel_count_above_limit_is_absurd(tmp_path: Path) -> None:
    path = _save(tmp_path / "ct.nii.gz", _volume())
    with pytest.raises(CaseDataError) as excinfo:
        read_nifti(path, role="ct", cfg=LoadConfig(max_voxels=119))
    _assert_rejected(excinfo, RejectReason.ABSURD_SIZE, "ct.nii.gz")
    assert read_nifti(path, role="ct", cfg=LoadConfig(max_voxels=120)).data.shape == SHAPE


@pytest.mark.parametrize(
    ("role", "bad"),
    [
        # NaN in a float CT
        ("ct", np.nan),
        # +inf in a float CT
        ("ct", np.inf),
        # NaN in a float mask
        ("mask", np.nan),
    ],
)
def test_read_nifti_non_finite_voxels_rejected(tmp_path: Path, role: str, bad: float) -> None:
    data = np.zeros(SHAPE, np.float32)
    data[3, 2, 1] = bad
    path = _save(tmp_path / "vol.nii.gz", data)
    with pytest.raises(CaseDataError) as excinfo:
        read_nifti(path, role=role)
    _assert_rejected(excinfo, RejectReason.NON_FINITE_VOXELS, "vol.nii.gz")


@pytest.mark.parametrize(
    ("data", "listed"),
    [
        # int8 mask with a 2
        (np.array([0, 1, 2, 1], np.int8), "values [0, 1, 2]"),
        # int8 mask with -1 (reads as 255 through the uint8 check)
        (np.array([0, -1, 1, 0], np.int8), "values [-1, 0, 1]"),
        # float mask with 0.5
        (np.array([0.0, 0.5, 1.0, 1.0], np.float32), "values [0.0, 0.5, 1.0]"),
        # multi-label int16 map
        (np.array([0, 3, 7, 0], np.int16), "values [0, 3, 7]"),
    ],
)
def test_read_nifti_mask_values_other_than_0_1_rejected(tmp_path: Path, data: np.ndarray, listed: str) -> None:
    path = _save(tmp_path / "liver_lesion.nii.gz", data.reshape(4, 1, 1))
    with pytest.raises(CaseDataError) as excinfo:
        read_nifti(path, role="mask")
    _assert_rejected(excinfo, RejectReason.BAD_MASK_VALUES, "liver_lesion.nii.gz")
    assert listed in excinfo.value.detail


def test_read_nifti_rejects_unknown_role(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="role"):
        read_nifti(_save(tmp_path / "ct.nii.gz", _volume()), role="label")  # type: ignore[arg-type]


# --- open_case: canonical orientation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("affine", "stored_shape", "to_canonical", "spacing"),
    [
        # RAS storage: unchanged
        (RAS, SHAPE, lambda a: a, ZOOMS),
        # LPS storage (DICOM-style): x and y flipped
        (LPS, SHAPE, lambda a: a[::-1, ::-1, :], ZOOMS),
        # stored (S, P, R): transposed and y flipped
        (SPR, SHAPE[::-1], lambda a: a[:, ::-1, :].transpose(2, 1, 0), (ZOOMS[0], ZOOMS[1], ZOOMS[2])),
    ],
)
def test_open_case_ct_is_canonical_ras_view(
    tmp_path: Path, affine: np.ndarray, stored_shape: tuple[int, int, int], to_canonical, spacing
) -> None:
    stored = _volume(stored_shape)
    ref = _case(tmp_path, stored, affine)

    case = open_case(ref)

    assert isinstance(case, CaseImages)
    assert case.case_id == CASE_ID
    np.testing.assert_array_equal(case.ct_hu, to_canonical(stored))
    assert case.ct_hu.shape == SHAPE
    assert case.ct_hu.dtype == np.int16 and not case.ct_hu.flags.owndata
    assert case.spacing_mm == pytest.approx(spacing)
    canonical = nib.as_closest_canonical(nib.load(ref.ct_path))
    np.testing.assert_allclose(case.affine_ras, canonical.affine)
    np.testing.assert_array_equal(case.ct_hu, np.asanyarray(canonical.dataobj))
    assert case.warnings == []


def test_open_case_missing_ct(tmp_path: Path) -> None:
    ref = _ref(tmp_path)
    with pytest.raises(CaseDataError) as excinfo:
        open_case(ref)
    _assert_rejected(excinfo, RejectReason.MISSING_CT, f"image_only/{CASE_ID}/ct.nii.gz")


def test_open_case_records_digests_of_every_file_read(tmp_path: Path) -> None:
    ref = _case(tmp_path)
    liver = _save_mask(ref, "liver", _volume() > 0)
    case = open_case(ref)
    ct_rel = f"image_only/{CASE_ID}/ct.nii.gz"
    liver_rel = f"mask_only/{CASE_ID}/segmentations/liver.nii.gz"
    assert case.file_digests == {ct_rel: hashlib.sha256(ref.ct_path.read_bytes()).hexdigest()}

    case.mask("liver")

    assert case.file_digests[liver_rel] == hashlib.sha256(liver.read_bytes()).hexdigest()
    assert set(case.file_digests) == {ct_rel, liver_rel}


def test_open_case_has_and_missing_mask(tmp_path: Path) -> None:
    ref = _case(tmp_path)
    _save_mask(ref, "liver", _volume() > 0)
    case = open_case(ref)
    assert case.has("liver") and not case.has("liver_lesion")
    assert case.mask("liver_lesion") is None


def test_open_case_reads_plain_nii_masks(tmp_path: Path) -> None:
    ref = _case(tmp_path)
    data = _volume() > 10
    _save(ref.mask_dir / "liver.nii", data.astype(np.uint8))
    np.testing.assert_array_equal(open_case(ref).mask("liver"), data)


# --- masks on the CT grid --------------------------------------------------------------------------------------


@pytest.mark.parametrize("ct_affine", [RAS, LPS, SPR], ids=["ras", "lps", "spr"])
def test_mask_same_grid_takes_ct_orientation(tmp_path: Path, ct_affine: np.ndarray) -> None:
    stored_shape = SHAPE[::-1] if ct_affine is SPR else SHAPE
    ref = _case(tmp_path, _volume(stored_shape), ct_affine)
    stored_mask = _volume(stored_shape) % 4 == 0
    _save_mask(ref, "liver", stored_mask, ct_affine)
    case = open_case(ref)

    mask = case.mask("liver")

    assert mask is not None and mask.dtype == np.bool_ and mask.shape == case.ct_hu.shape
    expected = apply_orientation(stored_mask, io_orientation(ct_affine))
    np.testing.assert_array_equal(mask, expected)
    # The mask covers exactly the CT voxels it covered in storage order.
    ct_stored = _volume(stored_shape)
    assert sorted(case.ct_hu[mask].tolist()) == sorted(ct_stored[stored_mask].tolist())
    assert case.warnings == []


def test_mask_with_sign_flipped_affine_over_same_voxels_is_taken_voxel_for_voxel(tmp_path: Path) -> None:
    ref = _case(tmp_path, affine=RAS)
    stored_mask = _volume() % 5 == 0
    _save_mask(ref, "aorta", stored_mask, LPS)  # LPS-signed affine, identical voxel array (BDMAP_00000002)
    case = open_case(ref)

    mask = case.mask("aorta")

    np.testing.assert_array_equal(mask, stored_mask)  # CT is RAS: canonical = stored; NOT mirrored by its own affine
    assert len(case.warnings) == 1
    assert case.warnings[0].startswith("aorta.nii.gz: affine disagrees with the CT's")


def _crop_affine(ct_affine: np.ndarray, index_map: np.ndarray, offset_vox: tuple[float, float, float]) -> np.ndarray:
    """Mask affine whose voxel m lands on CT voxel index_map @ m + offset_vox."""
    t = np.eye(4)
    t[:3, :3] = index_map
    t[:3, 3] = offset_vox
    return ct_affine @ t


def test_mask_on_cropped_grid_is_placed_at_its_offset(tmp_path: Path) -> None:
    ref = _case(tmp_path)
    crop = np.array([[[1, 0], [1, 1]], [[0, 1], [0, 0]], [[1, 1], [0, 1]]], dtype=bool)  # (3, 2, 2)
    _save_mask(ref, "liver", crop, _crop_affine(RAS, np.eye(3), (2, 1, 1)))
    case = open_case(ref)

    mask = case.mask("liver")

    expected = np.zeros(SHAPE, bool)
    expected[2:5, 1:3, 1:3] = crop
    np.testing.assert_array_equal(mask, expected)
    assert case.warnings == []


@pytest.mark.parametrize(
    ("ct_affine", "index_map", "offset"),
    [
        # RAS CT, mask cropped in the same orientation
        (RAS, np.eye(3), (1, 2, 0)),
        # RAS CT, mask cropped and stored LPS-signed (x and y flipped)
        (RAS, np.diag([-1.0, -1.0, 1.0]), (4, 2, 1)),
        # LPS CT, mask cropped in the same orientation
        (LPS, np.eye(3), (0, 3, 2)),
        # LPS CT, mask stored with x and z swapped and z flipped
        (LPS, np.array([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [-1.0, 0.0, 0.0]]), (3, 0, 3)),
    ],
)
def test_mask_on_other_grid_matches_voxelwise_oracle(
    tmp_path: Path, ct_affine: np.ndarray, index_map: np.ndarray, offset: tuple[int, int, int]
) -> None:
    ref = _case(tmp_path, affine=ct_affine)
    crop = np.random.default_rng(1).random((3, 2, 2)) > 0.4
    _save_mask(ref, "kidney_left", crop, _crop_affine(ct_affine, index_map, offset))
    case = open_case(ref)

    mask = case.mask("kidney_left")

    stored = np.zeros(SHAPE, bool)  # oracle: move every mask voxel by hand, then orient as nibabel does
    for m in np.ndindex(crop.shape):
        c = index_map @ np.array(m) + np.array(offset)
        stored[tuple(int(v) for v in c)] = crop[m]
    np.testing.assert_array_equal(mask, apply_orientation(stored, io_orientation(ct_affine)))


def test_mask_overhanging_ct_grid_with_only_zeros_outside_is_accepted(tmp_path: Path) -> None:
    ref = _case(tmp_path)
    crop = np.zeros((3, 2, 2), bool)
    crop[0, 0, 0] = True  # lands on CT voxel (4, 3, 2); mask x index 2 -> CT x 6 is outside, but empty
    _save_mask(ref, "liver", crop, _crop_affine(RAS, np.eye(3), (4, 3, 2)))
    mask = open_case(ref).mask("liver")
    expected = np.zeros(SHAPE, bool)
    expected[4, 3, 2] = True
    np.testing.assert_array_equal(mask, expected)


def test_mask_with_same_affine_but_smaller_grid_unlike_the_body_crop_is_refused(tmp_path: Path) -> None:
    # docs/contract.md#input: identical affines + a smaller mask are placed only at the CT's reproduced Mini body crop;
    # this CT's band (-100 < HU < 100) covers the whole grid, so the box is (6, 5, 4), not the mask's (3, 2, 2).
    ref = _case(tmp_path)
    _save_mask(ref, "spleen", np.ones((3, 2, 2), bool), RAS)
    case = open_case(ref)
    with pytest.raises(CaseDataError) as excinfo:
        case.mask("spleen")
    _assert_rejected(excinfo, RejectReason.MASK_GRID_MISMATCH, "spleen.nii.gz")
    assert "Mini body crop has shape (6, 5, 4)" in excinfo.value.detail


def _rotation_z(deg: float) -> np.ndarray:
    r = np.deg2rad(deg)
    return np.array([[np.cos(r), -np.sin(r), 0.0], [np.sin(r), np.cos(r), 0.0], [0.0, 0.0, 1.0]])


@pytest.mark.parametrize(
    ("index_map", "offset", "what"),
    [
        # rotated by 30 degrees in-plane
        (_rotation_z(30), (1, 1, 1), "rotated or scaled"),
        # half-voxel shift
        (np.eye(3), (1.5, 1, 1), "non-integer"),
        # twice the voxel size
        (np.diag([2.0, 1.0, 1.0]), (0, 0, 0), "rotated or scaled"),
        # nonzero voxels beyond the CT's x extent (6): mask x 0..2 lands on CT x 5..7
        (np.eye(3), (5, 0, 0), "outside the CT grid"),
        # entirely outside the CT grid
        (np.eye(3), (-10, 0, 0), "outside the CT grid"),
    ],
)
def test_mask_not_placeable_is_grid_mismatch(
    tmp_path: Path, index_map: np.ndarray, offset: tuple[float, float, float], what: str
) -> None:
    ref = _case(tmp_path)
    _save_mask(ref, "pancreas", np.ones((3, 2, 2), bool), _crop_affine(RAS, index_map, offset))
    case = open_case(ref)
    with pytest.raises(CaseDataError) as excinfo:
        case.mask("pancreas")
    _assert_rejected(excinfo, RejectReason.MASK_GRID_MISMATCH, "pancreas.nii.gz")
    assert what in excinfo.value.detail
    assert "(3, 2, 2)" in excinfo.value.detail and "(6, 5, 4)" in excinfo.value.detail
    assert "offset" in excinfo.value.detail


def test_mask_file_defects_name_the_mask(tmp_path: Path) -> None:
    ref = _case(tmp_path)
    bad = np.zeros(SHAPE, np.int8)
    bad[0, 0, 0] = 2
    _save_mask(ref, "liver_lesion", bad)
    with pytest.raises(CaseDataError) as excinfo:
        open_case(ref).mask("liver_lesion")
    _assert_rejected(excinfo, RejectReason.BAD_MASK_VALUES, f"mask_only/{CASE_ID}/segmentations/liver_lesion.nii.gz")


# --- header free text ------------------------------------------------------------------------------------------


FREE_TEXT = {
    "descrip": b"SECRET-DESCRIP",
    "aux_file": b"SECRET-AUX",
    "intent_name": b"SECRET-INTENT",
    "db_name": b"SECRET-DB",
}


def test_header_free_text_never_leaves_the_module(tmp_path: Path) -> None:
    ref = _case(tmp_path, **FREE_TEXT)
    _save_mask(ref, "aorta", _volume() > 0, LPS, **FREE_TEXT)  # triggers a warning
    bad = _save(tmp_path / "bad.nii.gz", _volume((6, 5)), RAS, **FREE_TEXT)

    vol = read_nifti(ref.ct_path, role="ct")
    case = open_case(ref)
    case.mask("aorta")
    with pytest.raises(CaseDataError) as excinfo:
        read_nifti(bad, role="ct")

    assert not hasattr(vol, "header") and not hasattr(case, "header")
    returned = [repr(getattr(vol, f)) for f in ("affine", "zooms_mm", "path")]
    returned += [repr(case.warnings), repr(case.file_digests), repr(case.spacing_mm), str(excinfo.value)]
    for text in FREE_TEXT.values():
        assert all(text.decode() not in r for r in returned)


# --- one-pass mask check and box ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(16, 8, 5), (7, 3, 4)])  # uint64 words, and the uint8 fallback (7*3 % 8 != 0)
def test_check_mask_bytes_finds_the_tight_box(shape: tuple[int, int, int]) -> None:
    from emrl_data.reading.nifti import _check_mask_bytes

    data = np.zeros(shape, dtype=np.uint8, order="F")
    data[2, 1, 3] = 1
    data[5, 2, 1] = 1
    assert _check_mask_bytes(data, "m.nii.gz") == (slice(2, 6), slice(1, 3), slice(1, 4))
    assert _check_mask_bytes(np.zeros(shape, dtype=np.uint8, order="F"), "m.nii.gz") is None


@pytest.mark.parametrize(
    ("voxels", "box"),
    [
        ([(2, 1, 3), (5, 2, 9)], (slice(2, 6), slice(1, 3), slice(3, 10))),  # first and last slab differ, gap between
        ([(0, 0, 0), (15, 7, 12)], (slice(0, 16), slice(0, 8), slice(0, 13))),  # the first and last slices
        ([(4, 4, 7)], (slice(4, 5), slice(4, 5), slice(7, 8))),  # one voxel in one slab
        ([(3, 2, 4), (6, 5, 5)], (slice(3, 7), slice(2, 6), slice(4, 6))),  # both in slab 4:6
    ],
)
def test_check_mask_bytes_k_extent_from_slabs(monkeypatch: pytest.MonkeyPatch, voxels, box) -> None:
    """With slabs of 2 slices the K extent comes from the first and last nonzero slabs; the box is the same."""
    from emrl_data.reading import nifti

    monkeypatch.setattr(nifti, "_SLAB_BYTES", 16 * 8 * 2)
    data = np.zeros((16, 8, 13), dtype=np.uint8, order="F")
    for v in voxels:
        data[v] = 1
    assert nifti._check_mask_bytes(data, "m.nii.gz") == box
    data[9, 1, 11] = 2  # a bad value in an otherwise empty slab
    with pytest.raises(CaseDataError) as info:
        nifti._check_mask_bytes(data, "m.nii.gz")
    assert info.value.reason == RejectReason.BAD_MASK_VALUES


@pytest.mark.parametrize(
    ("dtype", "value", "listed"), [(np.uint8, 2, "[0, 2]"), (np.int8, -1, "[-1, 0]"), (np.uint8, 255, "[0, 255]")]
)
def test_check_mask_bytes_refuses_values_other_than_0_and_1(dtype: type, value: int, listed: str) -> None:
    from emrl_data.reading.nifti import _check_mask_bytes

    data = np.zeros((16, 8, 5), dtype=dtype, order="F")
    data[3, 4, 2] = value
    with pytest.raises(CaseDataError) as info:
        _check_mask_bytes(data, "m.nii.gz")
    assert info.value.reason == RejectReason.BAD_MASK_VALUES
    assert f"found values {listed}" in str(info.value)


def test_orientation_maps_a_box_like_the_array() -> None:
    from emrl_data.labeling.crops import mask_box
    from emrl_data.reading.case_images import _Orientation

    affine = np.diag([-1.0, -1.0, 1.0, 1.0])[[1, 0, 2, 3]]  # stored i -> -A (y), stored j -> -R... (x), k -> S
    stored = np.zeros((6, 5, 4), dtype=np.bool_, order="F")
    stored[1:3, 2:5, 0:2] = True
    orientation = _Orientation.from_affine(affine, stored.shape)
    box = orientation.box((slice(1, 3), slice(2, 5), slice(0, 2)))
    assert box == mask_box(orientation.apply(stored))
    assert box == (slice(0, 3), slice(3, 5), slice(0, 2))
