"""E-MRL data: AbdomenAtlas 3.0 -> single-organ tumor reports with key-slice evidence.

A pure library (no Prefect, torch, TRL or Hub client). `flows/` orchestrates it, `train/` trains on its output.
"""

from pathlib import Path


__version__ = "0.1.0"
# The checkout this code runs from (`emrl_data/` sits at its top): where `prefect.yaml`, `train/` and `.cache/` are.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
