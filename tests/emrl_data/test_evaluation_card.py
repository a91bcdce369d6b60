"""The results card: what it records, and its refusal to compare evaluations made on different rows or shards."""

from __future__ import annotations

import hashlib
import json

import pytest

from emrl_data.text.results_card import (
    PARSER_VERSION,
    CardMismatch,
    check_comparable,
    dataset_source,
    make_card,
    read_card,
    rows_digest,
)


def _rows(n: int, start: int = 0) -> list[dict]:
    return [
        {
            "case_id": f"BDMAP_{i:08d}",
            "organ": "liver",
            "split": "test",
            "has_lesion": i % 2 == 0,
            "long_axis_mm": 20.0 if i % 2 == 0 else None,
        }
        for i in range(start, start + n)
    ]


def _tables(tmp_path, name: str, shard: bytes) -> tuple:
    """An sft table folder (one shard, its manifest) and a predictions folder whose manifest names it."""
    sft = tmp_path / name / "sft"
    (sft / "data").mkdir(parents=True)
    (sft / "data" / "test-00000-of-00001.parquet").write_bytes(shard)
    digest = {"data/test-00000-of-00001.parquet": {"sha256": name, "bytes": len(shard)}}
    (sft / "manifest.json").write_text(json.dumps({"files": digest}))
    predictions = tmp_path / name / "predictions"
    (predictions / "data").mkdir(parents=True)
    (predictions / "manifest.json").write_text(json.dumps({"sft_dir": str(sft), "files": {}}))
    return sft, predictions


def _card(tmp_path, name: str, shard: bytes, rows: list[dict], split: str = "test") -> dict:
    _, predictions = _tables(tmp_path, name, shard)
    return make_card(
        models=[f"{name}-model"], split=split, sources=[dataset_source(predictions)], rows=rows, evaluations={}
    )


def test_the_card_records_models_dataset_version_split_parser_and_rows(tmp_path):
    sft, predictions = _tables(tmp_path, "v1", b"shard")
    rows = _rows(4)
    card = make_card(
        models=["sft", "grpo"],
        split="test",
        sources=[dataset_source(predictions)] * 2,
        rows=rows,
        evaluations={"sft": {"average_bacc": {"value": 0.5}}},
    )
    assert card["models"] == ["sft", "grpo"] and card["split"] == "test" and card["parser_version"] == PARSER_VERSION
    assert card["dataset"]["version"] == hashlib.sha256((sft / "manifest.json").read_bytes()).hexdigest()
    assert card["dataset"]["rows"] == 4 and card["dataset"]["rows_digest"] == rows_digest(list(reversed(rows)))
    assert card["dataset"]["sources"][0]["sft_dir"] == str(sft)
    assert card["evaluations"]["sft"]["average_bacc"]["value"] == 0.5
    (tmp_path / "metrics.json").write_text(json.dumps(card))
    assert read_card(tmp_path) == card


def test_two_evaluations_on_the_same_rows_and_shards_are_comparable(tmp_path):
    a = _card(tmp_path / "a", "v1", b"same shard", _rows(6))
    b = _card(tmp_path / "b", "v1", b"same shard", _rows(6))
    check_comparable(a, b)  # no error


def test_the_card_refuses_a_comparison_across_different_shards(tmp_path):
    a = _card(tmp_path, "v1", b"shard of version 1", _rows(6))
    b = _card(tmp_path, "v2", b"shard of version 2", _rows(6))
    with pytest.raises(
        CardMismatch,
        match=r"v1-model with that of v2-model: they were not made on the same rows "
        r"\(dataset version [0-9a-f]{12} vs [0-9a-f]{12} \(the sft shards differ\)\)$",
    ):
        check_comparable(a, b)


def test_the_card_refuses_other_rows_another_split_or_parser_in_one_error(tmp_path):
    a = _card(tmp_path / "a", "v1", b"shard", _rows(6))
    b = _card(tmp_path / "b", "v1", b"shard", _rows(5, start=1), split="all")
    b["parser_version"] = PARSER_VERSION + 1
    with pytest.raises(CardMismatch) as caught:
        check_comparable(a, b)
    message = str(caught.value)
    assert "(6 rows) vs" in message and "(5 rows)" in message
    assert f"split test vs all; parser version {PARSER_VERSION} vs {PARSER_VERSION + 1}" in message


def test_models_predicted_on_different_sft_tables_cannot_share_a_card(tmp_path):
    _, one = _tables(tmp_path, "v1", b"one")
    _, two = _tables(tmp_path, "v2", b"two")
    with pytest.raises(CardMismatch, match="different sft tables"):
        make_card(
            models=["a", "b"],
            split="all",
            sources=[dataset_source(one), dataset_source(two)],
            rows=_rows(2),
            evaluations={},
        )


def test_a_constructed_predictions_file_has_no_dataset_version_and_a_non_card_is_refused(tmp_path):
    file = tmp_path / "preds.jsonl"
    file.write_text("{}\n")
    assert dataset_source(file) == {
        "path": str(file),
        "manifest_sha256": None,
        "sft_dir": None,
        "sft_manifest_sha256": None,
    }
    (tmp_path / "metrics.json").write_text(json.dumps({"table1": {}}))
    with pytest.raises(ValueError, match="metrics.json: not a results card"):
        read_card(tmp_path / "metrics.json")
