"""The case store: a curated case saved and read back, rows without frames and the frames per organ."""

from __future__ import annotations

from pathlib import Path

from emrl_data.config import CurateConfig
from emrl_data.labeling.case_store import CaseStore
from emrl_data.labeling.curate import curate_case
from emrl_data.reading.atlas import plan_atlas
from emrl_data.synthetic import CaseSpec, LesionSpec, write_atlas
from emrl_data.types import Organ


CFG = CurateConfig()
LESIONS = (
    LesionSpec(Organ.LIVER, "5", (12.0, 10.0, 10.0), "hypo"),
    LesionSpec(Organ.PANCREAS, "head", (6.0, 6.0, 6.0), "hypo"),
    LesionSpec(Organ.KIDNEY, "left", (8.0, 8.0, 8.0), "hyper"),
)


def test_case_store_round_trip(tmp_path: Path) -> None:
    write_atlas(tmp_path / "atlas", [CaseSpec("BDMAP_00000001", shape=(96, 80, 32), lesions=LESIONS)])
    (ref,) = plan_atlas(tmp_path / "atlas").refs
    result = curate_case(ref, split="train", cfg=CFG)
    store = CaseStore(tmp_path / "store")
    assert not store.has("k")
    store.save("k", result)
    assert store.has("k")
    light = store.load_rows("k")
    assert [r["organ"] for r in light.rows] == ["liver", "pancreas", "kidney"]
    assert all("frames" not in r for r in light.rows)
    frames = store.load_frames("k")
    assert frames["liver"] == result.rows[0]["frames"]
    assert light.rows[0]["frames_bytes"] == sum(len(f["bytes"]) for f in frames["liver"])
