"""From a Hub-protocol server to shards in the network-bound regime: `build-sft-set hf://…` end to end against the
download of the same files alone, over one throttled link.

A synthetic atlas is packed as the release (`emrl_data.synthetic.pack_release`) and served by the fake Hub of the tests
(`tests/fakehub.py`) on loopback, once per storage kind: LFS bytes redirected to its CDN host (`http`), and Xet files
from its CAS host read by hf_xet (`xet`); every response of every host together throttled to `--bandwidth-mbps` (one
shared link). In one process, one after the other: (a) every file of the release
downloaded alone (`hub.download.download_file`, one at a time: the link is the bound either way); (b) the `hf://` path
of `build-sft-set` with a scratch budget of one part pair (one pair at a time; each image part curated while it
downloads). Printed for each storage kind: both times and their ratio (goal: <= 1.1), and the peak bytes of (b)'s scratch folder, sampled on
disk every 5 ms, over the planned need of one part pair (`scratch_need`). Run: `make bench-hub` (or
`python bench/hub_curate.py --cases 8 --part-cases 4 --bandwidth-mbps 0.05`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from huggingface_hub import constants  # noqa: E402
from prefect.testing.utilities import prefect_test_harness

from emrl_data.reading.release import scratch_need  # noqa: E402
from emrl_data.synthetic import demo_specs, write_atlas  # noqa: E402
from emrl_data.synthetic.pack_release import write_release  # noqa: E402
from flows.build_sft_set import build_sft_set_flow
from hub.download import download_file
from hub.listing import resolve_release
from tests.fakehub import serve_fake_hub  # noqa: E402


REPO = "AbdomenAtlas/AbdomenAtlas3.0Mini"
FRAMES = {"frames": {"frame_size_px": 64, "max_frames": 8}}


class DiskPeak:
    """The most bytes the files under `root` held at once, sampled every 5 ms from another thread."""

    def __init__(self, root: Path) -> None:
        self.root, self.peak_bytes = root, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            total = 0
            for folder, _, names in os.walk(self.root):
                for name in names:
                    try:
                        total += os.stat(os.path.join(folder, name)).st_size
                    except FileNotFoundError:  # removed between the listing and the stat
                        pass
            self.peak_bytes = max(self.peak_bytes, total)

    def __enter__(self) -> DiskPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def download_alone(release: Any, work: Path) -> float:
    """(a): every file of the release, one after the other, verified."""
    started = time.perf_counter()
    for path, expected in sorted(release.files.items()):
        download_file(release.commit, path, work / "download" / path, expected)
    return time.perf_counter() - started


def hub_path(work: Path, budget: int) -> tuple[float, int, dict[str, Any]]:
    """(b): `build-sft-set hf://…` within a scratch budget of one part pair; seconds, sampled peak scratch, summary."""
    scratch = work / "scratch"
    scratch.mkdir(parents=True)
    with DiskPeak(scratch) as disk:
        started = time.perf_counter()
        summary = build_sft_set_flow(
            atlas_root=f"hf://datasets/{REPO}",
            output_dir=str(work / "out"),
            config=FRAMES,
            scratch_dir=str(scratch),
            scratch_budget=str(budget),
        )
        seconds = time.perf_counter() - started
    return seconds, disk.peak_bytes, summary["hub"]


def one_kind(root: Path, files: dict[str, bytes], kind: str, bandwidth_mbps: float) -> dict[str, Any]:
    """(a) then (b) against a fresh fake Hub serving the parts as `kind` (`http`: LFS from its CDN host; `xet`: Xet
    files from its CAS host, read by hf_xet), the link capped at `bandwidth_mbps` for every host together."""
    with serve_fake_hub(xet=kind == "xet", mb_per_s=None) as hub:
        hub.state.put_dataset(REPO, files)
        os.environ["HF_ENDPOINT"] = hub.url
        constants.ENDPOINT = hub.url

        release = resolve_release(REPO)
        one_pair = max(scratch_need(p) for p in release.pairs)
        hub.state.bandwidth_bps = bandwidth_mbps * 1e6
        a_s = download_alone(release, root / kind / "a")
        b_s, b_peak, summary = hub_path(root / kind / "b", one_pair)
        storage = "cas" if kind == "xet" else "cdn"
        return {
            "storage": kind,
            "storage_bytes_sent": hub.state.sent(storage),
            "download_alone_s": round(a_s, 2),
            "hub_end_to_end_s": round(b_s, 2),
            "parts_at_once": summary["parts_at_once"],
            "end_to_end_over_download": round(b_s / a_s, 3),
            "peak_scratch_bytes": b_peak,
            "one_part_pair_bytes": one_pair,
            "peak_scratch_over_one_pair": round(b_peak / one_pair, 3),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--part-cases", type=int, default=4)
    parser.add_argument("--bandwidth-mbps", type=float, default=0.05, help="the link, in MB/s (10**6 bytes)")
    parser.add_argument("--storage", nargs="+", choices=("http", "xet"), default=["http", "xet"])
    args = parser.parse_args()

    # One Prefect API server for every run, started before any clock starts.
    with tempfile.TemporaryDirectory() as tmp, prefect_test_harness(server_startup_timeout=120):
        root = Path(tmp)
        write_atlas(root / "atlas", demo_specs(args.cases))
        files = write_release(root / "atlas", root / "release", part_cases=args.part_cases)
        kinds = [one_kind(root, files, kind, args.bandwidth_mbps) for kind in args.storage]
    head = {"cases": args.cases, "part_cases": args.part_cases, "release_bytes": sum(len(d) for d in files.values())}
    print(json.dumps({**head, "bandwidth_MBps": args.bandwidth_mbps, "by_storage": kinds}, indent=2))


if __name__ == "__main__":
    main()
