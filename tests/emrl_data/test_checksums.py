"""The case cache key: it follows the content of the files a row reads, not their path."""

from __future__ import annotations

from pathlib import Path

from emrl_data.config import CurateConfig
from emrl_data.labeling.checksums import case_cache_key
from emrl_data.reading.atlas import plan_atlas
from emrl_data.synthetic import CaseSpec, LesionSpec, write_atlas
from emrl_data.types import Organ


CFG = CurateConfig()
LESIONS = (
    LesionSpec(Organ.LIVER, "5", (12.0, 10.0, 10.0), "hypo"),
    LesionSpec(Organ.PANCREAS, "head", (6.0, 6.0, 6.0), "hypo"),
    LesionSpec(Organ.KIDNEY, "left", (8.0, 8.0, 8.0), "hyper"),
)


def test_cache_key_follows_content_not_path(tmp_path: Path) -> None:
    spec = CaseSpec("BDMAP_00000001", shape=(96, 80, 32), lesions=LESIONS)
    write_atlas(tmp_path / "a", [spec])
    write_atlas(tmp_path / "b", [spec])
    (ref_a,), (ref_b,) = plan_atlas(tmp_path / "a").refs, plan_atlas(tmp_path / "b").refs
    assert case_cache_key(ref_a, CFG, "train") == case_cache_key(ref_b, CFG, "train")
    liver = ref_b.structure_path("liver")
    liver.write_bytes(liver.read_bytes()[:-8] + b"\0" * 8)  # content change (gzip trailer)
    assert case_cache_key(ref_a, CFG, "train") != case_cache_key(ref_b, CFG, "train")
    assert case_cache_key(ref_a, CFG, "train") != case_cache_key(ref_a, CFG, "test")
