"""A small synthetic `sft` table in the Hub layout, for tests, the smoke target and the device check.

The columns and types are the ones `train/` reads (see the sft layout: `case_id`, `organ`, `split`, the label columns
named as the reward arguments, `frames` as a list of Hub images, `prompt`, `report`); reports and prompts come from
`emrl_data.text.report`, so they parse with `emrl_data.text.parser`. Frames are 8-bit grayscale PNGs with a bright disc (the
"lesion") on the key frame and its neighbours of positive rows, so a model can learn something in a few steps.

Organs and locations come from the organ registry: rows cycle over the registered organs, and a lesion drawn on the
image's left / right half names `emrl_data.organs.side_locations(organ)` (a registered organ needs nothing here).
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from PIL import Image

from emrl_data.organs import side_locations
from emrl_data.tables.shards import DATA_DIR, shard_name
from emrl_data.text.report import render_evidence, render_findings, render_impression, render_prompt, render_report
from emrl_data.types import Organ


logger = logging.getLogger(__name__)


def _png(arr: NDArray[np.uint8]) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def make_frames(
    n_frames: int, size_px: int, key_frame: int | None, rng: np.random.Generator
) -> tuple[NDArray[np.uint8], list[int] | None]:
    """Return `(n_frames, size_px, size_px)` uint8 frames and the lesion box `[x1, y1, x2, y2)` in pixels (or None).

    Args:
        n_frames: frame count N.
        size_px: frame side in pixels.
        key_frame: 1-based frame of the largest lesion cross-section, or None for a negative row.
        rng: random generator (texture and lesion position).
    """
    yy, xx = np.mgrid[0:size_px, 0:size_px]
    organ = ((yy - size_px / 2) ** 2 + (xx - size_px / 2) ** 2) < (0.4 * size_px) ** 2
    frames = np.where(organ, 110, 20)[None].repeat(n_frames, 0).astype(np.float64)
    frames += rng.normal(0, 6, frames.shape)
    box = None
    if key_frame is not None:
        r = max(2, size_px // 8)
        cy, cx = (int(v) for v in rng.integers(size_px // 2 - size_px // 6, size_px // 2 + size_px // 6, 2))
        for f in range(max(1, key_frame - 1), min(n_frames, key_frame + 1) + 1):
            rad = r if f == key_frame else r // 2
            frames[f - 1][((yy - cy) ** 2 + (xx - cx) ** 2) < rad**2] = 230
        box = [cx - r, cy - r, cx + r, cy + r]
    return np.clip(frames, 0, 255).astype(np.uint8), box


def _row_skeleton(case_id: str, organ: str, split: str, positive: bool, n_frames: int) -> dict[str, Any]:
    """Return an sft row's label columns with the lesion attributes empty (the callers fill what their frames show)."""
    return {
        "case_id": case_id,
        "organ": organ,
        "split": split,
        "has_lesion": positive,
        "lesion_count": 1 if positive else 0,
        "long_axis_mm": None,
        "short_axis_mm": None,
        "volume_mm3": None,
        "location": [],
        "attenuation": None,
        "key_slice_frame": None,
        "bbox_qwen": None,
        "n_frames": n_frames,
    }


def row_report(row: dict[str, Any], organ: Organ, evidence: str | None) -> str:
    """Return the target report the row's label columns describe (findings, impression, evidence)."""
    positive = row["has_lesion"]
    kw = {k: row[k] for k in ("lesion_count", "long_axis_mm", "location", "attenuation")}
    findings = render_findings(
        organ, has_lesion=positive, short_axis_mm=row["short_axis_mm"], volume_mm3=row["volume_mm3"], **kw
    )
    return render_report(findings, render_impression(organ, has_lesion=positive, **kw), evidence)


def make_rows(n_rows: int, *, n_frames: int = 8, size_px: int = 64, split: str = "train", seed: int = 0) -> list[dict]:
    """Return `n_rows` sft rows (alternating positive/negative, cycling over the registered organs)."""
    rng = np.random.default_rng(seed)
    rows = []
    organs = [str(o) for o in Organ]
    for i in range(n_rows):
        organ = organs[i % len(organs)]
        positive = i % 2 == 0
        key = int(rng.integers(2, n_frames)) if positive else None
        frames, box = make_frames(n_frames, size_px, key, rng)
        o = Organ(organ)
        row = _row_skeleton(f"BDMAP_{i + 1:08d}", organ, split, positive, n_frames)
        row.update(key_slice_frame=key, frames=[{"bytes": _png(f), "path": None} for f in frames])
        row["prompt"] = render_prompt(o, n_frames)
        evidence = None
        if positive:
            assert box is not None and key is not None
            loc = list(side_locations(organ)[(i // 2) % 2])
            long_mm = float(rng.choice([12.0, 31.0, 48.0]))
            row.update(long_axis_mm=long_mm, short_axis_mm=long_mm * 0.7, volume_mm3=long_mm**3 * 0.3, location=loc)
            row["attenuation"] = ["hypo", "iso", "hyper"][(i // 2) % 3]
            row["bbox_qwen"] = [int(round(v * 1000 / size_px)) for v in box]
            evidence = render_evidence(key, row["bbox_qwen"])
        row["report"] = row_report(row, o, evidence)
        rows.append(row)
    return rows


# What the pixels of `make_visible_rows` encode (nothing of it is in the prompt).
VISIBLE_SIZES_MM = (12.0, 31.0, 48.0)  # long axis classes; disc radius = size_px * mm / 300 on the key frame
VISIBLE_INTENSITY = {"hypo": 40, "iso": 170, "hyper": 245}  # organ is 110, background 20
# The organ's outline (half-width, half-height as fractions of size_px): a slice shows which organ it is, as a CT slice
# does, so the verifier (shown one frame and a prompt that names no organ) can answer in that organ's terms.
VISIBLE_ORGAN_SHAPE = {"liver": (0.42, 0.42), "kidney": (0.3, 0.44), "pancreas": (0.44, 0.26)}


def visible_lesion_radii_px(n_frames: int, size_px: int, key_frame: int, long_mm: float, span: int) -> list[int]:
    """Return the lesion disc's radius in pixels on each frame (index 0 = frame 1; 0 = no lesion on that frame).

    The key frame's radius is `max(2, round(size_px * long_mm / 300))`; it shrinks linearly over the `span` frames on
    each side (`max(1, round(r * (1 - d / (span + 1))))` at distance d) and is 0 beyond.

    >>> visible_lesion_radii_px(8, 64, 4, 31.0, 3)
    [2, 4, 5, 7, 5, 4, 2, 0]
    """
    r = max(2, round(size_px * long_mm / 300))
    radii = []
    for f in range(1, n_frames + 1):
        d = abs(f - key_frame)
        radii.append(0 if d > span else r if d == 0 else max(1, round(r * (1 - d / (span + 1)))))
    return radii


def visible_slice_long_mm(long_mm: float, radius_px: int, key_radius_px: int) -> float:
    """Return the lesion's long axis on one slice (mm): the key frame's `long_mm` scaled by the slice's disc radius.

    >>> visible_slice_long_mm(31.0, 2, 7)
    8.9
    """
    return round(long_mm * radius_px / key_radius_px, 1)


def make_visible_volume(
    n_frames: int,
    size_px: int,
    rng: np.random.Generator,
    *,
    key_frame: int | None = None,
    long_mm: float = 31.0,
    side: int = 0,
    attenuation: str = "hypo",
    span: int = 1,
    organ: str | None = None,
) -> tuple[NDArray[np.uint8], list[int] | None, NDArray[np.bool_]]:
    """Return `make_visible_frames`'s frames and box, and the lesion mask `(n_frames, size_px, size_px)` it drew.

    The organ is an ellipse of `VISIBLE_ORGAN_SHAPE[organ]` (a disc of radius 0.42 size_px for None or another organ).
    """
    yy, xx = np.mgrid[0:size_px, 0:size_px]
    half_w, half_h = VISIBLE_ORGAN_SHAPE.get(organ or "", (0.42, 0.42))
    organ_mask = ((xx - size_px / 2) / (half_w * size_px)) ** 2 + ((yy - size_px / 2) / (half_h * size_px)) ** 2 < 1
    frames = np.where(organ_mask, 110, 20)[None].repeat(n_frames, 0).astype(np.float64)
    frames += rng.normal(0, 6, frames.shape)
    mask = np.zeros(frames.shape, dtype=bool)
    if key_frame is None:
        return np.clip(frames, 0, 255).astype(np.uint8), None, mask
    radii = visible_lesion_radii_px(n_frames, size_px, key_frame, long_mm, span)
    r = radii[key_frame - 1]
    cx = round(size_px / 2 + (-1 if side == 0 else 1) * size_px * 0.2 + rng.integers(-2, 3))
    cy = round(size_px / 2 + rng.integers(-size_px // 8, size_px // 8 + 1))
    if organ in VISIBLE_ORGAN_SHAPE and half_h < 0.3:  # a flat organ: the lesion stays near its midline
        cy = round(size_px / 2 + (cy - size_px / 2) / 2)
    for f, rad in enumerate(radii):
        if rad > 0:
            mask[f] = ((yy - cy) ** 2 + (xx - cx) ** 2) < rad**2
            frames[f][mask[f]] = VISIBLE_INTENSITY[attenuation]
    return np.clip(frames, 0, 255).astype(np.uint8), [cx - r, cy - r, cx + r, cy + r], mask


def make_visible_frames(
    n_frames: int,
    size_px: int,
    rng: np.random.Generator,
    *,
    key_frame: int | None = None,
    long_mm: float = 31.0,
    side: int = 0,
    attenuation: str = "hypo",
    span: int = 1,
    organ: str | None = None,
) -> tuple[NDArray[np.uint8], list[int] | None]:
    """Return frames whose lesion shows its presence, size class, location side, attenuation and key frame.

    The organ (110; its outline `VISIBLE_ORGAN_SHAPE[organ]`) lies on a dark background (20) with texture noise. A lesion is a disc of radius
    `size_px * long_mm / 300` on `key_frame` (1-based), shrinking linearly over the `span` frames on each side
    (`visible_lesion_radii_px`; span 1: half the radius on the two neighbours), in the organ's left half (`side` 0) or
    right half (`side` 1), drawn at `VISIBLE_INTENSITY[attenuation]`. Returns the frames and the lesion box
    `[x1, y1, x2, y2)` in pixels (None without a lesion); `make_visible_volume` also returns the mask.
    """
    frames, box, _ = make_visible_volume(
        n_frames,
        size_px,
        rng,
        key_frame=key_frame,
        long_mm=long_mm,
        side=side,
        attenuation=attenuation,
        span=span,
        organ=organ,
    )
    return frames, box


def make_visible_rows(
    n_rows: int,
    *,
    n_frames: int = 8,
    size_px: int = 64,
    split: str = "train",
    seed: int = 0,
    organs: tuple[str, ...] | None = None,
    positive_fraction: float = 0.5,
    sizes_mm: tuple[float, ...] = VISIBLE_SIZES_MM,
    span: int = 1,
    masks_out: list[NDArray[np.bool_]] | None = None,
    organ_outline: bool = True,
    boxes_out: list[list[int] | None] | None = None,
) -> list[dict]:
    """Return `n_rows` sft rows whose findings are visible only in the frames (`make_visible_frames`).

    Presence (a seeded draw with `positive_fraction`), size class, location side, attenuation and key frame are drawn
    independently per row; the organ cycles over `organs` (None: every registered organ). The prompt
    (`render_prompt`) names the organ and the frame count only, so a report that gets the findings right has read the
    pixels. `masks_out`, when given, receives each row's lesion mask `(n_frames, size_px, size_px)`
    (`make_visible_volume`); `boxes_out` the key frame's lesion box `[x1, y1, x2, y2)` in pixels before clipping
    (None for a negative row). `organ_outline` False draws every organ as the same disc.
    """
    if n_frames < 3:
        raise ValueError(f"n_frames={n_frames}: a key frame needs a neighbour on each side; use at least 3 frames.")
    rng = np.random.default_rng(seed)
    rows = []
    organs = tuple(str(o) for o in Organ) if organs is None else organs
    for i in range(n_rows):
        organ = organs[i % len(organs)]
        o = Organ(organ)
        positive = bool(rng.random() < positive_fraction)
        row = _row_skeleton(f"BDMAP_{seed:03d}{i + 1:05d}", organ, split, positive, n_frames)
        row["prompt"] = render_prompt(o, n_frames)
        evidence = None
        if positive:
            key = int(rng.integers(2, n_frames))  # 2..n_frames-1: both neighbours exist
            long_mm = float(rng.choice(sizes_mm))
            side = int(rng.integers(2))
            att = str(rng.choice(list(VISIBLE_INTENSITY)))
            frames, box, mask = make_visible_volume(
                n_frames,
                size_px,
                rng,
                key_frame=key,
                long_mm=long_mm,
                side=side,
                attenuation=att,
                span=span,
                organ=organ if organ_outline else None,
            )
            assert box is not None
            loc = list(side_locations(organ)[side])
            row.update(
                long_axis_mm=long_mm,
                short_axis_mm=round(long_mm * 0.7, 1),
                volume_mm3=round(long_mm**3 * 0.3),
                location=loc,
                attenuation=att,
                key_slice_frame=key,
            )
            row["bbox_qwen"] = [int(round(min(max(v, 0), size_px) * 1000 / size_px)) for v in box]
            evidence = render_evidence(key, row["bbox_qwen"])
        else:
            frames, _, mask = make_visible_volume(n_frames, size_px, rng, organ=organ if organ_outline else None)
        if masks_out is not None:
            masks_out.append(mask)
        if boxes_out is not None:
            boxes_out.append(list(box) if positive and box is not None else None)
        row["frames"] = [{"bytes": _png(f), "path": None} for f in frames]
        row["report"] = row_report(row, o, evidence)
        rows.append(row)
    return rows


def write_rows(table_dir: str | Path, splits: dict[str, list[dict]]) -> Path:
    """Write rows (as `make_rows` returns them) to one shard per split,
    `<table_dir>/data/{split}-00000-of-00001.parquet` (`shard_name`); return table_dir."""
    # lazy: datasets adds 0.75 s (measured); only the table writers need it, the row builders stay light
    import datasets

    out = Path(table_dir)
    (out / DATA_DIR).mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        ds = datasets.Dataset.from_list(rows, features=_features())
        ds.to_parquet(str(out / DATA_DIR / shard_name(split, 0, 1)))
    return out


def write_sft_table(
    table_dir: str | Path,
    *,
    n_train: int = 8,
    n_test: int = 2,
    n_frames: int = 8,
    size_px: int = 64,
    seed: int = 0,
) -> Path:
    """Write `<table_dir>/data/{train,test}-00000-of-00001.parquet` with Hub `List(Image())` frames; return table_dir."""
    splits = {
        split: make_rows(n, n_frames=n_frames, size_px=size_px, split=split, seed=s)
        for split, n, s in (("train", n_train, seed), ("test", n_test, seed + 1))
        if n > 0
    }
    write_rows(table_dir, splits)
    logger.info("Wrote a synthetic sft table (%d train, %d test rows) to %s", n_train, n_test, table_dir)
    return Path(table_dir)


def _features() -> Any:
    """Return the `datasets.Features` of the synthetic sft table (Hub `List(Image())` frames)."""
    import datasets  # lazy: datasets: +0.75 s (see write_rows)

    return datasets.Features(
        {
            "case_id": datasets.Value("string"),
            "organ": datasets.Value("string"),
            "split": datasets.Value("string"),
            "has_lesion": datasets.Value("bool"),
            "lesion_count": datasets.Value("int32"),
            "long_axis_mm": datasets.Value("float64"),
            "short_axis_mm": datasets.Value("float64"),
            "volume_mm3": datasets.Value("float64"),
            "location": datasets.List(datasets.Value("string")),
            "attenuation": datasets.Value("string"),
            "key_slice_frame": datasets.Value("int32"),
            "bbox_qwen": datasets.List(datasets.Value("int32")),
            "n_frames": datasets.Value("int32"),
            "frames": datasets.List(datasets.Image()),
            "prompt": datasets.Value("string"),
            "report": datasets.Value("string"),
        }
    )
