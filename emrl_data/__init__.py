"""E-MRL data: AbdomenAtlas 3.0 -> single-organ tumor reports with key-slice evidence.

A pure library (no Prefect, torch, TRL or Hub client). `flows/` orchestrates it, `train/` trains on its output.
"""

__version__ = "0.1.0"
