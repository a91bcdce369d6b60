"""Tests of emrl_data.labeling.frames: frame selection, crop, voxel -> pixel mapping, rendering."""

from __future__ import annotations

import io
import logging
import struct
import zlib

import cv2
import numpy as np
import pytest

from emrl_data.config import FrameConfig
from emrl_data.labeling import frames as frames_module
from emrl_data.labeling.frames import (
    FrameSet,
    box_px_to_qwen,
    box_vox_to_px,
    build_frames,
    crop_box_xy,
    encode_png_gray8,
    render_frames,
    select_frame_z,
    vox_to_px,
)
from emrl_data.outcome import CaseDataError, RejectReason


SMALL = FrameConfig(margin_slices=1, max_frames=5)


def _decode_gray(png: bytes) -> np.ndarray:
    img = cv2.imdecode(np.frombuffer(png, dtype=np.uint8), cv2.IMREAD_UNCHANGED)
    assert img is not None
    return img


def _ihdr_depth_and_colour(png: bytes) -> tuple[int, int]:
    """Return (bit depth, colour type) from the PNG IHDR chunk (0 = grey, 2 = RGB)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    return png[24], png[25]


def _bright_box(img: np.ndarray, threshold: int) -> tuple[int, int, int, int]:
    """Half-open (col0, row0, col1, row1) box of pixels above threshold."""
    rows, cols = np.nonzero(img > threshold)
    assert rows.size > 0
    return (int(cols.min()), int(rows.min()), int(cols.max()) + 1, int(rows.max()) + 1)


# --- select_frame_z ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "stop", "n_slices", "key_z", "expected"),
    [
        # fewer slices than max_frames: organ [4, 6) +- 1 = [3, 7) -> all 4 slices
        (4, 6, 20, None, [3, 4, 5, 6]),
        # exactly max_frames slices: [2, 7) -> all 5
        (3, 6, 20, None, [2, 3, 4, 5, 6]),
        # more: [9, 20) = 11 slices; linspace(9, 19, 5) = 9, 11.5, 14, 16.5, 19 -> rint (half to even)
        (10, 19, 40, None, [9, 12, 14, 16, 19]),
        # key slice already a sample: unchanged
        (10, 19, 40, 14, [9, 12, 14, 16, 19]),
        # key 17 replaces its nearest sample 16
        (10, 19, 40, 17, [9, 12, 14, 17, 19]),
        # key 13 is 1 from both 12 and 14: the tie replaces the lower sample (12)
        (10, 19, 40, 13, [9, 13, 14, 16, 19]),
        # key 10 replaces 9 (nearest); the first frame need not be the range start
        (10, 19, 40, 10, [10, 12, 14, 16, 19]),
        # margins clipped at both volume ends: [0, 3) - 1 and + 1 -> [0, 4) in a 4-slice volume
        (0, 3, 4, None, [0, 1, 2, 3]),
        # margin clipped at the top end only: [17, 20) + 1 clipped to 20
        (18, 20, 20, None, [17, 18, 19]),
        # key at the last slice of the volume inside the range: always a sample (linspace includes the end)
        (2, 30, 30, 29, [1, 8, 15, 22, 29]),
        # key at slice 0 of the volume, just below the range [1, 29): replaces the first sample
        (2, 28, 30, 0, [0, 8, 14, 21, 28]),
        # key above a take-all range [5, 8) = 5, 6, 7: replaces the last slice (frame count stays <= max_frames)
        (6, 7, 20, 9, [5, 6, 9]),
    ],
)
def test_select_frame_z_table(start: int, stop: int, n_slices: int, key_z: int | None, expected: list[int]) -> None:
    assert select_frame_z(start, stop, n_slices, key_z, cfg=SMALL) == expected


def test_select_frame_z_key_outside_range_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="emrl_data.labeling.frames"):
        select_frame_z(6, 7, 20, 9, cfg=SMALL)
    assert "outside the organ's frame range" in caplog.text


def test_select_frame_z_default_config_samples_32_and_keeps_every_key() -> None:
    cfg = FrameConfig()
    base = select_frame_z(100, 200, 300, None, cfg=cfg)
    assert len(base) == 32 and base[0] == 98 and base[-1] == 201
    for key in range(98, 202):
        frames = select_frame_z(100, 200, 300, key, cfg=cfg)
        assert key in frames and len(frames) == 32
        assert all(a < b for a, b in zip(frames, frames[1:], strict=False))
        assert sum(a != b for a, b in zip(frames, base, strict=True)) <= 1  # at most one sample replaced


@pytest.mark.parametrize(
    ("start", "stop", "n_slices", "key_z", "match"),
    [
        (5, 5, 20, None, "organ_z_start"),  # empty organ extent
        (0, 21, 20, None, "organ_z_start"),  # extent beyond the volume
        (3, 6, 20, 20, "outside the volume"),  # key past the last slice
        (3, 6, 20, -1, "outside the volume"),  # negative key
    ],
)
def test_select_frame_z_bad_arguments_raise(
    start: int, stop: int, n_slices: int, key_z: int | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        select_frame_z(start, stop, n_slices, key_z, cfg=SMALL)


# --- crop_box_xy ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("box", "spacing", "margin_mm", "expected"),
    [
        # x 20 vox * 0.5 = 10 mm, y 10 vox * 1.0 = 10 mm; side 10 + 2*5 = 20 mm -> 40 x 20 vox around (20, 25)
        ((10, 20, 0, 30, 30, 5), (0.5, 1.0, 2.5), 5.0, (0, 15, 40, 35)),
        # x 8 mm, y 12 mm; side 12 + 40 = 52 mm -> round(65) x round(86.67)=87 vox around (5, 10); runs outside
        ((0, 0, 0, 10, 20, 3), (0.8, 0.6, 2.5), 20.0, (-28, -34, 37, 53)),
        # isotropic, no margin, square organ: the crop is the organ box itself
        ((4, 6, 1, 12, 14, 2), (0.78, 0.78, 2.5), 0.0, (4, 6, 12, 14)),
        # x 4 mm is the short side: side = y 10 mm; 10 vox around centre x 10 -> starts at 5
        ((8, 0, 0, 12, 10, 1), (1.0, 1.0, 1.0), 0.0, (5, 0, 15, 10)),
        # odd/even mismatch: centre 10.5 with 10 vox -> start 5.5 is floored to 5
        ((8, 0, 0, 13, 10, 1), (1.0, 1.0, 1.0), 0.0, (5, 0, 15, 10)),
    ],
)
def test_crop_box_xy_square_in_mm(
    box: tuple[int, ...], spacing: tuple[float, float, float], margin_mm: float, expected: tuple[int, ...]
) -> None:
    crop = crop_box_xy(box, spacing, cfg=FrameConfig(crop_margin_mm=margin_mm))  # type: ignore[arg-type]
    assert crop == expected
    side_x_mm = (crop[2] - crop[0]) * spacing[0]
    side_y_mm = (crop[3] - crop[1]) * spacing[1]
    assert abs(side_x_mm - side_y_mm) <= max(spacing[:2])  # square in mm up to one voxel of rounding


def test_crop_box_xy_empty_box_raises() -> None:
    with pytest.raises(ValueError, match="empty"):
        crop_box_xy((5, 5, 0, 5, 9, 1), (1.0, 1.0, 1.0), cfg=FrameConfig())


# --- vox_to_px / box_vox_to_px / box_px_to_qwen -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "y", "expected"),
    [
        ((50.0), (40.0), (0.0, 0.0)),  # crop's max-x (patient right), max-y (anterior) corner -> top-left pixel
        ((10.0), (20.0), (400.0, 400.0)),  # crop's min-x, min-y corner -> bottom-right
        ((30.0), (30.0), (200.0, 200.0)),  # centre -> centre
        ((40.0), (25.0), (100.0, 300.0)),  # 10 vox * 10 px/vox from the right edge; 15 vox * 20 px/vox from the top
        ((60.0), (45.0), (-100.0, -100.0)),  # outside the crop maps outside the frame (not clipped)
    ],
)
def test_vox_to_px_table(x: float, y: float, expected: tuple[float, float]) -> None:
    assert vox_to_px(x, y, (10, 20, 50, 40), 400) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("bbox", "crop", "size", "expected"),
    [
        # 8 px per voxel: cols (56-14)*8..(56-10)*8, rows (56-30)*8..(56-20)*8
        ((10, 20, 14, 30), (0, 0, 56, 56), 448, (336, 208, 368, 288)),
        # 14.93 px per voxel: 283.73 floors to 283, 298.67 ceils to 299
        ((10, 10, 11, 11), (0, 0, 30, 30), 448, (283, 283, 299, 299)),
        # crop offset (-28, -34): a voxel box at the crop's right/anterior edge lands at (0, 0)
        ((27, 43, 37, 53), (-28, -34, 37, 53), 448, (0, 0, 69, 52)),
        # partly outside the crop: clipped to [0, 448]
        ((-5, 50, 10, 60), (0, 0, 56, 56), 448, (368, 0, 448, 48)),
        # entirely outside: empty box at the clip edge
        ((60, 60, 70, 70), (0, 0, 56, 56), 448, (0, 0, 0, 0)),
    ],
)
def test_box_vox_to_px_table(
    bbox: tuple[int, int, int, int], crop: tuple[int, int, int, int], size: int, expected: tuple[int, int, int, int]
) -> None:
    assert box_vox_to_px(bbox, crop, size) == expected


@pytest.mark.parametrize(
    ("bbox_px", "size", "expected"),
    [
        ((0, 0, 448, 448), 448, (0, 0, 1000, 1000)),  # whole frame
        ((1, 224, 447, 100), 448, (2, 500, 998, 223)),  # 2.23 -> 2, 500 exactly, 997.77 -> 998, 223.2 -> 223
        ((28, 84, 0, 0), 448, (62, 188, 0, 0)),  # 62.5 rounds half to even -> 62; 187.5 -> 188
        ((112, 56, 224, 1), 224, (500, 250, 1000, 4)),  # another frame size; 4.46 -> 4
    ],
)
def test_box_px_to_qwen_rounding(
    bbox_px: tuple[int, int, int, int], size: int, expected: tuple[int, int, int, int]
) -> None:
    assert box_px_to_qwen(bbox_px, size) == expected


# --- rendering --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x_range", "y_range", "left", "top"),
    [
        ((30, 40), (20, 30), True, True),  # patient right + anterior -> image left + top
        ((30, 40), (0, 10), True, False),  # patient right + posterior -> left + bottom
        ((0, 10), (20, 30), False, True),  # patient left + anterior -> right + top
        ((0, 10), (0, 10), False, False),  # patient left + posterior -> right + bottom
    ],
)
def test_render_orientation_pinned_by_marker(
    x_range: tuple[int, int], y_range: tuple[int, int], left: bool, top: bool
) -> None:
    # RAS+: x grows toward the patient's Right, y toward Anterior. Non-square (40 x 30) to catch a transpose.
    ct = np.full((40, 30, 3), 40, dtype=np.int16)
    ct[x_range[0] : x_range[1], y_range[0] : y_range[1], 1] = 1000
    crop = (0, 0, 40, 30)
    (png,) = render_frames(ct, [1], crop, cfg=FrameConfig())
    img = _decode_gray(png)
    rows, cols = np.nonzero(img > 200)
    half = 448 / 2
    assert (cols.max() < half) if left else (cols.min() >= half)
    assert (rows.max() < half) if top else (rows.min() >= half)
    # and the one mapping agrees with where it was drawn
    expected = box_vox_to_px((x_range[0], y_range[0], x_range[1], y_range[1]), crop, 448)
    assert all(abs(a - b) <= 1 for a, b in zip(_bright_box(img, 191), expected, strict=True))


@pytest.mark.parametrize(
    ("frame_size_px", "spacing"),
    [
        (448, (0.7, 0.9, 2.5)),  # crop smaller than the frame: enlarged with INTER_LINEAR
        (40, (0.7, 0.9, 2.5)),  # crop larger than the frame: shrunk with INTER_AREA
        (448, (0.8, 0.8, 2.5)),  # isotropic in-plane
    ],
)
def test_build_frames_px_box_covers_rendered_lesion(frame_size_px: int, spacing: tuple[float, float, float]) -> None:
    ct = np.full((64, 48, 20), 40, dtype=np.int16)  # W400/L40: 40 HU -> grey 128
    ct[20:27, 12:19, 9:12] = 1000  # bright square lesion, white
    cfg = FrameConfig(frame_size_px=frame_size_px)
    fs = build_frames(ct, spacing, (10, 8, 4, 50, 40, 16), 10, (20, 12, 27, 19), cfg=cfg)
    assert fs.key_slice_frame is not None and fs.bbox_xyxy_px is not None
    assert fs.frame_z_vox[fs.key_slice_frame - 1] == 10
    img = _decode_gray(fs.pngs[fs.key_slice_frame - 1])
    c0, r0, c1, r1 = fs.bbox_xyxy_px
    bright = img > 191  # midway between background (128) and lesion (255)
    assert bright.any() and not bright[:r0].any() and not bright[r1:].any()
    assert not bright[:, :c0].any() and not bright[:, c1:].any()
    # tight: each side of the px box within 1 px of the bright region
    assert all(abs(a - b) <= 1 for a, b in zip(_bright_box(img, 191), fs.bbox_xyxy_px, strict=True))


def test_render_frames_png_is_deterministic_8bit_gray_448() -> None:
    rng = np.random.default_rng(0)
    ct = rng.integers(-1000, 1000, size=(50, 40, 6), dtype=np.int16)
    cfg = FrameConfig()
    first = render_frames(ct, [0, 2, 5], (-5, 0, 45, 50), cfg=cfg)
    second = render_frames(ct, [0, 2, 5], (-5, 0, 45, 50), cfg=cfg)
    assert first == second
    # a non-contiguous view (Fortran order, as nibabel gives) renders the same bytes
    fortran = np.asfortranarray(ct)
    strided = np.zeros((50, 40, 12), dtype=np.int16)
    strided[:, :, ::2] = ct
    assert render_frames(fortran, [0, 2, 5], (-5, 0, 45, 50), cfg=cfg) == first
    assert render_frames(strided[:, :, ::2], [0, 2, 5], (-5, 0, 45, 50), cfg=cfg) == first
    for png in first:
        assert _ihdr_depth_and_colour(png) == (8, 0)
        img = _decode_gray(png)
        assert img.shape == (448, 448) and img.dtype == np.uint8


def test_render_frames_pads_outside_volume_black() -> None:
    ct = np.full((10, 10, 1), 1000, dtype=np.int16)  # all white
    (png,) = render_frames(ct, [0], (-10, -10, 20, 20), cfg=FrameConfig())
    img = _decode_gray(png)
    # the volume covers cols/rows (20-10)*448/30 = 149.3 .. 298.7; padding (-1000 HU) is windowed to 0. Linear
    # interpolation blends across half a source voxel (7.5 px) at each edge, so check clear of those bands.
    assert (img[:140] == 0).all() and (img[308:] == 0).all()
    assert (img[:, :140] == 0).all() and (img[:, 308:] == 0).all()
    assert (img[160:288, 160:288] == 255).all()


def test_render_frames_rejects_non_int16() -> None:
    with pytest.raises(TypeError, match="int16"):
        render_frames(np.zeros((4, 4, 1), dtype=np.float32), [0], (0, 0, 4, 4), cfg=FrameConfig())


# --- build_frames -----------------------------------------------------------------------------------------------


def test_build_frames_negative_row_has_no_key_fields() -> None:
    ct = np.full((20, 20, 8), 40, dtype=np.int16)
    fs = build_frames(ct, (1.0, 1.0, 2.0), (5, 5, 2, 15, 15, 6), None, None, cfg=FrameConfig(crop_margin_mm=2.0))
    assert fs == FrameSet(
        frame_z_vox=(0, 1, 2, 3, 4, 5, 6, 7),
        key_slice_frame=None,
        crop_xyxy_vox=(3, 3, 17, 17),
        bbox_xyxy_px=None,
        bbox_qwen=None,
        pngs=fs.pngs,
    )
    assert len(fs.pngs) == 8


def test_build_frames_key_fields_in_frame_space() -> None:
    ct = np.full((20, 20, 60), 40, dtype=np.int16)
    cfg = FrameConfig(max_frames=8, margin_slices=0, crop_margin_mm=0.0, frame_size_px=200)
    # organ [0, 50) -> linspace(0, 49, 8) = 0, 7, 14, 21, 28, 35, 42, 49; key 30 replaces 28 -> frame 5
    fs = build_frames(ct, (1.0, 1.0, 1.0), (0, 0, 0, 20, 20, 50), 30, (5, 10, 10, 20), cfg=cfg)
    assert fs.frame_z_vox == (0, 7, 14, 21, 30, 35, 42, 49)
    assert fs.key_slice_frame == 5
    assert fs.crop_xyxy_vox == (0, 0, 20, 20)
    assert fs.bbox_xyxy_px == (100, 0, 150, 100)  # 10 px/vox: cols (20-10)..(20-5), rows (20-20)..(20-10)
    assert fs.bbox_qwen == (500, 0, 750, 500)


def test_build_frames_key_and_box_must_come_together() -> None:
    ct = np.zeros((8, 8, 4), dtype=np.int16)
    with pytest.raises(ValueError, match="both or neither"):
        build_frames(ct, (1.0, 1.0, 1.0), (0, 0, 0, 8, 8, 4), 2, None, cfg=FrameConfig())


def test_build_frames_lesion_box_outside_crop_is_a_case_error() -> None:
    ct = np.zeros((100, 100, 4), dtype=np.int16)
    cfg = FrameConfig(crop_margin_mm=0.0)
    with pytest.raises(CaseDataError) as err:
        build_frames(ct, (1.0, 1.0, 1.0), (0, 0, 0, 10, 10, 4), 2, (80, 80, 90, 90), cfg=cfg)
    assert err.value.reason is RejectReason.LESION_OUTSIDE_ORGAN


# draw_contact_sheet: tests/emrl_data/test_contact_sheet.py
def _previous_png(image: np.ndarray) -> bytes:
    """The encoder `render_frames` used before: libpng through OpenCV at compression level 1."""
    ok, buf = cv2.imencode(".png", image, [cv2.IMWRITE_PNG_COMPRESSION, 1])
    assert ok
    return buf.tobytes()


def _constructed_frames() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    ramp = np.add.outer(np.arange(448), np.arange(448)).astype(np.uint8)  # wraps 255 -> 0 along rows and columns
    steps = np.zeros((448, 448), dtype=np.uint8)
    steps[::2] = 255  # every row differs from the one above by 255 (mod 256: the Up filter's extreme)
    return {
        "noise_448": rng.integers(0, 256, size=(448, 448), dtype=np.uint8),
        "ramp_wraps": ramp,
        "alternating_rows": steps,
        "black": np.zeros((448, 448), dtype=np.uint8),
        "white": np.full((448, 448), 255, dtype=np.uint8),
        "one_pixel": np.array([[200]], dtype=np.uint8),
        "one_row": rng.integers(0, 256, size=(1, 37), dtype=np.uint8),
        "one_column": rng.integers(0, 256, size=(29, 1), dtype=np.uint8),
        "non_square": rng.integers(0, 256, size=(40, 64), dtype=np.uint8),
        "strided_view": rng.integers(0, 256, size=(96, 90), dtype=np.uint8)[::2, ::3],
    }


@pytest.mark.parametrize("name", sorted(_constructed_frames()))
@pytest.mark.parametrize("level", [0, 1, 3, 9])
def test_png_decodes_to_the_same_pixels_as_the_previous_encoder(name: str, level: int) -> None:
    from PIL import Image

    image = _constructed_frames()[name]
    png = encode_png_gray8(image, level=level)
    assert _ihdr_depth_and_colour(png) == (8, 0)
    before = _decode_gray(_previous_png(image))
    after = _decode_gray(png)
    assert after.dtype == np.uint8 and after.shape == image.shape
    assert np.array_equal(after, before) and np.array_equal(after, image)
    # a second, independent decoder (Pillow checks every chunk CRC) agrees
    pil = Image.open(io.BytesIO(png))
    pil.load()
    assert pil.mode == "L" and np.array_equal(np.asarray(pil), image)
    assert encode_png_gray8(image, level=level) == png  # deterministic


def test_png_chunks_are_well_formed() -> None:
    png = encode_png_gray8(np.arange(12, dtype=np.uint8).reshape(3, 4))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, kinds = 8, []
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        kind, data = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", png[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + data)
        kinds.append(kind)
        pos += 12 + length
    assert pos == len(png) and kinds == [b"IHDR", b"IDAT", b"IEND"]
    assert struct.unpack(">II", png[16:24]) == (4, 3)  # width, height


@pytest.mark.parametrize(
    "bad",
    [np.zeros((4, 4), dtype=np.int16), np.zeros((4, 4, 3), dtype=np.uint8), np.zeros((0, 4), dtype=np.uint8)],
)
def test_png_refuses_what_it_cannot_encode(bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="2-D uint8"):
        encode_png_gray8(bad)


def test_rendered_frames_match_the_previous_encoder_pixel_for_pixel(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    ct = rng.integers(-1200, 1500, size=(60, 50, 4), dtype=np.int16)
    ct[10:30, 5:25] = 40  # flat parenchyma-like patch next to the noise
    args = (ct, [0, 1, 3], (-6, 2, 58, 66))
    now = render_frames(*args, cfg=FrameConfig())
    monkeypatch.setattr(frames_module, "encode_png_gray8", lambda image, level: _previous_png(image))
    before = render_frames(*args, cfg=FrameConfig())
    assert now != before  # the bytes changed once ...
    for png_now, png_before in zip(now, before, strict=True):
        assert np.array_equal(_decode_gray(png_now), _decode_gray(png_before))  # ... the pixels did not
