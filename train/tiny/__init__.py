"""Tiny Qwen3-VL models built from a config, and synthetic data, for the tests, the demo and the miniature: the model,
synthetic tables, the LM warm-up (its training data and held-out checks), the demo's SFT entry and learning
diagnostics. The training library (`train.sft`, `train.grpo`, ...) never imports it. Tools for GPU machines:
`train.tools`."""
