"""`build-sft-set hf://datasets/…` against the Hub as it stores parts now (Xet), and a run that outlives a failed part.

The fake Hub (tests/fakehub.py) in its Xet mode serves the synthetic release's parts as Xet files from a third host;
hf_xet reads them. Each run is checked against the unpacked atlas, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub.utils import _xet

from emrl_data.reading.release import part_name, scratch_need
from emrl_data.synthetic import demo_specs, write_atlas
from emrl_data.synthetic.pack_release import write_release
from flows.build_sft_set import build_sft_set_flow
from tests.fakehub import FakeHub, client_on_fake_hub
from tests.fakehub_xet import CHUNK_HEADER_BYTES, XetStore
from tests.flows.test_build_sft_set_hub import ROOT, _build, _shards


REPO = "AbdomenAtlas/AbdomenAtlas3.0Mini"
N_CASES, PART_CASES = 6, 3
FRAMES = {"frames": {"frame_size_px": 64, "max_frames": 8}}
CHUNK, PER_XORB = 1 << 14, 4  # 64 KiB xorbs: a part of a few hundred KiB spans several


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("xet-atlas")
    write_atlas(root / "atlas", demo_specs(N_CASES))
    return root / "atlas", write_release(root / "atlas", root / "release", part_cases=PART_CASES)


@pytest.fixture(scope="module")
def on_disk(release: tuple[Path, dict[str, bytes]], tmp_path_factory: pytest.TempPathFactory, prefect_harness) -> Path:
    out = tmp_path_factory.mktemp("xet-disk")
    build_sft_set_flow(atlas_root=str(release[0]), output_dir=str(out), config=FRAMES)
    return out


@pytest.fixture(params=["xet", "http"])
def hub(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    monkeypatch.setenv("HF_XET_CLIENT_RETRY_MAX_ATTEMPTS", "1")  # hf_xet's own retries: one try each
    monkeypatch.setattr(_xet, "_GLOBAL_XET_HOLDER", _xet.XetSessionHolder())
    monkeypatch.setattr(_xet, "XET_CONNECTION_INFO_CACHE", {})
    xet = XetStore(chunk_bytes=CHUNK, chunks_per_xorb=PER_XORB) if request.param == "xet" else False
    with client_on_fake_hub(monkeypatch, tmp_path / "hf", xet=xet) as fake:
        yield fake


@pytest.mark.slow
def test_a_gated_xet_release_is_read_with_the_token_and_gives_the_atlas_rows(
    prefect_harness, release: tuple[Path, dict[str, bytes]], on_disk: Path, hub: FakeHub, tmp_path: Path, monkeypatch
) -> None:
    _, files = release
    monkeypatch.setenv("HF_TOKEN", "hf_fake_read")
    hub.state.put_dataset(REPO, files, gated=True, granted={"hf_fake_read"})
    summary = _build(tmp_path / "out")
    assert _shards(tmp_path / "out") == _shards(on_disk) and summary["cases"] == N_CASES
    storage = hub.state.cas_authorizations if hub.state.xet is not None else hub.state.cdn_authorizations
    assert storage and not any("hf_fake_read" in a for a in storage)
    if hub.state.xet is not None:  # every part came through Xet, each chunk once
        parts = sum(len(d) for p, d in files.items() if p.endswith(".tar.gz"))
        chunks = sum(-(-len(d) // CHUNK) for p, d in files.items() if p.endswith(".tar.gz"))
        assert hub.state.sent("cas", "/xorb/") == parts + chunks * CHUNK_HEADER_BYTES
        assert hub.state.sent("cdn") == 0


@pytest.mark.slow
def test_one_part_failing_ends_its_pair_not_the_run_and_the_rerun_reads_only_it(
    prefect_harness, release: tuple[Path, dict[str, bytes]], on_disk: Path, hub: FakeHub, tmp_path: Path
) -> None:
    from flows.hub_parts import PartsFailedError

    _, files = release
    hub.state.put_dataset(REPO, files)
    bad = part_name("image_only", 4, 6)
    hub.state.fail_next("HEAD", bad, 404)  # the Hub no longer has it: not transient, the pair fails at once
    budget = str(max(scratch_need(p) for p in _pairs()))  # one pair at a time: the good one runs first
    with pytest.raises(PartsFailedError) as failed:
        _build(tmp_path / "out", scratch_budget=budget)
    assert list(failed.value.failed) == ["BDMAP_00000004_BDMAP_00000006"]
    assert str(failed.value).startswith(
        "1 part pair(s) failed after their retries (1 finished): BDMAP_00000004_BDMAP_00000006: "
    )
    assert "signature=" not in str(failed.value) and "expires=" not in str(failed.value)
    ledger = [json.loads(p.read_text()) for p in (tmp_path / "out" / ".work" / "parts").glob("*.json")]
    assert [e["part"] for e in ledger] == ["BDMAP_00000001_BDMAP_00000003"]  # the finished pair's cases are stored
    assert len(ledger[0]["cases"]) == PART_CASES

    summary = _build(tmp_path / "out", scratch_budget=budget)
    assert (summary["hub"]["parts_from_ledger"], summary["hub"]["parts_read"]) == (1, 1)
    assert _shards(tmp_path / "out") == _shards(on_disk)


def _pairs() -> tuple:
    from hub.listing import resolve_release

    return resolve_release(REPO).pairs


@pytest.mark.slow
def test_a_scratch_disk_without_room_is_refused_before_any_part_starts(
    prefect_harness, release: tuple[Path, dict[str, bytes]], hub: FakeHub, tmp_path: Path, monkeypatch
) -> None:
    from collections import namedtuple

    from emrl_data.reading import release as release_module
    from emrl_data.reading.release import ScratchSpaceError

    _, files = release
    hub.state.put_dataset(REPO, files)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(release_module.shutil, "disk_usage", lambda _: usage(10_000, 9_000, 1_000))
    with pytest.raises(ScratchSpaceError) as refused:
        _build(tmp_path / "out", scratch_dir=str(tmp_path / "scratch"))
    need = sum(scratch_need(p) for p in _pairs())
    from emrl_data.reading.release import format_size

    assert str(refused.value).startswith(
        f"the scratch folder {tmp_path / 'scratch'} has 1000 B free (0 B already held there); this run holds up to "
        f"{format_size(need)} at once"
    )
    assert hub.state.sent("cdn") == hub.state.sent("cas") == 0  # no byte of a part was asked for


@pytest.mark.slow
def test_a_xet_run_killed_at_60_percent_resumes_fetching_at_most_one_range_twice(
    prefect_harness, release: tuple[Path, dict[str, bytes]], on_disk: Path, hub: FakeHub, tmp_path: Path
) -> None:
    """kill -9 of a running `build-sft-set hf://…` while an image part is 60 % downloaded (throttled link); the
    rerun's storage bytes, counted in the Hub's request log, repeat at most one range of that part."""
    import signal
    import subprocess
    import sys
    import time

    from prefect.settings import PREFECT_API_URL

    from hub.pairs import archive_path

    if hub.state.xet is None:
        pytest.skip("the HTTP path's kill -9 resume is tested in test_build_sft_set_hub.py")
    _, files = release
    hub.state.put_dataset(REPO, files)
    first, second = _pairs()
    image = part_name("image_only", second.start, second.end)
    hub.state.bandwidth_bps = len(files[image]) / 4.0
    budget, out, scratch = str(max(scratch_need(p) for p in (first, second))), tmp_path / "hub", tmp_path / "scratch"
    run = (
        "import json, sys\n"
        "from flows.build_sft_set import build_sft_set_flow\n"
        "build_sft_set_flow(atlas_root=sys.argv[1], output_dir=sys.argv[2], config=json.loads(sys.argv[3]),"
        " scratch_dir=sys.argv[4], scratch_budget=sys.argv[5], max_workers=2)\n"
    )
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    partial = archive_path(scratch, second, second.image)
    partial = partial.with_name(partial.name + ".incomplete")
    log = open(tmp_path / "killed.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [sys.executable, "-c", run, ROOT, str(out), json.dumps(FRAMES), str(scratch), budget],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not (partial.exists() and partial.stat().st_size >= 0.6 * len(files[image])):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "killed.log").read_text()[-3000:]
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    left = partial.stat().st_size
    assert 0.6 * len(files[image]) <= left < len(files[image])

    hub.state.bandwidth_bps = None
    xet = hub.state.xet
    assert xet is not None
    oid = hashlib.sha256(files[image]).hexdigest()
    xorbs = {t.xorb for t in xet.files[xet.by_oid[oid]].terms}
    before = sum(e["bytes"] for e in hub.state.log if e["host"] == "cas" and e["path"].split("/")[-1] in xorbs)
    summary = _build(out, scratch_dir=str(scratch), scratch_budget=budget)
    after = sum(e["bytes"] for e in hub.state.log if e["host"] == "cas" and e["path"].split("/")[-1] in xorbs)
    chunks = -(-len(files[image]) // CHUNK)
    wire = len(files[image]) + chunks * CHUNK_HEADER_BYTES
    one_range = PER_XORB * (CHUNK + CHUNK_HEADER_BYTES)
    assert wire <= after <= wire + one_range  # both runs together: every chunk once, plus at most one range again
    assert after - before <= wire - left + one_range
    assert (summary["hub"]["parts_from_ledger"], summary["hub"]["parts_read"]) == (1, 1)
    assert _shards(out) == _shards(on_disk)


@pytest.mark.slow
def test_a_folder_of_parts_and_a_warm_cache_give_the_hub_rows_with_no_download(
    prefect_harness, release: tuple[Path, dict[str, bytes]], on_disk: Path, hub: FakeHub, tmp_path: Path, monkeypatch
) -> None:
    """What users already have: the folder `hf download` leaves (parts as tar files, the CSV, TrainTestIDS/), read in
    place, checked against the listing with `--revision`; and an `hf://` run that finds the parts in the Hugging Face
    cache. Both give the unpacked atlas's rows and ask the storage for nothing."""
    from huggingface_hub import constants

    if hub.state.xet is None:
        pytest.skip("one storage kind is enough: nothing is downloaded")
    atlas, files = release
    sha = hub.state.put_dataset(REPO, files)
    folder = atlas.parent / "release"
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == sorted(files)

    plain = _build_local(folder, tmp_path / "folder")
    assert _shards(tmp_path / "folder") == _shards(on_disk) and plain["atlas_source"] == str(folder.resolve())
    pinned = _build_local(folder, tmp_path / "pinned", revision="main")
    assert _shards(tmp_path / "pinned") == _shards(on_disk) and pinned["atlas_revision"] == sha
    assert hub.state.sent("cas") == hub.state.sent("cdn") == 0  # the listing was read, no part

    cache = tmp_path / "hf-cache"
    blobs = cache / "datasets--AbdomenAtlas--AbdomenAtlas3.0Mini" / "blobs"
    blobs.mkdir(parents=True)
    for path, data in files.items():
        if path.endswith(".tar.gz"):
            (blobs / hashlib.sha256(data).hexdigest()).write_bytes(data)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    summary = _build(tmp_path / "cached")
    assert _shards(tmp_path / "cached") == _shards(on_disk) and summary["hub"]["sha"] == sha
    assert hub.state.sent("cas") == hub.state.sent("cdn") == 0 and summary["hub"]["bytes_read"] == 0

    bad = part_name("mask_only", 1, 3)
    (folder / bad).write_bytes(files[bad][:-1] + bytes([files[bad][-1] ^ 0xFF]))  # refused by name with --revision
    try:
        with pytest.raises(ValueError, match=f"{folder.resolve() / bad}: sha256 [0-9a-f]{{64}}, the listing has"):
            _build_local(folder, tmp_path / "refused", revision="main")
    finally:
        (folder / bad).write_bytes(files[bad])


def _build_local(folder: Path, out: Path, **kwargs) -> dict:
    return build_sft_set_flow(atlas_root=str(folder), output_dir=str(out), config=FRAMES, max_workers=2, **kwargs)


def test_the_summary_states_each_parts_bytes_time_and_rate() -> None:
    from flows.hub_parts import hub_summary_lines

    hub = {"source": "hf://datasets/o/n@1", "revision": "main", "part_pairs": 2, "parts_read": 1}
    hub.update(parts_from_ledger=1, parts_failed_verification=0, bytes_read=2_000_000, parts_at_once=2)
    hub["scratch_budget_bytes"], hub["parts_seconds"] = 1 << 30, 5.0
    hub["per_part"] = [
        {"part": "A", "cases": 3, "bytes_read": 2_000_000, "seconds": 4.0, "from_ledger": False},
        {"part": "B", "cases": 3, "bytes_read": 0, "seconds": 0.01, "from_ledger": True},
    ]
    assert hub_summary_lines(hub) == [
        "- atlas: `hf://datasets/o/n@1` (revision `main`)",
        "- part pairs: 2 (1 read, 1 already curated, 0 failed verification); 1.9 MiB read at 0.5 MB/s a pair on "
        "average; 2 at once within a scratch budget of 1.0 GiB",
        "- over the run: 1.9 MiB and 6 cases in 5.0 s at 0.4 MB/s, 1.20 cases/s",  # the run's wall time
        "- per part: A 1.9 MiB 4.0 s at 0.5 MB/s; B 0 B 0.01 s",
    ]
