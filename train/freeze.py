"""Which Qwen3-VL parameters train in each E-MRL stage (docs/contract.md#training-recipe, docs/training.md#qwen3-vl-facts-the-code-relies-on).

* SFT: the vision encoder and the projector (merger and DeepStack mergers) train; the LLM and `lm_head` are frozen.
* GRPO: the projector and the LLM (incl. `lm_head`) train; the ViT (patch/pos embeddings, blocks) is frozen.
* lm_warmup (demo only, not in the paper): everything trains, so a tiny randomly initialised LLM learns the report
  language before the paper's SFT freezing (a real run starts from Qwen3-VL-8B-Instruct, whose LLM already writes).

The merger lives inside `model.model.visual`, so "freeze the vision tower" must re-enable it.
"""

from __future__ import annotations

import logging

from torch import nn


logger = logging.getLogger(__name__)

VIT_PREFIXES = ("model.visual.patch_embed.", "model.visual.pos_embed.", "model.visual.blocks.")
PROJECTOR_PREFIXES = ("model.visual.merger.", "model.visual.deepstack_merger_list.")
LLM_PREFIXES = ("model.language_model.", "lm_head.")
STAGE_TRAINABLE: dict[str, tuple[str, ...]] = {
    "sft": VIT_PREFIXES + PROJECTOR_PREFIXES,
    "grpo": PROJECTOR_PREFIXES + LLM_PREFIXES,
    # Demo only (not the paper): a randomly initialised tiny LLM first learns the report language, every part trains.
    "lm_warmup": VIT_PREFIXES + PROJECTOR_PREFIXES + LLM_PREFIXES,
}


def parameter_group(name: str) -> str:
    """Return "vit", "projector" or "llm" for a Qwen3-VL parameter name.

    Raises:
        ValueError: on a name outside the three groups (a new architecture part must be assigned explicitly).
    """
    for group, prefixes in (("vit", VIT_PREFIXES), ("projector", PROJECTOR_PREFIXES), ("llm", LLM_PREFIXES)):
        if name.startswith(prefixes):
            return group
    raise ValueError(f"Parameter {name!r} belongs to no known group (vit, projector, llm).")


def set_stage_trainable(model: nn.Module, stage: str) -> dict[str, int]:
    """Set `requires_grad` for a stage and return the trainable parameter count per group.

    Args:
        model: a `Qwen3VLForConditionalGeneration` (parameter names `model.visual.*`, `model.language_model.*`,
            `lm_head.*`).
        stage: "sft" or "grpo".

    Raises:
        ValueError: on an unknown stage.
    """
    if stage not in STAGE_TRAINABLE:
        raise ValueError(f"Unknown stage {stage=}; valid stages are {sorted(STAGE_TRAINABLE)}.")
    counts = {"vit": 0, "projector": 0, "llm": 0}
    for name, param in model.named_parameters():
        train = name.startswith(STAGE_TRAINABLE[stage])
        param.requires_grad_(train)
        if train:
            counts[parameter_group(name)] += param.numel()
    logger.info("Stage %s trainable parameters per group: %s", stage, counts)
    return counts
