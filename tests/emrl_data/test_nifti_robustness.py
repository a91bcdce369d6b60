"""Adversarial tests of emrl_data.reading.nifti / inflate / placement: gzip as gzip means it, header-bounded memory,
trustworthy geometry, mask placement by evidence and reused decode buffers."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from scipy import ndimage

from emrl_data.config import LoadConfig
from emrl_data.outcome import CaseDataError, RejectReason
from emrl_data.reading import inflate
from emrl_data.reading.atlas import CaseRef
from emrl_data.reading.case_images import open_case
from emrl_data.reading.nifti import read_nifti
from emrl_data.synthetic import CaseSpec, write_case


SHAPE = (6, 5, 4)
ZOOMS = (0.8, 0.7, 2.5)
RAS = np.diag([*ZOOMS, 1.0])
REPO = Path(__file__).resolve().parents[2]


def _volume(shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    return (np.arange(int(np.prod(shape))).reshape(shape) - 60).astype(np.int16)


def _nifti_bytes(data: np.ndarray, affine: np.ndarray = RAS) -> bytes:
    return nib.Nifti1Image(data, affine).to_bytes()


def _members(blob: bytes, cuts: list[int]) -> bytes:
    """`blob` as concatenated gzip members split at `cuts` (byte offsets of the uncompressed stream)."""
    edges = [0, *cuts, len(blob)]
    return b"".join(gzip.compress(blob[a:b], mtime=0) for a, b in zip(edges, edges[1:], strict=False))


def _reject(path: Path, reason: RejectReason, role: str = "ct", cfg: LoadConfig | None = None) -> CaseDataError:
    with pytest.raises(CaseDataError) as excinfo:
        read_nifti(path, role=role, cfg=cfg or LoadConfig())  # type: ignore[arg-type]
    err = excinfo.value
    assert err.reason == reason, err
    assert err.path is not None and path.name in err.path and path.name in err.detail
    return err


# --- gzip as gzip means it ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cuts",
    [
        # two members split in the voxels
        [400],
        # the NIfTI header itself split over three members
        [100, 200],
        # an empty member in the middle
        [300, 300],
    ],
)
def test_multi_member_gzip_reads_like_one_member(tmp_path: Path, cuts: list[int]) -> None:
    data = _volume()
    path = tmp_path / "ct.nii.gz"
    path.write_bytes(_members(_nifti_bytes(data), cuts))
    np.testing.assert_array_equal(read_nifti(path, role="ct").data, data)


@pytest.mark.parametrize(
    "tail",
    [
        # one zero byte
        b"\x00",
        # 10 kB of zeros (tape-block padding)
        bytes(10_000),
        # an empty gzip member, then zeros
        gzip.compress(b"", mtime=0) + bytes(7),
    ],
)
def test_trailing_zero_padding_and_empty_members_are_accepted(tmp_path: Path, tail: bytes) -> None:
    data = _volume()
    path = tmp_path / "ct.nii.gz"
    path.write_bytes(gzip.compress(_nifti_bytes(data), mtime=0) + tail)
    np.testing.assert_array_equal(read_nifti(path, role="ct").data, data)


@pytest.mark.parametrize(
    ("tail", "what"),
    [
        # garbage after the stream
        (b"\x00\x00junk", "neither a gzip member nor zero padding"),
        # a second member that adds voxels beyond the header's size
        (gzip.compress(b"extra", mtime=0), "inflates to more than the header's"),
        # a broken second member
        (b"\x1f\x8b\x08\x00garbage-garbage-garbage", "corrupt or truncated"),
    ],
)
def test_anything_else_after_the_stream_is_corrupt(tmp_path: Path, tail: bytes, what: str) -> None:
    path = tmp_path / "ct.nii.gz"
    path.write_bytes(gzip.compress(_nifti_bytes(_volume()), mtime=0) + tail)
    assert what in _reject(path, RejectReason.CORRUPT_GZIP).detail


@pytest.mark.parametrize(
    ("member", "offset_from_end"),
    [
        # CRC32 of the first of two members
        (0, 8),
        # ISIZE of the first of two members
        (0, 4),
        # CRC32 of the second member
        (1, 8),
    ],
)
def test_every_member_crc_and_isize_is_verified(tmp_path: Path, member: int, offset_from_end: int) -> None:
    blob = _nifti_bytes(_volume())
    parts = [bytearray(gzip.compress(blob[:560], mtime=0)), bytearray(gzip.compress(blob[560:], mtime=0))]
    parts[member][len(parts[member]) - offset_from_end] ^= 0x01
    path = tmp_path / "ct.nii.gz"
    path.write_bytes(bytes(parts[0] + parts[1]))
    assert "CRC32 or ISIZE" in _reject(path, RejectReason.CORRUPT_GZIP).detail


def test_stream_shorter_than_the_header_is_corrupt(tmp_path: Path) -> None:
    blob = _nifti_bytes(_volume())
    path = tmp_path / "ct.nii.gz"
    path.write_bytes(gzip.compress(blob[:-2], mtime=0))
    assert (
        f"inflates to {len(blob) - 2} bytes, header needs {len(blob)}"
        in _reject(path, RejectReason.CORRUPT_GZIP).detail
    )


def test_plain_nii_with_bytes_after_the_image_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ct.nii"
    path.write_bytes(_nifti_bytes(_volume()) + bytes(3))
    assert "3 bytes after the image" in _reject(path, RejectReason.ABSURD_SIZE).detail


# --- memory bounded by the header (peak RSS measured in a fresh subprocess) ------------------------------------


def _bomb(path: Path, gib: int = 1) -> None:
    """A ~1 MB .nii.gz of a 64^3 int16 header whose stream inflates to `gib` GiB; ISIZE forged to the header's."""
    hdr_blob = _nifti_bytes(np.zeros((64, 64, 64), np.int16))[:352]
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = comp.compress(hdr_blob) + comp.flush(zlib.Z_FULL_FLUSH)
    block = comp.compress(bytes(1 << 20)) + comp.flush(zlib.Z_FULL_FLUSH)  # dictionary reset: repeatable
    tail = comp.flush(zlib.Z_FINISH)
    expected = 352 + 64**3 * 2
    with path.open("wb") as f:
        f.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + head)
        for _ in range(gib * 1024):
            f.write(block)
        f.write(tail + (0).to_bytes(4, "little") + expected.to_bytes(4, "little"))


def _peak_rss_mb(path: Path, role: str = "ct") -> dict:
    """Read `path` in a fresh interpreter; return the outcome and the peak RSS (MB) of that process."""
    code = f"""
import json, resource
from pathlib import Path
from emrl_data.reading.nifti import read_nifti
from emrl_data.outcome import CaseDataError

def peak_mb():
    # VmHWM: ru_maxrss can be inherited from the (large) pytest parent across fork+exec
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

before = peak_mb()
try:
    vol = read_nifti(Path({str(path)!r}), role={role!r})
    out = {{"reason": None, "shape": list(vol.data.shape)}}
except CaseDataError as err:
    out = {{"reason": str(err.reason), "detail": err.detail}}
out["import_mb"] = before
out["peak_mb"] = peak_mb()
print(json.dumps(out))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO)},
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_gzip_bomb_with_forged_isize_stops_at_the_header_size(tmp_path: Path) -> None:
    path = tmp_path / "ct.nii.gz"
    _bomb(path)
    assert path.stat().st_size < 2_000_000
    out = _peak_rss_mb(path)
    assert out["reason"] == "corrupt_gzip"
    assert "inflates to more than the header's 524640 bytes" in out["detail"]
    assert out["peak_mb"] < 300, out


def test_plain_nii_with_a_sparse_1_gib_tail_is_refused_without_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "ct.nii"
    path.write_bytes(_nifti_bytes(_volume()))
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size + (1 << 30))  # sparse: no disk used
    out = _peak_rss_mb(path)
    assert out["reason"] == "absurd_size" and f"{1 << 30} bytes after the image" in out["detail"]
    assert out["peak_mb"] < 300, out


@pytest.mark.slow
def test_gzip_with_a_sparse_1_gib_zero_tail_is_accepted_in_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "ct.nii.gz"
    path.write_bytes(gzip.compress(_nifti_bytes(_volume()), mtime=0))
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size + (1 << 30))
    out = _peak_rss_mb(path)
    assert out["reason"] is None and out["shape"] == list(SHAPE)
    assert out["peak_mb"] < 300, out


# --- geometry you can trust -----------------------------------------------------------------------------------


def _save_header(path: Path, data: np.ndarray, *, sform=None, qform=None, pixdim=None) -> Path:  # type: ignore[no-untyped-def]
    img = nib.Nifti1Image(data, None)
    hdr = img.header
    hdr.set_sform(sform if sform is not None else RAS, code=2 if sform is not None else 0)
    hdr.set_qform(qform if qform is not None else RAS, code=1 if qform is not None else 0)
    if pixdim is None:
        chosen = sform if sform is not None else qform if qform is not None else RAS
        pixdim = np.sqrt((chosen[:3, :3] ** 2).sum(axis=0))
    p = hdr["pixdim"].copy()
    p[1:4] = pixdim
    hdr["pixdim"] = p
    hdr.set_data_offset(352)
    path.write_bytes(gzip.compress(hdr.binaryblock + bytes(4) + data.tobytes(order="F"), mtime=0))
    return path


def test_pixdim_ten_times_the_sform_voxel_size_is_a_geometry_conflict(tmp_path: Path) -> None:
    path = _save_header(tmp_path / "ct.nii.gz", _volume(), sform=RAS, pixdim=[8.0, 7.0, 25.0])
    err = _reject(path, RejectReason.GEOMETRY_CONFLICT)
    assert "voxel sizes in pixdim (8, 7, 25) mm disagree with the affine's (0.8, 0.7, 2.5) mm" in err.detail


def test_sform_and_qform_describing_different_grids_are_a_geometry_conflict(tmp_path: Path) -> None:
    lps = np.diag([-0.8, -0.7, 2.5, 1.0])
    path = _save_header(tmp_path / "ct.nii.gz", _volume(), sform=RAS, qform=lps)
    assert "sform and qform place the grid" in _reject(path, RejectReason.GEOMETRY_CONFLICT).detail


def test_sform_and_qform_within_rounding_agree(tmp_path: Path) -> None:
    nearly = RAS.copy()
    nearly[:3, 3] = [0.001, -0.002, 0.0]
    vol = read_nifti(_save_header(tmp_path / "ct.nii.gz", _volume(), sform=RAS, qform=nearly), role="ct")
    np.testing.assert_allclose(vol.affine, RAS)  # sform wins, as nibabel's get_best_affine


@pytest.mark.parametrize(
    ("zooms", "rejected"),
    [
        # the report's "707106.8 cm": pixdim 1e6 mm with a matching sform
        ((1e6, 1e6, 1e6), True),
        # too fine for a CT
        ((0.05, 0.7, 2.5), True),
        # the limits themselves are plausible
        ((0.1, 0.7, 20.0), False),
        # just beyond
        ((0.8, 0.7, 20.5), True),
    ],
)
def test_spacing_outside_the_plausible_range_is_refused(
    tmp_path: Path, zooms: tuple[float, float, float], rejected: bool
) -> None:
    affine = np.diag([*zooms, 1.0])
    path = _save_header(tmp_path / "ct.nii.gz", _volume(), sform=affine, pixdim=list(zooms))
    if not rejected:
        assert read_nifti(path, role="ct").zooms_mm == pytest.approx(zooms)
        return
    assert "outside the plausible range [0.1, 20] mm" in _reject(path, RejectReason.IMPLAUSIBLE_SPACING).detail


def test_spacing_range_is_configurable(tmp_path: Path) -> None:
    path = _save_header(tmp_path / "ct.nii.gz", _volume(), sform=np.diag([30.0, 30.0, 30.0, 1.0]), pixdim=[30.0] * 3)
    assert read_nifti(path, role="ct", cfg=LoadConfig(spacing_range_mm=(0.1, 50.0))).zooms_mm == (30.0, 30.0, 30.0)
    _reject(path, RejectReason.IMPLAUSIBLE_SPACING)


# --- mask placement by evidence (an anatomical phantom: emrl_data.synthetic) ----------------------------------

PHANTOM_SHAPE = (96, 80, 32)
ORGAN_FILES = ("liver", "pancreas", "kidney_left", "kidney_right")


@pytest.fixture(scope="module")
def phantom(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CaseRef]:
    root = tmp_path_factory.mktemp("phantom")
    truth = write_case(root, CaseSpec("BDMAP_00000007", shape=PHANTOM_SHAPE))
    ref = CaseRef(truth.case_id, root, root / truth.ct_path, root / truth.mask_dir)
    return root, ref


def _copy_case(src: CaseRef, dst_root: Path) -> CaseRef:
    ref = CaseRef(src.case_id, dst_root, dst_root / src.relative(src.ct_path), dst_root / src.relative(src.mask_dir))
    ref.ct_path.parent.mkdir(parents=True)
    ref.mask_dir.mkdir(parents=True)
    ref.ct_path.write_bytes(src.ct_path.read_bytes())
    for f in src.mask_dir.iterdir():
        (ref.mask_dir / f.name).write_bytes(f.read_bytes())
    return ref


def _mask_data(path: Path) -> tuple[np.ndarray, np.ndarray]:
    img = nib.load(str(path))
    return np.asanyarray(img.dataobj), img.affine


def _write_mask(path: Path, data: np.ndarray, affine: np.ndarray) -> None:
    nib.Nifti1Image(np.asarray(data, dtype=np.int8), affine).to_filename(str(path))


def test_clean_phantom_organ_masks_fit_the_evidence(phantom: tuple[Path, CaseRef]) -> None:
    _, ref = phantom
    case = open_case(ref)
    for name in ORGAN_FILES:
        mask = case.mask(name)
        assert mask is not None and mask.any()
    assert case.warnings == []


@pytest.mark.parametrize(
    ("edit", "reason", "organ", "file"),
    [
        # liver voxels mirrored left-right under the correct affine
        ("mirror_liver", RejectReason.MASK_ORIENTATION_CONFLICT, "liver", "liver.nii.gz"),
        # kidney files swapped: each kidney mask lies on the other side
        ("swap_kidneys", RejectReason.MASK_ORIENTATION_CONFLICT, "kidney", "kidney_left.nii.gz"),
        # a stale liver mask shifted into the air in front of the patient; it has the CT's own shape, so the grid
        # is fine and only the liver row is lost (a mask on another grid off the body rejects the case)
        ("liver_in_air", RejectReason.MASK_GRID_MISMATCH, "liver", "liver.nii.gz"),
        # the CT's pancreas region reads 400 HU
        ("pancreas_400_hu", RejectReason.IMPLAUSIBLE_ORGAN_HU, "pancreas", "pancreas.nii.gz"),
    ],
)
def test_organ_masks_that_contradict_the_ct_are_refused(
    phantom: tuple[Path, CaseRef],
    tmp_path: Path,
    edit: str,
    reason: RejectReason,
    organ: str | None,
    file: str,
) -> None:
    ref = _copy_case(phantom[1], tmp_path)
    seg = ref.mask_dir
    if edit == "mirror_liver":
        data, affine = _mask_data(seg / "liver.nii.gz")
        _write_mask(seg / "liver.nii.gz", data[::-1], affine)
    elif edit == "swap_kidneys":
        left, right = (seg / "kidney_left.nii.gz").read_bytes(), (seg / "kidney_right.nii.gz").read_bytes()
        (seg / "kidney_left.nii.gz").write_bytes(right)
        (seg / "kidney_right.nii.gz").write_bytes(left)
    elif edit == "liver_in_air":
        data, affine = _mask_data(seg / "liver.nii.gz")
        moved = np.zeros_like(data)
        moved[:6, :6, :] = 1  # the grid's corner: outside the body ellipse
        _write_mask(seg / "liver.nii.gz", moved, affine)
    else:
        img = nib.load(str(ref.ct_path))
        ct = np.asanyarray(img.dataobj).copy()
        pancreas, _ = _mask_data(seg / "pancreas.nii.gz")
        ct[pancreas.astype(bool)] = 400
        nib.Nifti1Image(ct, img.affine).to_filename(str(ref.ct_path))
    case = open_case(ref)
    structure = file.removesuffix(".nii.gz")
    with pytest.raises(CaseDataError) as excinfo:
        case.mask(structure)
    err = excinfo.value
    assert (err.reason, err.organ) == (reason, organ), err
    assert err.path == f"mask_only/BDMAP_00000007/segmentations/{file}"


def _reference_mini_box(ct: np.ndarray) -> tuple[slice, ...]:
    """OncoKit Mini's crop, independently: scipy 26-connected labelling of -100 < clip(HU) < 100."""
    clipped = np.clip(ct, -1000, 1000)
    labels, n = ndimage.label((clipped > -100) & (clipped < 100), structure=np.ones((3, 3, 3)))
    sizes = np.bincount(labels.ravel())[1:]
    largest = labels == (1 + int(np.argmax(sizes)))
    return ndimage.find_objects(largest.astype(np.int8))[0]


def test_mini_masks_with_the_unchanged_affine_are_placed_at_the_body_crop(
    phantom: tuple[Path, CaseRef], tmp_path: Path
) -> None:
    ref = _copy_case(phantom[1], tmp_path)
    ct = np.asanyarray(nib.load(str(ref.ct_path)).dataobj)
    box = _reference_mini_box(ct)
    assert tuple(s.stop - s.start for s in box) != ct.shape  # a real crop
    full = {}
    for name in ORGAN_FILES:
        data, affine = _mask_data(ref.mask_dir / f"{name}.nii.gz")
        full[name] = data.astype(bool)
        _write_mask(ref.mask_dir / f"{name}.nii.gz", data[box], affine)  # Mini: cropped, affine unchanged
    case = open_case(ref)
    for name in ORGAN_FILES:
        np.testing.assert_array_equal(case.mask(name), full[name])  # the phantom is stored RAS: canonical = stored
    assert len(case.warnings) == 4 and all("placed at the CT's Mini body crop origin" in w for w in case.warnings)


@pytest.mark.parametrize(
    "shrink",
    [
        # one voxel short of the crop along x
        (1, 0, 0),
        # larger than the CT (the reverse: a Mini CT met with full-grid masks)
        (-200, 0, 0),
    ],
)
def test_masks_with_the_ct_affine_but_another_shape_than_the_crop_are_refused(
    phantom: tuple[Path, CaseRef], tmp_path: Path, shrink: tuple[int, int, int]
) -> None:
    ref = _copy_case(phantom[1], tmp_path)
    data, affine = _mask_data(ref.mask_dir / "liver.nii.gz")
    shape = tuple(n - d for n, d in zip(data.shape, shrink, strict=True))
    crop = np.zeros(shape, np.int8)
    crop[: min(shape[0], data.shape[0])] = data[: shape[0]]
    _write_mask(ref.mask_dir / "liver.nii.gz", crop, affine)
    case = open_case(ref)
    with pytest.raises(CaseDataError) as excinfo:
        case.mask("liver")
    assert excinfo.value.reason == RejectReason.MASK_GRID_MISMATCH
    assert excinfo.value.path == "mask_only/BDMAP_00000007/segmentations/liver.nii.gz"


# --- reused decode buffers ------------------------------------------------------------------------------------


def test_arrays_handed_out_are_never_overwritten_by_later_reads(tmp_path: Path) -> None:
    a, b = _volume(), (_volume() * -1).astype(np.int16)
    pa, pb = tmp_path / "a.nii.gz", tmp_path / "b.nii.gz"
    pa.write_bytes(gzip.compress(_nifti_bytes(a), mtime=0))
    pb.write_bytes(gzip.compress(_nifti_bytes(b), mtime=0))
    kept = read_nifti(pa, role="ct").data[::-1].T  # a view of a view over the pooled buffer
    for _ in range(3):
        np.testing.assert_array_equal(read_nifti(pb, role="ct").data, b)
    np.testing.assert_array_equal(kept, a[::-1].T)


def test_buffers_are_reused_once_released(tmp_path: Path) -> None:
    path = tmp_path / "ct.nii.gz"
    path.write_bytes(gzip.compress(_nifti_bytes(_volume((64, 64, 16))), mtime=0))
    inflate.release_thread_buffers()
    pool = inflate.thread_pool()
    first = read_nifti(path, role="ct").data
    base = first.base
    while getattr(base, "base", None) is not None:
        base = base.base
    address = base.ctypes.data
    del first, base
    retained = pool.retained_bytes()
    for _ in range(5):
        again = read_nifti(path, role="ct").data
        root = again.base
        while getattr(root, "base", None) is not None:
            root = root.base
        assert root.ctypes.data == address  # the same memory: no fresh pages to fault in
        del again, root
    assert pool.retained_bytes() == retained


def test_buffer_pool_is_per_thread_and_can_be_disabled(tmp_path: Path) -> None:
    path = tmp_path / "ct.nii.gz"
    path.write_bytes(gzip.compress(_nifti_bytes(_volume()), mtime=0))
    pools = []

    def work() -> None:
        read_nifti(path, role="ct")
        pools.append(inflate.thread_pool())

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pools[0] is not pools[1]
    try:
        inflate.configure_buffer_pool(0)
        read_nifti(path, role="ct")
        assert inflate.thread_pool().retained_bytes() == 0
    finally:
        inflate.configure_buffer_pool(inflate.DEFAULT_POOL_MAX_BYTES)


def test_non_zero_byte_far_into_a_long_padding_is_corrupt(tmp_path: Path) -> None:
    # The padding is longer than the compressed bytes held in memory: it is checked in chunks, to its last byte.
    path = tmp_path / "ct.nii.gz"
    path.write_bytes(gzip.compress(_nifti_bytes(_volume()), mtime=0) + bytes(3 << 20) + b"\x01" + bytes(10))
    assert "non-zero bytes after the gzip stream" in _reject(path, RejectReason.CORRUPT_GZIP).detail


def test_header_larger_than_any_inflate_of_the_file_is_refused_before_allocating(tmp_path: Path) -> None:
    # 512 x 512 x 2048 int16 (1 GiB, within max_voxels) claimed by a 4 kB file: deflate cannot expand 1032:1 beyond.
    hdr = nib.Nifti1Header()
    hdr.set_data_shape((512, 512, 2048))
    hdr.set_data_dtype(np.int16)
    hdr.set_sform(RAS, code=2)
    hdr.set_zooms(ZOOMS)
    hdr.set_data_offset(352)
    path = tmp_path / "ct.nii.gz"
    path.write_bytes(gzip.compress(hdr.binaryblock + bytes(4) + bytes(1 << 20), mtime=0))
    out = _peak_rss_mb(path)
    assert out["reason"] == "absurd_size" and "can hold at most" in out["detail"]
    assert out["peak_mb"] < 300, out


def test_evidence_holds_for_a_case_stored_with_z_first(phantom: tuple[Path, CaseRef], tmp_path: Path) -> None:
    # Stored axes (z, y, x): the per-slice body steps must follow world z, not the last stored axis.
    ref = _copy_case(phantom[1], tmp_path)
    perm = np.array([[0.0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1]])
    img = nib.load(str(ref.ct_path))
    nib.Nifti1Image(np.asanyarray(img.dataobj).transpose(2, 1, 0), img.affine @ perm).to_filename(str(ref.ct_path))
    for name in ORGAN_FILES:
        data, affine = _mask_data(ref.mask_dir / f"{name}.nii.gz")
        stored = data[::-1] if name == "liver" else data  # the liver mirrored (patient's left-right)
        _write_mask(ref.mask_dir / f"{name}.nii.gz", stored.transpose(2, 1, 0), affine @ perm)
    case = open_case(ref)
    for name in ORGAN_FILES[1:]:
        assert case.mask(name) is not None
    with pytest.raises(CaseDataError) as excinfo:
        case.mask("liver")
    assert (excinfo.value.reason, excinfo.value.organ) == (RejectReason.MASK_ORIENTATION_CONFLICT, "liver")
    assert "mirror image along stored axis 2 fits" in excinfo.value.detail
