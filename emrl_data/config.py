"""Configuration of the pipeline: frozen dataclasses with defaults from docs/contract.md#labels and docs/contract.md#frames and a stable fingerprint."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any, Self


# The hard set's cap: the default of `target_size` in `select_hard_rows`, the `build-rl-hardset` flow and its
# `--target-size` option (the paper's hard set has about 2K rows: docs/contract.md#what-the-pipeline-does).
HARD_SET_SIZE = 2000


@dataclass(frozen=True, slots=True)
class LabelConfig:
    """How labels of an organ row are computed (docs/contract.md#labels)."""

    # RadGPT's recommended `--th 10`: components below 10 mm^3 are noise.
    min_lesion_volume_mm3: float = 10.0
    # A sub-structure is part of `location` when it holds more than this share of the lesion's labelled voxels.
    location_min_fraction: float = 0.10
    # Attenuation: lesion mean vs parenchyma mean +- SD * this factor (RadGPT: SD/10).
    iso_sd_fraction: float = 0.10
    # A lesion with less than this share of its voxels inside its organ (dilated by one voxel) is rejected.
    min_lesion_inside_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.min_lesion_volume_mm3 < 0:
            raise ValueError(f"min_lesion_volume_mm3={self.min_lesion_volume_mm3} must be >= 0.")
        if not 0 <= self.location_min_fraction < 1:
            raise ValueError(f"location_min_fraction={self.location_min_fraction} must be in [0, 1).")
        if self.iso_sd_fraction < 0:
            raise ValueError(f"iso_sd_fraction={self.iso_sd_fraction} must be >= 0.")
        if not 0 <= self.min_lesion_inside_fraction <= 1:
            raise ValueError(f"min_lesion_inside_fraction={self.min_lesion_inside_fraction} must be in [0, 1].")


@dataclass(frozen=True, slots=True)
class FrameConfig:
    """How an organ is rendered as a frame sequence (docs/contract.md#frames).

    The defaults (448 px, at most 32 frames) are the E-MRL setting and their one home: the `emrl` options
    (`cli/settings.py`) and the training memory plan (`train/tools/memory_plan.py`) read them from here.
    """

    margin_slices: int = 2
    max_frames: int = 32
    crop_margin_mm: float = 20.0
    frame_size_px: int = 448
    window_width_hu: float = 400.0
    window_level_hu: float = 40.0
    png_compress_level: int = 1  # level 1 is 2-2.5x faster than 6 and 15 % larger (measured on 448² CT frames)

    def __post_init__(self) -> None:
        if self.margin_slices < 0:
            raise ValueError(f"margin_slices={self.margin_slices} must be >= 0.")
        if self.max_frames < 1:
            raise ValueError(f"max_frames={self.max_frames} must be >= 1.")
        if self.crop_margin_mm < 0:
            raise ValueError(f"crop_margin_mm={self.crop_margin_mm} must be >= 0.")
        if self.frame_size_px < 8:
            raise ValueError(f"frame_size_px={self.frame_size_px} must be >= 8.")
        if self.window_width_hu <= 0:
            raise ValueError(f"window_width_hu={self.window_width_hu} must be > 0.")
        if not 0 <= self.png_compress_level <= 9:
            raise ValueError(f"png_compress_level={self.png_compress_level} must be in 0..9.")


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """Limits applied while reading NIfTI files (refuse before allocating)."""

    max_voxels: int = 1024 * 1024 * 2048  # 2 Gi voxels: far above any CT (512 x 512 x 2000 = 0.5 Gi)
    max_dim: int = 4096
    # Every voxel size (mm) must lie in this range; outside it the file is refused (`implausible_spacing`).
    spacing_range_mm: tuple[float, float] = (0.1, 20.0)
    # sform vs pixdim voxel sizes may differ by this fraction; sform vs qform grid corners by this many voxels.
    geometry_rtol: float = 0.01
    # Share of an organ mask's voxels that must lie on the (hole-filled) body (placement evidence).
    min_body_fraction: float = 0.99

    def __post_init__(self) -> None:
        if self.max_voxels < 1 or self.max_dim < 1:
            raise ValueError(f"max_voxels={self.max_voxels} and max_dim={self.max_dim} must be positive.")
        low, high = self.spacing_range_mm
        if not 0 < low < high:
            raise ValueError(f"spacing_range_mm={self.spacing_range_mm} must be (low, high) with 0 < low < high.")
        if not 0 < self.geometry_rtol < 1:
            raise ValueError(f"geometry_rtol={self.geometry_rtol} must be in (0, 1).")
        if not 0 <= self.min_body_fraction <= 1:
            raise ValueError(f"min_body_fraction={self.min_body_fraction} must be in [0, 1].")


@dataclass(frozen=True, slots=True)
class SftConfig:
    """Which organ rows form the SFT set (docs/contract.md#what-the-pipeline-does)."""

    negatives_per_positive: float = 1.0  # negatives sampled per organ, as a ratio of that organ's train positives
    seed: int = 0
    test_fraction: float = 0.10  # hash split when no IID split files exist

    def __post_init__(self) -> None:
        if self.negatives_per_positive < 0:
            raise ValueError(f"negatives_per_positive={self.negatives_per_positive} must be >= 0.")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test_fraction={self.test_fraction} must be in (0, 1).")


@dataclass(frozen=True, slots=True)
class CurateConfig:
    """Everything that changes the content of an organ row. Its fingerprint keys caches and manifests."""

    labels: LabelConfig = LabelConfig()
    frames: FrameConfig = FrameConfig()
    load: LoadConfig = LoadConfig()

    def to_dict(self) -> dict[str, Any]:
        """Return a plain nested dict (JSON-serialisable)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """Build from a nested dict; unknown keys raise with the valid names."""
        parts = {}
        for f in fields(cls):
            sub_cls = {"labels": LabelConfig, "frames": FrameConfig, "load": LoadConfig}[f.name]
            sub = dict(data.get(f.name, {}))
            valid = {g.name for g in fields(sub_cls)}
            unknown = set(sub) - valid
            if unknown:
                raise ValueError(f"Unknown {f.name} config keys {sorted(unknown)}; valid keys are {sorted(valid)}.")
            parts[f.name] = sub_cls(**sub)
        unknown_top = set(data) - {f.name for f in fields(cls)}
        if unknown_top:
            raise ValueError(f"Unknown config sections {sorted(unknown_top)}; valid: labels, frames, load.")
        return cls(**parts)

    def fingerprint(self) -> str:
        """Return a short stable hash of the configuration (sha256 of its sorted JSON, 16 hex digits)."""
        return config_fingerprint(self.to_dict())


def config_fingerprint(data: dict[str, Any]) -> str:
    """Return sha256 (16 hex digits) of the canonical JSON of `data`."""
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
