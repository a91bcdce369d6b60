"""The seam between `train.grpo_trainer.VideoGRPOTrainer` and TRL: the pinned TRL release, the exact signatures of the
four private `GRPOTrainer` methods it overrides, and every line of TRL's trainer that reads `self.use_vllm` (the one
attribute whose meaning the trainer redefines). A TRL upgrade that changes any of them fails here first, before a
training run loses the CT video without an error (the table in `train/grpo_trainer.py` says what breaks)."""

from __future__ import annotations

import inspect

import pytest
import trl
import trl.trainer.grpo_trainer
from trl import GRPOTrainer

from train.grpo_trainer import VideoGRPOTrainer


OVERRIDDEN = {
    "_generate_and_score_completions": (
        "(self, inputs: list[dict[str, torch.Tensor | typing.Any]]) -> dict[str, torch.Tensor | typing.Any]"
    ),
    "_generate_single_turn": "(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False)",
    "_compute_loss": "(self, model, inputs)",
    "_get_per_token_logps_and_entropies": (
        "(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, "
        "compute_aux_loss=False, pixel_values=None, image_grid_thw=None, num_images=None, pixel_attention_mask=None, "
        "spatial_shapes=None, num_tiles=None, image_sizes=None, token_type_ids=None, mm_token_type_ids=None, "
        "image_position_ids=None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]"
    ),
}

# Every line of TRL 1.16's GRPO trainer that reads `self.use_vllm`, stripped, in file order. After `__init__` (where
# the trainer keeps it false) only the importance-sampling lines may see it true; the two others are TRL's tool loop
# and custom-rollout path, which this project does not use.
USE_VLLM_LINES = [
    "self.use_vllm = args.use_vllm",
    'if self.loss_type == "vespo" and self.use_vllm and self.vllm_importance_sampling_correction:',
    "if self.use_vllm:",  # __init__: builds TRL's vLLM generation backend
    "if self.use_vllm:",  # _generate_single_turn: overridden
    'if self.use_vllm and self.vllm_mode == "colocate":',  # the tool loop
    "if self.use_vllm and self.state.global_step != self._last_loaded_step:",  # rollout_func
    "self.use_vllm and self.vllm_importance_sampling_correction",
    "if self.use_vllm and self.vllm_importance_sampling_correction:",
    "if self.use_vllm and self.vllm_importance_sampling_correction:",
    "if self.use_vllm and self.vllm_importance_sampling_correction:",
    'if self.use_vllm and self.vllm_importance_sampling_correction and self.loss_type != "vespo":',
]


def test_trl_is_the_pinned_release() -> None:
    assert trl.__version__ == "1.16.0"


def test_the_overridden_trl_methods_keep_their_signatures() -> None:
    found = {name: str(inspect.signature(getattr(GRPOTrainer, name))) for name in OVERRIDDEN}
    assert found == OVERRIDDEN


def test_the_trainer_overrides_exactly_these_trl_methods() -> None:
    """Every private method of TRL's `GRPOTrainer` the subclass redefines is one the signature test pins."""
    ours = {
        name
        for name, value in vars(VideoGRPOTrainer).items()
        if callable(value) and name.startswith("_") and not name.startswith("__") and hasattr(GRPOTrainer, name)
    }
    assert ours == set(OVERRIDDEN)


def test_trl_reads_use_vllm_only_where_the_trainer_expects() -> None:
    source = inspect.getsource(trl.trainer.grpo_trainer)
    lines = [line.strip() for line in source.splitlines() if "self.use_vllm" in line]
    assert lines == USE_VLLM_LINES


def test_use_vllm_is_the_importance_sampling_flag_and_refuses_true() -> None:
    """TRL's inherited code reads `use_vllm` as the trainer's `importance_sampling_correction`; assigning true (TRL's
    own video-dropping vLLM path) raises. Checked on an instance built without `__init__` (no model needed)."""
    trainer = VideoGRPOTrainer.__new__(VideoGRPOTrainer)
    assert trainer.use_vllm is False
    trainer.importance_sampling_correction = True
    assert trainer.use_vllm is True
    trainer.use_vllm = False  # what TRL's __init__ assigns: accepted, changes nothing
    assert trainer.use_vllm is True
    with pytest.raises(RuntimeError, match="generates through train.vllm_rollout"):
        trainer.use_vllm = True
