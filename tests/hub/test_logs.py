"""The Hub libraries' warnings: once, a retry in one line, no signed URL; unit cases with exact lines, then a whole
`emrl build-sft-set hf://…` through a busy fake Hub whose every output is searched for credentials."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId
from prefect.client.schemas.sorting import FlowRunSort
from prefect.settings import PREFECT_API_URL

from emrl_data.reading.release import part_name
from emrl_data.synthetic import demo_specs, write_atlas
from emrl_data.synthetic.pack_release import write_release
from hub.logs import OneLineRetries, redact, route_library_logs
from hub.retry import ATTEMPTS
from tests.fakehub import FakeHub, serve_fake_hub


ROOT = Path(__file__).resolve().parents[2]
SECRETS = ("signature=", "Signature=", "X-Amz-", "Expires=", "expires=", "hf_fake_read", "Bearer ")


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord("huggingface_hub.utils._http", logging.WARNING, __file__, 1, message, None, None)


def test_a_retry_said_in_two_lines_by_the_library_is_one_line_without_its_url() -> None:
    one = OneLineRetries()
    failed = _record(
        "HTTP Error 429 thrown while requesting GET https://cdn.test/x.tar.gz?X-Amz-Signature=s&Expires=9"
    )
    assert one.filter(failed) is False  # dropped: its cause goes into the next line
    waiting = _record("Rate limited. Waiting 2.0s before retry [Retry 1/5].")
    assert one.filter(waiting) is True and waiting.getMessage() == "HTTP 429 from cdn.test: waiting 2 s, try 2 of 6"
    reset = _record("'[Errno 104] Connection reset by peer' thrown while requesting GET http://127.0.0.2:9/a?sig=1")
    assert one.filter(reset) is False
    backoff = _record("Retrying in 1s [Retry 2/5].")
    assert one.filter(backoff) is True
    assert backoff.getMessage() == "[Errno 104] Connection reset by peer from 127.0.0.2:9: waiting 1 s, try 3 of 6"
    other = _record("Could not read https://cdn.test/y?token=abc#frag here")
    assert one.filter(other) is True and other.getMessage() == "Could not read https://cdn.test/y here"
    assert redact("no url here") == "no url here"


def test_the_librarys_own_handler_goes_so_a_warning_is_printed_once(capsys: pytest.CaptureFixture[str]) -> None:
    library = logging.getLogger("huggingface_hub")
    own = logging.StreamHandler()  # what huggingface_hub adds at import
    library.addHandler(own)
    route_library_logs()
    route_library_logs()  # idempotent: one filter each
    assert own not in library.handlers
    http = logging.getLogger("huggingface_hub.utils._http")
    assert sum(isinstance(f, OneLineRetries) for f in http.filters) == 1


@pytest.mark.slow
def test_a_busy_hub_run_says_each_retry_once_and_no_credential_anywhere(prefect_harness, tmp_path: Path) -> None:
    """A redirect for every part, 429 on a part's first request, 503 on a download, a cut connection, a gated repo
    read with a token, and a part pair that fails for good (its signed URL refused on every try): stdout and stderr
    of the CLI, the run's Prefect logs and artifacts, the ledger and every output file hold no signed URL or token;
    the library's retry line appears once, as one line, and the failure is named in one line."""
    files = _release(tmp_path)
    with serve_fake_hub() as hub:
        hub.state.put_dataset(REPO, files, gated=True)
        image = part_name("image_only", 1, 3)
        hub.state.fail_next("HEAD", image, 429, retry_after=1)  # the library retries: its two lines become one
        hub.state.fail_next("GET", f"/cdn/{_sha(files[part_name('mask_only', 4, 6)])}", 503)
        hub.state.cut[part_name("image_only", 4, 6)] = 2000
        for _ in range(ATTEMPTS):  # an expired signed URL on every try: the pair fails after its retries
            hub.state.fail_next("GET", f"/cdn/{_sha(files[part_name('image_only', 7, 9)])}", 403, retry_after=1)
        out, done = _run_cli(hub, tmp_path)
    said = done.stdout + done.stderr
    assert done.returncode == 1, said[-3000:]
    assert hub.state.faults == [] and hub.state.cut == {}  # every fault was met
    port = hub.url.rsplit(":", 1)[1]
    assert said.count(f"HTTP 429 from 127.0.0.1:{port}: waiting 2 s, try 2 of 6") == 1, said[-3000:]
    assert "thrown while requesting" not in said and "Rate limited." not in said
    assert said.count("download: HTTP 503; waiting 1 s, try 2 of 6") == 1  # our retry of the 503, once
    assert said.count("download: HTTP 403; waiting 1 s, try") == ATTEMPTS - 1  # each retry of the refused URL, once
    failed = [line for line in done.stderr.splitlines() if line.startswith("emrl build-sft-set: failed: ")]
    assert failed == [
        "emrl build-sft-set: failed: 1 part pair(s) failed after their retries (2 finished): "
        "BDMAP_00000007_BDMAP_00000009: HfHubHTTPError: 403 Forbidden: fakehub: injected 403."
    ]
    assert not [s for s in SECRETS if s in said], said[-3000:]
    logs, artifacts = _run_logs_and_artifacts(out)
    size = r"[\d.]+ (?:B|KiB|MiB)"
    progress = rf"BDMAP_00000004_BDMAP_00000006: {size} of {size} \(\d+ %\), [\d.]+ MB/s, (?:ETA \d+ s|done)"
    assert len(re.findall(progress, logs)) >= 5  # the run's own lines: its byte progress, every 10 %
    assert "BDMAP_00000007_BDMAP_00000009 failed after its retries: HfHubHTTPError: 403" in logs
    assert not [s for s in SECRETS if s in logs], [
        line for line in logs.splitlines() if any(s in line for s in SECRETS)
    ]
    assert len(artifacts) >= 7 and not [a for a in artifacts if any(s in a for s in SECRETS)]
    assert [
        a for a in artifacts if a.startswith("build-sft-set-bytes ") and "(bytes downloaded, all part pairs) 100" in a
    ]
    written = [p for p in out.rglob("*") if p.is_file() and p.suffix in (".json", ".md", ".jsonl", ".csv", ".txt")]
    assert (out / ".work" / "parts").is_dir() and written  # the two finished pairs' ledger entries and cases
    assert not [p for p in written if any(s in p.read_text(errors="replace") for s in SECRETS)]


REPO = "AbdomenAtlas/AbdomenAtlas3.0Mini"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _release(tmp_path: Path) -> dict[str, bytes]:
    """Nine synthetic cases packed as the release, three to a part pair."""
    write_atlas(tmp_path / "atlas", demo_specs(9))
    return write_release(tmp_path / "atlas", tmp_path / "release", part_cases=3)


def _run_cli(hub: FakeHub, tmp_path: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """`emrl build-sft-set hf://…` with a read token against `hub`, stdout and stderr piped."""
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "PYTHONPATH": str(ROOT)}
    env.update(HF_ENDPOINT=hub.url, HF_TOKEN="hf_fake_read", HF_HOME=str(tmp_path / "hf"))
    out = tmp_path / "out"
    args = ["build-sft-set", f"hf://datasets/{REPO}", str(out), "--scratch", str(tmp_path / "scratch")]
    args += ["--frame-size", "64", "--max-frames", "4"]
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    return out, done


def _run_logs_and_artifacts(out: Path) -> tuple[str, list[str]]:
    """The log messages of the flow run that wrote `out`, and each of its artifacts (key, description, data) as
    text, read back through the Prefect client (the harness holds every test's runs)."""
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=20)
        run_id = next(r.id for r in runs if r.parameters.get("output_dir") == str(out))
        this_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))
        pages = [client.read_logs(this_run, limit=200, offset=i) for i in range(0, 2000, 200)]
        logs = "\n".join(log.message for page in pages for log in page)
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])), limit=200
        )
    return logs, [f"{a.key} {a.description} {a.data}" for a in found]
