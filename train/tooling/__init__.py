"""Test and demo tooling: tiny Qwen3-VL models built locally, synthetic tables, the demo's LM warm-up and SFT entry,
and learning diagnostics. The training library (`train.sft`, `train.grpo`, ...) never imports it."""
