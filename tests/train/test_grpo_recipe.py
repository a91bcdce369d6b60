"""The shipped GRPO configs hold the paper's hyperparameters as `train.grpo.GRPO_RECIPE` states them (one source)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from train.grpo import GRPO_RECIPE


CONFIGS = Path(__file__).resolve().parents[2] / "train" / "configs"
# What a shipped config may change of the recipe, and why.
DEVIATIONS = {
    "grpo.yaml": {},
    # one GPU reaches the paper's 64 completions per step by accumulation (checked at launch: completions_per_step)
    "grpo_lora.yaml": {"gradient_accumulation_steps": 64},
}


def recipe_differences(config: dict, deviations: dict) -> dict[str, tuple]:
    """Keys of the recipe whose value in `config` is neither the recipe's nor the allowed deviation: key -> (found,
    expected); a missing key counts (a config that leaves a value to a default states it nowhere)."""
    expected = {**GRPO_RECIPE, **deviations}
    return {k: (config.get(k), v) for k, v in expected.items() if k not in config or config[k] != v}


def test_recipe_differences_on_constructed_configs() -> None:
    shipped = dict(GRPO_RECIPE)
    assert recipe_differences(shipped, {}) == {}
    assert recipe_differences({**shipped, "beta": 0.04}, {}) == {"beta": (0.04, 0.01)}
    del shipped["num_train_epochs"]
    assert recipe_differences(shipped, {"learning_rate": 1e-6}) == {
        "learning_rate": (5e-6, 1e-6),
        "num_train_epochs": (None, 5),
    }


@pytest.mark.parametrize("name", sorted(DEVIATIONS))
def test_shipped_grpo_configs_hold_the_recipe(name: str) -> None:
    config = yaml.safe_load((CONFIGS / name).read_text())
    assert recipe_differences(config, DEVIATIONS[name]) == {}, f"train/configs/{name} differs from GRPO_RECIPE"
