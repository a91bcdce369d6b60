"""Command-line tools for GPU machines: the device check, the GPU memory plan, the checkpoint upgrade and the wheel
fetch. Tiny models and synthetic data for the tests, the demo and the miniature: `train.tiny`."""
