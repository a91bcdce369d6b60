"""Labels and frames: per-organ lesion labels, the model's frames, and the per-case driver."""
