"""GRPO learns: with the project's trainer and real rewards, the mean reward rises over a learning-rate-0 control.

The task is learnable by construction: the policy (a tiny Qwen3-VL whose LLM first learned two kidney reports, one
positive and one negative, over the same lesion-free frames) writes a lesion claim about half of the time; GRPO then
trains on true negatives only, where r_e and r_f pay for "no lesion" and r_c is None (so the verifier is not queried). The control runs the same seed (the same prompts in the same order per step) at learning rate 0.
The test asserts on the reward and on the sign of the update, never on time.
"""

import pytest
import torch
from trl import GRPOConfig

from train.data import load_split
from train.grpo import build_grpo_trainer, reward_curve
from train.learning import logprob_shift_correlation
from train.sft import main as sft_main
from train.synthetic import make_rows, write_rows


def _two_report_rows(n_each):
    """Rows that all show the same lesion-free kidney frames; half carry one positive report, half one negative."""
    rows = make_rows(6, n_frames=4, size_px=32, seed=3)
    positive, negative = rows[2], rows[5]  # kidney rows (organs cycle liver, pancreas, kidney; even rows positive)
    out = []
    for i in range(2 * n_each):
        row = dict(positive if i % 2 == 0 else negative)
        row["case_id"], row["frames"] = f"BDMAP_{i + 1:08d}", negative["frames"]
        out.append(row)
    return out


@pytest.fixture(scope="module")
def report_policy(tmp_path_factory):
    """(model dir, table dir): a tiny policy whose LLM learned the two reports, and a table of true negatives.

    The frames carry no lesion evidence, so the warmed-up policy writes either report about half of the time.
    """
    root = tmp_path_factory.mktemp("learn")
    rows = _two_report_rows(8)
    sft_dir = write_rows(root / "sft", {"train": rows})
    grpo_dir = write_rows(root / "neg", {"train": [r for r in rows if not r["has_lesion"]]})
    sft_main(["--config", "train/configs/sft_tiny.yaml", "--dataset_dir", str(sft_dir), "--output_dir",
              str(root / "policy"), "--lm_warmup_steps", "50", "--lm_warmup_frame_px", "32", "--max_steps", "1",
              "--per_device_train_batch_size", "4", "--learning_rate", "1e-2", "--lr_scheduler_type", "constant",
              "--logging_steps", "10",
              "--gradient_checkpointing", "false"])  # fmt: skip
    return root / "policy", grpo_dir


def _args(tmp, lr):
    return GRPOConfig(output_dir=str(tmp), num_generations=4, per_device_train_batch_size=8, max_completion_length=32,
                      max_steps=8, beta=0.0, learning_rate=lr, lr_scheduler_type="constant", logging_steps=1,
                      use_cpu=True, bf16=False, report_to="none", save_strategy="no", loss_type="grpo", seed=0,
                      temperature=1.0)  # fmt: skip


def _rewards(model_dir, ds, tmp, lr):
    torch.manual_seed(0)
    trainer = build_grpo_trainer(str(model_dir), ds, _args(tmp, lr), rewards=["r_e", "r_f", "r_c"])
    trainer.train()
    curve = reward_curve(trainer.state.log_history)
    zero_std = [h["frac_reward_zero_std"] for h in trainer.state.log_history if "frac_reward_zero_std" in h]
    return [v for _, v in curve["reward"]], zero_std, trainer


def test_grpo_raises_mean_reward_over_lr0_control(report_policy, tmp_path):
    model_dir, table = report_policy
    ds = load_split(table, "train")
    run, zero_std, trainer = _rewards(model_dir, ds, tmp_path / "run", 1e-3)
    control, _, control_trainer = _rewards(model_dir, ds, tmp_path / "control", 0.0)
    assert min(zero_std) < 1.0  # some group had reward variance (a gradient)
    assert len(run) == len(control) == 8
    half = len(run) // 2
    gain = sum(run[half:]) / half - sum(control[half:]) / half
    assert gain > 0.1, (run, control)
    verifier = trainer.reward_funcs[2].verifier
    assert verifier.n_calls == 0  # true negatives only: r_c is None and the verifier never runs


def test_advantage_correlates_with_logprob_change(report_policy, tmp_path):
    model_dir, table = report_policy
    ds = load_split(table, "train")
    torch.manual_seed(1)
    trainer = build_grpo_trainer(str(model_dir), ds, _args(tmp_path, 1e-3), rewards=["r_e", "r_f", "r_c"])
    trainer.model.train()
    rows = [dict(trainer.train_dataset[i]) for i in range(4) for _ in range(4)]  # 4 prompts x G = 4
    corr, details = logprob_shift_correlation(trainer, rows, lr=1e-3)
    assert details["grad_norm"] > 0
    assert corr > 0, details
