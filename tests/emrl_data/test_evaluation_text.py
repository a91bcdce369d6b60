"""Text metrics (BLEU-1..4, ROUGE-L, CIDEr-D) against values computed by hand on short strings."""

from __future__ import annotations

import math

import numpy as np
import pytest

from emrl_data.text.text_metrics import (
    _bleu,
    _row_statistics,
    cider_d,
    gold_sections,
    paired_text_differences,
    report_sections,
    text_metrics,
)


def _row(organ: str, findings: str, impression: str, gold_findings: str, gold_impression: str) -> dict:
    return {
        "organ": organ,
        "prediction": f"<findings>{findings}</findings> || <impression>{impression}</impression>",
        "findings": gold_findings,
        "impression": gold_impression,
    }


def test_bleu_and_rouge_l_of_one_row_are_the_hand_computed_values():
    # "a b c d" against "a b c e": n-gram precisions 3/4, 2/3, 1/2 and 0/1 (smoothed to 1/(2 x 1)), no brevity penalty.
    # BLEU-n is their geometric mean over orders 1..n; ROUGE-L: LCS "a b c" = 3 of 4 tokens either way, F = 3/4.
    got = text_metrics([_row("liver", "A b C d", "x y", "a b c e", "x y")], n_bootstrap=0)
    findings = got.cells["findings"]["liver"]
    expected = {
        "bleu1": 0.75,
        "bleu2": math.sqrt(0.75 * 2 / 3),
        "bleu3": (0.75 * 2 / 3 * 0.5) ** (1 / 3),
        "bleu4": (0.75 * 2 / 3 * 0.5 * 0.5) ** (1 / 4),
        "rouge_l": 0.75,
    }
    assert {m: findings[m][0] for m in expected} == pytest.approx(expected)
    assert math.isnan(findings["bleu1"][1])  # no replicates, no interval
    impression = got.cells["impression"]["liver"]  # identical two-word impressions: no trigram, BLEU-3 = 0
    assert [impression[m][0] for m in ("bleu1", "bleu2", "bleu3", "rouge_l")] == pytest.approx([1.0, 1.0, 0.0, 1.0])
    assert got.cells["findings"]["all"] == findings


def test_bleu_from_summed_statistics_is_corpus_bleu_with_a_brevity_penalty():
    # Two rows pooled: hypothesis 2 + 3 tokens, references 3 + 3: BP = exp(1 - 6/5); unigram precision 4/5.
    stats = _row_statistics(["a b", "c d e"], ["a b f", "c d x"]).sum(axis=0)
    assert _bleu(stats, 1) == pytest.approx(math.exp(1 - 6 / 5) * 4 / 5)
    assert _bleu(stats, 2) == pytest.approx(math.exp(1 - 6 / 5) * math.sqrt(4 / 5 * 2 / 3))


def test_cider_d_is_the_hand_computed_tf_idf_consensus():
    # References "a b" and "c d": every reference n-gram has df 1, idf log 2 (an unseen n-gram too: df clipped to 1).
    # Row 1 equals its reference: cosine 1 for unigrams and bigrams, no trigram: 10 x (1 + 1 + 0 + 0) / 4 = 5.
    # Row 2 "c x": unigram vectors (c, x) and (c, d) share c: 1/2; bigram "c x" vs "c d": 0 -> 10 x 0.5 / 4 = 1.25.
    assert cider_d(["a b", "c x"], ["a b", "c d"]).tolist() == pytest.approx([5.0, 1.25])
    # The length penalty: "a b" against "a b z z z z z z" (delta -6) scores exp(-36 / 72) of the clipped cosine.
    score = cider_d(["a b", "q"], ["a b z z z z z z", "q r"])[0]
    # Unigrams (a, b) vs (a, b, 6 z): 2 / (sqrt 2 sqrt 38); bigram "a b" vs ("a b", "b z", 5 "z z"): 1 / sqrt 27.
    unpenalised = 10 * (2 / (math.sqrt(2) * math.sqrt(38)) + 1 / math.sqrt(27)) / 4
    assert score == pytest.approx(unpenalised * math.exp(-0.5))


def test_per_organ_and_overall_cells_and_intervals():
    rows = [_row("liver", "a b c d", "m", "a b c d", "m")] * 3 + [_row("kidney", "p q", "n", "r s", "n")] * 2
    got = text_metrics(rows, n_bootstrap=200, seed=0)
    assert got.counts == {"liver": 3, "kidney": 2, "all": 5}
    assert list(got.cells["findings"]) == ["liver", "kidney", "all"]
    liver, kidney = got.cells["findings"]["liver"], got.cells["findings"]["kidney"]
    assert liver["bleu4"] == pytest.approx((1.0, 1.0, 1.0)) and liver["rouge_l"] == (1.0, 1.0, 1.0)
    assert kidney["bleu1"] == (0.0, 0.0, 0.0) and kidney["rouge_l"] == (0.0, 0.0, 0.0)
    assert got.cells["findings"]["all"]["rouge_l"] == pytest.approx((0.6, 0.6, 0.6))  # strata keep their sizes
    json_cells = got.to_json()["sections"]["impression"]["all"]["rouge_l"]
    assert json_cells == {"value": 1.0, "ci_low": 1.0, "ci_high": 1.0}
    assert "#### Text metrics, findings" in got.to_markdown()


def test_sections_are_read_as_the_parser_reads_them_and_the_gold_from_the_sft_columns_or_the_report():
    assert report_sections("FINDINGS: Liver is normal.\nIMPRESSION: No tumor.") == ("liver is normal.", "no tumor.")
    assert report_sections(None) == ("", "")
    assert gold_sections({"findings": "A  B", "impression": "C"}) == ("a b", "c")
    assert gold_sections({"report": "<findings>x</findings> || <impression>y</impression>"}) == ("x", "y")
    with pytest.raises(ValueError, match="need the gold report"):
        gold_sections({"organ": "liver"})
    with pytest.raises(ValueError, match="no row"):
        text_metrics([])


def test_an_empty_prediction_scores_zero():
    got = text_metrics([_row("liver", "", "", "a b c", "d e")], n_bootstrap=0)
    assert all(v[0] == 0.0 for v in got.cells["findings"]["liver"].values())
    assert np.isfinite([v[0] for v in got.cells["impression"]["all"].values()]).all()


def _keyed(rows: list[dict]) -> list[dict]:
    return [r | {"case_id": f"BDMAP_{i:08d}"} for i, r in enumerate(rows)]


def test_paired_text_differences_are_the_difference_of_the_two_models_metrics_with_a_paired_interval():
    gold = [("a b c d e", "m n"), ("p q r s", "x y z")] * 5
    copy = _keyed([_row("liver", f, i, f, i) for f, i in gold])
    worse = _keyed([_row("liver", "a b c" if k % 2 == 0 else f, i, f, i) for k, (f, i) in enumerate(gold)])
    same = paired_text_differences(copy, [dict(r) for r in copy], n_bootstrap=200, seed=0)
    assert all(v == (0.0, 0.0, 0.0) for s in same.cells.values() for o in s.values() for v in o.values())
    diff = paired_text_differences(copy, worse, names=("sft", "grpo"), n_bootstrap=200, seed=0)
    a, b = text_metrics(copy, n_bootstrap=0), text_metrics(worse, n_bootstrap=0)
    for metric in ("bleu1", "bleu4", "rouge_l", "cider_d"):
        expected = b.cells["findings"]["liver"][metric][0] - a.cells["findings"]["liver"][metric][0]
        value, low, high = diff.cells["findings"]["liver"][metric]
        assert value == pytest.approx(expected) and value < 0 and low <= value <= high
    # ROUGE-L: "a b c" against "a b c d e" is F = 2 x 1 x 3/5 / (1 + 3/5) = 3/4 on half the rows: mean -1/8.
    assert diff.cells["findings"]["liver"]["rouge_l"][0] == pytest.approx(-0.125)
    assert diff.cells["impression"]["all"]["bleu1"] == (0.0, 0.0, 0.0)
    assert "#### Text metrics, findings: grpo − sft" in diff.to_markdown()
    assert diff.to_json()["difference"] == "grpo − sft"
