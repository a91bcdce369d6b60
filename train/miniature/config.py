"""The miniature's configuration: every knob in one dataclass, read from one YAML (`train/configs/miniature.yaml`).

Its own module so that the experiment (`train.miniature`) and its diagnosis (`train.miniature.diagnose`) both read it
without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from emrl_data.organs import ORGANS
from emrl_data.text.scoring import NEGATIVE_ROWS
from train.checks import TrainConfigError
from train.miniature.noise import check_fraction


# The runs a config's `models` may name (train.miniature.runs.MODELS has their labels, in this order).
SFT_KEY_FRAMES = ("gold", "random_visible")
MODEL_NAMES = ("sft", "grpo_a", "grpo_b", "grpo_c", "grpo_f", "grpo_g", "grpo_h", "more_sft", "more_sft_llm")


@dataclass
class MiniatureConfig:
    """Every knob of the miniature (one YAML; see train/configs/miniature.yaml)."""

    n_train: int = 240
    n_test: int = 120
    n_frames: int = 8
    size_px: int = 64
    organs: list[str] = field(default_factory=lambda: [str(organ) for organ in ORGANS])  # every registered organ
    sizes_mm: list[float] = field(default_factory=lambda: [31.0, 48.0, 90.0])  # lesion long-axis classes
    lesion_span: int = 3  # frames on each side of the key frame that show a (shrinking) lesion
    seed: int = 0
    min_test_rows_per_class: int = 10  # per organ and class (positive / negative): below it the intervals mean little
    warmup_max_steps: int = 3000
    warmup_eval_every: int = 100
    warmup_target_parse_rate: float = 0.95
    warmup_target_sampled_parse_rate: float = 0.85
    warmup_learning_rate: float = 3.0e-3
    warmup_batch_size: int = 4
    warmup_verifier_batch_size: int = 2  # verifier frames a warm-up step (half with a lesion)
    warmup_val_rows: int = 12
    warmup_target_verifier_accuracy: float = 0.9  # the gates' accuracy (0 = report only)
    # the rates the warm-up is gated on (train.tiny.warmup_checks.VERIFIER_RATES); "size" needs the slice's long axis
    warmup_verifier_gates: list[str] = field(
        default_factory=lambda: ["sensitivity", "specificity", "location", "attenuation"]
    )
    verifier_eval_frames: int = 48  # held-out frames per verifier check (half with the lesion, half without)
    warmup_gate_checks: int = 1  # the verifier's gates hold on the mean of this many last checks (1: the last one)
    verifier_distance_rows: int = 0  # eval: positive test rows whose frames at d = 0..span+1 from the key are asked
    gold_noise: float = 0.0  # fraction of TRAINING rows whose gold is corrupted (train/miniature/noise.py); in [0, 1)
    key_frame_noise: float = 0.0  # fraction of positive TRAINING rows whose gold key frame moves 2-4 frames; in [0, 1)
    warmup_pool_rows: int = 0  # rows of a pool of their own the warm-up reads (0: the clean training rows themselves)
    # SFT's key frame: "gold" (the largest cross-section), or "random_visible": a seeded draw among the frames that
    # show the lesion (train/miniature/noise.py `random_visible_keys`); GRPO and the eval keep the gold key frame
    sft_key_frame: str = "gold"
    # the warm-up's report targets' key frame, drawn as `sft_key_frame` draws SFT's (its verifier keeps each frame's
    # own truth): a warm-up on gold report targets teaches the gold key frame before SFT starts
    warmup_key_frame: str = "gold"
    # after SFT, the share of positive test rows whose greedy report names a frame that shows the lesion, measured on
    # a fresh eval of the finished SFT model; below it the seed is excluded before any GRPO arm (0: not checked)
    sft_policy_gate: float = 0.0
    negative_rows: str = "skip"  # GRPO's r_c on negative rows (train/rewards.py): skip | query_named_slice
    models: list[str] = field(
        default_factory=lambda: ["sft", "grpo_a", "grpo_b", "grpo_c", "more_sft", "more_sft_llm"]
    )  # the runs (train.miniature.runs.MODELS keys); sft always
    sft_steps: int = 100
    sft_learning_rate: float = 1.0e-3
    sft_batch_size: int = 4
    grpo_steps: int = 30
    grpo_learning_rate: float = 2.0e-4
    grpo_prompts_per_step: int = 4
    num_generations: int = 4
    grpo_temperature: float = 1.0  # the rollouts' sampling temperature (the verifier and the eval stay greedy)
    max_completion_length: int = 112
    beta: float = 0.01
    verifier_max_new_tokens: int = 40
    eval_max_new_tokens: int = 128
    n_bootstrap: int = 1000
    diagnose_prompts: int = 16  # `--stages diagnose`: train prompts sampled num_generations times at the SFT model
    diagnose_temperatures: list[float] = field(default_factory=lambda: [1.0, 0.7])


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> MiniatureConfig:
    """Return the config from a YAML file (unknown keys are an error) plus `overrides`."""
    data: dict[str, Any] = {}
    if path is not None:
        data = yaml.safe_load(Path(path).read_text()) or {}
    data.update(overrides or {})
    return config_from_dict(data, path)


def config_from_dict(data: dict[str, Any], source: str | Path | None = None) -> MiniatureConfig:
    """Return the config of a mapping (unknown keys, non-numbers, a bad `gold_noise` or `models` are one-line errors
    naming `source`)."""
    data = dict(data)
    path = source
    known = {f.name for f in fields(MiniatureConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise TrainConfigError(f"{path}: unknown keys {unknown}; valid keys are {sorted(known)}")
    types = {f.name: f.type for f in fields(MiniatureConfig)}
    for key, value in data.items():
        try:
            if types[key] == "float" and isinstance(value, int | float | str):
                data[key] = float(value)  # YAML reads 1e-4 (no dot) as a string
            elif types[key] == "int" and not isinstance(value, int):
                data[key] = int(value)
        except ValueError:
            raise TrainConfigError(f"{path}: {key}={value!r}: expected a number ({types[key]})") from None
    cfg = MiniatureConfig(**data)

    check_fraction(cfg.gold_noise)
    check_fraction(cfg.key_frame_noise, "key_frame_noise")
    if cfg.gold_noise > 0 and cfg.key_frame_noise > 0:
        raise TrainConfigError(
            f"{path}: gold_noise={cfg.gold_noise} and key_frame_noise={cfg.key_frame_noise}: one kind of noise a run"
        )
    for key in ("sft_key_frame", "warmup_key_frame"):
        value = getattr(cfg, key)
        if value not in SFT_KEY_FRAMES:
            raise TrainConfigError(f"{path}: {key}={value!r} must be one of {' | '.join(SFT_KEY_FRAMES)}")
    # a random key frame is drawn in the clean lesion: under key-frame noise GRPO's gold moves, SFT's draw does not;
    # gold noise corrupts the other labels SFT learns, which a draw from the clean rows would drop
    if cfg.sft_key_frame != "gold" and cfg.gold_noise > 0:
        raise TrainConfigError(f"{path}: sft_key_frame={cfg.sft_key_frame!r} does not run with gold_noise > 0")
    if not 0 <= cfg.sft_policy_gate <= 1:
        raise TrainConfigError(f"{path}: sft_policy_gate={cfg.sft_policy_gate} must be in [0, 1]")
    if cfg.warmup_gate_checks < 1:
        raise TrainConfigError(f"{path}: warmup_gate_checks={cfg.warmup_gate_checks} must be at least 1")
    if cfg.warmup_pool_rows < 0:
        raise TrainConfigError(f"{path}: warmup_pool_rows={cfg.warmup_pool_rows} must be >= 0")

    if cfg.negative_rows not in NEGATIVE_ROWS:
        raise TrainConfigError(
            f"{path}: negative_rows={cfg.negative_rows!r} must be one of {' | '.join(NEGATIVE_ROWS)}"
        )
    unknown_models = [m for m in cfg.models if m not in MODEL_NAMES]
    if unknown_models or "sft" not in cfg.models:
        raise TrainConfigError(f"{path}: models={cfg.models}: each of {list(MODEL_NAMES)}, sft included")
    return cfg
