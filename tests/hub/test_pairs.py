"""`hub.pairs.read_pair`, without Prefect: one part pair from the fake Hub into the case store, the ledger, and the
verified archives kept by content until the pair's cases are stored."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import constants

from emrl_data.config import CurateConfig
from emrl_data.labeling.case_store import CaseStore
from emrl_data.synthetic import demo_specs, write_atlas
from emrl_data.synthetic.pack_release import write_release
from flows.build_sft_set import curate_bounded
from hub.listing import resolve_release
from hub.pairs import PartJob, archive_path, read_pair
from tests.fakehub import FakeHub, client_on_fake_hub


REPO = "AbdomenAtlas/AbdomenAtlas3.0Mini"
CFG = CurateConfig.from_dict({"frames": {"frame_size_px": 64, "max_frames": 8}})


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("pairs")
    write_atlas(root / "atlas", demo_specs(3))
    return write_release(root / "atlas", root / "release", part_cases=3)


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    with client_on_fake_hub(monkeypatch, tmp_path / "hf") as fake:
        yield fake


def _job(tmp_path: Path) -> PartJob:
    release = resolve_release(REPO)
    (pair,) = release.pairs
    return PartJob(
        pair=pair,
        commit=release.commit,
        splits={},
        conflicts={},
        metadata={},
        test_fraction=0.2,
        cfg_dict=CFG.to_dict(),
        store_dir=str(tmp_path / "store"),
        ledger_dir=str(tmp_path / "ledger"),
        scratch_dir=str(tmp_path / "scratch"),
        allowance_bytes=1 << 30,
    )


def test_a_pair_is_curated_then_found_in_the_ledger(hub: FakeHub, files: dict[str, bytes], tmp_path: Path) -> None:
    hub.state.put_dataset(REPO, files)
    job = _job(tmp_path)
    cases: list[int] = []
    first = read_pair(job, curate_bounded, on_case=lambda: cases.append(1))
    assert [c for c, _, _ in first.done] == ["BDMAP_00000001", "BDMAP_00000002", "BDMAP_00000003"]
    assert first.bytes_read == job.pair.bytes and len(cases) == 3 and not first.from_ledger
    assert all(CaseStore(tmp_path / "store").has(k) for _, k, _ in first.done)
    assert list((tmp_path / "scratch").iterdir()) == []  # archives and unpacked files gone once the cases are stored
    again = read_pair(job, curate_bounded)
    assert (again.from_ledger, again.bytes_read, again.done) == (True, 0, [(c, k, True) for c, k, _ in first.done])


def test_a_crash_mid_pair_keeps_the_verified_archives_and_the_rerun_downloads_nothing(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    hub.state.put_dataset(REPO, files)
    job = _job(tmp_path)

    def crash_on_case_2(ref, *args):  # the process dies while the image part is being read
        if ref.case_id == "BDMAP_00000002":
            raise KeyboardInterrupt
        return curate_bounded(ref, *args)

    with pytest.raises(KeyboardInterrupt):
        read_pair(job, crash_on_case_2)
    kept = [archive_path(tmp_path / "scratch", job.pair, p) for p in (job.pair.image, job.pair.mask)]
    assert all(p.is_file() for p in kept)  # both verified parts, named by their sha256
    served = dict(hub.state.served)
    rerun = read_pair(job, curate_bounded)
    assert rerun.bytes_read == 0 and hub.state.served == served  # not one byte downloaded again
    assert [c for c, _, _ in rerun.done] == ["BDMAP_00000001", "BDMAP_00000002", "BDMAP_00000003"]
    assert not any(p.exists() for p in kept)


def test_the_image_part_is_curated_while_it_downloads(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)  # huggingface_hub writes 10 MiB at a time
    hub.state.put_dataset(REPO, files)
    job = _job(tmp_path)
    image = archive_path(tmp_path / "scratch", job.pair, job.pair.image)
    hub.state.bandwidth_bps = job.pair.image.size / 2.0  # about 2 s for the image part
    still_downloading: list[bool] = []

    def curate_and_look(ref, *args):
        still_downloading.append(image.with_name(image.name + ".incomplete").exists() and not image.exists())
        return curate_bounded(ref, *args)

    outcome = read_pair(job, curate_and_look)
    assert still_downloading[0] is True  # the first case was curated before its part had finished downloading
    assert outcome.verified and len(outcome.done) == 3 and outcome.bytes_read == job.pair.bytes


def test_a_part_read_while_downloading_that_fails_its_sha256_is_read_again_from_a_verified_download(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path
) -> None:
    hub.state.put_dataset(REPO, files)
    job = _job(tmp_path)
    hub.state.corrupt[job.pair.image.path] = 1
    outcome = read_pair(job, curate_bounded)
    assert outcome.verified and [c for c, _, _ in outcome.done] == [f"BDMAP_0000000{i}" for i in (1, 2, 3)]
    assert outcome.bytes_read == job.pair.mask.size + 2 * job.pair.image.size
    clean = read_pair(_job(tmp_path / "clean"), curate_bounded)
    assert outcome.done == clean.done  # the same store keys: the cases read from bad bytes were dropped
