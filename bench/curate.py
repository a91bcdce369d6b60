"""Benchmark: curating 512x512x300 cases in a warm worker, against a fair floor and a naive baseline.

Cases (synthetic, written once under --workdir): `lesions` has lesions in all three organs (liver, pancreas, left
kidney: the case reads its CT and every organ, lesion and sub-structure mask), `no_lesions` has none.

Variants, each in its own persistent worker process, started once and warmed up on every case:
  * ours       - `emrl_data.labeling.curate.curate_case` (load, labels for 3 organs, frames, reports), in a worker started the
                 way `flows/runners.py` starts its workers (`reuse_heap`);
  * fair floor - the same files ours reads (from the digests it records), read and inflated into a reused heap,
                 nothing else: the better of ISA-L (`isal_zlib`) and libdeflate (`deflate`), per case;
  * naive      - nibabel `get_fdata()` float64 + full-volume `scipy.ndimage.label` + full-volume boolean gathers
                 (the lesion case, first round only: it takes ~15 s);
  * ours_default_heap (with --compare-heap) - ours in a worker that keeps glibc's default malloc settings.
The rounds are interleaved (round r runs every variant on every case, in turn), so the machine's noise hits all of
them alike; ratios are taken per round, then the median over rounds. They use each worker's CPU time (user + system,
so page faults count) by default: on a shared 2-core machine wall time mostly measures the wait for a core
(`--clock wall` uses it anyway; the table shows both). Peak RSS is the ours worker's high-water mark.

Beside the floor, not in it (measured in the floor worker, timed apart): the PNG encode of the very frames ours wrote,
the sha256 of the files read (the manifest's promise) and one read of each organ/lesion mask's voxels (a mask's box
cannot be found without one). Their sum over the floor is the least any pipeline that does them as separate passes can
add; the ratios against floor + PNG and floor + all three are printed before the last line, never instead of it.

Targets: ours <= 1.2x the fair floor, naive >= 30x ours, peak RSS <= 600 MB per worker. The last line reads
`ours/fair_floor=...x naive/ours=...x peak_rss_mb=...`.

    python bench/curate.py [--rounds 5] [--workdir /tmp/emrl-bench] [--compare-heap] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for `python bench/curate.py`

import cv2
import deflate
import nibabel as nib
import numpy as np
from isal import isal_zlib
from scipy import ndimage

from emrl_data.config import CurateConfig
from emrl_data.labeling.curate import curate_case
from emrl_data.labeling.frames import encode_png_gray8
from emrl_data.reading.atlas import ORGAN_STRUCTURES, discover_cases
from emrl_data.reading.case_images import _PART_ONLY_MASKS
from emrl_data.synthetic import bench_spec, write_atlas
from flows.runners import reuse_heap


ROOT = Path(__file__).resolve().parent.parent
CASES = {"lesions": "BDMAP_00000001", "no_lesions": "BDMAP_00000002"}
TARGETS = {"ours/fair_floor": 1.2, "naive/ours": 30.0, "peak_rss_mb": 600.0}


def write_cases(atlas: Path) -> None:
    """Write the two bench cases (about 80 MB of gzip) unless they are there."""
    if (atlas / "synthetic_truth.json").is_file():
        return
    print(f"writing the two 512x512x300 bench cases to {atlas} ...", flush=True)
    with_lesions = bench_spec(CASES["lesions"])
    without = replace(with_lesions, case_id=CASES["no_lesions"], lesions=(), seed=2)
    write_atlas(atlas, [with_lesions, without], metadata_csv=False, split_files=False)


# --- the workers (each runs in its own process) ------------------------------------------------------------------


def _refs(atlas: Path) -> dict[str, Any]:
    by_id = {ref.case_id: ref for ref in discover_cases(atlas).refs}
    return {name: by_id[case_id] for name, case_id in CASES.items()}


class Ours:
    """`curate_case`, as a warm worker runs it."""

    def __init__(self, atlas: Path, reuse: bool) -> None:
        self.heap_reused = reuse_heap() if reuse else False
        self.refs, self.cfg = _refs(atlas), CurateConfig()

    def run(self, case: str) -> dict[str, Any]:
        result = curate_case(self.refs[case], split="train", cfg=self.cfg)
        if result.rejections or len(result.rows) != 3:
            raise RuntimeError(f"{case}: expected 3 rows and no rejection, got {result.rejections}")
        return {"files": sorted(result.file_digests), "lesions": sum(r["has_lesion"] for r in result.rows)}


class FairFloor:
    """Read and inflate exactly the files ours reads, into a reused heap; the better of ISA-L and libdeflate.

    Apart (not in the floor, reported beside it): the PNG encode of the very frames ours wrote for the case (decoded
    once at start, re-encoded each round by `encode_png_gray8`, the fastest encoder measured, docs/scaling.md), the
    sha256 of each file and one read of each organ/lesion mask's voxels: work every row needs, whatever the pipeline
    around it. Their time is taken out of the floor's, on both clocks.
    """

    def __init__(self, atlas: Path) -> None:
        self.heap_reused = reuse_heap()
        self.atlas, self.refs, self.cfg = atlas, _refs(atlas), CurateConfig()
        results = {case: curate_case(self.refs[case], split="train", cfg=self.cfg) for case in CASES}
        self.files = {case: self._files_read(case, results[case].file_digests) for case in CASES}
        self.frames = {case: _decoded_frames(results[case].rows) for case in CASES}

    def _files_read(self, case: str, file_digests: dict[str, str]) -> list[Path]:
        ref = self.refs[case]
        files = []
        for rel in sorted(file_digests):
            # the digests are keyed by path relative to the case folder; accept atlas-relative keys too
            found = [p for p in (ref.root / rel, self.atlas / rel, Path(rel)) if p.is_file()]
            if not found:
                raise FileNotFoundError(f"{case}: curate_case read {rel!r}, which the bench cannot find")
            files.append(found[0])
        return files

    def run(self, case: str) -> dict[str, Any]:
        seconds, cpu, out_bytes, read_bytes = {}, {}, 0, 0
        beside = {"sha256_cpu_s": 0.0, "scan_cpu_s": 0.0, "beside_wall_s": 0.0}  # timed apart, in the libdeflate pass
        for codec in ("isal", "libdeflate"):
            started, started_cpu = time.perf_counter(), time.process_time()
            out_bytes = 0
            for path in self.files[case]:
                raw = path.read_bytes()
                read_bytes += len(raw)
                if codec == "isal":
                    isize = int.from_bytes(raw[-4:], "little")
                    data = isal_zlib.decompress(raw, wbits=31, bufsize=max(isize, 1))
                else:
                    data = deflate.gzip_decompress(raw)  # checks the CRC-32 and the size
                    self._beside(path, raw, data, beside)
                out_bytes += len(data)
                del data
            seconds[codec], cpu[codec] = time.perf_counter() - started, time.process_time() - started_cpu
        cpu["libdeflate"] -= beside["sha256_cpu_s"] + beside["scan_cpu_s"]
        seconds["libdeflate"] -= beside.pop("beside_wall_s")
        best = min(cpu, key=cpu.__getitem__)  # the better codec on this case, by CPU time
        png_s, png_cpu_s = self._encode_frames(case)
        return {
            "isal_s": cpu["isal"],
            "libdeflate_s": cpu["libdeflate"],
            "files": len(self.files[case]),
            "inflated_mb": out_bytes / 1e6,
            "read_mb": read_bytes / 2e6,
            "seconds": seconds[best],
            "cpu_s": cpu[best],
            "png_s": png_s,
            "png_cpu_s": png_cpu_s,
            "frames": len(self.frames[case]),
            **beside,
        }

    @staticmethod
    def _beside(path: Path, raw: bytes, data: bytes, into: dict[str, float]) -> None:
        """Time, apart from the floor, two more things a row needs: the sha256 of the file (the manifest's promise)
        and, for an organ or lesion mask, one read of its voxels (its box cannot be found without one)."""
        wall, started = time.perf_counter(), time.process_time()
        hashlib.sha256(raw).digest()
        into["sha256_cpu_s"] += time.process_time() - started
        stem = path.name.removesuffix(".gz").removesuffix(".nii")
        if path.parent.name == "segmentations" and stem not in _PART_ONLY_MASKS:
            vox_offset = int(np.frombuffer(data, "<f4", count=1, offset=108)[0])  # NIfTI-1 (the bench's masks)
            voxels = np.frombuffer(data, np.uint8)[vox_offset:]
            started = time.process_time()
            np.bitwise_or.reduce(voxels[: voxels.size // 8 * 8].view(np.uint64))
            into["scan_cpu_s"] += time.process_time() - started
        into["beside_wall_s"] += time.perf_counter() - wall

    def _encode_frames(self, case: str) -> tuple[float, float]:
        """Wall and CPU seconds to PNG-encode the case's frames (ours' pixels, ours' level)."""
        level = self.cfg.frames.png_compress_level
        started, started_cpu = time.perf_counter(), time.process_time()
        for image in self.frames[case]:
            encode_png_gray8(image, level=level)
        return time.perf_counter() - started, time.process_time() - started_cpu


def _decoded_frames(rows: list[dict[str, Any]]) -> list[Any]:
    """The uint8 pixels of every frame of the rows, decoded from their PNGs (`{"bytes": png, "path": ...}`)."""
    return [
        cv2.imdecode(np.frombuffer(frame["bytes"], np.uint8), cv2.IMREAD_UNCHANGED)
        for row in rows
        for frame in row["frames"]
    ]


class Naive:
    """The baseline a straightforward script would be (nibabel `get_fdata` float64, full-volume scipy labels, boolean gathers: docs/scaling.md#what-curation-costs-measured-on-this-machine)."""

    def __init__(self, atlas: Path) -> None:
        self.refs = _refs(atlas)

    def run(self, case: str) -> dict[str, Any]:
        ref = self.refs[case]
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
        return {}


def _serve(kind: str, atlas: Path) -> None:
    """Worker loop: one JSON command per stdin line (`{"case": ...}`), one JSON answer per stdout line."""
    variant: Any = {
        "ours": lambda: Ours(atlas, reuse=True),
        "ours_default_heap": lambda: Ours(atlas, reuse=False),
        "floor": lambda: FairFloor(atlas),
        "naive": lambda: Naive(atlas),
    }[kind]()
    print(json.dumps({"ready": True, "heap_reused": getattr(variant, "heap_reused", False)}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        wall, cpu = time.perf_counter(), time.process_time()
        info = variant.run(command["case"])
        info.setdefault("seconds", time.perf_counter() - wall)
        info.setdefault("cpu_s", time.process_time() - cpu)
        info["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(info), flush=True)


class Worker:
    """A persistent worker process of one variant."""

    def __init__(self, kind: str, atlas: Path) -> None:
        self.kind = kind
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", kind, "--workdir", str(atlas.parent)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.heap_reused = self._read()["heap_reused"]

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise RuntimeError(f"the {self.kind} worker died (exit code {self.proc.wait()})")
        return json.loads(line)

    def run(self, case: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"case": case}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


# --- the driver ---------------------------------------------------------------------------------------------------


def measure(atlas: Path, rounds: int, compare_heap: bool) -> dict[str, Any]:
    """Run the interleaved rounds; return every sample, per variant and case."""
    kinds = ["ours", "floor"] + (["ours_default_heap"] if compare_heap else [])
    workers = {kind: Worker(kind, atlas) for kind in kinds}
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {k: {c: [] for c in CASES} for k in kinds + ["naive"]}
    try:
        for case in CASES:  # warm-up: imports, first-touch of the heap, the page cache
            for worker in workers.values():
                worker.run(case)
        for r in range(rounds):
            for case in CASES:
                for kind, worker in workers.items():
                    samples[kind][case].append(worker.run(case))
            if r == 0:
                naive = Worker("naive", atlas)  # fresh process each time: its peak RSS is its own
                samples["naive"]["lesions"].append(naive.run("lesions"))
                naive.close()
            print(f"round {r + 1}/{rounds}: " + _round_line(samples, r), flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    return {"samples": samples, "heap_reused": {k: w.heap_reused for k, w in workers.items()}}


def _round_line(samples: dict[str, Any], r: int) -> str:
    return ", ".join(
        f"{kind} {case} {runs[r]['seconds']:.2f}s"
        for kind, by_case in samples.items()
        for case, runs in by_case.items()
        if len(runs) > r
    )


def summarise(samples: dict[str, dict[str, list[dict[str, Any]]]], clock: str) -> dict[str, Any]:
    """Medians per variant and case (wall and CPU), and the headline ratios on `clock` ("cpu_s" or "seconds"):
    per-round ratios of the totals over both cases, median over rounds."""
    med = {
        metric: {
            kind: {case: statistics.median(s[metric] for s in runs) for case, runs in by_case.items() if runs}
            for kind, by_case in samples.items()
        }
        for metric in ("seconds", "cpu_s")
    }
    n_rounds = len(samples["ours"]["lesions"])

    def per_round(kind: str, base: str) -> float:
        return statistics.median(
            sum(samples[kind][c][r][clock] for c in CASES) / sum(samples[base][c][r][clock] for c in CASES)
            for r in range(n_rounds)
        )

    out: dict[str, Any] = {"clock": clock, "median": med, "ours/fair_floor": per_round("ours", "floor")}
    # Beside the floor, not in it: the PNG encode of ours' own frames, measured in the floor worker each round.
    png = "png_cpu_s" if clock == "cpu_s" else "png_s"
    out["png_encode/fair_floor"] = statistics.median(
        sum(samples["floor"][c][r][png] for c in CASES) / sum(samples["floor"][c][r][clock] for c in CASES)
        for r in range(n_rounds)
    )
    if clock == "cpu_s":  # the sha256 and mask-scan shares are CPU time only
        required = ("png_cpu_s", "sha256_cpu_s", "scan_cpu_s")
        out["required/fair_floor"] = statistics.median(
            sum(samples["floor"][c][r][k] for c in CASES for k in required)
            / sum(samples["floor"][c][r][clock] for c in CASES)
            for r in range(n_rounds)
        )
        out["ours/(fair_floor+required)"] = statistics.median(
            sum(samples["ours"][c][r][clock] for c in CASES)
            / sum(samples["floor"][c][r][clock] + sum(samples["floor"][c][r][k] for k in required) for c in CASES)
            for r in range(n_rounds)
        )
    out["ours/(fair_floor+png_encode)"] = statistics.median(
        sum(samples["ours"][c][r][clock] for c in CASES)
        / sum(samples["floor"][c][r][clock] + samples["floor"][c][r][png] for c in CASES)
        for r in range(n_rounds)
    )
    out["naive/ours"] = med[clock]["naive"]["lesions"] / med[clock]["ours"]["lesions"]
    out["peak_rss_mb"] = max(s["peak_rss_mb"] for runs in samples["ours"].values() for s in runs)
    if "ours_default_heap" in samples:
        out["default_heap/ours"] = per_round("ours_default_heap", "ours")
    return out


def print_table(summary: dict[str, Any], samples: dict[str, Any]) -> None:
    """The README table (markdown) and the targets."""
    wall, cpu, clock = summary["median"]["seconds"], summary["median"]["cpu_s"], summary["clock"]
    codec = {
        case: min(
            ("isal_s", "ISA-L"), ("libdeflate_s", "libdeflate"), key=lambda k: statistics.median(s[k[0]] for s in runs)
        )[1]
        for case, runs in samples["floor"].items()
    }
    print()
    print("| variant | case | wall s (median) | CPU s (median) | CPU vs fair floor | peak RSS (MB) |")
    print("|---|---|---:|---:|---:|---:|")
    for kind in wall:
        for case in wall[kind]:
            label = f"fair floor ({codec[case]})" if kind == "floor" else kind
            peak = max(s["peak_rss_mb"] for s in samples[kind][case])
            ratio = cpu[kind][case] / cpu["floor"][case]
            print(f"| {label} | {case} | {wall[kind][case]:.3f} | {cpu[kind][case]:.3f} | {ratio:.2f}x | {peak:.0f} |")
    for case, runs in samples["floor"].items():  # beside the floor, not in it
        png_wall = statistics.median(s["png_s"] for s in runs)
        for key, label in (
            ("png_cpu_s", f"not in the floor: PNG encode of ours' {runs[0]['frames']} frames"),
            ("sha256_cpu_s", "not in the floor: sha256 of the files"),
            ("scan_cpu_s", "not in the floor: one read of each organ/lesion mask"),
        ):
            value = statistics.median(s[key] for s in runs)
            shown_wall = f"{png_wall:.3f}" if key == "png_cpu_s" else ""
            print(f"| {label} | {case} | {shown_wall} | {value:.3f} | {value / cpu['floor'][case]:.2f}x | |")
    print()
    print(f"ratios on {'CPU time (user + system) of each worker' if clock == 'cpu_s' else 'wall-clock time'}:")
    for name, target in TARGETS.items():
        value, at_least = summary[name], name == "naive/ours"
        ok = value >= target if at_least else value <= target
        print(f"  {name} = {value:.2f} (target {'>=' if at_least else '<='} {target}): {'met' if ok else 'NOT met'}")
    print(
        f"  beside the floor: PNG-encoding ours' frames alone costs {summary['png_encode/fair_floor']:.2f}x the floor; "
        f"ours / (floor + that encode) = {summary['ours/(fair_floor+png_encode)']:.2f}"
    )
    if "required/fair_floor" in summary:
        print(
            f"  beside the floor: PNG encode + sha256 of the inputs + one read of each organ/lesion mask (for its box) = "
            f"{summary['required/fair_floor']:.2f}x the floor, so ours >= {1 + summary['required/fair_floor']:.2f}x "
            "the floor in any pipeline that does them as separate passes"
        )
        print(f"  ours / (floor + those three) = {summary['ours/(fair_floor+required)']:.2f}")
    if "default_heap/ours" in summary:
        print(f"  heap reuse: ours with glibc's default heap takes {summary['default_heap/ours']:.2f}x as long")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/emrl-bench"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare-heap", action="store_true", help="also run ours with glibc's default heap")
    parser.add_argument("--json", type=Path, default=None, help="write every sample and the summary here")
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="time the ratios use: cpu (default; on a shared machine wall time also counts the wait for a core)",
    )
    parser.add_argument("--serve", choices=["ours", "ours_default_heap", "floor", "naive"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    atlas = args.workdir / "atlas"
    if args.serve:
        _serve(args.serve, atlas)
        return
    write_cases(atlas)
    run = measure(atlas, args.rounds, args.compare_heap)
    summary = summarise(run["samples"], "cpu_s" if args.clock == "cpu" else "seconds")
    print_table(summary, run["samples"])
    if args.json:
        args.json.write_text(json.dumps({**run, "summary": summary}, indent=1))
    print(
        f"ours/fair_floor={summary['ours/fair_floor']:.2f}x naive/ours={summary['naive/ours']:.1f}x "
        f"peak_rss_mb={summary['peak_rss_mb']:.0f}"
    )


if __name__ == "__main__":
    main()
