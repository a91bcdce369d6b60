"""The model's view of one organ: frame selection, crop, voxel -> pixel mapping, PNG rendering (docs/contract.md#conventions, docs/contract.md#frames).

The single owner of the voxel (x, y) -> frame pixel (col, row) mapping (`vox_to_px`); every box that reaches a
frame goes through it (`box_vox_to_px`), and `render_frames` draws the pixels with the same orientation, so a box
computed from the masks lands on the lesion as rendered. Also draws the QA contact sheet of key frames.

Callers: the curate step (`build_frames` per organ row) and the QA report (`draw_contact_sheet`).
"""

from __future__ import annotations

import logging
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import cv2
import numpy as np
import pyarrow as pa
from isal import isal_zlib
from numpy.typing import NDArray

from emrl_data.config import FrameConfig
from emrl_data.outcome import CaseDataError, RejectReason
from emrl_data.types import column


logger = logging.getLogger(__name__)

AIR_HU = -1000  # padding outside the volume: air, black under any abdominal window
QWEN_GRID = 1000  # Qwen3-VL grounds boxes on a relative 0-1000 grid (docs/contract.md#frames)
_EDGE_EPS = 1e-6  # px; absorbs float error so an exact pixel edge is not floored/ceiled one pixel outward
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_FILTER_UP = 2  # PNG row filter type 2: each byte minus the byte above it (mod 256)
_ISAL_MAX_LEVEL = 3  # ISA-L deflate levels are 0..3


def select_frame_z(
    organ_z_start: int, organ_z_stop: int, n_slices: int, key_z: int | None, *, cfg: FrameConfig
) -> list[int]:
    """Choose the axial slices shown as frames 1..N (inferior -> superior).

    The z-range is the organ's z-extent `[organ_z_start, organ_z_stop)` widened by `cfg.margin_slices` on both
    sides and clipped to `[0, n_slices)`. A range of at most `cfg.max_frames` slices is taken whole; a longer one is
    sampled uniformly: `round(np.linspace(first, last, cfg.max_frames))`, both ends included (round half to even,
    numpy's rule; the samples are distinct because the step exceeds one slice). The key slice is always a frame:
    if it is not already a sample it replaces its nearest sample (ties -> the lower sample), which keeps the list
    strictly increasing. A key slice outside the widened range (a lesion reaching beyond its organ) still replaces
    the nearest sample, i.e. the first or last one, and a warning is logged.

    Args:
        organ_z_start: first canonical z (voxel index) of the organ mask.
        organ_z_stop: one past the last canonical z of the organ mask.
        n_slices: number of axial slices of the volume (its Z size).
        key_z: canonical z of the key slice, or None when the organ has no lesion.
        cfg: frame settings (`margin_slices`, `max_frames`).

    Returns:
        Canonical z of every frame, strictly increasing; frame k (1-based) is element k - 1.

    Raises:
        ValueError: if the organ z-extent is empty or outside `[0, n_slices)`, or `key_z` is outside the volume.
    """
    if not 0 <= organ_z_start < organ_z_stop <= n_slices:
        raise ValueError(
            f"Need 0 <= organ_z_start < organ_z_stop <= n_slices, got {organ_z_start=}, {organ_z_stop=}, {n_slices=}."
        )
    if key_z is not None and not 0 <= key_z < n_slices:
        raise ValueError(f"key_z={key_z} lies outside the volume's slices [0, {n_slices}).")
    first = max(0, organ_z_start - cfg.margin_slices)
    last = min(n_slices, organ_z_stop + cfg.margin_slices) - 1
    if last - first + 1 <= cfg.max_frames:
        frames = list(range(first, last + 1))
    else:
        frames = [int(v) for v in np.rint(np.linspace(first, last, cfg.max_frames))]
    if key_z is None or key_z in frames:
        return frames
    if not first <= key_z <= last:
        logger.warning("Key slice z=%d lies outside the organ's frame range [%d, %d].", key_z, first, last)
    # min() returns the first minimum: on a tie the lower sample is replaced.
    nearest = min(range(len(frames)), key=lambda i: abs(frames[i] - key_z))
    frames[nearest] = key_z
    return frames


def crop_box_xy(
    organ_box_xyzxyz_vox: tuple[int, int, int, int, int, int],
    spacing_mm: tuple[float, float, float],
    *,
    cfg: FrameConfig,
) -> tuple[int, int, int, int]:
    """Return the in-plane crop of an organ: a square in millimetres around its (x, y) extent plus a margin.

    `side_mm = max(extent_x_mm, extent_y_mm) + 2 * cfg.crop_margin_mm`; the crop has `round(side_mm / spacing)`
    voxels along each axis (at least 1) and is centred on the organ box centre. When the centre falls between
    voxel edges (odd/even mismatch) the crop starts at the lower index. The crop may extend outside the volume;
    `render_frames` pads it with air.

    Args:
        organ_box_xyzxyz_vox: the organ's 3-D box in canonical voxels, half-open `(x0, y0, z0, x1, y1, z1)`.
        spacing_mm: voxel size `(sx, sy, sz)` in mm along canonical x, y, z.
        cfg: frame settings (`crop_margin_mm`).

    Returns:
        The crop as a half-open canonical voxel box `(x0, y0, x1, y1)`; may hold negative indices or indices
        beyond the volume.

    Raises:
        ValueError: if the box is empty or has the wrong length, or a spacing is not positive.
    """
    if len(organ_box_xyzxyz_vox) != 6:
        raise ValueError(f"organ_box_xyzxyz_vox must have 6 values, got {organ_box_xyzxyz_vox!r}.")
    x0, y0, _, x1, y1, _ = (int(v) for v in organ_box_xyzxyz_vox)
    if x1 <= x0 or y1 <= y0:
        raise ValueError(f"organ_box_xyzxyz_vox={organ_box_xyzxyz_vox} is empty in x or y.")
    sx, sy = float(spacing_mm[0]), float(spacing_mm[1])
    if not (sx > 0 and sy > 0):
        raise ValueError(f"spacing_mm={spacing_mm} must be positive in x and y.")
    side_mm = max((x1 - x0) * sx, (y1 - y0) * sy) + 2 * cfg.crop_margin_mm
    nx = max(1, round(side_mm / sx))
    ny = max(1, round(side_mm / sy))
    # Centre (x0 + x1) / 2; start = centre - n / 2, floored when it is a half voxel.
    cx0 = (x0 + x1 - nx) // 2
    cy0 = (y0 + y1 - ny) // 2
    return (cx0, cy0, cx0 + nx, cy0 + ny)


def vox_to_px(
    x_vox: float, y_vox: float, crop_xyxy_vox: tuple[int, int, int, int], frame_size_px: int
) -> tuple[float, float]:
    """Map a canonical voxel position (x, y) to a frame pixel position (col, row): THE one mapping.

    Coordinates are continuous edge coordinates: voxel i covers `[i, i + 1)` and pixel j covers `[j, j + 1)`.

    Derivation. Canonical volumes are RAS+: x grows toward the patient's Right, y toward Anterior. Radiological
    display puts the patient's right on the image LEFT, so the column must grow as x falls: the crop's right edge
    `x1` maps to column 0 and its left edge `x0` to column `frame_size_px`. Anterior is at the TOP, so the row must
    grow as y falls: `y1` maps to row 0 and `y0` to row `frame_size_px`. The crop is stretched to the square frame
    independently along each axis (it is square in mm, so pixels are square in mm)::

        col = (x1 - x) * frame_size_px / (x1 - x0)
        row = (y1 - y) * frame_size_px / (y1 - y0)

    This is exactly the image `render_frames` draws (crop transposed to (y, x), both axes reversed, then resized
    edge to edge), so a mask box mapped here covers the lesion as rendered.

    Args:
        x_vox: canonical x in voxels (continuous edge coordinate).
        y_vox: canonical y in voxels (continuous edge coordinate).
        crop_xyxy_vox: the frame's crop, half-open canonical voxel box `(x0, y0, x1, y1)`.
        frame_size_px: side of the square frame in pixels.

    Returns:
        `(col, row)` in frame pixels (continuous; may fall outside `[0, frame_size_px]`).
    """
    cx0, cy0, cx1, cy1 = crop_xyxy_vox
    col = (cx1 - x_vox) * frame_size_px / (cx1 - cx0)
    row = (cy1 - y_vox) * frame_size_px / (cy1 - cy0)
    return (col, row)


def box_vox_to_px(
    bbox_xyxy_vox: tuple[int, int, int, int], crop_xyxy_vox: tuple[int, int, int, int], frame_size_px: int
) -> tuple[int, int, int, int]:
    """Map a half-open voxel box of an axial slice into frame pixels through `vox_to_px`.

    Both corners are mapped, then ordered (the display flips both axes); the start is floored and the stop ceiled
    so the pixel box covers every pixel the voxel box touches, then both are clipped to `[0, frame_size_px]`.

    Args:
        bbox_xyxy_vox: half-open canonical voxel box `(x0, y0, x1, y1)`.
        crop_xyxy_vox: the frame's crop, half-open canonical voxel box `(x0, y0, x1, y1)`.
        frame_size_px: side of the square frame in pixels.

    Returns:
        Half-open pixel box `(col0, row0, col1, row1)`; empty (start == stop) if the voxel box lies outside the crop.
    """
    bx0, by0, bx1, by1 = bbox_xyxy_vox
    ca, ra = vox_to_px(bx0, by0, crop_xyxy_vox, frame_size_px)
    cb, rb = vox_to_px(bx1, by1, crop_xyxy_vox, frame_size_px)

    def _clip(v: int) -> int:
        return min(max(v, 0), frame_size_px)

    col0 = _clip(math.floor(min(ca, cb) + _EDGE_EPS))
    row0 = _clip(math.floor(min(ra, rb) + _EDGE_EPS))
    col1 = _clip(math.ceil(max(ca, cb) - _EDGE_EPS))
    row1 = _clip(math.ceil(max(ra, rb) - _EDGE_EPS))
    return (col0, row0, col1, row1)


def box_px_to_qwen(bbox_xyxy_px: tuple[int, int, int, int], frame_size_px: int) -> tuple[int, int, int, int]:
    """Express a pixel box on Qwen3-VL's relative 0-1000 grid: `round(v * 1000 / frame_size_px)` per value.

    Rounding is Python's `round` (half to even: pixel 28 of 448 is 62.5 -> 62).

    Args:
        bbox_xyxy_px: half-open pixel box `(col0, row0, col1, row1)` of a `frame_size_px` square frame.
        frame_size_px: side of the square frame in pixels.

    Returns:
        The box as integers in `[0, 1000]`, same order.

    >>> box_px_to_qwen((100, 224, 300, 448), 448)
    (223, 500, 670, 1000)
    """
    return tuple(round(int(v) * QWEN_GRID / frame_size_px) for v in bbox_xyxy_px)  # type: ignore[return-value]


@lru_cache(maxsize=8)
def _window_lut(width_hu: float, level_hu: float) -> NDArray[np.uint8]:
    """Return a 65536-entry LUT: index `hu + 32768` (every int16) -> windowed uint8 grey level."""
    hu = np.arange(-32768, 32768, dtype=np.float64)
    grey = np.rint((hu - (level_hu - width_hu / 2)) * (255.0 / width_hu))
    lut = np.clip(grey, 0, 255).astype(np.uint8)
    lut.flags.writeable = False
    return lut


@lru_cache(maxsize=8)
def _window_lut_u16(width_hu: float, level_hu: float) -> NDArray[np.uint8]:
    """`_window_lut` rotated so that an int16 HU viewed as uint16 indexes it directly (no int32 temporary)."""
    lut = _window_lut(width_hu, level_hu)
    rotated = np.concatenate([lut[32768:], lut[:32768]])  # uint16 u < 32768 is HU u; u >= 32768 is HU u - 65536
    rotated.flags.writeable = False
    return rotated


def _crop_slice_padded(slice_hu: NDArray[np.int16], crop_xyxy_vox: tuple[int, int, int, int]) -> NDArray[np.int16]:
    """Cut `crop_xyxy_vox` out of one axial slice `(X, Y)`, filling voxels outside the slice with air."""
    cx0, cy0, cx1, cy1 = crop_xyxy_vox
    out = np.full((cx1 - cx0, cy1 - cy0), AIR_HU, dtype=np.int16)
    sx0, sy0 = max(cx0, 0), max(cy0, 0)
    sx1, sy1 = min(cx1, slice_hu.shape[0]), min(cy1, slice_hu.shape[1])
    if sx0 < sx1 and sy0 < sy1:
        out[sx0 - cx0 : sx1 - cx0, sy0 - cy0 : sy1 - cy0] = slice_hu[sx0:sx1, sy0:sy1]
    return out


def render_frames(
    ct_hu: NDArray[np.int16], frame_z_vox: Sequence[int], crop_xyxy_vox: tuple[int, int, int, int], *, cfg: FrameConfig
) -> list[bytes]:
    """Render the frames of an organ row as 8-bit grayscale PNGs (radiological display, see `vox_to_px`).

    Per slice: cut the crop (air, -1000 HU, outside the volume), window W/L to uint8 through a LUT, orient (rows =
    y descending, cols = x descending), resize to `cfg.frame_size_px` square (`INTER_AREA` when the crop has more
    voxels than the frame along either axis, else `INTER_LINEAR`) and encode with `encode_png_gray8` at
    `cfg.png_compress_level`.
    The bytes are deterministic: the same input gives the same bytes.

    Args:
        ct_hu: CT in HU, int16, shape `(X, Y, Z)` in canonical RAS order; may be a non-contiguous view.
        frame_z_vox: canonical z of each frame, in frame order.
        crop_xyxy_vox: half-open canonical voxel box `(x0, y0, x1, y1)` of the crop; may extend outside the volume.
        cfg: frame settings (`frame_size_px`, `window_width_hu`, `window_level_hu`, `png_compress_level`).

    Returns:
        One PNG per frame, in the order of `frame_z_vox`.

    Raises:
        TypeError: if `ct_hu` is not int16.
        ValueError: if `ct_hu` is not 3-D, the crop is empty, or a z is outside the volume.
    """
    if ct_hu.dtype != np.int16:
        raise TypeError(f"ct_hu must be int16 HU, got dtype={ct_hu.dtype}.")
    if ct_hu.ndim != 3:
        raise ValueError(f"ct_hu must be 3-D (X, Y, Z), got shape={ct_hu.shape}.")
    cx0, cy0, cx1, cy1 = crop_xyxy_vox
    if cx1 <= cx0 or cy1 <= cy0:
        raise ValueError(f"crop_xyxy_vox={crop_xyxy_vox} is empty.")
    size = cfg.frame_size_px
    lut = _window_lut_u16(float(cfg.window_width_hu), float(cfg.window_level_hu))
    shrinking = (cx1 - cx0) > size or (cy1 - cy0) > size
    interpolation = cv2.INTER_AREA if shrinking else cv2.INTER_LINEAR
    inside = cx0 >= 0 and cy0 >= 0 and cx1 <= ct_hu.shape[0] and cy1 <= ct_hu.shape[1]
    pngs: list[bytes] = []
    for z in frame_z_vox:
        if not 0 <= z < ct_hu.shape[2]:
            raise ValueError(f"Frame z={z} lies outside the volume's slices [0, {ct_hu.shape[2]}).")
        # (x, y) -> (row = y, col = x), both reversed: anterior on top, patient right on the left. Windowing through
        # the LUT (int16 read as uint16 indexes the rotated LUT) gathers straight from that view into a new
        # C-contiguous image: one pass, no copy of the crop (the padded copy only where the crop leaves the slice).
        crop = ct_hu[cx0:cx1, cy0:cy1, z] if inside else _crop_slice_padded(ct_hu[:, :, z], crop_xyxy_vox)
        grey = lut.take(crop.view(np.uint16).T[::-1, ::-1])
        frame = cv2.resize(grey, (size, size), interpolation=interpolation).astype(np.uint8, copy=False)
        pngs.append(encode_png_gray8(frame, level=cfg.png_compress_level))
    return pngs


_INT_LIST = pa.list_(pa.int32())


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, type, data, CRC-32 of type + data."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", isal_zlib.crc32(data, zlib.crc32(kind)))


def encode_png_gray8(image: NDArray[np.uint8], *, level: int = 1) -> bytes:
    """Encode a 2-D uint8 image as an 8-bit greyscale PNG, fast: one fixed row filter and ISA-L deflate.

    libpng (behind `cv2.imencode`) tries every row filter on every row and deflates with zlib; here every row uses
    the Up filter (computed in one numpy subtraction) and the filtered rows are deflated once by ISA-L, ~5x faster
    at the same size on CT frames (docs/scaling.md). The file is a plain PNG (signature, IHDR, one IDAT, IEND;
    non-interlaced) that any decoder reads back to exactly `image`. Deterministic for a given ISA-L build and CPU
    family (ISA-L picks its SIMD kernel at run time); the decoded pixels are the same everywhere.

    Args:
        image: `(rows, cols)` uint8 pixels.
        level: deflate effort; ISA-L has levels 0..3, higher values use 3.

    Returns:
        The PNG file bytes.

    Raises:
        ValueError: if `image` is not a non-empty 2-D uint8 array.
    """
    if image.dtype != np.uint8 or image.ndim != 2 or image.size == 0:
        raise ValueError(f"need a non-empty 2-D uint8 image, got dtype={image.dtype}, shape={image.shape}.")
    rows, cols = image.shape
    filtered = np.empty((rows, cols + 1), dtype=np.uint8)  # each scanline: filter byte + filtered pixels
    filtered[:, 0] = _PNG_FILTER_UP
    filtered[0, 1:] = image[0]  # the row above the first one is zeros
    np.subtract(image[1:], image[:-1], out=filtered[1:, 1:])  # uint8 arithmetic wraps mod 256, as PNG requires
    idat = isal_zlib.compress(filtered.data, min(max(int(level), 0), _ISAL_MAX_LEVEL))
    # IHDR: width, height, bit depth 8, colour type 0 (grey), deflate, adaptive filtering method 0, no interlace.
    ihdr = struct.pack(">IIBBBBB", cols, rows, 8, 0, 0, 0, 0)
    return _PNG_SIGNATURE + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


@dataclass(frozen=True, slots=True)
class FrameSet:
    """The frames of one organ row and the key-lesion evidence in frame space (docs/contract.md#frames).

    Attributes:
        frame_z_vox: canonical z of each frame; frame k (1-based) shows slice `frame_z_vox[k - 1]`.
        key_slice_frame: 1-based frame number of the key slice, or None without lesion.
        crop_xyxy_vox: half-open canonical voxel box of the in-plane crop (may extend outside the volume).
        bbox_xyxy_px: half-open pixel box of the key lesion on the key frame, or None without lesion.
        bbox_qwen: `bbox_xyxy_px` on Qwen3-VL's 0-1000 grid, or None without lesion.
        pngs: one 8-bit grayscale PNG per frame, in frame order.

    Fields declared with `column` are columns of the organ row (`emrl_data.tables.records`); `n_frames` is derived.
    """

    frame_z_vox: tuple[int, ...] = field(
        metadata=column(_INT_LIST, "canonical z of every frame, frames 1..N inferior -> superior")
    )
    n_frames: int = field(init=False, metadata=column(pa.int32(), "number of frames"))  # len(frame_z_vox)
    key_slice_frame: int | None = field(metadata=column(pa.int32(), "1-based frame number of the key slice"))
    crop_xyxy_vox: tuple[int, int, int, int] = field(
        metadata=column(_INT_LIST, "in-plane square crop rendered into every frame, canonical voxels")
    )
    bbox_xyxy_px: tuple[int, int, int, int] | None = field(
        metadata=column(_INT_LIST, "key-slice box in frame pixels, half-open")
    )
    bbox_qwen: tuple[int, int, int, int] | None = field(
        metadata=column(_INT_LIST, "the same box on Qwen3-VL's 0-1000 grid (used in the report)")
    )
    pngs: tuple[bytes, ...]  # the `frames` column is built from them (`emrl_data.labeling.curate`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "n_frames", len(self.frame_z_vox))


def build_frames(
    ct_hu: NDArray[np.int16],
    spacing_mm: tuple[float, float, float],
    organ_box_xyzxyz_vox: tuple[int, ...],
    key_slice_z_vox: int | None,
    bbox_xyxy_vox: tuple[int, int, int, int] | None,
    *,
    cfg: FrameConfig,
) -> FrameSet:
    """Build the model's view of one organ: frame slices, crop, rendered PNGs and the key box in frame space.

    Args:
        ct_hu: CT in HU, int16, shape `(X, Y, Z)` in canonical RAS order; may be a non-contiguous view.
        spacing_mm: voxel size `(sx, sy, sz)` in mm along canonical x, y, z.
        organ_box_xyzxyz_vox: the organ's 3-D box in canonical voxels, half-open `(x0, y0, z0, x1, y1, z1)`.
        key_slice_z_vox: canonical z of the key slice, or None without lesion.
        bbox_xyxy_vox: half-open canonical voxel box `(x0, y0, x1, y1)` of the key lesion on the key slice, or None
            without lesion (given together with `key_slice_z_vox`).
        cfg: frame settings.

    Returns:
        The `FrameSet` of the organ row.

    Raises:
        ValueError: on inconsistent arguments (key slice without box or the reverse, empty boxes, bad shapes).
        CaseDataError: `LESION_OUTSIDE_ORGAN` when the key lesion box lies entirely outside the organ's crop.
    """
    if (key_slice_z_vox is None) != (bbox_xyxy_vox is None):
        raise ValueError(f"Give both or neither of {key_slice_z_vox=} and {bbox_xyxy_vox=}.")
    if ct_hu.ndim != 3:
        raise ValueError(f"ct_hu must be 3-D (X, Y, Z), got shape={ct_hu.shape}.")
    if len(organ_box_xyzxyz_vox) != 6:
        raise ValueError(f"organ_box_xyzxyz_vox must have 6 values, got {organ_box_xyzxyz_vox!r}.")
    box6 = tuple(int(v) for v in organ_box_xyzxyz_vox)
    frame_z = select_frame_z(box6[2], box6[5], ct_hu.shape[2], key_slice_z_vox, cfg=cfg)
    crop = crop_box_xy(box6, spacing_mm, cfg=cfg)  # type: ignore[arg-type]
    key_frame: int | None = None
    bbox_px: tuple[int, int, int, int] | None = None
    bbox_qwen: tuple[int, int, int, int] | None = None
    if key_slice_z_vox is not None and bbox_xyxy_vox is not None:
        bx0, by0, bx1, by1 = bbox_xyxy_vox
        if bx1 <= bx0 or by1 <= by0:
            raise ValueError(f"bbox_xyxy_vox={bbox_xyxy_vox} is empty.")
        key_frame = frame_z.index(key_slice_z_vox) + 1
        bbox_px = box_vox_to_px(bbox_xyxy_vox, crop, cfg.frame_size_px)
        if bbox_px[2] <= bbox_px[0] or bbox_px[3] <= bbox_px[1]:
            raise CaseDataError(
                RejectReason.LESION_OUTSIDE_ORGAN,
                f"key lesion box {bbox_xyxy_vox} (vox, z={key_slice_z_vox}) lies outside the organ crop {crop}",
            )
        if bx0 < crop[0] or by0 < crop[1] or bx1 > crop[2] or by1 > crop[3]:
            logger.warning("Key lesion box %s (vox) is clipped by the organ crop %s.", bbox_xyxy_vox, crop)
        bbox_qwen = box_px_to_qwen(bbox_px, cfg.frame_size_px)
    pngs = render_frames(ct_hu, frame_z, crop, cfg=cfg)
    return FrameSet(
        frame_z_vox=tuple(frame_z),
        key_slice_frame=key_frame,
        crop_xyxy_vox=crop,
        bbox_xyxy_px=bbox_px,
        bbox_qwen=bbox_qwen,
        pngs=tuple(pngs),
    )


CONTACT_GAP_PX = 8  # background margin around and between contact-sheet cells
CONTACT_BACKGROUND_BGR = (48, 48, 48)  # dark grey: tiles (black CT borders) stand apart from it
CAPTION_FONT = cv2.FONT_HERSHEY_SIMPLEX
CAPTION_FONT_SCALE = 0.75  # capitals and digits 15 px tall (>= 14 px: legible at 100 %)
CAPTION_THICKNESS = 1
CAPTION_PAD_PX = 6  # inside the caption strip, around and between lines


def _wrap_caption(caption: str, width_px: int) -> list[str]:
    """Split a caption into lines that fit `width_px` at the caption font (words first, then characters)."""

    def fits(text: str) -> bool:
        return cv2.getTextSize(text, CAPTION_FONT, CAPTION_FONT_SCALE, CAPTION_THICKNESS)[0][0] <= width_px

    lines: list[str] = []
    for word in caption.split():
        if lines and fits(f"{lines[-1]} {word}"):
            lines[-1] = f"{lines[-1]} {word}"
            continue
        while not fits(word) and len(word) > 1:  # a word wider than the tile: cut it
            cut = max(i for i in range(1, len(word)) if fits(word[:i]) or i == 1)
            lines.append(word[:cut])
            word = word[cut:]
        lines.append(word)
    return lines or [""]


def _caption_line_px() -> tuple[int, int]:
    """Return (text height above the baseline, line pitch) of the caption font in pixels."""
    (_, height), baseline = cv2.getTextSize("Ag", CAPTION_FONT, CAPTION_FONT_SCALE, CAPTION_THICKNESS)
    return height, height + baseline + CAPTION_PAD_PX


def _tile_cell(
    png: bytes, bbox_px: tuple[int, int, int, int] | None, lines: list[str], tile_px: int, cell_h: int
) -> NDArray[np.uint8]:
    """Return one cell: the frame scaled to `tile_px` with its box in red, the caption lines in white below it."""
    frame = cv2.imdecode(np.frombuffer(png, dtype=np.uint8), cv2.IMREAD_COLOR)
    if frame is None:
        raise ValueError(f"Tile {' '.join(lines)!r} is not a decodable image.")
    h, w = frame.shape[:2]
    interpolation = cv2.INTER_AREA if (w > tile_px or h > tile_px) else cv2.INTER_LINEAR
    cell = np.zeros((cell_h, tile_px, 3), dtype=np.uint8)
    cell[:tile_px] = cv2.resize(frame, (tile_px, tile_px), interpolation=interpolation)
    if bbox_px is not None:
        c0, r0, c1, r1 = bbox_px
        sx, sy = tile_px / w, tile_px / h
        # Half-open box -> inclusive corner pixels for cv2.rectangle.
        p0 = (math.floor(c0 * sx), math.floor(r0 * sy))
        p1 = (max(math.ceil(c1 * sx) - 1, p0[0]), max(math.ceil(r1 * sy) - 1, p0[1]))
        cv2.rectangle(cell, p0, p1, color=(0, 0, 255), thickness=1)
    text_h, pitch = _caption_line_px()
    for j, line in enumerate(lines):
        origin = (CAPTION_PAD_PX, tile_px + CAPTION_PAD_PX + text_h + j * pitch)
        cv2.putText(
            cell, line, origin, CAPTION_FONT, CAPTION_FONT_SCALE, (255, 255, 255), CAPTION_THICKNESS, cv2.LINE_AA
        )
    return cell


def draw_contact_sheet(
    tiles: Sequence[tuple[bytes, tuple[int, int, int, int] | None, str]], *, tile_px: int = 224, columns: int = 6
) -> bytes:
    """Draw a QA contact sheet: key frames in a grid, each with its lesion box in red and a caption in white.

    Each cell is the frame scaled to `tile_px` square with a black caption strip below it; cells are separated from
    each other and from the sheet's edge by `CONTACT_GAP_PX` of grey background. Captions use a font whose capitals
    are 15 px tall and wrap onto as many lines as the longest caption needs (words that do not fit are cut), so no
    caption is clipped. The grid has `min(columns, len(tiles))` columns and as many rows as needed; unused cells of
    the last row stay background. See `contact_sheet_shape` for the sheet size.

    Args:
        tiles: `(png, bbox_xyxy_px, caption)` per tile: the PNG of a key frame (any size, grey or colour), the
            half-open pixel box in that frame's pixels or None, and a caption such as "BDMAP_00000003 liver k=7".
        tile_px: side of each scaled frame in pixels (at least 32: room for a caption line).
        columns: maximum number of tiles per row.

    Returns:
        The sheet as an RGB PNG (deterministic bytes).

    Raises:
        ValueError: if there are no tiles, `tile_px` is below 32 or `columns` below 1, or a PNG cannot be decoded.
    """
    if not tiles:
        raise ValueError("draw_contact_sheet needs at least one tile.")
    if tile_px < 32 or columns < 1:
        raise ValueError(f"tile_px={tile_px} must be >= 32 and columns={columns} >= 1.")
    wrapped = [_wrap_caption(caption, tile_px - 2 * CAPTION_PAD_PX) for _, _, caption in tiles]
    height, width, n_cols, cell_h = contact_sheet_shape(len(tiles), tile_px, columns, max(map(len, wrapped)))
    sheet = np.empty((height, width, 3), dtype=np.uint8)  # BGR, as cv2 draws and encodes
    sheet[:] = CONTACT_BACKGROUND_BGR
    for i, ((png, bbox_px, _), lines) in enumerate(zip(tiles, wrapped, strict=True)):
        row, col = divmod(i, n_cols)
        top = CONTACT_GAP_PX + row * (cell_h + CONTACT_GAP_PX)
        left = CONTACT_GAP_PX + col * (tile_px + CONTACT_GAP_PX)
        sheet[top : top + cell_h, left : left + tile_px] = _tile_cell(png, bbox_px, lines, tile_px, cell_h)
    ok, buf = cv2.imencode(".png", sheet, [cv2.IMWRITE_PNG_COMPRESSION, 1])
    if not ok:
        raise RuntimeError("cv2.imencode failed for the contact sheet.")
    return buf.tobytes()


def contact_sheet_shape(n_tiles: int, tile_px: int, columns: int, caption_lines: int) -> tuple[int, int, int, int]:
    """Return `(height, width, n_cols, cell_h)` of a contact sheet; `caption_lines` is the longest caption's lines."""
    n_cols = min(columns, n_tiles)
    n_rows = math.ceil(n_tiles / n_cols)
    _, pitch = _caption_line_px()
    cell_h = tile_px + CAPTION_PAD_PX + caption_lines * pitch
    height = n_rows * cell_h + (n_rows + 1) * CONTACT_GAP_PX
    width = n_cols * tile_px + (n_cols + 1) * CONTACT_GAP_PX
    return height, width, n_cols, cell_h
