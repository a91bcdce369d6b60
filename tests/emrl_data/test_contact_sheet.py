"""Tests of `emrl_data.labeling.frames.draw_contact_sheet`: layout with gaps, legible wrapped captions, boxes, determinism."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from emrl_data.labeling.frames import (
    CAPTION_PAD_PX,
    CONTACT_BACKGROUND_BGR,
    CONTACT_GAP_PX,
    draw_contact_sheet,
)


def _tile_png(value: int, size: int = 448) -> bytes:
    ok, buf = cv2.imencode(".png", np.full((size, size), value, dtype=np.uint8))
    assert ok
    return buf.tobytes()


def _decode(png: bytes) -> np.ndarray:
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[25] == 2  # an RGB PNG
    return cv2.imdecode(np.frombuffer(png, dtype=np.uint8), cv2.IMREAD_COLOR)


@pytest.mark.parametrize(
    ("n_tiles", "columns", "tile_px", "caption", "shape"),
    [
        # 3 columns x 3 rows of 100 px tiles; the caption wraps onto 4 lines of 31 px: cell 100 + 6 + 124 = 230.
        (7, 3, 100, "BDMAP_00000003 liver k=7", (3 * 230 + 4 * 8, 3 * 100 + 4 * 8, 3)),
        # fewer tiles than columns: one row of 2; two caption lines: cell 224 + 6 + 62 = 292.
        (2, 6, 224, "BDMAP_00000003 liver k=7", (292 + 2 * 8, 2 * 224 + 3 * 8, 3)),
        # exactly one full row; a short caption on one line: cell 224 + 6 + 31 = 261.
        (6, 6, 224, "0003 liver k=7", (261 + 2 * 8, 6 * 224 + 7 * 8, 3)),
    ],
)
def test_draw_contact_sheet_size(
    n_tiles: int, columns: int, tile_px: int, caption: str, shape: tuple[int, int, int]
) -> None:
    tiles = [(_tile_png(60), None, caption) for _ in range(n_tiles)]
    sheet = _decode(draw_contact_sheet(tiles, tile_px=tile_px, columns=columns))
    assert sheet.shape == shape


def test_draw_contact_sheet_tiles_are_separated_by_gaps() -> None:
    tiles = [(_tile_png(200), None, "0001 liver k=3") for _ in range(4)]
    sheet = _decode(draw_contact_sheet(tiles, tile_px=64, columns=2))
    background = np.array(CONTACT_BACKGROUND_BGR, dtype=np.uint8)
    g = CONTACT_GAP_PX
    gap_columns = [*range(0, g), *range(g + 64, 2 * g + 64), *range(2 * g + 128, 3 * g + 128)]
    assert (sheet[:, gap_columns] == background).all()  # left edge, between the columns, right edge
    cell_h = (sheet.shape[0] - 3 * g) // 2
    gap_rows = [*range(0, g), *range(g + cell_h, 2 * g + cell_h), *range(2 * g + 2 * cell_h, sheet.shape[0])]
    assert (sheet[gap_rows] == background).all()  # top edge, between the rows, bottom edge
    assert (sheet[g : g + 64, g : g + 64] == 200).all()  # the first tile itself, untouched


def test_draw_contact_sheet_captions_are_at_least_14_px_tall_and_never_clipped() -> None:
    tiles = [(_tile_png(0), None, "BDMAP 1730"), (_tile_png(0), None, "BDMAP_00000003 pancreas k=17 extra words")]
    sheet = _decode(draw_contact_sheet(tiles, tile_px=224, columns=2))
    g = CONTACT_GAP_PX
    first_strip = sheet[g + 224 : -g, g : g + 224].max(axis=2)
    rows = np.nonzero((first_strip > 127).any(axis=1))[0]
    assert rows.max() - rows.min() + 1 >= 14  # capitals and digits, no descenders
    second = sheet[g + 224 : -g, 2 * g + 224 : 2 * g + 448].max(axis=2)
    lit_rows = np.nonzero((second > 127).any(axis=1))[0]
    lit_cols = np.nonzero((second > 127).any(axis=0))[0]
    assert lit_cols.max() < 224 - CAPTION_PAD_PX // 2  # wrapped inside the tile, not cut at its edge
    assert lit_rows.max() - lit_rows.min() > 2 * 20  # three lines of text


def test_draw_contact_sheet_box_red_caption_white_deterministic() -> None:
    tiles = [
        (_tile_png(60), (112, 224, 336, 448), "BDMAP_00000003 liver k=7"),
        (_tile_png(60), None, "BDMAP_00000004 kidney"),
    ]
    png = draw_contact_sheet(tiles, tile_px=224, columns=2)
    assert png == draw_contact_sheet(tiles, tile_px=224, columns=2)
    bgr = _decode(png)
    red = (bgr[:, :, 2] == 255) & (bgr[:, :, 1] == 0) & (bgr[:, :, 0] == 0)
    rows, cols = np.nonzero(red)
    g = CONTACT_GAP_PX
    # box scaled by 0.5: half-open (56, 112, 168, 224) -> inclusive corners (56, 112)..(167, 223), first tile only
    assert (cols.min() - g, rows.min() - g, cols.max() - g, rows.max() - g) == (56, 112, 167, 223)
    strip = bgr[g + 224 : -g, g : g + 224]
    assert (strip == 255).all(axis=2).any()  # white caption text in the strip
    assert (bgr[g : g + 224, 2 * g + 224 : 2 * g + 448] == 60).all()  # second tile: untouched grey, no box


@pytest.mark.parametrize(
    ("tiles", "kwargs", "message"),
    [
        ([], {}, "at least one tile"),
        ([(b"not a png", None, "x")], {}, "not a decodable image"),
        ([(_tile_png(1), None, "x")], {"tile_px": 31}, "tile_px=31 must be >= 32"),
        ([(_tile_png(1), None, "x")], {"columns": 0}, "columns=0 >= 1"),
    ],
)
def test_draw_contact_sheet_bad_input_raises(tiles: list, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        draw_contact_sheet(tiles, **kwargs)
