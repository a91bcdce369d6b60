"""Noisy gold: exactly which training rows and fields `corrupt_gold` changes, and its guards."""

from __future__ import annotations

import numpy as np
import pytest

from emrl_data.organs import side_locations
from emrl_data.text.parser import parse_report
from train.checks import TrainConfigError
from train.miniature.config import load_config
from train.miniature.noise import FIELDS, check_fraction, corrupt_gold
from train.tooling.synthetic import make_visible_rows


SIZES = (31.0, 48.0, 90.0)
LABELS = ("has_lesion", "long_axis_mm", "short_axis_mm", "volume_mm3", "location", "attenuation", "key_slice_frame",
          "bbox_qwen", "lesion_count", "report")  # fmt: skip


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
