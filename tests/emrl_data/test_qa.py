"""The QA report: exact counts, agreement rates with the disagreeing ids, and the ranking of implausible rows."""

from __future__ import annotations

from emrl_data.labeling.curate import PLAUSIBLE_ORGAN_VOLUME_CM3
from emrl_data.outcome import Rejection, RejectReason
from emrl_data.tables.qa import build_qa_report, qa_markdown


def _row(case: str, organ: str = "liver", **kwargs) -> dict:
    row = {
        "case_id": case,
        "organ": organ,
        "has_lesion": True,
        "lesion_count": 1,
        "long_axis_mm": 30.0,
        "location": ["5"],
        "attenuation": "hypo",
        "organ_volume_mm3": 1_500_000.0,
        "atlas_lesion_count": 1,
        "atlas_long_axis_cm": 3.1,
        "atlas_location": ["5"],
        "atlas_attenuation": "hypo",
        "atlas_organ_volume_cm3": 1480.0,
        "qa_flags": [],
        "warnings": [],
    }
    return {**row, **kwargs}


def test_qa_report_counts_agreement_and_ranking() -> None:
    rows = [
        _row("BDMAP_00000001"),  # agrees on everything
        _row("BDMAP_00000002", lesion_count=2, attenuation="hyper"),  # count and attenuation disagree
        _row("BDMAP_00000003", organ_volume_mm3=14_000.0, qa_flags=["organ_volume_low"]),  # 14 cm^3: stale header
        _row(
            "BDMAP_00000004",
            has_lesion=False,
            lesion_count=0,
            long_axis_mm=None,
            location=[],
            attenuation=None,
            atlas_lesion_count=0,
            atlas_long_axis_cm=0.0,
            atlas_location=None,
            atlas_attenuation=None,
            atlas_organ_volume_cm3=None,
            qa_flags=["unrecognised_lesion_file"],
            warnings=["liver_mass.nii*: ..."],
        ),
    ]
    rejections = [
        Rejection("BDMAP_00000005", None, "load", RejectReason.UNREADABLE_FILE, "x", "x"),
        Rejection("BDMAP_00000006", None, "discover", RejectReason.SPLIT_CONFLICT, "y", "y"),
        Rejection("BDMAP_00000006", None, "metadata", RejectReason.BAD_METADATA_ROW, "z", "z"),
    ]

    digests = {
        "BDMAP_00000001/image_only/BDMAP_00000001/ct.nii.gz": "aa",
        "BDMAP_00000001/mask_only/BDMAP_00000001/segmentations/liver.nii.gz": "m1",
        "BDMAP_00000002/image_only/BDMAP_00000002/ct.nii.gz": "bb",
        "BDMAP_00000002/mask_only/BDMAP_00000002/segmentations/liver.nii.gz": "m1",  # masks may repeat: not listed
        "BDMAP_00000003/image_only/BDMAP_00000003/ct.nii": "aa",
    }
    report = build_qa_report(
        rows, rejections, plausible_volume_cm3=PLAUSIBLE_ORGAN_VOLUME_CM3, warnings=["w1"], file_digests=digests
    )

    assert report.n_rows == 4 and report.n_cases == 6
    assert report.duplicate_cts == (("BDMAP_00000001", "BDMAP_00000003"),)
    assert report.flag_counts == {"organ_volume_low": 1, "rows_with_warnings": 1, "unrecognised_lesion_file": 1}
    assert report.rejection_counts == {"bad_metadata_row": 1, "split_conflict": 1, "unreadable_file": 1}
    by_name = {a.attribute: (a.compared, a.agreed, a.disagreeing) for a in report.agreements}
    assert by_name == {
        "lesion_count": (4, 3, ("BDMAP_00000002/liver",)),
        "long_axis": (3, 3, ()),
        "location": (3, 3, ()),
        "attenuation": (3, 2, ("BDMAP_00000002/liver",)),
        "organ_volume": (3, 2, ("BDMAP_00000003/liver",)),
    }
    # 14 cm^3 vs 500: 2 * log2(500 / 14) = 10.32, + 1 (organ volume disagrees with the CSV).
    assert [(key, score) for key, score, _ in report.implausible] == [
        ("BDMAP_00000003/liver", 11.32),
        ("BDMAP_00000002/liver", 2.0),
        ("BDMAP_00000004/liver", 1.5),
    ]
    assert report.implausible[0][2] == (
        "organ volume 14.0 cm^3 outside [500, 5000]; disagrees with the CSV on organ_volume"
    )

    md = qa_markdown(report)
    assert "| flag | organ_volume_low | 1 |" in md and "| rejection | split_conflict | 1 |" in md
    assert "| attenuation | 3 | 66.7 % | BDMAP_00000002/liver |" in md
    assert "| BDMAP_00000003/liver | 11.32 |" in md and "- w1" in md
    assert "- BDMAP_00000001, BDMAP_00000003" in md


def test_qa_report_of_an_empty_run() -> None:
    report = build_qa_report([], [], plausible_volume_cm3=PLAUSIBLE_ORGAN_VOLUME_CM3)
    assert report.implausible == () and all(a.rate is None for a in report.agreements)
    assert "| lesion_count | 0 | n/a | - |" in qa_markdown(report)
