"""The miniature's runs: each model's label, the freezing of the more-SFT runs (d) and (e), each GRPO run's rewards
(and whether it is the learning-rate-0 control) and r_c's cross view. The stage runner (`train.miniature.study`) and
the report of a run (`train.miniature.run_report`) read them."""

from __future__ import annotations


MODELS = {
    "sft": "SFT",
    "grpo_a": "(a) GRPO r_e+r_f+r_c",
    "grpo_b": "(b) GRPO r_e+r_f",
    "grpo_c": "(c) lr-0 control",
    "grpo_f": "(f) GRPO r_e+r_f+distance term",
    "grpo_g": "(g) GRPO r_c, random frame",
    "grpo_h": "(h) GRPO r_e+r_f+attribute term",
    "more_sft": "(d) more SFT, ViT+projector",
    "more_sft_llm": "(e) more SFT, LLM+projector",
}
# (d), (e): SFT continued from the SFT checkpoint on as many train rows as GRPO's prompts (`more_sft_steps`), with the
# paper's SFT freezing (d) or GRPO's (e): does GRPO beat plain supervised training given the same rows?
MORE_SFT_RUNS = {"more_sft": "sft", "more_sft_llm": "grpo"}  # stage -> the freezing (train.freeze.STAGE_TRAINABLE)
GRPO_RUNS = {
    "grpo_a": (["r_e", "r_f", "r_c"], False),
    "grpo_b": (["r_e", "r_f"], False),
    "grpo_c": (["r_e", "r_f", "r_c"], True),
    "grpo_f": (["r_e", "r_f", "r_c"], False),
    "grpo_g": (["r_e", "r_f", "r_c"], False),
    "grpo_h": (["r_e", "r_f", "r_c"], False),
}
# r_c's cross-view option per run (train/rewards.py `cross_view`): (f) keeps only the key-frame window's distance term,
# (g) shows the verifier a random frame of another row: is r_c's gain from reading the named slice? (h) keeps the
# verifier's reading of the named slice and drops the distance term (`reward_options`: lambda = 0).
CROSS_VIEW = {
    "grpo_a": "full",
    "grpo_b": "full",
    "grpo_c": "full",
    "grpo_f": "distance_only",
    "grpo_g": "random_frame",
    "grpo_h": "full",
}
