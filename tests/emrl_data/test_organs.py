"""The organ registry: `Organ` behaves as the enum it replaced, and a fourth organ is one registry entry.

The spleen test registers an organ the code has never heard of (no sub-structures) and runs the synthetic pipeline end
to end for it: synthetic atlas -> plan -> curate -> rows, whose labels equal the generator's truth and whose reports
name the spleen and parse back to the same claims. A spleen with two poles (sub-structures drawn by `PartRegion`s)
shows that its entry alone gives it synthetic anatomy, a mention in the dataset card and training-synthetic locations.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
from collections.abc import Iterator
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from emrl_data.config import CurateConfig
from emrl_data.labeling.curate import curate_case
from emrl_data.organs import (
    LOCATION_NAMES,
    ORGANS,
    CsvColumns,
    Organ,
    OrganAnatomy,
    OrganSpec,
    PartRegion,
    organ_spec,
    register_organ,
    side_locations,
    unregister_organ,
)
from emrl_data.reading.atlas import plan_atlas
from emrl_data.sources import SOURCE_COLUMNS
from emrl_data.synthetic import CaseSpec, LesionSpec, write_atlas, write_case
from emrl_data.tables.card import default_label_definitions, organ_names_prose, table_description
from emrl_data.tables.records import TABLE_COLUMNS
from emrl_data.text.parser import ParsedReport, ParseFailure, parse_free_text, parse_report
from emrl_data.text.report import NEGATIVE_FINDINGS, format_location, render_prompt
from emrl_data.text.scoring import score_report, truth_from_row
from train.tiny.synthetic import make_visible_rows


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
    # Left upper quadrant, posterior: clear of the liver (patient's right), the pancreas and the left kidney (below).
    anatomy=OrganAnatomy(hu=45, shapes=(("spleen", ((-0.50, -0.20, 0.35), (0.14, 0.18, 0.20))),)),
)
# The same spleen cut into an upper and a lower pole at its ellipsoid's equator (w = 0).
POLED_SPLEEN = dataclasses.replace(
    SPLEEN,
    parts=(("spleen_upper_pole", "upper"), ("spleen_lower_pole", "lower")),
    location_words=(("upper", ("upper",)), ("lower", ("lower",))),
    anatomy=dataclasses.replace(
        SPLEEN.anatomy,
        parts=(
            PartRegion(file="spleen_upper_pole", w=(0.0, math.inf)),
            PartRegion(file="spleen_lower_pole", w=(-math.inf, 0.0)),
        ),
    ),
)


@pytest.fixture
def spleen() -> Iterator[Organ]:
    """Register the spleen (with its anatomy) for one test, then restore the registry."""
    organ = register_organ(SPLEEN)
    try:
        yield organ
    finally:
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
    assert SPLEEN.anatomy is not None
    with pytest.raises(ValueError, match=r"anatomy.shapes draws \['liver'\], not organ_masks \('spleen',\)"):
        dataclasses.replace(
            SPLEEN, anatomy=dataclasses.replace(SPLEEN.anatomy, shapes=ORGANS[Organ.LIVER].anatomy.shapes)
        )
    with pytest.raises(
        ValueError, match=r"anatomy.parts draws \[\]; the parts are \['spleen_lower_pole', 'spleen_upper"
    ):
        dataclasses.replace(POLED_SPLEEN, anatomy=SPLEEN.anatomy)  # parts nobody draws
    with pytest.raises(ValueError, match=r"anatomy.side_locations names \('hilum',\)"):
        dataclasses.replace(SPLEEN, anatomy=dataclasses.replace(SPLEEN.anatomy, side_locations=(("hilum",), ())))


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
    # a case's row holds the declared columns, but its source's: those join when the table is assembled (with_source)
    assert all(set(r) == {c.name for c in TABLE_COLUMNS["sft"]} - set(SOURCE_COLUMNS) for r in rows)
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


def test_an_organ_without_anatomy_is_refused_by_the_synthetic_atlas_naming_the_fix(tmp_path: Path) -> None:
    register_organ(dataclasses.replace(SPLEEN, anatomy=None))
    try:
        with pytest.raises(KeyError, match=r"'spleen' has no synthetic anatomy; give its OrganSpec an `anatomy="):
            write_case(tmp_path, CaseSpec("BDMAP_00000001"))
    finally:
        unregister_organ("spleen")


def test_one_registry_entry_gives_anatomy_card_prose_and_training_locations(tmp_path: Path) -> None:
    """A poled spleen, registered here and nowhere else: drawn, truthed, named in the card, used by train.tiny.synthetic."""
    organ = register_organ(POLED_SPLEEN)
    try:
        upper = LesionSpec(organ, "upper", (4.0, 4.0, 4.0), "hypo")
        truth = write_case(tmp_path, CaseSpec("BDMAP_00000001", lesions=(upper,), seed=1)).organs[organ]
        seg = tmp_path / "mask_only" / "BDMAP_00000001" / "segmentations"
        files = {"spleen", "spleen_lesion", "spleen_upper_pole", "spleen_lower_pole"}
        assert {p.name.removesuffix(".nii.gz") for p in seg.glob("spleen*")} == files
        masks = {name: np.asanyarray(nib.load(seg / f"{name}.nii.gz").dataobj) > 0 for name in files}
        poles = masks["spleen_upper_pole"], masks["spleen_lower_pole"]
        assert poles[0].any() and poles[1].any() and not (poles[0] & poles[1]).any()  # two halves, no overlap
        assert np.array_equal(poles[0] | poles[1], masks["spleen"])  # that partition the organ
        z_upper, z_lower = (np.nonzero(p)[2] for p in poles)
        assert z_lower.max() < z_upper.min()  # the upper pole is superior (z grows superior)
        assert (truth.has_lesion, truth.location, truth.lesion_count) == (True, ("upper",), 1)

        assert organ_names_prose() == "liver, pancreas, kidney and spleen"
        assert "one row per (case, organ) for liver, pancreas, kidney and spleen." in table_description("sft")
        assert "spleen `upper`/`lower`" in default_label_definitions()

        assert side_locations(organ) == (("upper",), ("lower",))  # the default: the first / last location name
        rows = make_visible_rows(12, organs=("spleen",), positive_fraction=1.0, seed=3)
        assert {tuple(r["location"]) for r in rows} == {("upper",), ("lower",)}
        assert all("spleen" in r["prompt"] and r["report"].count("upper") + r["report"].count("lower") for r in rows)
        assert [r["organ"] for r in make_visible_rows(4, seed=3)] == ["liver", "pancreas", "kidney", "spleen"]
    finally:
        unregister_organ("spleen")


def test_built_in_training_locations_come_from_the_registry() -> None:
    assert [side_locations(o) for o in Organ] == [
        (("5", "8"), ("2",)),
        (("head",), ("body", "tail")),
        (("left",), ("right",)),  # the default
    ]
