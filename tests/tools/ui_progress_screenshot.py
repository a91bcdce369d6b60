"""A throttled `emrl build-sft-set hf://…` watched in the Prefect UI: the flow run's page, caught mid-run by headless
Chromium, with the byte progress of its part pairs (docs/img/ui-hub-bytes.png, shown in docs/operations.md).

What it does, all on loopback, in a temporary folder: writes a synthetic atlas packed as the release
(`emrl_data.synthetic.pack_release`), serves it from the fake Hub of the tests (`tests/fakehub.py`) throttled to
`--mb-per-s`, starts `prefect server start` (API and UI) with a home of its own, runs the CLI against both (its
output printed at the end), waits until the run's progress artifact `build-sft-set-bytes` is between `--at-pct` and
95 %, takes the screenshot of the run's Artifacts tab (the UI's v2 pages: v1 ignores `?tab=`), then waits for the
run to end and stops the server. Needs `chromium` on PATH (Debian: `apt-get install -y chromium`).

Run: `python -m tests.tools.ui_progress_screenshot --out docs/img/ui-hub-bytes.png [--mb-per-s 0.1] [--at-pct 40]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402

from emrl_data.synthetic import demo_specs, write_atlas  # noqa: E402
from emrl_data.synthetic.pack_release import write_release  # noqa: E402
from tests.fakehub import serve_fake_hub  # noqa: E402


ROOT = Path(__file__).resolve().parents[2]
REPO = "AbdomenAtlas/AbdomenAtlas3.0Mini"
ARTIFACT = "build-sft-set-bytes"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_server(home: Path, port: int) -> subprocess.Popen:
    """`prefect server start` (API and UI) on 127.0.0.1:`port`, in its own session; returns once `/api/health` answers."""
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env["PREFECT_UI_API_URL"] = f"http://127.0.0.1:{port}/api"  # the UI's default names port 4200
    env.pop("PREFECT_API_URL", None)
    prefect = str(Path(sys.executable).with_name("prefect"))
    log = (home / "server.log").open("wb")
    argv = [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--analytics-off"]
    server = subprocess.Popen(argv, env=env, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            break
        time.sleep(1)
    raise SystemExit(f"the Prefect server did not start: see {home / 'server.log'}")


def _progress(api: str, output_dir: str) -> tuple[str | None, float]:
    """The flow run that writes `output_dir` and its bytes artifact's percentage (None, 0 before they exist)."""
    runs = httpx.post(f"{api}/flow_runs/filter", json={"limit": 20}, timeout=10).json()
    run = next((r for r in runs if r["parameters"].get("output_dir") == output_dir), None)
    if run is None:
        return None, 0.0
    body = {"artifacts": {"flow_run_id": {"any_": [run["id"]]}, "type": {"any_": ["progress"]}}, "limit": 50}
    found = httpx.post(f"{api}/artifacts/filter", json=body, timeout=10).json()
    pct = max((float(a["data"]) for a in found if a["key"] == ARTIFACT), default=0.0)
    return run["id"], pct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "ui-hub-bytes.png")
    parser.add_argument("--mb-per-s", type=float, default=0.1, help="the fake Hub's bandwidth")
    parser.add_argument("--at-pct", type=float, default=40.0, help="take the screenshot past this much of the bytes")
    parser.add_argument("--cases", type=int, default=12, help="synthetic cases, 4 to a part pair")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium is not on PATH (Debian: apt-get install -y chromium)")
    work = Path(tempfile.mkdtemp(prefix="ui-progress-"))
    write_atlas(work / "atlas", demo_specs(args.cases))
    files = write_release(work / "atlas", work / "release", part_cases=4)
    port = _free_port()
    (work / "prefect").mkdir()
    server = _start_server(work / "prefect", port)
    api, out = f"http://127.0.0.1:{port}/api", str(work / "out")
    try:
        with serve_fake_hub(mb_per_s=args.mb_per_s) as hub:
            hub.state.put_dataset(REPO, files)
            env = {**os.environ, "PREFECT_API_URL": api, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": hub.url}
            env.update(HF_HOME=str(work / "hf"), PREFECT_HOME=str(work / "prefect"))
            argv = [sys.executable, "-m", "cli.main", "build-sft-set", f"hf://datasets/{REPO}", out]
            argv += ["--frame-size", "64", "--max-frames", "8"]
            with (work / "cli.log").open("wb") as log:
                run = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=log)
                run_id, pct = None, 0.0
                while run.poll() is None and not (run_id and args.at_pct <= pct < 95.0):
                    time.sleep(0.5)
                    run_id, pct = _progress(api, out)
                if run_id is None or run.poll() is not None:
                    raise SystemExit(f"the run ended before {args.at_pct} % of its bytes: see {work / 'cli.log'}")
                url = f"http://127.0.0.1:{port}/v2/runs/flow-run/{run_id}?tab=Artifacts"
                args.out.parent.mkdir(parents=True, exist_ok=True)
                shot = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
                shot += [
                    f"--screenshot={args.out.resolve()}",
                    "--window-size=1400,1000",
                    "--virtual-time-budget=15000",
                ]
                subprocess.run([*shot, url], check=True, capture_output=True, timeout=120)
                print(f"screenshot at {pct:.0f} % of the bytes: {args.out} ({url})")
                run.wait(timeout=600)
        print((work / "cli.log").read_text(errors="replace")[-3000:])
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
