"""Noisy gold: exactly which training rows and fields `corrupt_gold` changes, and its guards."""

from __future__ import annotations

import numpy as np
import pytest

from emrl_data.organs import side_locations
from emrl_data.text.parser import parse_report
from train.checks import TrainConfigError
from train.miniature.config import load_config
from train.miniature.noise import FIELDS, check_fraction, corrupt_gold
from train.tiny.synthetic import make_visible_rows


SIZES = (31.0, 48.0, 90.0)
LABELS = (
    "has_lesion",
    "long_axis_mm",
    "short_axis_mm",
    "volume_mm3",
    "location",
    "attenuation",
    "key_slice_frame",
    "bbox_qwen",
    "lesion_count",
    "report",
)


def _rows():
    return make_visible_rows(40, n_frames=8, size_px=32, seed=7, organs=("kidney", "liver"), sizes_mm=SIZES, span=3)


def _changed(before, after):
    return {k for k in LABELS if before[k] != after[k]}


def test_corruption_picks_the_documented_rows_and_fields():
    rows = _rows()
    noisy, log = corrupt_gold(rows, 0.30, seed=11, sizes_mm=SIZES)
    n = round(0.30 * 40)  # 12 rows; round(0.1 * 12) = 1 existence flip, the first row of the seeded permutation
    order = [int(i) for i in np.random.default_rng(11).permutation(40)]
    positives = [i for i in order[1:] if rows[i]["has_lesion"]][: n - 1]
    assert [e["row"] for e in log] == sorted([order[0], *positives])
    by_row = {e["row"]: e for e in log}
    assert by_row[order[0]]["field"] == "has_lesion"
    assert [by_row[i]["field"] for i in positives] == [FIELDS[j % 4] for j in range(n - 1)]  # size, side, att, key
    for i, (before, after) in enumerate(zip(rows, noisy, strict=True)):
        assert after["frames"] == before["frames"]  # the pixels still show the truth
        entry = by_row.get(i)
        if entry is None:
            assert _changed(before, after) == set()
            continue
        assert (
            entry["from"] == before[entry["field"]] and entry["to"] == after[entry["field"]] != before[entry["field"]]
        )
        expected = {
            "long_axis_mm": {"long_axis_mm", "short_axis_mm", "volume_mm3", "report"},
            "location": {"location", "report"},
            "attenuation": {"attenuation", "report"},
            "key_slice_frame": {"key_slice_frame", "report"},
        }.get(entry["field"])
        if expected is not None:
            assert _changed(before, after) == expected
        parsed = parse_report(after["report"], after["organ"])  # the report says the corrupted labels
        assert parsed.has_lesion == after["has_lesion"]
        if entry["field"] == "key_slice_frame":
            assert 2 <= abs(after["key_slice_frame"] - before["key_slice_frame"]) <= 4
            assert parsed.key_slice == after["key_slice_frame"]
        if entry["field"] == "location":
            assert {tuple(before["location"]), tuple(after["location"])} == set(side_locations(after["organ"]))
        if entry["field"] == "long_axis_mm":
            assert after["long_axis_mm"] in SIZES and parsed.long_axis_cm == pytest.approx(after["long_axis_mm"] / 10)
    assert rows == _rows()  # the input is left as it was


def test_corruption_is_deterministic_and_zero_is_clean():
    rows = _rows()
    assert corrupt_gold(rows, 0.15, seed=3, sizes_mm=SIZES) == corrupt_gold(rows, 0.15, seed=3, sizes_mm=SIZES)
    assert corrupt_gold(rows, 0.15, seed=3, sizes_mm=SIZES)[1] != corrupt_gold(rows, 0.15, seed=4, sizes_mm=SIZES)[1]
    assert len(corrupt_gold(rows, 0.15, seed=3, sizes_mm=SIZES)[1]) == 6
    assert corrupt_gold(rows, 0.0, seed=3, sizes_mm=SIZES) == (rows, [])


@pytest.mark.parametrize("fraction", [1.0, -0.1, 1.5])
def test_a_fraction_outside_zero_one_is_one_line(fraction, tmp_path):
    with pytest.raises(TrainConfigError) as err:
        check_fraction(fraction)
    assert "\n" not in str(err.value) and f"gold_noise={fraction} must be in [0, 1)" in str(err.value)
    path = tmp_path / "m.yaml"
    path.write_text(f"gold_noise: {fraction}\n")
    with pytest.raises(TrainConfigError, match=r"must be in \[0, 1\)"):
        load_config(path)


def test_too_few_positive_rows_for_the_fraction_is_one_line():
    with pytest.raises(TrainConfigError, match="positive training rows are left; lower gold_noise"):
        corrupt_gold(_rows(), 0.9, seed=0, sizes_mm=SIZES)


def _positive(case: int, key: int, n_frames: int = 10) -> dict:
    from emrl_data.types import Organ
    from train.tiny.synthetic import row_report

    row = {
        "case_id": f"c{case}",
        "organ": "kidney",
        "has_lesion": True,
        "lesion_count": 1,
        "n_frames": n_frames,
        "long_axis_mm": 31.0,
        "short_axis_mm": 21.7,
        "volume_mm3": 8937,
        "location": ["left"],
        "attenuation": "hypo",
        "key_slice_frame": key,
        "bbox_qwen": [200, 400, 400, 600],
        "frames": [b"x"],
    }
    from emrl_data.text.report import render_evidence

    row["report"] = row_report(row, Organ.KIDNEY, render_evidence(key, row["bbox_qwen"]))
    return row


def _negative(case: int) -> dict:
    return {
        "case_id": f"n{case}",
        "organ": "kidney",
        "has_lesion": False,
        "lesion_count": 0,
        "n_frames": 10,
        "long_axis_mm": None,
        "short_axis_mm": None,
        "volume_mm3": None,
        "location": [],
        "attenuation": None,
        "key_slice_frame": None,
        "bbox_qwen": None,
        "report": "no lesion",
        "frames": [b"y"],
    }


def test_key_frame_noise_moves_only_key_frames_by_2_to_4_on_the_stated_fraction_of_positives():
    from train.miniature.noise import move_key_frames

    rows = [_positive(0, 2), _negative(1), _positive(2, 5), _positive(3, 9), _negative(4), _positive(5, 6)]
    noisy, log = move_key_frames(rows, 0.5, seed=3)
    positives = [0, 2, 3, 5]
    chosen = sorted(int(i) for i in np.random.default_rng(3).choice(positives, size=2, replace=False))
    assert [e["row"] for e in log] == chosen and all(e["field"] == "key_slice_frame" for e in log)
    for i, (before, after) in enumerate(zip(rows, noisy, strict=True)):
        if i in chosen:
            assert 2 <= abs(after["key_slice_frame"] - before["key_slice_frame"]) <= 4
            assert 1 <= after["key_slice_frame"] <= 10
            assert _changed(before, after) == {"key_slice_frame", "report"}
            assert parse_report(after["report"], "kidney").key_slice == after["key_slice_frame"]
        else:
            assert after == before
    assert rows[0]["key_slice_frame"] == 2  # the input is left as it was
    # exact values: key 2 of 10 frames can only move up (4, 5, 6); key 9 to 5, 6, 7 (down) only
    only_up, _ = move_key_frames([_positive(0, 2)], 0.9, seed=0)
    only_down, _ = move_key_frames([_positive(0, 9)], 0.9, seed=0)
    assert only_up[0]["key_slice_frame"] in (4, 5, 6) and only_down[0]["key_slice_frame"] in (5, 6, 7)
    assert move_key_frames(rows, 0.0, seed=3) == (rows, [])
    assert len(move_key_frames(rows, 0.25, seed=3)[1]) == 1  # round(0.25 x 4 positives)
    with pytest.raises(TrainConfigError, match="cannot move key frame 2 of 3 frames by 2-4"):
        move_key_frames([_positive(0, 2, n_frames=3)], 0.9, seed=0)


def test_the_data_stage_moves_key_frames_of_training_rows_only_and_draws_a_disjoint_warmup_pool(tmp_path):
    from dataclasses import replace

    from train.data import load_split
    from train.miniature.study import Miniature, warmup_pool_seed
    from train.miniature.suite import load_study

    cfg = replace(load_study("train/configs/miniature_micro.yaml")[0], key_frame_noise=0.5, n_train=12)
    Miniature(cfg, tmp_path).run(stages=("data",))
    train = list(load_split(tmp_path / "data", "train"))
    test = list(load_split(tmp_path / "data", "test"))
    pool = list(load_split(tmp_path / "data" / "warmup_pool", "train"))
    assert not (tmp_path / "data" / "clean").exists()  # no copy of the training rows' clean labels
    clean = make_visible_rows(12, n_frames=4, size_px=32, organs=("kidney",), sizes_mm=SIZES, span=1, seed=cfg.seed)
    import json

    log = json.loads((tmp_path / "data" / "noise.json").read_text())
    moved = {e["row"] for e in log}
    assert len(moved) == round(0.5 * sum(r["has_lesion"] for r in clean)) and {e["field"] for e in log} == {
        "key_slice_frame"
    }
    for i, (row, truth) in enumerate(zip(train, clean, strict=True)):
        assert (row["key_slice_frame"] != truth["key_slice_frame"]) == (i in moved)
        assert row["has_lesion"] == truth["has_lesion"] and row["attenuation"] == truth["attenuation"]
    assert len(pool) == cfg.warmup_pool_rows and warmup_pool_seed(cfg.seed) not in (cfg.seed, cfg.seed + 1000)
    pool_ids = {r["case_id"] for r in pool}
    assert [r["case_id"] for r in Miniature(cfg, tmp_path)._rows("train", clean=True)] == [r["case_id"] for r in pool]
    assert not pool_ids & {r["case_id"] for r in train} and not pool_ids & {r["case_id"] for r in test}
    train_frames = {bytes(f) if isinstance(f, bytes | bytearray) else str(f) for r in train for f in r["frames"][:1]}
    assert not {bytes(f) if isinstance(f, bytes | bytearray) else str(f) for r in pool for f in r["frames"][:1]} & (
        train_frames
    )
