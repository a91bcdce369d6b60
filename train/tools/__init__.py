"""Tools around training: the GPU device check, the GPU memory plan, and the checkpoint upgrade."""
