"""Table schemas: one explicit pyarrow schema per table (docs/contract.md#outputs), with the Hub `features` each carries.

Each column is declared once, with its Arrow type and description: on the dataclass that computes it
(`labels.OrganLabels`, `frames.FrameSet`, `scoring.ReportScore`, via `emrl_data.types.column`) or below. Schemas,
`schemas/*.schema.json`, the dataset card's column descriptions and the row dicts (`emrl_data.types.row_values`)
all derive from these declarations.

The schemas are the interface: `sft` column names are the keyword arguments the GRPO rewards receive and the
arguments the shared scorer takes. `schemas/*.schema.json` are generated from here
(`python -m emrl_data.tables.records --write-schemas schemas/`) and a test checks they are up to date.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa

from emrl_data.labeling.frames import FrameSet
from emrl_data.labeling.labels import OrganLabels
from emrl_data.sources import SOURCE_COLUMNS
from emrl_data.text.scoring import TRUTH_COLUMNS, ReportScore
from emrl_data.types import Organ


IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
_INT_LIST = pa.list_(pa.int32())


class Column(NamedTuple):
    """One column of a table: name, Arrow type, whether it may be null, description (also the card's)."""

    name: str
    arrow: pa.DataType
    nullable: bool
    doc: str


def columns_of(record_type: type, *, nullable: bool | None = None) -> list[Column]:
    """Return the columns a dataclass declares: its fields made with `emrl_data.types.column`, in field order.

    Args:
        record_type: a dataclass (`OrganLabels`, `FrameSet`, `ReportScore`).
        nullable: None: a field is nullable when its type admits None (`X | None`); True/False: every column is.
    """
    hints = typing.get_type_hints(record_type)
    out = []
    for f in dataclasses.fields(record_type):
        if "arrow" not in f.metadata:
            continue
        optional = type(None) in typing.get_args(hints[f.name])
        out.append(Column(f.name, f.metadata["arrow"], optional if nullable is None else nullable, f.metadata["doc"]))
    return out


# Where a row comes from (`emrl_data.sources.Source.columns`): on organ rows and rejection rows.
_SOURCE_DOCS = {
    "source_dataset": "the dataset layout the case was read from (`emrl layouts`)",
    "source_case_id": "the case's id in that dataset",
    "source_license": "SPDX id of that dataset's licence (LicenseRef-*: its own terms)",
}
SOURCE_COLUMN_LIST: list[Column] = [Column(name, pa.string(), False, _SOURCE_DOCS[name]) for name in SOURCE_COLUMNS]

# The columns of an organ row, in table order. A column is declared once: on the dataclass that computes it
# (`OrganLabels`, `FrameSet`) or here; its value in a row comes from the same place (`emrl_data.labeling.curate._organ_row`).
# Adding a column is one line: a `column(...)` field on one of those dataclasses, or a `Column(...)` here.
ORGAN_ROW_COLUMNS: list[Column] = [
    Column("case_id", pa.string(), False, "BDMAP_ + 8 digits"),
    Column("organ", pa.string(), False, " | ".join(str(o) for o in Organ)),
    Column("split", pa.string(), False, "train | test (IID split files, else case-id hash)"),
    *columns_of(OrganLabels),
    Column("spacing_mm", pa.list_(pa.float64()), False, "voxel spacing in canonical (x, y, z) order"),
    Column("shape_vox", _INT_LIST, False, "CT shape in canonical (x, y, z) order"),
    *columns_of(FrameSet),
    Column("findings", pa.string(), False, "findings text"),
    Column("impression", pa.string(), False, "impression text"),
    Column("report", pa.string(), False, "target report in the E-MRL format"),
    Column("prompt", pa.string(), False, "user prompt of the row"),
    Column("atlas_lesion_count", pa.int32(), True, "metadata CSV: number of lesion instances"),
    Column("atlas_long_axis_cm", pa.float64(), True, "metadata CSV: largest lesion diameter (cm)"),
    Column("atlas_location", pa.list_(pa.string()), True, "metadata CSV: largest lesion location"),
    Column("atlas_attenuation", pa.string(), True, "metadata CSV: largest lesion attenuation"),
    Column("atlas_organ_volume_cm3", pa.float64(), True, "metadata CSV: organ volume"),
    Column("atlas_agreement", pa.bool_(), True, "our labels agree with the CSV (null: no CSV row)"),
    Column("warnings", pa.list_(pa.string()), False, "non-fatal problems met while loading the case"),
    Column(
        "lesion_files",
        pa.list_(pa.string()),
        False,
        "mask files whose union is the lesion mask: <organ>_lesion, else its *_tumor/*_cyst files; [] = none",
    ),
    Column(
        "qa_flags",
        pa.list_(pa.string()),
        False,
        "plausibility flags, never a rejection: organ_volume_low | organ_volume_high | unrecognised_lesion_file",
    ),
    Column("pipeline_version", pa.string(), False, "emrl_data version that produced the row"),
    Column("config_fingerprint", pa.string(), False, "fingerprint of the curation config"),
    *SOURCE_COLUMN_LIST,
]

FRAMES_COLUMN = Column("frames", pa.list_(IMAGE_STRUCT), False, "frames as Hub Image structs (8-bit grayscale PNG)")

REJECTION_COLUMNS: list[Column] = [
    Column("case_id", pa.string(), False, "case id (or the invalid folder name)"),
    Column("organ", pa.string(), True, "organ of the rejected row; null when the whole case is rejected"),
    Column(
        "step",
        pa.string(),
        False,
        "discover | metadata | load | labels | frames | curate (a case_timeout) | fetch, archive (a Hub part)",
    ),
    Column("reason", pa.string(), False, "reason code (emrl_data.outcome.RejectReason)"),
    Column("detail", pa.string(), False, "message naming the file and the problem"),
    Column("path", pa.string(), True, "offending file, relative to the atlas root"),
    *SOURCE_COLUMN_LIST,
]


def _hub_feature(arrow_type: pa.DataType) -> dict[str, Any]:
    """Return the `datasets` feature JSON for an arrow type (Image for the image struct)."""
    if arrow_type == IMAGE_STRUCT:
        return {"_type": "Image"}
    if pa.types.is_list(arrow_type):
        return {"_type": "List", "feature": _hub_feature(arrow_type.value_type)}
    names = {
        pa.string(): "string",
        pa.bool_(): "bool",
        pa.int32(): "int32",
        pa.int64(): "int64",
        pa.float64(): "float64",
        pa.float32(): "float32",
    }
    return {"_type": "Value", "dtype": names[arrow_type]}


def make_schema(columns: Sequence[tuple[str, pa.DataType, bool, str]]) -> pa.Schema:
    """Build a pyarrow schema whose metadata carries the Hub features (key `huggingface` -> `info` -> `features`).

    Fields are nullable and carry no field metadata on purpose: `datasets` applies the Hub features only when each
    field equals the one it derives from them (`datasets` decodes a column as `Image()` from the schema's `huggingface` metadata, key `info`, or from the card). Required columns are enforced by
    `check_required` before writing instead, and described in `schemas/*.schema.json`.
    """
    fields = [pa.field(n, t) for n, t, _, _ in columns]
    features = {n: _hub_feature(t) for n, t, _, _ in columns}
    return pa.schema(fields, metadata={"huggingface": json.dumps({"info": {"features": features}})})


def hub_features(schema: pa.Schema) -> dict[str, Any]:
    """Return the Hub features dict a schema made by `make_schema` carries."""
    return json.loads(schema.metadata[b"huggingface"])["info"]["features"]


HARD_COLUMNS: list[Column] = [
    Column(
        "hard_reasons",
        pa.list_(pa.string()),
        False,
        "why the row was chosen: existence | size | location | enhancement | k_hit | parse_failure",
    ),
    Column("hard_rank", pa.int32(), False, "rank within its organ by SFT reward, 1 = hardest"),
    Column("sft_prediction", pa.string(), False, "the SFT model's report"),
    Column("sft_reward", pa.float64(), False, "R of the SFT model's report (r_c not computed during mining)"),
]

# The organ-row columns a `predictions` row repeats: the row's key, the truth the scorer reads, the frame count.
PREDICTION_TRUTH_COLUMNS: tuple[str, ...] = tuple(
    c[0] for c in ORGAN_ROW_COLUMNS if c[0] in {"case_id", "split", "n_frames", *TRUTH_COLUMNS}
)

# A row is scored only when its inference succeeded, so every score column may be null.
PREDICTION_COLUMNS: list[Column] = [
    *(c for c in ORGAN_ROW_COLUMNS if c[0] in PREDICTION_TRUTH_COLUMNS),
    Column("prediction", pa.string(), True, "the model's report (null when inference failed)"),
    Column("inference_error", pa.string(), True, "why inference failed, null when it succeeded (then not scored)"),
    Column("model", pa.string(), False, "checkpoint path or endpoint model name"),
    *columns_of(ReportScore, nullable=True),
    Column("hard", pa.bool_(), True, "wrong existence, attribute or K-Hit (null when not scored)"),
    Column("hard_reasons", pa.list_(pa.string()), True, "why it is hard"),
]

TABLE_COLUMNS: dict[str, list[Column]] = {
    name: [Column(*c) for c in columns]  # a plain (name, type, nullable, doc) tuple is a Column too
    for name, columns in {
        "findings": ORGAN_ROW_COLUMNS,
        "sft": [*ORGAN_ROW_COLUMNS, FRAMES_COLUMN],
        "rejections": REJECTION_COLUMNS,
        "predictions": PREDICTION_COLUMNS,
        "rl_hardset": [*ORGAN_ROW_COLUMNS, FRAMES_COLUMN, *HARD_COLUMNS],
    }.items()
}
SCHEMAS: dict[str, pa.Schema] = {name: make_schema(cols) for name, cols in TABLE_COLUMNS.items()}
SFT_SCHEMA = SCHEMAS["sft"]


def column_descriptions(table: str) -> dict[str, str]:
    """Return column name -> description of a table (the dataset card's column descriptions)."""
    return {c.name: c.doc for c in TABLE_COLUMNS[table]}


def required_columns(table: str) -> list[str]:
    """Return the columns of `table` that may never be null."""
    return [n for n, _, nullable, _ in TABLE_COLUMNS[table] if not nullable]


def check_required(table: str, row: Mapping[str, Any]) -> None:
    """Raise ValueError naming the column when a required column of `table` is missing or null in `row`."""
    for name in required_columns(table):
        if row.get(name) is None:
            raise ValueError(f"{table}: column {name!r} is required but is null in row {row.get('case_id')!r}.")


def schema_to_json(table: str) -> dict[str, Any]:
    """Return a stable JSON description of a table's schema (what `schemas/*.schema.json` hold)."""
    return {
        "table": table,
        "fields": [
            {"name": n, "type": str(t), "nullable": nullable, "description": d}
            for n, t, nullable, d in TABLE_COLUMNS[table]
        ],
        "hub_features": hub_features(SCHEMAS[table]),
    }


def write_schemas(out_dir: Path) -> list[Path]:
    """Write `<table>.schema.json` for every table into `out_dir`; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in SCHEMAS:
        path = out_dir / f"{name}.schema.json"
        path.write_text(json.dumps(schema_to_json(name), indent=2, sort_keys=False) + "\n")
        paths.append(path)
    return paths


def main() -> None:
    """CLI: `python -m emrl_data.tables.records --write-schemas schemas/`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write-schemas", type=Path, required=True, metavar="DIR")
    args = parser.parse_args()
    for path in write_schemas(args.write_schemas):
        print(path)


if __name__ == "__main__":
    main()
