"""Measure the NIfTI decode path on one 512x512x300 case: ours (libdeflate into reused per-thread buffers, header
bounded) against plain fresh-buffer inflates of the same files, plus the cost of the placement evidence.

Every round runs every method once, in turn (interleaved), in one warm process; medians of the rounds after a
warm-up round. Peak RSS of each method is measured in its own fresh process.

    PYTHONPATH=$PWD python bench/nifti_decode.py [--rounds 5] [--workdir /tmp/emrl-nifti-bench] [--methods a,b]
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

import deflate
from isal import isal_zlib

from emrl_data.reading import inflate
from emrl_data.reading.atlas import discover_cases
from emrl_data.reading.case_images import open_case
from emrl_data.reading.nifti import read_nifti
from emrl_data.reading.placement import BodyEvidence, mini_body_box, verify_organ_mask
from emrl_data.synthetic import bench_spec, write_atlas


ROOT = Path(__file__).resolve().parent.parent


def _case(workdir: Path):  # type: ignore[no-untyped-def]

    atlas = workdir / "atlas"
    if not atlas.exists():
        write_atlas(atlas, [bench_spec()], metadata_csv=False, split_files=False)
    (ref,) = discover_cases(atlas).refs
    return ref


def _files(ref) -> list[Path]:  # type: ignore[no-untyped-def]
    return [ref.ct_path, *sorted(p for p in ref.mask_dir.iterdir() if p.name.endswith(".nii.gz"))]


def ours(ref) -> None:  # type: ignore[no-untyped-def]
    """open_case + every mask (placement and, for organ masks, evidence checks included)."""
    case = open_case(ref)
    for path in _files(ref)[1:]:
        case.mask(path.name.removesuffix(".nii.gz"))


def ours_read_only(ref) -> None:  # type: ignore[no-untyped-def]
    """read_nifti of every file (decode path only, no placement/evidence)."""
    files = _files(ref)
    read_nifti(files[0], role="ct")
    for path in files[1:]:
        read_nifti(path, role="mask")


def ours_no_pool(ref) -> None:  # type: ignore[no-untyped-def]

    inflate.configure_buffer_pool(0)
    try:
        ours_read_only(ref)
    finally:
        inflate.configure_buffer_pool(inflate.DEFAULT_POOL_MAX_BYTES)


def isal_fresh(ref) -> None:  # type: ignore[no-untyped-def]
    """The previous loader's inflate: ISA-L one-shot into a fresh buffer of ISIZE bytes."""
    for path in _files(ref):
        raw = path.read_bytes()
        isal_zlib.decompress(raw, wbits=31, bufsize=max(1, int.from_bytes(raw[-4:], "little")))


def libdeflate_fresh(ref) -> None:  # type: ignore[no-untyped-def]
    """libdeflate one-shot (`deflate.gzip_decompress`, CRC/ISIZE checked) into a fresh buffer."""
    for path in _files(ref):
        deflate.gzip_decompress(path.read_bytes())


_LOADED: dict = {}
_ORGAN_FILES = (("liver", "liver"), ("pancreas", "pancreas"), ("kidney", "kidney_left"), ("kidney", "kidney_right"))


def _loaded(ref):  # type: ignore[no-untyped-def]
    """The CT and the four organ masks, read once (so that the evidence methods time the evidence only)."""
    if not _LOADED:
        _LOADED["ct"] = read_nifti(ref.ct_path, role="ct")
        for _, name in _ORGAN_FILES:
            _LOADED[name] = read_nifti(ref.mask_dir / f"{name}.nii.gz", role="mask").data
    return _LOADED


def evidence(ref) -> None:  # type: ignore[no-untyped-def]
    """The placement evidence alone (files already read): subsampled hole-filled body + four organ-mask checks."""
    data = _loaded(ref)
    ev = BodyEvidence(data["ct"].data, data["ct"].affine)
    for organ, name in _ORGAN_FILES:
        verify_organ_mask(data[name], ev, organ=organ, structure=name, name=name, how="bench", min_body_fraction=0.99)


def mini_crop(ref) -> None:  # type: ignore[no-untyped-def]
    """Reproducing OncoKit Mini's body crop on the full CT (paid only for identical-affine smaller masks)."""
    mini_body_box(_loaded(ref)["ct"].data)


METHODS = {
    f.__name__: f for f in (ours, ours_read_only, ours_no_pool, isal_fresh, libdeflate_fresh, evidence, mini_crop)
}


def vm_hwm_mb() -> float:
    """Peak RSS of this process (VmHWM; unlike ru_maxrss it is not inherited from the parent across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak(name: str, workdir: Path) -> float:
    code = (
        f"import sys; from pathlib import Path; sys.path.insert(0, {str(ROOT)!r}); import bench.nifti_decode as b; "
        f"ref = b._case(Path({str(workdir)!r})); b.METHODS[{name!r}](ref); b.METHODS[{name!r}](ref); "
        "print(b.vm_hwm_mb())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/emrl-nifti-bench"))
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of the methods")
    args = parser.parse_args()
    methods = {n: METHODS[n] for n in args.methods.split(",")}
    ref = _case(args.workdir)
    sizes = {p.name: p.stat().st_size for p in _files(ref)}
    times: dict[str, list[float]] = {n: [] for n in methods}
    for rnd in range(args.rounds + 1):
        for name, fn in methods.items():
            t = time.perf_counter()
            fn(ref)
            if rnd:
                times[name].append(time.perf_counter() - t)
    result = {
        "files": len(sizes),
        "compressed_mb": round(sum(sizes.values()) / 1e6, 1),
        "median_s": {n: round(statistics.median(v), 3) for n, v in times.items()},
        "min_s": {n: round(min(v), 3) for n, v in times.items()},
        "peak_rss_mb": {n: round(_peak(n, args.workdir)) for n in methods},
        "this_process_peak_rss_mb": round(vm_hwm_mb()),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
