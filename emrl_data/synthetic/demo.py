"""Ready-made synthetic atlases: the demo atlas (`demo_specs`) and the benchmark case (`bench_spec`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from emrl_data.synthetic.specs import CaseSpec, LesionSpec
from emrl_data.types import Organ, Split


DEMO_SHAPE: tuple[int, int, int] = (160, 128, 40)


def _lesion(organ: Organ, part: str, radius: float | tuple[float, float, float], att: str = "hypo") -> LesionSpec:
    radii = (radius, radius, radius) if isinstance(radius, int | float) else radius
    return LesionSpec(organ, part, radii, att)


def _demo_catalogue() -> list[dict[str, Any]]:
    """Hand-designed demo cases (keyword arguments of CaseSpec without case_id/seed/split)."""
    liver, pancreas, kidney = Organ.LIVER, Organ.PANCREAS, Organ.KIDNEY
    return [
        # 1: one large hypo liver lesion (> 2 cm) in segment 8; other organs negative.
        {"lesions": (_lesion(liver, "8", (12.0, 10.0, 10.0)),)},
        # 2: all three organs positive, small lesions (< 2 cm).
        {"lesions": (_lesion(liver, "6", 4.0), _lesion(pancreas, "head", 4.0), _lesion(kidney, "right", 4.0))},
        # 3: negative case (no lesion anywhere).
        {},
        # 4: several liver lesions (3), hyper largest in segment 7, two small hypo.
        {"lesions": (_lesion(liver, "7", 8.0, "hyper"), _lesion(liver, "3", 3.0), _lesion(liver, "5", 3.0))},
        # 5: pancreas: large hypo tail lesion (2.2 cm) + small head lesion.
        {"lesions": (_lesion(pancreas, "tail", (11.0, 6.0, 6.0)), _lesion(pancreas, "head", 3.0))},
        # 6: kidneys: two left lesions (iso largest) + one right.
        {"lesions": (_lesion(kidney, "left", 6.0, "iso"), _lesion(kidney, "right", 3.5, "hyper"))},
        # 7: iso liver lesion, large.
        {"lesions": (_lesion(liver, "4", (11.0, 11.0, 7.5), "iso"),)},
        # 8: hyper pancreatic lesion, kidney negative, liver small hypo.
        {"lesions": (_lesion(pancreas, "body", 4.5, "hyper"), _lesion(liver, "2", 5.0))},
        # 9: quirk mask_cropped_grid, liver + kidney lesions.
        {"lesions": (_lesion(liver, "5", 6.0), _lesion(kidney, "left", 5.0)), "quirks": {"mask_cropped_grid"}},
        # 10: quirk flipped_affine_mask with a right kidney lesion (the flipped file matters).
        {"lesions": (_lesion(kidney, "right", 5.0),), "quirks": {"flipped_affine_mask"}},
        # 11: quirk lps_storage, liver + pancreas lesions.
        {"lesions": (_lesion(liver, "8", 7.0), _lesion(pancreas, "head", 4.0)), "storage": "LPS"},
        # 12: quirk anisotropic spacing (0.7, 0.9, 3.0), liver hyper lesion.
        {"lesions": (_lesion(liver, "6", 6.0, "hyper"),), "quirks": {"anisotropic"}},
        # 13: LPS + cropped masks + empty lesion files for negatives.
        {
            "lesions": (_lesion(pancreas, "tail", 5.0),),
            "quirks": {"lps_storage", "mask_cropped_grid", "empty_lesion_files"},
        },
        # 14: defect truncated_gzip (the CT file is cut).
        {"lesions": (_lesion(liver, "7", 6.0),), "defect": "truncated_gzip"},
        # 15: defect mask_grid_mismatch (liver.nii.gz has a rotated affine on its own grid).
        {"lesions": (_lesion(liver, "5", 5.0),), "defect": "mask_grid_mismatch"},
    ]


def _random_demo_case(rng: np.random.Generator) -> dict[str, Any]:
    """A seeded filler case: each organ negative or with 1-2 lesions in distinct, well separated parts."""
    lesions: list[LesionSpec] = []
    choices = {
        Organ.LIVER: (("8", "6", "3"), (4.0, 5.0, 7.0, 10.0)),
        Organ.PANCREAS: (("head", "tail"), (3.5, 4.5)),
        Organ.KIDNEY: (("left", "right"), (3.5, 5.0)),
    }
    attenuations = ("hypo", "hypo", "hypo", "hyper", "iso")
    for organ, (parts, radii) in choices.items():
        n = int(rng.choice([0, 0, 1, 2]))
        picked = rng.permutation(len(parts))[:n]
        for rank, p in enumerate(picked):
            radius = float(rng.choice(radii)) if rank == 0 else 3.0
            lesions.append(
                _lesion(organ, parts[int(p)], radius, str(rng.choice(attenuations)) if rank == 0 else "hypo")
            )
    return {"lesions": tuple(lesions)}


def demo_specs(n_cases: int = 32, seed: int = 0) -> list[CaseSpec]:
    """Return the demo atlas: hand-designed cases, then seeded random fillers, ids BDMAP_00000001..

    With the default 32 cases it covers all three organs, positives and negatives, several lesions per organ,
    lesions under and over 2 cm, every quirk, two defective cases (truncated_gzip, mask_grid_mismatch) and both
    splits (every 4th case is a test case). Fewer cases truncate the catalogue (coverage is then not guaranteed).

    Args:
        n_cases: number of cases (>= 1).
        seed: seeds the fillers and the per-case noise.

    Returns:
        The specs, grid `DEMO_SHAPE` at 0.8 x 0.8 x 2.5 mm unless a quirk says otherwise.
    """
    if n_cases < 1:
        raise ValueError(f"n_cases={n_cases} must be >= 1.")
    rng = np.random.default_rng([seed, 7])
    kwargs = _demo_catalogue()[:n_cases]
    while len(kwargs) < n_cases:
        kwargs.append(_random_demo_case(rng))
    specs = []
    for i, kw in enumerate(kwargs, start=1):
        kw = dict(kw)
        kw["quirks"] = frozenset(kw.get("quirks", ()))
        split = Split.TEST if i % 4 == 0 else Split.TRAIN
        specs.append(CaseSpec(case_id=f"BDMAP_{i:08d}", shape=DEMO_SHAPE, seed=seed * 100_000 + i, split=split, **kw))
    return specs


def bench_spec(case_id: str = "BDMAP_00000001") -> CaseSpec:
    """Return the benchmark case: 512 x 512 x 300 at 0.78 x 0.78 x 2.5 mm, LPS storage, three lesions.

    Lesions: a 3.6 cm hypo liver lesion (segment 7), a 2.0 cm hypo pancreatic head lesion, a 2.4 cm hyper
    left kidney lesion.
    """
    return CaseSpec(
        case_id=case_id,
        shape=(512, 512, 300),
        spacing_mm=(0.78, 0.78, 2.5),
        lesions=(
            LesionSpec(Organ.LIVER, "7", (18.0, 14.0, 15.0), "hypo"),
            LesionSpec(Organ.PANCREAS, "head", (10.0, 8.0, 8.0), "hypo"),
            LesionSpec(Organ.KIDNEY, "left", (12.0, 12.0, 12.0), "hyper"),
        ),
        storage="LPS",
        seed=1,
    )
