"""Benchmark: what the CT fingerprint adds to curating a case, as a ratio measured in one run.

The case is `bench/curate.py`'s lesion case (synthetic 512 x 512 x 300, 0.78 x 0.78 x 2.5 mm, LPS storage), written
once under --workdir. Each round, in this process (warm after a first unmeasured round), times in CPU seconds (user +
system: on a shared machine wall time mostly measures the wait for a core):

  * curation - `curate_case` (load, labels for 3 organs, frames, reports, and the fingerprint it computes);
  * fingerprint - `ct_fingerprint` alone on the same case's loaded CT (the load is curation's, not counted).

Rounds are interleaved; the ratio is taken per round, then the median. The last line reads
`fingerprint/curation=...x fingerprint_cpu_s=... curation_cpu_s=...`.

    python bench/fingerprint.py [--rounds 5] [--workdir /tmp/emrl-bench]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for `python bench/...`

from emrl_data.config import CurateConfig
from emrl_data.labeling.curate import curate_case
from emrl_data.labeling.fingerprint import ct_fingerprint
from emrl_data.reading.atlas import discover_cases
from emrl_data.reading.case_images import open_case
from emrl_data.synthetic import bench_spec, write_atlas


CASE_ID = "BDMAP_00000001"


def write_case(atlas: Path) -> None:
    """Write the bench case (about 40 MB of gzip) unless it is there."""
    if (atlas / "image_only" / CASE_ID).is_dir():
        return
    print(f"writing the 512x512x300 bench case to {atlas} ...", flush=True)
    write_atlas(atlas, [bench_spec(CASE_ID)], metadata_csv=False, split_files=False)


def _cpu() -> float:
    return time.process_time()


def one_round(atlas: Path, cfg: CurateConfig) -> tuple[float, float]:
    """(curation CPU s, fingerprint CPU s) of one round."""
    ref = next(r for r in discover_cases(atlas).refs if r.case_id == CASE_ID)
    start = _cpu()
    result = curate_case(ref, split="train", cfg=cfg)
    curation = _cpu() - start
    assert result.rows and result.fingerprint is not None, result.rejections
    ct = open_case(ref, cfg=cfg.load).ct_hu
    start = _cpu()
    fingerprint = ct_fingerprint(ct)
    spent = _cpu() - start
    assert fingerprint == result.fingerprint
    return curation, spent


def summarise(samples: list[tuple[float, float]]) -> dict[str, float]:
    """Medians of the per-round ratio and of each time."""
    return {
        "fingerprint/curation": statistics.median(f / c for c, f in samples),
        "fingerprint_cpu_s": statistics.median(f for _, f in samples),
        "curation_cpu_s": statistics.median(c for c, _ in samples),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/emrl-bench"))
    args = parser.parse_args()
    atlas = args.workdir / "atlas-fingerprint"
    write_case(atlas)
    cfg = CurateConfig()
    one_round(atlas, cfg)  # warm-up: imports, allocator, page cache
    samples = []
    for n in range(args.rounds):
        samples.append(one_round(atlas, cfg))
        print(
            f"round {n + 1}: curation {samples[-1][0]:.3f} CPU s, fingerprint {samples[-1][1]:.3f} CPU s", flush=True
        )
    s = summarise(samples)
    print(
        f"fingerprint/curation={s['fingerprint/curation']:.3f}x fingerprint_cpu_s={s['fingerprint_cpu_s']:.3f} "
        f"curation_cpu_s={s['curation_cpu_s']:.3f}"
    )


if __name__ == "__main__":
    main()
