"""Table schemas: one explicit pyarrow schema per table (SPEC §8), with the Hub `features` each carries.

The schemas are the interface: `sft` column names are the keyword arguments the GRPO rewards receive and the
arguments the shared scorer takes. `schemas/*.schema.json` are generated from here
(`python -m emrl_data.records --write-schemas schemas/`) and a test checks they are up to date.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa


IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
_INT_LIST = pa.list_(pa.int32())

# (name, arrow type, nullable, description). Order is the column order of the tables.
ORGAN_ROW_COLUMNS: list[tuple[str, pa.DataType, bool, str]] = [
    ("case_id", pa.string(), False, "BDMAP_ + 8 digits"),
    ("organ", pa.string(), False, "liver | pancreas | kidney"),
    ("split", pa.string(), False, "train | test (IID split files, else case-id hash)"),
    ("has_lesion", pa.bool_(), False, ">= 1 lesion component survives the noise filter"),
    ("lesion_count", pa.int32(), False, "26-connected components >= min_lesion_volume_mm3"),
    ("long_axis_mm", pa.float64(), True, "largest lesion: longest axial Feret diameter over its slices"),
    ("short_axis_mm", pa.float64(), True, "largest lesion: extent perpendicular to the long axis on that slice"),
    ("volume_mm3", pa.float64(), True, "largest lesion volume"),
    ("total_lesion_volume_mm3", pa.float64(), False, "all surviving lesion components"),
    ("organ_volume_mm3", pa.float64(), False, "organ mask volume"),
    ("location", pa.list_(pa.string()), False, "sub-structures with > 10 % of the lesion's labelled voxels, sorted"),
    ("attenuation", pa.string(), True, "hypo | iso | hyper vs parenchyma mean +- SD/10 (RadGPT)"),
    ("lesion_mean_hu", pa.float64(), True, "largest lesion mean HU"),
    ("parenchyma_mean_hu", pa.float64(), False, "organ minus all lesions, mean HU"),
    ("parenchyma_sd_hu", pa.float64(), False, "organ minus all lesions, SD of HU"),
    ("key_slice_z_vox", pa.int32(), True, "canonical z of the max cross-sectional area slice (ties: lowest z)"),
    ("max_diameter_z_vox", pa.int32(), True, "canonical z of the longest-diameter slice (RadGPT's 'image')"),
    ("bbox_xyxy_vox", _INT_LIST, True, "largest lesion box on the key slice, canonical voxels, half-open"),
    ("lesion_box_xyzxyz_vox", _INT_LIST, True, "largest lesion 3-D box, canonical voxels, half-open"),
    ("organ_box_xyzxyz_vox", _INT_LIST, False, "organ 3-D box, canonical voxels, half-open"),
    ("spacing_mm", pa.list_(pa.float64()), False, "voxel spacing in canonical (x, y, z) order"),
    ("shape_vox", _INT_LIST, False, "CT shape in canonical (x, y, z) order"),
    ("frame_z_vox", _INT_LIST, False, "canonical z of every frame, frames 1..N inferior -> superior"),
    ("n_frames", pa.int32(), False, "number of frames"),
    ("key_slice_frame", pa.int32(), True, "1-based frame number of the key slice"),
    ("crop_xyxy_vox", _INT_LIST, False, "in-plane square crop rendered into every frame, canonical voxels"),
    ("bbox_xyxy_px", _INT_LIST, True, "key-slice box in frame pixels, half-open"),
    ("bbox_qwen", _INT_LIST, True, "the same box on Qwen3-VL's 0-1000 grid (used in the report)"),
    ("findings", pa.string(), False, "findings text"),
    ("impression", pa.string(), False, "impression text"),
    ("report", pa.string(), False, "target report in the E-MRL format"),
    ("prompt", pa.string(), False, "user prompt of the row"),
    ("atlas_lesion_count", pa.int32(), True, "metadata CSV: number of lesion instances"),
    ("atlas_long_axis_cm", pa.float64(), True, "metadata CSV: largest lesion diameter (cm)"),
    ("atlas_location", pa.list_(pa.string()), True, "metadata CSV: largest lesion location"),
    ("atlas_attenuation", pa.string(), True, "metadata CSV: largest lesion attenuation"),
    ("atlas_organ_volume_cm3", pa.float64(), True, "metadata CSV: organ volume"),
    ("atlas_agreement", pa.bool_(), True, "our labels agree with the CSV (null: no CSV row)"),
    ("warnings", pa.list_(pa.string()), False, "non-fatal problems met while loading the case"),
    (
        "lesion_files",
        pa.list_(pa.string()),
        False,
        "mask files whose union is the lesion mask: <organ>_lesion, else its *_tumor/*_cyst files; [] = none",
    ),
    (
        "qa_flags",
        pa.list_(pa.string()),
        False,
        "plausibility flags, never a rejection: organ_volume_low | organ_volume_high | unrecognised_lesion_file",
    ),
    ("pipeline_version", pa.string(), False, "emrl_data version that produced the row"),
    ("config_fingerprint", pa.string(), False, "fingerprint of the curation config"),
]

FRAMES_COLUMN: tuple[str, pa.DataType, bool, str] = (
    "frames",
    pa.list_(IMAGE_STRUCT),
    False,
    "frames as Hub Image structs (8-bit grayscale PNG)",
)

REJECTION_COLUMNS: list[tuple[str, pa.DataType, bool, str]] = [
    ("case_id", pa.string(), False, "case id (or the invalid folder name)"),
    ("organ", pa.string(), True, "organ of the rejected row; null when the whole case is rejected"),
    ("step", pa.string(), False, "discover | metadata | load | labels | frames"),
    ("reason", pa.string(), False, "reason code (emrl_data.outcome.RejectReason)"),
    ("detail", pa.string(), False, "message naming the file and the problem"),
    ("path", pa.string(), True, "offending file, relative to the atlas root"),
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


def make_schema(columns: list[tuple[str, pa.DataType, bool, str]]) -> pa.Schema:
    """Build a pyarrow schema whose metadata carries the Hub features (key `huggingface` -> `info` -> `features`).

    Fields are nullable and carry no field metadata on purpose: `datasets` applies the Hub features only when each
    field equals the one it derives from them (notes/prefect_hub.md §4.3). Required columns are enforced by
    `check_required` before writing instead, and described in `schemas/*.schema.json`.
    """
    fields = [pa.field(n, t) for n, t, _, _ in columns]
    features = {n: _hub_feature(t) for n, t, _, _ in columns}
    return pa.schema(fields, metadata={"huggingface": json.dumps({"info": {"features": features}})})


def hub_features(schema: pa.Schema) -> dict[str, Any]:
    """Return the Hub features dict a schema made by `make_schema` carries."""
    return json.loads(schema.metadata[b"huggingface"])["info"]["features"]


HARD_COLUMNS: list[tuple[str, pa.DataType, bool, str]] = [
    (
        "hard_reasons",
        pa.list_(pa.string()),
        False,
        "why the row was chosen: existence | size | location | enhancement | k_hit | parse_failure",
    ),
    ("hard_rank", pa.int32(), False, "rank within its organ by SFT reward, 1 = hardest"),
    ("sft_prediction", pa.string(), False, "the SFT model's report"),
    ("sft_reward", pa.float64(), False, "R of the SFT model's report (r_c not computed during mining)"),
]

PREDICTION_COLUMNS: list[tuple[str, pa.DataType, bool, str]] = [
    ("case_id", pa.string(), False, "case id"),
    ("organ", pa.string(), False, "liver | pancreas | kidney"),
    ("split", pa.string(), False, "train | test"),
    ("has_lesion", pa.bool_(), False, "truth"),
    ("long_axis_mm", pa.float64(), True, "truth"),
    ("location", pa.list_(pa.string()), False, "truth"),
    ("attenuation", pa.string(), True, "truth"),
    ("key_slice_frame", pa.int32(), True, "truth, 1-based frame"),
    ("n_frames", pa.int32(), False, "frames shown to the model"),
    ("prediction", pa.string(), True, "the model's report (null when inference failed)"),
    ("inference_error", pa.string(), True, "why inference failed, null when it succeeded"),
    ("model", pa.string(), False, "checkpoint path or endpoint model name"),
    ("parse_failure", pa.string(), True, "parser failure reason"),
    ("score_existence", pa.float64(), True, "existence correct (0/1)"),
    ("score_size", pa.float64(), True, "size correct (0/1), null on true negatives"),
    ("score_location", pa.float64(), True, "location correct (0/1), null on true negatives"),
    ("score_enhancement", pa.float64(), True, "enhancement correct (0/1), null on true negatives"),
    ("score_k_hit", pa.float64(), True, "key slice within +-1 frame (0/1), null on true negatives"),
    ("r_e", pa.float64(), True, "existence reward"),
    ("r_f", pa.float64(), True, "findings reward"),
    ("reward", pa.float64(), True, "R (r_c not computed during mining)"),
    ("pred_has_lesion", pa.bool_(), True, "parsed claim"),
    ("pred_long_axis_cm", pa.float64(), True, "parsed long axis"),
    ("pred_location", pa.list_(pa.string()), True, "parsed location"),
    ("pred_attenuation", pa.string(), True, "parsed attenuation"),
    ("pred_key_slice", pa.int32(), True, "parsed key frame"),
    ("pred_bbox", _INT_LIST, True, "parsed box (0-1000 grid)"),
    ("hard", pa.bool_(), True, "wrong existence, attribute or K-Hit"),
    ("hard_reasons", pa.list_(pa.string()), True, "why it is hard"),
]

TABLE_COLUMNS: dict[str, list[tuple[str, pa.DataType, bool, str]]] = {
    "findings": ORGAN_ROW_COLUMNS,
    "sft": [*ORGAN_ROW_COLUMNS, FRAMES_COLUMN],
    "rejections": REJECTION_COLUMNS,
    "predictions": PREDICTION_COLUMNS,
    "rl_hardset": [*ORGAN_ROW_COLUMNS, FRAMES_COLUMN, *HARD_COLUMNS],
}
SCHEMAS: dict[str, pa.Schema] = {name: make_schema(cols) for name, cols in TABLE_COLUMNS.items()}
FINDINGS_SCHEMA = SCHEMAS["findings"]
SFT_SCHEMA = SCHEMAS["sft"]
REJECTIONS_SCHEMA = SCHEMAS["rejections"]


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
    """CLI: `python -m emrl_data.records --write-schemas schemas/`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write-schemas", type=Path, required=True, metavar="DIR")
    args = parser.parse_args()
    for path in write_schemas(args.write_schemas):
        print(path)


if __name__ == "__main__":
    main()
