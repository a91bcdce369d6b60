"""Noisy gold: corrupt a stated fraction of the miniature's TRAINING labels (the test split stays clean).

`corrupt_gold(rows, fraction, seed, sizes_mm)` picks `round(fraction * len(rows))` rows (seeded, without replacement).
Of those, `round(flip_share * n)` (the first ones drawn) get an existence flip: a positive row becomes a negative
report, a negative row a positive one with an invented lesion. The rest are positive rows (drawn from the positive
rows not already picked) and get one field wrong, cycling size class, side, attenuation, key frame in draw order:

* `long_axis_mm`: another of `sizes_mm` (short axis and volume follow, as `make_visible_rows` derives them);
* `location`: the other side's locations (`emrl_data.organs.side_locations`);
* `attenuation`: another of hypo / iso / hyper;
* `key_slice_frame`: moved by 2 to 4 frames (a seeded choice among the moves that stay inside 1..n_frames).

The report is re-rendered from the corrupted labels; the frames are untouched (the pixels still show the truth).
Each change is listed in the returned log: `{"row", "case_id", "field", "from", "to"}`.

`move_key_frames(rows, fraction, seed)` is key-frame-only noise: `round(fraction * positives)` positive rows (seeded,
without replacement) get their key frame moved by 2 to 4 frames, as above; existence, size, side and attenuation stay
clean. It asks what the verifier's reading adds when the gold's key frame, and so r_c's distance term, is wrong.

`random_visible_keys(rows, key_boxes_px, ...)` is SFT's key frame without a preference inside the lesion: every
positive row's key frame is a seeded uniform draw among the frames that show its lesion (the key frame included), its
box the lesion's disc on that frame (`visible_lesion_radii_px` around the key frame's centre, in the gold's
convention); size, side and attenuation stay the lesion's. A policy trained on them finds the lesion and picks a
frame of it at chance, so a reward on the named frame has room to move the choice inside the lesion.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from emrl_data.organs import side_locations
from emrl_data.text.report import render_evidence
from emrl_data.types import Organ
from train.checks import TrainConfigError
from train.tiny.synthetic import VISIBLE_INTENSITY, row_report, visible_lesion_radii_px


FIELDS = ("long_axis_mm", "location", "attenuation", "key_slice_frame")
FLIP_SHARE = 0.1  # of the corrupted rows, this share are existence flips ("a few")


def check_fraction(fraction: float, name: str = "gold_noise") -> None:
    """Refuse a fraction outside [0, 1) in one line."""
    if not 0.0 <= fraction < 1.0:
        raise TrainConfigError(
            f"miniature: {name}={fraction} must be in [0, 1) (the fraction of training rows corrupted)"
        )


def _set_size(row: dict[str, Any], long_mm: float) -> None:
    row.update(long_axis_mm=long_mm, short_axis_mm=round(long_mm * 0.7, 1), volume_mm3=round(long_mm**3 * 0.3))


def _corrupt_field(row: dict[str, Any], name: str, rng: np.random.Generator, sizes_mm: Sequence[float]) -> Any:
    """Set one wrong value of `name` in a positive row; return it."""
    if name == "long_axis_mm":
        _set_size(row, float(rng.choice([s for s in sizes_mm if s != row["long_axis_mm"]])))
    elif name == "location":
        left, right = side_locations(row["organ"])
        row["location"] = list(right if tuple(row["location"]) == tuple(left) else left)
    elif name == "attenuation":
        row["attenuation"] = str(rng.choice([a for a in VISIBLE_INTENSITY if a != row["attenuation"]]))
    else:
        _move_key(row, rng)
    return row[name]


def _move_key(row: dict[str, Any], rng: np.random.Generator) -> int:
    """Move a positive row's key frame by 2 to 4 frames (a seeded choice among the moves inside 1..n_frames)."""
    key, n = int(row["key_slice_frame"]), int(row["n_frames"])
    moves = [key + s * d for d in (2, 3, 4) for s in (-1, 1) if 1 <= key + s * d <= n]
    if not moves:
        raise TrainConfigError(f"miniature: gold noise cannot move key frame {key} of {n} frames by 2-4")
    row["key_slice_frame"] = int(rng.choice(moves))
    return row["key_slice_frame"]


def move_key_frames(
    rows: Sequence[dict[str, Any]], fraction: float, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Return (a copy of `rows` with the key frame of `round(fraction * positives)` positive rows moved by 2 to 4
    frames, the log of changes); everything else, and `rows`, stay as they are. See the module doc."""
    check_fraction(fraction, "key_frame_noise")
    out = [copy.deepcopy(dict(r)) for r in rows]
    positives = [i for i, r in enumerate(out) if r["has_lesion"]]
    n = round(fraction * len(positives))
    if n == 0:
        return out, []
    rng = np.random.default_rng(seed)
    log = []
    for i in sorted(int(j) for j in rng.choice(positives, size=n, replace=False)):
        before = out[i]["key_slice_frame"]
        log.append(
            {
                "row": i,
                "case_id": out[i]["case_id"],
                "field": "key_slice_frame",
                "from": before,
                "to": _move_key(out[i], rng),
            }
        )
        _rerender(out[i])
    return out, log


def _flip_existence(row: dict[str, Any], rng: np.random.Generator, sizes_mm: Sequence[float]) -> bool:
    """Flip a row's existence label; a new positive gets an invented lesion (size, side, attenuation, key, box)."""
    if row["has_lesion"]:
        row.update(
            has_lesion=False,
            lesion_count=0,
            long_axis_mm=None,
            short_axis_mm=None,
            volume_mm3=None,
            location=[],
            attenuation=None,
            key_slice_frame=None,
            bbox_qwen=None,
        )
        return False
    n = int(row["n_frames"])
    side = int(rng.integers(2))
    row.update(
        has_lesion=True,
        lesion_count=1,
        location=list(side_locations(row["organ"])[side]),
        attenuation=str(rng.choice(list(VISIBLE_INTENSITY))),
        key_slice_frame=int(rng.integers(2, n)),
    )
    _set_size(row, float(rng.choice(list(sizes_mm))))
    x = 300 if side == 0 else 700
    row["bbox_qwen"] = [x - 100, 400, x + 100, 600]
    return True


def _rerender(row: dict[str, Any]) -> None:
    evidence = render_evidence(row["key_slice_frame"], row["bbox_qwen"]) if row["has_lesion"] else None
    row["report"] = row_report(row, Organ(row["organ"]), evidence)


def corrupt_gold(
    rows: Sequence[dict[str, Any]],
    fraction: float,
    seed: int,
    sizes_mm: Sequence[float],
    flip_share: float = FLIP_SHARE,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Return (a corrupted copy of `rows`, the log of changes); `rows` are left as they are. See the module doc."""
    check_fraction(fraction)
    out = [copy.deepcopy(dict(r)) for r in rows]
    n = round(fraction * len(out))
    if n == 0:
        return out, []
    rng = np.random.default_rng(seed)
    order = [int(i) for i in rng.permutation(len(out))]
    n_flip = round(flip_share * n)
    flips = order[:n_flip]
    positives = [i for i in order[n_flip:] if out[i]["has_lesion"]]
    if len(positives) < n - n_flip:
        raise TrainConfigError(
            f"miniature: gold_noise={fraction} asks {n - n_flip} attribute corruptions, but only {len(positives)} "
            "positive training rows are left; lower gold_noise"
        )
    log = []
    for i in flips:
        log.append(
            {
                "row": i,
                "case_id": out[i]["case_id"],
                "field": "has_lesion",
                "from": out[i]["has_lesion"],
                "to": _flip_existence(out[i], rng, sizes_mm),
            }
        )
    for j, i in enumerate(positives[: n - n_flip]):
        name = FIELDS[j % len(FIELDS)]
        before = copy.deepcopy(out[i][name])
        log.append(
            {
                "row": i,
                "case_id": out[i]["case_id"],
                "field": name,
                "from": before,
                "to": _corrupt_field(out[i], name, rng, sizes_mm),
            }
        )
    for i in {entry["row"] for entry in log}:
        _rerender(out[i])
    return out, sorted(log, key=lambda e: e["row"])


def random_visible_keys(
    rows: Sequence[dict[str, Any]],
    key_boxes_px: Sequence[list[int] | None],
    *,
    size_px: int,
    span: int,
    seed: int,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Return (a copy of `rows` whose positive rows name a random frame of their lesion, the log of changes).

    `key_boxes_px` are `make_visible_rows`'s `boxes_out` for the same rows (the key frame's disc box in pixels, before
    clipping). A row whose draw is its gold key frame is unchanged and not logged. See the module doc.
    """
    if len(key_boxes_px) != len(rows):
        raise TrainConfigError(f"miniature: {len(rows)} rows but {len(key_boxes_px)} lesion boxes")
    rng = np.random.default_rng([seed, 1])  # a stream of its own: the gold noise draws from default_rng(seed)
    out = [copy.deepcopy(dict(r)) for r in rows]
    log = []
    for i, (row, box) in enumerate(zip(out, key_boxes_px, strict=True)):
        if not row["has_lesion"]:
            continue
        if box is None:
            raise TrainConfigError(f"miniature: positive row {row['case_id']} has no lesion box")
        key, n = int(row["key_slice_frame"]), int(row["n_frames"])
        radii = visible_lesion_radii_px(n, size_px, key, float(row["long_axis_mm"]), span)
        frame = int(rng.choice([f for f in range(1, n + 1) if radii[f - 1] > 0]))
        if frame == key:
            continue
        cx, cy, rad = (box[0] + box[2]) // 2, (box[1] + box[3]) // 2, radii[frame - 1]
        px = [cx - rad, cy - rad, cx + rad, cy + rad]
        row["key_slice_frame"] = frame
        row["bbox_qwen"] = [int(round(min(max(v, 0), size_px) * 1000 / size_px)) for v in px]
        _rerender(row)
        log.append({"row": i, "case_id": row["case_id"], "field": "key_slice_frame", "from": key, "to": frame})
    return out, log
