"""`emrl eval A B --out DIR`: paired differences, text metrics and the results card, on constructed prediction tables."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import polars as pl
import pytest

from cli.main import main
from emrl_data.text.report import render_evidence, render_findings, render_impression, render_report
from emrl_data.text.results_card import check_comparable, read_card
from emrl_data.types import Organ


N_POS, N_NEG, MISSED = 12, 12, 6


def _truth(i: int) -> dict:
    if i < N_POS:
        return {
            "case_id": f"BDMAP_{i:08d}",
            "organ": "liver",
            "split": "test",
            "has_lesion": True,
            "long_axis_mm": 30.0,
            "location": ["5"],
            "attenuation": "hypo",
            "key_slice_frame": 7,
        }
    return {
        "case_id": f"BDMAP_{i:08d}",
        "organ": "liver",
        "split": "test",
        "has_lesion": False,
        "long_axis_mm": None,
        "location": [],
        "attenuation": None,
        "key_slice_frame": None,
    }


def _sections(positive: bool) -> tuple[str, str]:
    if not positive:
        return render_findings(Organ.LIVER, has_lesion=False), render_impression(Organ.LIVER, has_lesion=False)
    kwargs = dict(has_lesion=True, lesion_count=1, long_axis_mm=30.0, location=["5"], attenuation="hypo")
    return render_findings(Organ.LIVER, short_axis_mm=20.0, volume_mm3=5000.0, **kwargs), render_impression(
        Organ.LIVER, **kwargs
    )


def _report(positive: bool) -> str:
    findings, impression = _sections(positive)
    return render_report(findings, impression, render_evidence(7, [1, 2, 30, 40]) if positive else None)


def _tables(root: Path, names: tuple[str, str] = ("sft", "grpo")) -> tuple[Path, Path, Path]:
    """An sft table (gold findings and impression, its manifest) and two models' predictions tables naming it: the
    reference reports every row as the gold does; the other misses the first MISSED lesions."""
    n = N_POS + N_NEG
    sft = root / "sft"
    (sft / "data").mkdir(parents=True)
    gold = [_truth(i) | dict(zip(("findings", "impression"), _sections(i < N_POS), strict=True)) for i in range(n)]
    pl.DataFrame(gold).write_parquet(sft / "data" / "test-00000-of-00001.parquet")
    (sft / "manifest.json").write_text(json.dumps({"files": {"data/test-00000-of-00001.parquet": {}}}))
    folders = []
    for index, (model, missed) in enumerate(zip(names, (0, MISSED), strict=True)):
        folder = root / f"run-{index}" / "predictions"
        (folder / "data").mkdir(parents=True)
        rows = [_truth(i) | {"model": model, "prediction": _report(i < N_POS and i >= missed)} for i in range(n)]
        pl.DataFrame(rows).write_parquet(folder / "data" / "test-00000-of-00001.parquet")
        (folder / "manifest.json").write_text(json.dumps({"sft_dir": str(sft), "files": {}}))
        folders.append(folder)
    return sft, folders[0], folders[1]


def test_eval_of_two_models_prints_and_writes_their_paired_differences_and_text_metrics(tmp_path, capsys):
    sft, reference, other = _tables(tmp_path)
    out = tmp_path / "eval"
    main(["eval", str(reference), str(other), "--out", str(out), "--bootstrap", "400", "--text-metrics"])
    printed = capsys.readouterr().out
    assert "## Paired differences against sft" in printed and "### grpo − sft" in printed
    assert "24 paired rows" in printed and "#### Text metrics, findings" in printed

    card = read_card(out)
    assert card["models"] == ["sft", "grpo"] and card["split"] == "all"
    assert card["dataset"]["version"] == hashlib.sha256((sft / "manifest.json").read_bytes()).hexdigest()
    assert card["dataset"]["rows"] == N_POS + N_NEG
    (paired,) = card["paired_differences"]
    sen = paired["table1"]["liver"]["sen"]
    assert sen["diff"] == pytest.approx(-MISSED / N_POS) and sen["ci_high"] < 0 and sen["n"] == N_POS
    assert paired["table1"]["liver"]["spec"] == {"diff": 0.0, "ci_low": 0.0, "ci_high": 0.0, "n": N_NEG}
    assert paired["average_bacc"]["diff"] == pytest.approx(-MISSED / N_POS / 2)
    assert paired["rows"] == {"paired": 24, "reference_only": 0, "model_only": 0}
    assert card["evaluations"]["sft"]["table1"]["liver"]["sen"]["value"] == 1.0
    # The reference copies the gold sections word for word: every text metric is perfect, and CIDEr-D is > 0.
    reference_text = card["text_metrics"]["sft"]["sections"]["findings"]["all"]
    assert [reference_text[m]["value"] for m in ("bleu1", "bleu4", "rouge_l")] == pytest.approx([1.0, 1.0, 1.0])
    missed_text = card["text_metrics"]["grpo"]["sections"]["findings"]["liver"]
    assert missed_text["bleu4"]["value"] < 1.0
    assert (out / "model-1" / "metrics.json").is_file() and (out / "model-2" / "metrics.png").is_file()
    assert "| grpo | model-2 | 24 |" in (out / "metrics.md").read_text()
    check_comparable(card, read_card(out / "model-1" / "metrics.json"))  # the same rows: comparable
    assert read_card(out / "model-2")["models"] == ["grpo"]
    (text_paired,) = card["text_paired_differences"]
    assert text_paired["difference"] == "grpo − sft"
    assert text_paired["sections"]["findings"]["liver"]["bleu4"]["ci_high"] < 0
    assert "## Text metrics, paired: grpo − sft" in (out / "metrics.md").read_text()


def test_two_runs_of_one_checkpoint_stay_two_models(tmp_path, capsys):
    _, first, second = _tables(tmp_path, names=("runs/sft", "runs/sft"))
    main(["eval", str(first), str(second), "--out", str(tmp_path / "eval"), "--bootstrap", "100"])
    card = read_card(tmp_path / "eval")
    assert card["models"] == ["runs/sft", f"runs/sft [{second}]"]
    assert card["paired_differences"][0]["table1"]["liver"]["sen"]["diff"] == pytest.approx(-MISSED / N_POS)


def test_text_metrics_without_gold_reports_are_refused_in_one_line(tmp_path, capsys):
    _, reference, _ = _tables(tmp_path)
    (reference / "manifest.json").write_text(json.dumps({"files": {}}))  # names no sft table
    with pytest.raises(SystemExit):
        main(["eval", str(reference), "--out", str(tmp_path / "eval"), "--text-metrics"])
    assert "--text-metrics needs the gold reports" in capsys.readouterr().err


def test_an_earlier_evaluation_is_compared_only_on_the_same_rows(tmp_path, capsys):
    _, reference, other = _tables(tmp_path)
    main(["eval", str(reference), "--out", str(tmp_path / "first"), "--bootstrap", "50"])
    main(
        [
            "eval",
            str(other),
            "--out",
            str(tmp_path / "second"),
            "--bootstrap",
            "50",
            "--against",
            str(tmp_path / "first"),
        ]
    )
    printed = capsys.readouterr().out
    assert f"## Against {tmp_path / 'first'} (the same rows)" in printed
    assert "| sft | 100.00 / n/a |" in printed and "| grpo | n/a / 75.00 |" in printed  # B-Acc 1 - 6/12/2
    (tmp_path / "subset").mkdir()
    pl.read_parquet(other / "data" / "test-00000-of-00001.parquet").head(10).write_parquet(
        tmp_path / "subset" / "p.parquet"
    )
    with pytest.raises(SystemExit):
        main(
            ["eval", str(tmp_path / "subset"), "--out", str(tmp_path / "third"), "--against", str(tmp_path / "first")]
        )
    err = capsys.readouterr().err
    assert "cannot compare the evaluation of grpo with that of sft: they were not made on the same rows" in err
    assert "(10 rows) vs" in err and "(24 rows)" in err
    assert not (tmp_path / "third" / "metrics.json").exists()  # refused before anything is written
