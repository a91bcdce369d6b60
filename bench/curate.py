"""Benchmark: curating one 512x512x300 case with three lesions, against the physical floor and a naive baseline.

Prints, measured in ONE run (the machine is noisy, so compare the ratios):
  * ours   - `emrl_data.curate.curate_case` (load, labels for 3 organs, frames, reports), warm worker process;
  * floor  - ISA-L gunzip of exactly the files ours reads (the decompression-bound floor, notes/performance.md);
  * naive  - nibabel `get_fdata()` float64 + full-volume `scipy.ndimage.label` + full-volume boolean HU gathers;
  * the ratios and the peak RSS of each, each measured in its own fresh process.
Targets: ours <= 1.5x floor, ours >= 15x faster than naive, peak RSS <= 1 GB.

    python bench/curate.py [--rounds 3] [--workdir /tmp/emrl-bench]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent


def _ref(workdir: Path):
    from emrl_data.atlas import discover_cases

    (ref,) = discover_cases(workdir / "atlas").refs
    return ref


def _files_read(workdir: Path) -> list[Path]:
    """The files `curate_case` reads for this case (from the digests it records)."""
    from emrl_data.config import CurateConfig
    from emrl_data.curate import curate_case

    ref = _ref(workdir)
    result = curate_case(ref, split="train", cfg=CurateConfig())
    return [ref.root / rel for rel in result.file_digests]


def run_ours(workdir: Path, repeats: int) -> list[float]:
    from emrl_data.config import CurateConfig
    from emrl_data.curate import curate_case

    ref, cfg = _ref(workdir), CurateConfig()
    times = []
    for _ in range(repeats + 1):  # first call warms imports and the heap
        t = time.perf_counter()
        result = curate_case(ref, split="train", cfg=cfg)
        times.append(time.perf_counter() - t)
        assert len(result.rows) == 3 and not result.rejections, result.rejections
    return times[1:]


def run_floor(workdir: Path, repeats: int) -> list[float]:
    from isal import isal_zlib

    files = _files_read(workdir)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        for path in files:
            raw = path.read_bytes()
            isize = int.from_bytes(raw[-4:], "little")
            isal_zlib.decompress(raw, wbits=31, bufsize=max(isize, 1))
        times.append(time.perf_counter() - t)
    return times[1:]


def run_naive(workdir: Path, repeats: int) -> list[float]:
    import nibabel as nib
    import numpy as np
    from scipy import ndimage

    from emrl_data.atlas import ORGAN_STRUCTURES

    ref = _ref(workdir)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        ct = nib.load(ref.ct_path).get_fdata()
        for structures in ORGAN_STRUCTURES.values():
            organ = sum(nib.load(ref.structure_path(s)).get_fdata() for s in structures.organ_masks)
            lesion = nib.load(ref.structure_path(structures.lesion_mask)).get_fdata()
            labels, n = ndimage.label(lesion > 0, structure=np.ones((3, 3, 3)))
            parenchyma = ct[(organ > 0) & (lesion == 0)]
            _ = parenchyma.mean(), parenchyma.std()
            for i in range(1, n + 1):
                component = labels == i
                _ = ct[component].mean(), component.sum(axis=(0, 1)).argmax()
            for path, _name in structures.parts:
                part = nib.load(ref.structure_path(path)).get_fdata()
                _ = (part[labels > 0] > 0).sum()
        times.append(time.perf_counter() - t)
    return times


def _worker(kind: str, workdir: Path, repeats: int) -> None:
    sys.path.insert(0, str(ROOT))
    times = {"ours": run_ours, "floor": run_floor, "naive": run_naive}[kind](workdir, repeats)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"kind": kind, "times": times, "peak_rss_mb": peak_mb}))


def _measure(kind: str, workdir: Path, repeats: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--worker", kind, "--workdir", str(workdir), "--rounds", str(repeats)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/emrl-bench"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", choices=["ours", "floor", "naive"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.workdir, args.rounds)
        return

    from emrl_data.synthetic import bench_spec, write_atlas

    if not (args.workdir / "atlas").is_dir():
        print(f"writing the 512x512x300 bench case to {args.workdir / 'atlas'} ...", flush=True)
        write_atlas(args.workdir / "atlas", [bench_spec()], metadata_csv=False, split_files=False)
    results = {}
    for kind, repeats in (("floor", args.rounds), ("ours", args.rounds), ("naive", 1)):
        print(f"measuring {kind} ...", flush=True)
        results[kind] = _measure(kind, args.workdir, repeats)
    med = {k: statistics.median(v["times"]) for k, v in results.items()}
    print()
    print("| variant | s/case (median) | vs floor | peak RSS (MB) |")
    print("|---|---:|---:|---:|")
    for kind in ("floor", "ours", "naive"):
        print(f"| {kind} | {med[kind]:.3f} | {med[kind] / med['floor']:.2f}x | {results[kind]['peak_rss_mb']:.0f} |")
    print()
    print(f"ours / floor = {med['ours'] / med['floor']:.2f}x (target <= 1.5x)")
    print(f"naive / ours = {med['naive'] / med['ours']:.1f}x (target >= 15x)")
    print(f"ours peak RSS = {results['ours']['peak_rss_mb']:.0f} MB (target <= 1024 MB)")


if __name__ == "__main__":
    main()
