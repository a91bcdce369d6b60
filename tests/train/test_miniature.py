"""The miniature end to end at toy size (every stage, the more-SFT controls, resume) and its seed summary."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from train.freeze import parameter_group
from train.miniature.config import MiniatureConfig
from train.miniature.run_report import claim_check
from train.miniature.runs import MODELS
from train.miniature.seeds import seeds_markdown, summarize_seeds
from train.miniature.study import STAGES, Miniature, main, more_sft_steps


def _model(bacc, khit, half=(0.05, 0.1)):
    return {
        "label": "m",
        "average_bacc": {"value": bacc, "ci_low": bacc - half[0], "ci_high": bacc + half[0]},
        "k_hit": {"value": khit, "ci_low": khit - half[1], "ci_high": khit + half[1]},
    }


def test_more_sft_steps_see_as_many_rows_as_grpo_prompts():
    assert more_sft_steps(MiniatureConfig(grpo_steps=60, grpo_prompts_per_step=8, sft_batch_size=4)) == 120
    assert more_sft_steps(MiniatureConfig(grpo_steps=7, grpo_prompts_per_step=3, sft_batch_size=4)) == 6  # 21 / 4 up


def test_claim_check_against_more_sft():
    base = {"sft": _model(0.6, 0.3), "grpo_a": _model(0.8, 0.5), "grpo_c": _model(0.6, 0.3)}
    claim = claim_check(base | {"more_sft": _model(0.7, 0.45), "more_sft_llm": _model(0.75, 0.2)})
    assert claim["average_bacc: (a) - more_sft"]["gap"] == pytest.approx(0.1)  # beyond 0.05
    assert claim["average_bacc: (a) - more_sft_llm"]["beyond_interval"] is False  # +0.05, not beyond 0.05
    assert claim["k_hit: (a) - more_sft"]["beyond_interval"] is False  # +0.05 < 0.10
    assert claim["k_hit: (a) - more_sft_llm"]["beyond_interval"] is True  # +0.30
    assert claim["claim_holds"] is True
    assert claim["beats_more_sft"] is False  # no one metric beats both (d) and (e)
    both = claim_check(base | {"more_sft": _model(0.6, 0.3), "more_sft_llm": _model(0.7, 0.35)})
    assert both["beats_more_sft"] is True  # B-Acc +0.2 and +0.1, both beyond 0.05


def test_seed_summary_gaps_means_and_counts():
    def run(a_khit, sft_khit):
        models = {"sft": _model(0.6, sft_khit), "grpo_a": _model(0.7, a_khit), "grpo_c": _model(0.6, sft_khit)}
        return {"models": models, "claim": claim_check(models)}

    summary = summarize_seeds({0: run(0.5, 0.3), 1: run(0.35, 0.3), 2: run(0.2, 0.4)})
    k = summary["comparisons"]["k_hit: (a) - sft"]
    assert k["gaps"] == pytest.approx({0: 0.2, 1: 0.05, 2: -0.2})
    assert (k["mean_gap"], k["min_gap"], k["max_gap"]) == pytest.approx((0.05 / 3, -0.2, 0.2))
    assert (k["n_beyond"], k["n_seeds"]) == (1, 3)
    assert summary["comparisons"]["average_bacc: (a) - grpo_c"]["n_beyond"] == 3  # +0.1 > 0.05 in each seed
    assert summary["flags"]["claim_holds"] == {0: True, 1: True, 2: True}
    assert summary["values"]["grpo_a"]["k_hit"] == {0: 0.5, 1: 0.35, 2: 0.2}
    md = seeds_markdown(summary)
    assert "| m | K-Hit | 50.0 | 35.0 | 20.0 | 35.0 |" in md
    assert "| k_hit: (a) - sft | +20.0 | +5.0 | -20.0 | +1.7 | 1 of 3 |" in md
    assert "- claim ((a) beats SFT and (c)): 3 of 3 seeds" in md
    assert "(a) beats (d) and (e)" not in md  # neither ran


TOY = {
    "n_train": 8,
    "n_test": 4,
    "n_frames": 4,
    "size_px": 32,
    "organs": ["kidney"],
    "min_test_rows_per_class": 1,
    "warmup_max_steps": 2,
    "warmup_eval_every": 2,
    "warmup_val_rows": 2,
    "warmup_target_parse_rate": 0.0,
    "warmup_target_sampled_parse_rate": 0.0,
    "sft_steps": 2,
    "sft_batch_size": 2,
    "grpo_steps": 1,
    "grpo_prompts_per_step": 2,
    "num_generations": 2,
    "max_completion_length": 8,
    "verifier_max_new_tokens": 4,
    "eval_max_new_tokens": 8,
    "n_bootstrap": 40,
    "warmup_target_verifier_accuracy": 0.0,
    "verifier_eval_frames": 4,
    "lesion_span": 1,
}


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("miniature")
    lines: list[str] = []
    Miniature(MiniatureConfig(**TOY), out, log=lines.append).run()
    return out, lines


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def _changed_groups(before, after):
    return {parameter_group(k) for k in before if not torch.equal(before[k], after[k])}


@pytest.mark.slow
def test_every_stage_finishes_and_results_hold_every_model(toy_run):
    out, _ = toy_run
    assert all((out / s / "done.json").exists() for s in STAGES)
    results = json.loads((out / "results.json").read_text())
    assert (
        list(results["models"])
        == MiniatureConfig().models
        == [m for m in MODELS if m not in ("grpo_f", "grpo_g", "grpo_h")]
    )
    assert set(results["claim"]) >= {"k_hit: (a) - more_sft", "k_hit: (a) - more_sft_llm", "beats_more_sft"}
    assert isinstance(results["claim"]["beats_more_sft"], bool)
    assert "(e) more SFT, LLM+projector" in (out / "results.md").read_text()
    for stage, freezing in (("more_sft", "sft"), ("more_sft_llm", "grpo")):
        done = json.loads((out / stage / "done.json").read_text())
        assert (done["steps"], done["start"], done["freezing"]) == (1, "sft", freezing)  # 1 x 2 prompts / 2 rows


@pytest.mark.slow
def test_more_sft_trains_its_own_parameter_groups(toy_run):
    out, _ = toy_run
    sft = _weights(out / "sft")
    assert _changed_groups(sft, _weights(out / "more_sft")) == {"vit", "projector"}  # the paper's SFT freezing
    assert _changed_groups(sft, _weights(out / "more_sft_llm")) == {"llm", "projector"}  # GRPO's freezing


@pytest.mark.slow
def test_a_rerun_skips_every_finished_stage(toy_run):
    out, _ = toy_run
    lines: list[str] = []
    Miniature(MiniatureConfig(**TOY), out, log=lines.append).run()
    assert [line.split(":")[0] for line in lines if line.startswith("==")] == [f"== {s}" for s in STAGES]
    assert all("done earlier" in line for line in lines if line.startswith("=="))


@pytest.mark.slow
def test_seeds_cli_runs_one_folder_per_seed_and_summarises(toy_run, tmp_path, capsys):
    out, _ = toy_run
    (tmp_path / "seed-0").symlink_to(out, target_is_directory=True)  # seed 0 has run: only its eval is read back
    config = tmp_path / "toy.json"
    config.write_text(json.dumps(TOY))
    main(["--config", str(config), "--output_dir", str(tmp_path), "--seeds", "0", "--stages", "eval"])
    summary = json.loads((tmp_path / "seeds.json").read_text())
    assert summary["seeds"] == [0] and list(summary["values"]) == MiniatureConfig().models
    assert (tmp_path / "seeds.png").stat().st_size > 0
    assert "| comparison | seed 0 | mean | beyond the interval |" in capsys.readouterr().out


@pytest.mark.slow
def test_trainer_rollouts_at_a_near_zero_temperature_are_the_greedy_reports(toy_run):
    from model_io.processor import load_model_and_processor, user_messages
    from train.data import load_split
    from train.miniature.diagnose import trainer_rollout_groups
    from train.tiny.warmup_checks import generate_texts

    out, _ = toy_run
    rows = [dict(r) for r in load_split(out / "data", "train")][:3]  # 3 prompts, 2 per call: a padded, partial batch
    groups, texts = trainer_rollout_groups(
        out / "sft", rows, num_generations=2, temperature=1e-4, max_new_tokens=8, prompts_per_call=2, seed=0
    )
    model, proc = load_model_and_processor(out / "sft", dtype=torch.float32)
    greedy = generate_texts(model, proc, [user_messages(r["prompt"], r["frames"]) for r in rows], 8)
    assert texts == [g for g in greedy for _ in range(2)]  # GRPO's rollout path samples the policy's own report
    assert [len(g) for g in groups] == [2, 2, 2]


@pytest.mark.slow
def test_diagnose_rollouts_cli_writes_both_summaries(toy_run):
    from train.miniature.diagnose import main as diagnose_main

    out, _ = toy_run
    diagnose_main(["--run_dir", str(out), "--rollouts", "--prompts", "2", "--temperatures", "1.0"])
    result = json.loads((out / "diagnose_sft_train" / "rollouts_T1.0.json").read_text())
    assert (result["trainer"]["n_groups"], result["trainer"]["group_size"]) == (2, 2)
    assert (result["own"]["n_groups"], result["own"]["group_size"]) == (2, 2)
    assert set(result["trainer"]["sampled_rate"]) == {"existence", "attributes", "k_hit", "parse_ok"}
