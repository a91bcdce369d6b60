"""Hard-case selection: the paper's rule, the cap, organ stratification, the reasons."""

from __future__ import annotations

import pytest

from emrl_data.mining import organ_quotas, select_hard_rows
from emrl_data.report import render_evidence, render_findings, render_impression, render_report
from emrl_data.scoring import Truth, score_report
from emrl_data.types import Organ


LIVER = Truth(Organ.LIVER, True, 3.1, ("5",), "hypo", 12)


def _report(long_axis_mm: float = 31.0, location=("5",), attenuation="hypo", k: int = 12) -> str:
    kw = dict(has_lesion=True, lesion_count=1, long_axis_mm=long_axis_mm, location=location, attenuation=attenuation)
    findings = render_findings(Organ.LIVER, short_axis_mm=20.0, volume_mm3=5000.0, **kw)
    return render_report(findings, render_impression(Organ.LIVER, **kw), render_evidence(k, [1, 2, 3, 4]))


NEGATIVE = "<findings>No focal liver lesion is identified.</findings> || <impression>No liver tumor.</impression>"


@pytest.mark.parametrize(
    ("report", "reasons"),
    [
        (_report(), ()),  # all right: not hard
        (_report(k=13), ()),  # K-Hit within +-1 frame: not hard
        (_report(k=14), ("k_hit",)),  # key slice two frames off
        (_report(long_axis_mm=45.0), ("size",)),  # 4.5 vs 3.1 cm: outside max(0.5, 20 %)
        (_report(location=("5", "6")), ("location",)),  # set must match exactly
        (_report(attenuation="hyper"), ("enhancement",)),
        (NEGATIVE, ("existence", "size", "location", "enhancement", "k_hit")),  # missed lesion: everything wrong
        ("garbage", ("parse_failure", "existence", "size", "location", "enhancement", "k_hit")),
    ],
)
def test_select_records_why_a_row_is_hard(report: str, reasons: tuple[str, ...]) -> None:
    chosen = select_hard_rows([({"case_id": "BDMAP_00000001", "organ": "liver"}, score_report(report, LIVER))])
    assert [h.reasons for h in chosen] == ([reasons] if reasons else [])


def test_select_ranks_by_reward_and_caps_per_organ_proportionally() -> None:
    candidates = []
    # 6 hard liver rows with decreasing badness, 2 hard pancreas rows, 1 easy kidney row.
    for i, k in enumerate([14, 15, 16, 20, 30, 40]):
        candidates.append(({"case_id": f"BDMAP_0000001{i}", "organ": "liver"}, score_report(_report(k=k), LIVER)))
    candidates.append(({"case_id": "BDMAP_00000020", "organ": "liver"}, score_report("garbage", LIVER)))
    pancreas = Truth(Organ.PANCREAS, False, None, (), None, None)
    for i in range(2):
        row = {"case_id": f"BDMAP_0000003{i}", "organ": "pancreas"}
        candidates.append((row, score_report(_report(), pancreas)))  # a false positive
    kidney = Truth(Organ.KIDNEY, False, None, (), None, None)
    kidney_negative = NEGATIVE.replace("liver lesion", "kidney lesion").replace("liver tumor", "kidney tumor")
    candidates.append(({"case_id": "BDMAP_00000040", "organ": "kidney"}, score_report(kidney_negative, kidney)))

    chosen = select_hard_rows(candidates, target_size=6)

    # 7 hard liver + 2 hard pancreas = 9 hard; quotas 6 * 7/9 = 4.67 -> 5 (largest remainder), 6 * 2/9 = 1.33 -> 1.
    assert [(h.organ, h.rank) for h in chosen] == [("liver", r) for r in range(1, 6)] + [("pancreas", 1)]
    liver = [h for h in chosen if h.organ == "liver"]
    assert liver[0].case_id == "BDMAP_00000020"  # the unparseable report has the lowest reward (0)
    assert [h.reward for h in liver] == sorted(h.reward for h in liver)
    assert all(h.organ != "kidney" for h in chosen)  # the kidney row was right


def test_organ_quotas_keep_everything_under_the_cap_and_sum_to_it_above() -> None:
    assert organ_quotas({"liver": 3, "pancreas": 1}, 10) == {"liver": 3, "pancreas": 1}
    assert organ_quotas({"liver": 1, "pancreas": 1, "kidney": 1}, 2) == {"liver": 1, "pancreas": 1, "kidney": 0}
    assert sum(organ_quotas({"liver": 997, "pancreas": 2, "kidney": 1}, 100).values()) == 100
    with pytest.raises(ValueError, match="target_size"):
        organ_quotas({"liver": 1}, -1)
