"""Columns are declared once: schemas, card descriptions and row dicts derive from the dataclass declarations."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pyarrow as pa

from emrl_data.labeling.frames import FrameSet
from emrl_data.labeling.labels import OrganLabels
from emrl_data.tables.records import (
    PREDICTION_TRUTH_COLUMNS,
    SCHEMAS,
    TABLE_COLUMNS,
    Column,
    column_descriptions,
    columns_of,
    make_schema,
    required_columns,
)
from emrl_data.text.scoring import TRUTH_COLUMNS, ReportScore
from emrl_data.types import Organ, column, row_values


@dataclass(frozen=True)
class _Measurement:
    organ: Organ  # not a column: no metadata
    size_mm: float | None = field(metadata=column(pa.float64(), "a size"))
    parts: tuple[str, ...] = field(metadata=column(pa.list_(pa.string()), "parts"))


def test_a_column_is_one_declared_field() -> None:
    assert columns_of(_Measurement) == [
        Column("size_mm", pa.float64(), True, "a size"),
        Column("parts", pa.list_(pa.string()), False, "parts"),
    ]
    assert columns_of(_Measurement, nullable=True)[1].nullable is True
    schema = make_schema(columns_of(_Measurement))
    assert schema.names == ["size_mm", "parts"] and schema.field("parts").type == pa.list_(pa.string())
    row = row_values(_Measurement(Organ.LIVER, None, ("a", "b")))
    assert row == {"size_mm": None, "parts": ["a", "b"]} and type(row["parts"]) is list


def test_organ_row_columns_come_from_the_dataclasses_in_order() -> None:
    names = [c.name for c in TABLE_COLUMNS["findings"]]
    labels = [f.name for f in dataclasses.fields(OrganLabels) if f.name != "organ"]
    frames = [f.name for f in dataclasses.fields(FrameSet) if f.name != "pngs"]
    assert names[3 : 3 + len(labels)] == labels
    start = names.index("frame_z_vox")
    assert names[start : start + len(frames)] == frames
    assert SCHEMAS["sft"].names == [*names, "frames"]
    assert "long_axis_mm" not in required_columns("findings") and "location" in required_columns("findings")
    assert column_descriptions("sft")["organ"] == "liver | pancreas | kidney"


def test_predictions_use_the_scorers_names_and_the_one_list_of_truth_columns() -> None:
    names = SCHEMAS["predictions"].names
    scores = [f.name for f in dataclasses.fields(ReportScore)]
    assert names[names.index("parse_failure") : names.index("parse_failure") + len(scores)] == scores
    assert set(TRUTH_COLUMNS) <= set(PREDICTION_TRUTH_COLUMNS) and names[: len(PREDICTION_TRUTH_COLUMNS)] == list(
        PREDICTION_TRUTH_COLUMNS
    )
    assert all(c.nullable for c in TABLE_COLUMNS["predictions"] if c.name in scores)
