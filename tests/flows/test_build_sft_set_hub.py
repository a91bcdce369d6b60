"""`build-sft-set hf://datasets/…`: the release read from a Hub-protocol server by the real huggingface_hub client.

The fake Hub (tests/fakehub.py) serves a synthetic atlas packed as the release (`emrl_data.synthetic.pack_release`):
parts of 3 cases under the released names, listed with their sha256 as LFS files.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from emrl_data.reading.release import part_name
from emrl_data.synthetic import demo_specs, write_atlas
from emrl_data.synthetic.pack_release import tar_gz, write_release
from flows.build_sft_set import build_sft_set_flow
from tests.fakehub import FakeHub, client_on_fake_hub
from tests.flows.helpers import rejection_rows


REPO = "AbdomenAtlas/AbdomenAtlas3.0Mini"
ROOT = f"hf://datasets/{REPO}"
N_CASES, PART_CASES = 6, 3
FRAMES = {"frames": {"frame_size_px": 64, "max_frames": 8}}


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("hub-atlas")
    write_atlas(root / "atlas", demo_specs(N_CASES))
    return root / "atlas", write_release(root / "atlas", root / "release", part_cases=PART_CASES)


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    with client_on_fake_hub(monkeypatch, tmp_path / "hf") as fake:
        yield fake


def _shards(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for table in ("findings", "sft", "rejections")
        for p in sorted((out / table / "data").glob("*.parquet"))
    }


def _build(out: Path, **kwargs) -> dict:
    return build_sft_set_flow(atlas_root=ROOT, output_dir=str(out), config=FRAMES, max_workers=2, **kwargs)


def _rejections(out: Path) -> list[tuple]:
    return sorted(rejection_rows(out, "case_id", "step", "reason"))


@pytest.mark.slow
def test_hub_run_equals_the_unpacked_atlas_then_reads_no_part_and_then_only_the_changed_one(
    prefect_harness, release: tuple[Path, dict[str, bytes]], hub: FakeHub, tmp_path: Path
) -> None:
    atlas, files = release
    sha = hub.state.put_dataset(REPO, files)
    on_disk = build_sft_set_flow(atlas_root=str(atlas), output_dir=str(tmp_path / "disk"), config=FRAMES)

    summary = _build(tmp_path / "hub", scratch_dir=str(tmp_path / "scratch"))
    assert _shards(tmp_path / "hub") == _shards(tmp_path / "disk")  # byte for byte
    assert summary["cases"] == on_disk["cases"] == N_CASES
    assert summary["hub"]["sha"] == sha and summary["atlas_revision"] == sha
    assert summary["hub"]["part_pairs"] == 2 and summary["hub"]["parts_read"] == 2
    assert summary["hub"]["bytes_read"] == sum(len(d) for p, d in files.items() if p.endswith(".tar.gz"))
    manifest = json.loads((tmp_path / "hub" / "findings" / "manifest.json").read_text())
    assert manifest["atlas_revision"] == sha
    assert f"`{ROOT}@{sha}`" in (tmp_path / "hub" / "sft" / "README.md").read_text()
    assert not any((tmp_path / "scratch").iterdir())  # everything unpacked is gone

    # An unchanged release: no part is read.
    served = dict(hub.state.served)
    again = _build(tmp_path / "hub", scratch_dir=str(tmp_path / "scratch"))
    assert again["hub"]["parts_from_ledger"] == 2 and again["hub"]["bytes_read"] == 0
    assert {p: n for p, n in hub.state.served.items() if p.endswith(".tar.gz")} == {
        p: n for p, n in served.items() if p.endswith(".tar.gz")
    }
    assert _shards(tmp_path / "hub") == _shards(tmp_path / "disk")

    # A new revision with one changed part (same members, packed again in another order): only that part is read.
    changed = part_name("mask_only", 4, 6)
    tar = files[changed]
    import gzip
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(tar))) as t:
        entries = [(m.name, None if m.isdir() else t.extractfile(m).read()) for m in t.getmembers()]
    new = tar_gz(list(reversed(entries)))
    new_sha = hub.state.put_dataset(REPO, {changed: new}, title="repack one part")
    third = _build(tmp_path / "hub", scratch_dir=str(tmp_path / "scratch"))
    assert third["hub"]["sha"] == new_sha != sha
    assert (third["hub"]["parts_read"], third["hub"]["parts_from_ledger"]) == (1, 1)
    assert third["hub"]["bytes_read"] == len(new) + len(files[part_name("image_only", 4, 6)])
    assert _shards(tmp_path / "hub") == _shards(tmp_path / "disk")


@pytest.mark.slow
def test_a_part_failing_its_checksum_is_fetched_again_then_its_cases_are_rejected(
    prefect_harness, release: tuple[Path, dict[str, bytes]], hub: FakeHub, tmp_path: Path
) -> None:
    _, files = release
    hub.state.put_dataset(REPO, files)
    bad = part_name("image_only", 1, 3)
    hub.state.corrupt[bad] = 1  # once: the second fetch verifies
    summary = _build(tmp_path / "once")
    assert summary["hub"]["parts_failed_verification"] == 0 and summary["cases"] == N_CASES

    hub.state.corrupt[bad] = 2  # twice: the part's cases become rejections, the run goes on
    summary = _build(tmp_path / "twice")
    assert summary["hub"]["parts_failed_verification"] == 1
    rejected = [r for r in _rejections(tmp_path / "twice") if r[2] == "part_checksum_mismatch"]
    assert rejected == [(f"BDMAP_{i:08d}", "fetch", "part_checksum_mismatch") for i in (1, 2, 3)]
    assert summary["cases"] == N_CASES  # cases 4-6 curated


class _DiskSampler:
    """The most bytes the files under `root` held at once, sampled every 5 ms from another thread."""

    def __init__(self, root: Path) -> None:
        self.root, self.peak_bytes = root, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            total = 0
            for folder, _, names in os.walk(self.root):  # a folder removed mid-walk is skipped, not raised
                for name in names:
                    try:
                        total += os.stat(os.path.join(folder, name)).st_size
                    except FileNotFoundError:  # removed between the listing and the stat
                        pass
            self.peak_bytes = max(self.peak_bytes, total)

    def __enter__(self) -> _DiskSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.slow
def test_the_scratch_budget_sets_parts_at_once_and_holds(
    prefect_harness, release: tuple[Path, dict[str, bytes]], hub: FakeHub, tmp_path: Path
) -> None:
    _, files = release
    hub.state.put_dataset(REPO, files)
    from emrl_data.reading.release import pair_parts, scratch_need
    from hub.listing import resolve_release

    pairs = resolve_release(REPO).pairs
    need = max(scratch_need(p) for p in pairs)
    assert pair_parts  # imported for the reader: the pairs come from the listing
    hub.state.bandwidth_bps = max(len(d) for d in files.values()) / 1.5  # downloads long enough to be sampled
    with _DiskSampler(tmp_path / "scratch") as sampled:
        summary = _build(tmp_path / "one", scratch_dir=str(tmp_path / "scratch"), scratch_budget=str(need))
    hub.state.bandwidth_bps = None
    assert 0 < sampled.peak_bytes <= need  # measured on disk, beside the run's own accounting
    assert summary["hub"]["parts_at_once"] == 1
    assert 0 < summary["hub"]["peak_scratch_bytes_per_part"] <= need
    assert all(r["peak_scratch_bytes"] <= need for r in summary["hub"]["per_part"])
    with pytest.raises(ValueError, match="is below the"):
        _build(tmp_path / "none", scratch_budget=str(need - 1))


@pytest.mark.slow
def test_a_limited_hub_run_reads_only_the_parts_holding_its_cases(
    prefect_harness, release: tuple[Path, dict[str, bytes]], hub: FakeHub, tmp_path: Path
) -> None:
    """`limit=2`: the first pair only (cases 1-2 of it), and the shards of `limit=2` on the unpacked atlas."""
    atlas, files = release
    hub.state.put_dataset(REPO, files)
    on_disk = build_sft_set_flow(atlas_root=str(atlas), output_dir=str(tmp_path / "disk"), config=FRAMES, limit=2)
    summary = _build(tmp_path / "hub", limit=2)
    assert summary["cases"] == on_disk["cases"] == 2
    assert (summary["hub"]["part_pairs"], summary["hub"]["parts_read"]) == (1, 1)
    first = [part_name(kind, 1, PART_CASES) for kind in ("image_only", "mask_only")]
    assert summary["hub"]["bytes_read"] == sum(len(files[p]) for p in first)
    assert _shards(tmp_path / "hub") == _shards(tmp_path / "disk")


@pytest.mark.slow
def test_a_hub_run_on_dask_workers_equals_threads(
    prefect_harness, release: tuple[Path, dict[str, bytes]], hub: FakeHub, tmp_path: Path
) -> None:
    """The part tasks run unchanged on a Dask LocalCluster (worker processes downloading from the Hub themselves)."""
    _, files = release
    hub.state.put_dataset(REPO, files)
    _build(tmp_path / "thread")
    summary = _build(tmp_path / "dask", task_runner="dask")
    assert summary["hub"]["parts_read"] == 2 and summary["cases"] == N_CASES
    assert _shards(tmp_path / "dask") == _shards(tmp_path / "thread")


def test_a_download_killed_mid_part_resumes_where_it_stopped(hub: FakeHub, tmp_path: Path) -> None:
    """kill -9 of the downloading process after its first MiB; the rerun asks only for the rest (HTTP Range)."""
    import hashlib
    import subprocess
    import sys

    from emrl_data.reading.release import HubFile
    from hub.download import download_file
    from hub.listing import resolve_release

    data = bytes(range(256)) * (3 << 12)  # 3 MiB
    path = part_name("image_only", 1, 3)
    hub.state.put_dataset(REPO, {path: data, part_name("mask_only", 1, 3): b"m"})
    commit = resolve_release(REPO).commit
    expected = HubFile(path, len(data), hashlib.sha256(data).hexdigest())
    dest = tmp_path / "image.tar.gz"
    killer = (
        "import os, signal, sys\n"
        "from emrl_data.reading.release import HubFile\n"
        "from hub.download import download_file\n"
        "from hub.listing import HubCommit\n"
        "import huggingface_hub.constants as c; c.DOWNLOAD_CHUNK_SIZE = 1 << 20\n"  # 1 MiB writes, not 10
        "f = HubFile(sys.argv[3], int(sys.argv[4]), sys.argv[5])\n"
        "download_file(HubCommit(*sys.argv[6:9]), sys.argv[3], __import__('pathlib').Path(sys.argv[2]), f,"
        " on_bytes=lambda n: os.kill(os.getpid(), signal.SIGKILL))\n"
    )
    args = [commit.sha, str(dest), path, str(len(data)), expected.sha256 or "", commit.repo_id, commit.sha]
    args.append(commit.endpoint)
    done = subprocess.run([sys.executable, "-c", killer, *args], env=os.environ.copy(), timeout=120)
    assert done.returncode == -9
    partial = dest.with_name(dest.name + ".incomplete")
    left = partial.stat().st_size
    assert 0 < left < len(data)

    resumed = download_file(commit, path, dest, expected)
    assert (resumed.resumed_from, resumed.bytes_read) == (left, len(data) - left)
    assert hub.state.ranges[-1] == (path, left)
    assert dest.read_bytes() == data and not partial.exists()


@pytest.mark.slow
def test_a_run_killed_mid_part_resumes_that_part_and_reads_no_finished_one(
    prefect_harness, release: tuple[Path, dict[str, bytes]], hub: FakeHub, tmp_path: Path
) -> None:
    """kill -9 of a running `build-sft-set hf://…` flow while its second part's CT archive is coming in.

    One part pair at a time (the scratch budget), the Hub throttled so the kill lands inside that download. The rerun
    finds the first pair in the part ledger (no byte read), asks only for the rest of the interrupted archive (HTTP
    Range) and writes the shards the unpacked atlas gives.
    """

    import signal
    import subprocess
    import sys
    import time

    from prefect.settings import PREFECT_API_URL

    from emrl_data.reading.release import scratch_need
    from hub.listing import resolve_release
    from hub.pairs import archive_path

    atlas, files = release
    hub.state.put_dataset(REPO, files)
    on_disk = build_sft_set_flow(atlas_root=str(atlas), output_dir=str(tmp_path / "disk"), config=FRAMES)
    first, second = resolve_release(REPO).pairs
    image = part_name("image_only", second.start, second.end)
    hub.state.bandwidth_bps = len(files[image]) / 4.0  # about 4 s for the archive the kill interrupts
    budget, out, scratch = str(max(scratch_need(p) for p in (first, second))), tmp_path / "hub", tmp_path / "scratch"
    run = (
        "import json, sys\n"
        "import huggingface_hub.constants as c; c.DOWNLOAD_CHUNK_SIZE = 1 << 16\n"  # 64 KiB writes, not 10 MiB
        "from flows.build_sft_set import build_sft_set_flow\n"
        "build_sft_set_flow(atlas_root=sys.argv[1], output_dir=sys.argv[2], config=json.loads(sys.argv[3]),"
        " scratch_dir=sys.argv[4], scratch_budget=sys.argv[5], max_workers=2)\n"
    )
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    args = [ROOT, str(out), json.dumps(FRAMES), str(scratch), budget]
    archive = archive_path(scratch, second, second.image)
    partial = archive.with_name(archive.name + ".incomplete")
    log = open(tmp_path / "killed.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [sys.executable, "-c", run, *args], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 180
        while not (partial.exists() and partial.stat().st_size > 0):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "killed.log").read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    left = partial.stat().st_size
    assert 0 < left < len(files[image])

    hub.state.bandwidth_bps = None
    summary = _build(out, scratch_dir=str(scratch), scratch_budget=budget)
    assert (summary["hub"]["parts_from_ledger"], summary["hub"]["parts_read"]) == (1, 1)
    assert hub.state.ranges[-1] == (image, left)
    mask = archive_path(scratch, second, second.mask)  # verified before the kill, kept: never downloaded again
    assert summary["hub"]["bytes_read"] == len(files[image]) - left and not mask.exists()
    assert summary["cases"] == on_disk["cases"] == N_CASES
    assert _shards(out) == _shards(tmp_path / "disk")
    assert not any(scratch.iterdir())


def test_fetch_atlas_writes_the_released_layout_and_skips_finished_parts(
    release: tuple[Path, dict[str, bytes]], hub: FakeHub, tmp_path: Path
) -> None:
    atlas, files = release
    hub.state.put_dataset(REPO, files)
    from hub.fetch import fetch_atlas

    report = fetch_atlas(tmp_path / "dest", repo_id=REPO, workers=2)
    assert len(report["fetched"]) == 4 and report["failed"] == [] and report["rejected"] == []
    for path in sorted(atlas.rglob("*")):
        rel = path.relative_to(atlas)
        if path.is_file() and rel.parts[0] in ("image_only", "mask_only", "TrainTestIDS"):
            assert (tmp_path / "dest" / rel).read_bytes() == path.read_bytes(), rel
    served = dict(hub.state.served)
    again = fetch_atlas(tmp_path / "dest", repo_id=REPO, workers=2)
    assert len(again["skipped"]) == 4 and again["fetched"] == []
    assert {p: n for p, n in hub.state.served.items() if p.endswith(".tar.gz")} == {
        p: n for p, n in served.items() if p.endswith(".tar.gz")
    }


@pytest.mark.slow
def test_a_busy_hub_429_503_a_cut_and_redirects_still_accounts_for_every_case(
    prefect_harness, release: tuple[Path, dict[str, bytes]], hub: FakeHub, tmp_path: Path, monkeypatch
) -> None:
    """Every part's first request answered 429 (`Retry-After: 1`), the listing and one download 503, one download cut
    mid-part, every part redirected to the second host: the run ends with every case curated, no token off the Hub."""
    _, files = release
    hub.state.put_dataset(REPO, files)
    monkeypatch.setenv("HF_TOKEN", "hf_fake_read")
    parts = [p for p in files if p.endswith(".tar.gz")]
    hub.state.fail_next("GET", f"/api/datasets/{REPO}", 503, retry_after=1)
    for part in parts:
        hub.state.fail_next("HEAD", part, 429, retry_after=1)
    import hashlib

    hub.state.fail_next("GET", f"/cdn/{hashlib.sha256(files[parts[0]]).hexdigest()}", 503)
    hub.state.cut[parts[1]] = 2000
    summary = _build(tmp_path / "busy")
    assert summary["cases"] == N_CASES and summary["hub"]["parts_read"] == 2
    assert summary["hub"]["parts_failed_verification"] == 0
    assert [r for r in _rejections(tmp_path / "busy") if r[1] in ("fetch", "archive")] == []
    assert hub.state.faults == [] and hub.state.cut == {}  # every fault was met
    assert set(hub.state.cdn_authorizations) == {""} and len(hub.state.cdn_authorizations) >= len(parts)


@pytest.mark.slow
def test_a_gated_release_without_a_token_stops_the_run_with_one_line(
    prefect_harness, release: tuple[Path, dict[str, bytes]], hub: FakeHub, tmp_path: Path
) -> None:
    from hub.listing import HubAccessError

    _, files = release
    hub.state.put_dataset(REPO, files, gated=True)
    with pytest.raises(HubAccessError) as raised:
        _build(tmp_path / "gated")
    assert str(raised.value) == (
        f"{ROOT} is gated and no Hugging Face token is set: set HF_TOKEN (or run `hf auth login`) with a token of an "
        "account that accepted its terms"
    )
    assert not any(r.startswith("CDN ") for r in hub.state.requests)  # no byte of a part was asked for


def test_fetch_atlas_interrupted_mid_unpack_completes_on_rerun_without_fetching_the_part_again(
    release: tuple[Path, dict[str, bytes]], hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash after a part is verified and unpacked into its temporary folder, but before its cases are moved in (a
    stale case folder left in DEST too): the rerun unpacks again from the kept archive and replaces the stale folder."""
    import hub.fetch as fetch

    atlas, files = release
    hub.state.put_dataset(REPO, files)
    image = part_name("image_only", 1, PART_CASES)
    real_read_part = fetch.read_part

    def crash_on_image(fh, **kwargs):
        reading = real_read_part(fh, **kwargs)
        if kwargs["name"] == image:
            raise RuntimeError("killed mid-unpack")
        return reading

    monkeypatch.setattr(fetch, "read_part", crash_on_image)
    with pytest.raises(RuntimeError, match="killed mid-unpack"):
        fetch.fetch_atlas(tmp_path / "dest", repo_id=REPO, workers=1)
    monkeypatch.setattr(fetch, "read_part", real_read_part)
    stale = tmp_path / "dest" / "image_only" / "BDMAP_00000001" / "ct.nii.gz"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"half")
    served = dict(hub.state.served)

    report = fetch.fetch_atlas(tmp_path / "dest", repo_id=REPO, workers=1)
    later = part_name("image_only", PART_CASES + 1, N_CASES)  # queued behind the crash: cancelled, fetched now
    assert (report["fetched"], len(report["skipped"]), report["failed"]) == ([image, later], 2, [])
    assert hub.state.served.get(image) == served.get(image)  # the verified archive was kept: not one byte again
    for path in sorted(atlas.rglob("*")):
        rel = path.relative_to(atlas)
        if path.is_file() and rel.parts[0] in ("image_only", "mask_only"):
            assert (tmp_path / "dest" / rel).read_bytes() == path.read_bytes(), rel
    assert sorted(p.name for p in (tmp_path / "dest" / ".emrl-fetch").iterdir() if not p.name.endswith(".done")) == []
