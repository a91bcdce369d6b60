"""From a Hub-protocol server to shards: (a) download every part, unpack them all, then curate, against (b) the
`hf://` path of `build-sft-set` (verified downloads, one part pair at a time, CTs streamed out of the tar).

A synthetic atlas is packed as the release (`emrl_data.synthetic.release`) and served by the fake Hub of the tests
(`tests/fakehub.py`) on 127.0.0.1, throttled to `--bandwidth-mbps`. Both ways run in one process, one after the other;
printed: end-to-end seconds and peak scratch bytes of each, and the two ratios (a)/(b). Peak scratch: (a) every
`tar.gz` plus every unpacked file (measured on disk); (b) the per-part peak the flow measured times the parts it ran at
once. Run: `make bench-hub` (or `python bench/hub_curate.py --cases 8 --part-cases 4 --bandwidth-mbps 20`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from huggingface_hub import constants  # noqa: E402

from emrl_data.reading.archive import ScratchMeter, read_part  # noqa: E402
from emrl_data.reading.release import HubFile, parse_part_name  # noqa: E402
from emrl_data.synthetic import demo_specs, write_atlas  # noqa: E402
from emrl_data.synthetic.release import write_release  # noqa: E402
from tests.fakehub import serve_fake_hub  # noqa: E402


REPO = "AbdomenAtlas/AbdomenAtlas3.0Mini"
FRAMES = {"frames": {"frame_size_px": 64, "max_frames": 8}}


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def download_then_curate(release: Any, files: dict[str, bytes], work: Path) -> tuple[float, int]:
    """(a): every file downloaded, every part unpacked, then the on-disk atlas curated."""
    from flows.build_sft_set import build_sft_set_flow
    from hub.download import download_file

    started = time.perf_counter()
    atlas = work / "atlas"
    for path, data in files.items():
        expected = HubFile(path, len(data), hashlib.sha256(data).hexdigest())
        download_file(release.commit, path, work / "download" / path, expected)
    for path in files:
        parsed = parse_part_name(path)
        if parsed is None:
            (atlas / path).parent.mkdir(parents=True, exist_ok=True)
            (atlas / path).write_bytes((work / "download" / path).read_bytes())
            continue
        with (work / "download" / path).open("rb") as fh:
            read_part(fh, name=path, kind=parsed[0], dest=atlas, case_range=parsed[1:], meter=ScratchMeter(1 << 50))
    peak = _du(work)
    build_sft_set_flow(atlas_root=str(atlas), output_dir=str(work / "out"), config=FRAMES)
    return time.perf_counter() - started, peak


def hub_path(work: Path) -> tuple[float, int]:
    """(b): `build-sft-set hf://…`."""
    from flows.build_sft_set import build_sft_set_flow

    started = time.perf_counter()
    summary = build_sft_set_flow(atlas_root=f"hf://datasets/{REPO}", output_dir=str(work / "out"), config=FRAMES)
    hub = summary["hub"]
    return time.perf_counter() - started, hub["peak_scratch_bytes_per_part"] * hub["parts_at_once"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--part-cases", type=int, default=4)
    parser.add_argument("--bandwidth-mbps", type=float, default=20.0, help="server bandwidth in MB/s (10**6 bytes)")
    args = parser.parse_args()
    from prefect.testing.utilities import prefect_test_harness

    # One Prefect API server for both ways, started before either clock starts.
    with (
        tempfile.TemporaryDirectory() as tmp,
        serve_fake_hub() as hub,
        prefect_test_harness(server_startup_timeout=120),
    ):
        root = Path(tmp)
        write_atlas(root / "atlas", demo_specs(args.cases))
        files = write_release(root / "atlas", root / "release", part_cases=args.part_cases)
        hub.state.put_dataset(REPO, files)
        hub.state.bandwidth_bps = args.bandwidth_mbps * 1e6
        os.environ["HF_ENDPOINT"] = hub.url
        constants.ENDPOINT = hub.url
        from hub.listing import resolve_release

        release = resolve_release(REPO)
        a_s, a_peak = download_then_curate(release, files, root / "a")
        b_s, b_peak = hub_path(root / "b")
    print(
        json.dumps(
            {
                "cases": args.cases,
                "part_cases": args.part_cases,
                "release_bytes": sum(len(d) for d in files.values()),
                "bandwidth_MBps": args.bandwidth_mbps,
                "a_download_unpack_curate": {"seconds": round(a_s, 2), "peak_scratch_bytes": a_peak},
                "b_hub_streamed": {"seconds": round(b_s, 2), "peak_scratch_bytes": b_peak},
                "time_ratio_a_over_b": round(a_s / b_s, 2),
                "peak_disk_ratio_a_over_b": round(a_peak / b_peak, 2),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
