"""The organ registry: `Organ` behaves as the enum it replaced, and a fourth organ is a registry entry plus anatomy.

The spleen test registers an organ the code has never heard of (no sub-structures) and runs the synthetic pipeline end
to end for it: synthetic atlas -> plan -> curate -> rows, whose labels equal the generator's truth and whose reports
name the spleen and parse back to the same claims.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest

from emrl_data.config import CurateConfig
from emrl_data.labeling.curate import curate_case
from emrl_data.organs import (
    LOCATION_NAMES,
    ORGANS,
    CsvColumns,
    Organ,
    OrganSpec,
    organ_spec,
    register_organ,
    unregister_organ,
)
from emrl_data.reading.atlas import plan_atlas
from emrl_data.synthetic import ANATOMY, CaseSpec, LesionSpec, OrganAnatomy, write_atlas
from emrl_data.tables.records import TABLE_COLUMNS
from emrl_data.text.parser import ParsedReport, ParseFailure, parse_free_text, parse_report
from emrl_data.text.report import NEGATIVE_FINDINGS, format_location, render_prompt
from emrl_data.text.scoring import score_report, truth_from_row


SPLEEN = OrganSpec(
    name="spleen",
    organ_masks=("spleen",),
    lesion_mask="spleen_lesion",
    display="spleen",
    adjective="splenic",
    whole_organ_phrase="the spleen",
    mentions=("spleen", "splenic"),
    words=("spleen", "splenic"),
    in_organ_nouns="spleen",
    negation_modifiers=("splenic", "spleen"),
    csv=CsvColumns.atlas("spleen", "spleen", "none"),
)
# Left upper quadrant, posterior: clear of the liver (patient's right), the pancreas and the left kidney (below).
SPLEEN_ANATOMY = OrganAnatomy(hu=45, shapes={"spleen": ((-0.50, -0.20, 0.35), (0.14, 0.18, 0.20))})


@pytest.fixture
def spleen() -> Iterator[Organ]:
    """Register the spleen and its anatomy for one test, then restore the registry."""
    organ = register_organ(SPLEEN)
    ANATOMY["spleen"] = SPLEEN_ANATOMY
    try:
        yield organ
    finally:
        del ANATOMY["spleen"]
        unregister_organ("spleen")


# --------------------------------------------------------------------------------------------------------------------
# Organ: the enum it replaced


def test_organ_behaves_as_the_former_enum() -> None:
    assert list(Organ) == ["liver", "pancreas", "kidney"] and len(Organ) == 3
    assert Organ("liver") is Organ.LIVER and Organ(Organ.KIDNEY) is Organ.KIDNEY
    assert Organ.PANCREAS == "pancreas" and str(Organ.PANCREAS) == "pancreas" and f"{Organ.KIDNEY}" == "kidney"
    assert (Organ.LIVER.value, Organ.LIVER.name, repr(Organ.LIVER)) == ("liver", "LIVER", "<Organ.LIVER: 'liver'>")
    assert "kidney" in Organ and "spleen" not in Organ
    assert pickle.loads(pickle.dumps(Organ.KIDNEY)) is Organ.KIDNEY and copy.deepcopy(Organ.LIVER) is Organ.LIVER
    assert {Organ.LIVER: 1}["liver"] == 1
    with pytest.raises(ValueError, match="'spleen' is not a registered organ"):
        Organ("spleen")


def test_built_in_specs_hold_what_the_modules_used_to_spell_out() -> None:
    kidney = organ_spec("kidney")
    assert kidney.organ_masks == ("kidney_left", "kidney_right") and kidney.single_location
    assert LOCATION_NAMES[Organ.LIVER] == tuple(str(i) for i in range(1, 9))
    assert LOCATION_NAMES["pancreas"] == ("head", "body", "tail")
    assert organ_spec("pancreas").csv.location == "largest pancreatic lesion location (head, body, tail)"
    assert organ_spec("liver").csv.organ_volume_cm3 == "liver volume (cm^3)"
    assert [format_location(o, ()) for o in Organ] == ["the liver", "the pancreas", "the kidney"]
    assert format_location(Organ.KIDNEY, ["left"]) == "left kidney"
    assert format_location(Organ.LIVER, ["5", "8"]) == "hepatic segment 5/8"
    assert NEGATIVE_FINDINGS[Organ.PANCREAS] == "No focal pancreatic lesion is identified."


def test_registry_refuses_duplicates_and_bad_specs() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_organ(ORGANS[Organ.LIVER])
    with pytest.raises(ValueError, match="location_phrase"):
        OrganSpec(**{**_fields(SPLEEN), "location_phrase": "spleen"})
    with pytest.raises(ValueError, match="not in"):
        OrganSpec(**{**_fields(SPLEEN), "location_words": (("upper", ("upper pole",)),)})
    with pytest.raises(KeyError, match="not a registered organ"):
        organ_spec("spleen")


def _fields(spec: OrganSpec) -> dict:
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


# --------------------------------------------------------------------------------------------------------------------
# A fourth organ, end to end


def test_spleen_reports_name_it_and_parse_back(spleen: Organ) -> None:
    assert list(Organ) == ["liver", "pancreas", "kidney", "spleen"]
    assert "spleen" in render_prompt(spleen, 8)
    negative = f"<findings>{NEGATIVE_FINDINGS[spleen]}</findings> || <impression>No splenic tumor.</impression>"
    assert negative == (
        "<findings>No focal splenic lesion is identified.</findings> || <impression>No splenic tumor.</impression>"
    )
    assert parse_report(negative, spleen) == ParsedReport(False, None, None, None, None, None, None, 0)
    # A multi-organ report is read one organ at a time: the spleen sentence is not the liver's, and vice versa.
    text = "<findings>No focal liver lesion is identified. A 2.5 cm hypodense lesion in the spleen.</findings>"
    liver, spleen_claims = parse_report(text, "liver"), parse_report(text, "spleen")
    assert isinstance(liver, ParsedReport) and not liver.has_lesion
    assert isinstance(spleen_claims, ParsedReport)
    assert (spleen_claims.has_lesion, spleen_claims.long_axis_cm, spleen_claims.location) == (True, 2.5, ())
    free = parse_free_text("A 3 cm hyperdense splenic mass.", spleen)
    assert isinstance(free, ParsedReport) and (free.has_lesion, free.attenuation) == (True, "hyper")
    # The kidney does not claim spleen sentences ("not liver or pancreas" is no longer kidney): nothing about it here.
    assert parse_report(text, "kidney") == ParseFailure("undetermined")


def test_spleen_runs_the_synthetic_pipeline_end_to_end(spleen: Organ, tmp_path: Path) -> None:
    specs = [
        CaseSpec(
            "BDMAP_00000001",
            lesions=(
                LesionSpec(spleen, "", (6.0, 5.0, 5.0), "hypo"),
                LesionSpec(Organ.LIVER, "8", (5.0, 5.0, 5.0), "hypo"),
            ),
            seed=1,
        ),
        CaseSpec("BDMAP_00000002", lesions=(LesionSpec(spleen, "", (3.0, 3.0, 3.0), "hyper"),), seed=2),
        CaseSpec("BDMAP_00000003", seed=3),
    ]
    truth = write_atlas(tmp_path / "atlas", specs)
    assert (tmp_path / "atlas" / "mask_only" / "BDMAP_00000001" / "segmentations" / "spleen_lesion.nii.gz").is_file()
    plan = plan_atlas(tmp_path / "atlas")
    rows, rejections = [], []
    for ref in plan.refs:
        result = curate_case(
            ref, split=plan.splits[ref.case_id], cfg=CurateConfig(), metadata=plan.metadata.get(ref.case_id)
        )
        rows += result.rows
        rejections += result.rejections
    assert rejections == [] and len(rows) == 3 * 4
    assert all(set(r) == {c.name for c in TABLE_COLUMNS["sft"]} for r in rows)  # a row holds the declared columns
    by_key = {(r["case_id"], r["organ"]): r for r in rows}
    expected_has_lesion = {"BDMAP_00000001": True, "BDMAP_00000002": True, "BDMAP_00000003": False}
    for case in truth.cases:
        expected = case.organs[spleen]
        row = by_key[(case.case_id, "spleen")]
        assert row["has_lesion"] is expected.has_lesion is expected_has_lesion[case.case_id]
        for name in ("lesion_count", "key_slice_z_vox", "max_diameter_z_vox", "attenuation", "volume_mm3"):
            assert row[name] == expected.__getattribute__(name), (case.case_id, name)
        for name in ("bbox_xyxy_vox", "lesion_box_xyzxyz_vox", "organ_box_xyzxyz_vox"):
            value = expected.__getattribute__(name)
            assert row[name] == (None if value is None else list(value)), (case.case_id, name)
        assert row["location"] == [] and row["atlas_agreement"] is True
        assert row["prompt"].count("spleen") == 2
        parsed = parse_report(row["report"], "spleen")
        assert isinstance(parsed, ParsedReport) and parsed.has_lesion is expected.has_lesion
        if expected.has_lesion:
            assert "splenic" in row["report"] and "lesion in the spleen" in row["report"]
            assert parsed.location == () and parsed.attenuation == expected.attenuation
            assert parsed.key_slice == row["key_slice_frame"] and list(parsed.bbox or ()) == row["bbox_qwen"]
        else:
            assert row["report"].startswith("<findings>No focal splenic lesion is identified.</findings>")
        score = score_report(row["report"], truth_from_row(row))
        assert (score.score_existence, score.reward) == (1.0, 1.0)
    # The other organs are untouched by the fourth one.
    liver = by_key[("BDMAP_00000001", "liver")]
    assert liver["location"] == list(truth.cases[0].organs[Organ.LIVER].location) and liver["has_lesion"]
    assert not by_key[("BDMAP_00000001", "kidney")]["has_lesion"]
