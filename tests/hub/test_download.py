"""The Hub on a busy day, through the real huggingface_hub client against the fake Hub (tests/fakehub.py): downloads
redirected to a second host that never sees the token, 429 with `Retry-After`, 503, a connection cut mid-part, a
gated repository, side files checked against their git blob id."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import constants

from emrl_data.reading.release import part_name
from hub.download import download_file, download_verified
from hub.listing import HubAccessError, HubRelease, resolve_release
from hub.retry import call_with_retry
from tests.fakehub import FakeHub, client_on_fake_hub, git_blob_sha1


REPO = "AbdomenAtlas/AbdomenAtlas3.0Mini"
IMAGE, MASK = part_name("image_only", 1, 3), part_name("mask_only", 1, 3)
CSV = "AbdomenAtlas3.0MiniWithMeta.csv"
DATA = bytes(range(256)) * (1 << 12)  # 1 MiB
FILES = {IMAGE: DATA, MASK: DATA[::-1], CSV: b"BDMAP ID,sex\nBDMAP_00000001,F\n"}


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    with client_on_fake_hub(monkeypatch, tmp_path / "hf") as fake:
        yield fake


def _release(hub: FakeHub, **kwargs: bool) -> HubRelease:
    hub.state.put_dataset(REPO, FILES, **kwargs)
    return resolve_release(REPO)


def test_a_part_is_fetched_from_the_second_host_which_never_sees_the_token(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_fake_read")
    release = _release(hub)
    assert release.files[IMAGE].sha256 == hashlib.sha256(DATA).hexdigest()
    done = download_file(release.commit, IMAGE, tmp_path / "image.tar.gz", release.files[IMAGE])
    assert done.path.read_bytes() == DATA and done.bytes_read == len(DATA)
    cdn = [r for r in hub.state.requests if r.startswith("CDN ")]
    assert cdn and all(IMAGE in r for r in cdn)  # the bytes came from the second host
    assert hub.state.cdn_authorizations and set(hub.state.cdn_authorizations) == {""}  # no token went there
    assert "Bearer hf_fake_read" in hub.state.authorizations  # the Hub itself got it


def test_a_429_with_retry_after_on_the_first_request_and_on_the_download_is_waited_out(
    hub: FakeHub, tmp_path: Path
) -> None:
    release = _release(hub)
    hub.state.fail_next("HEAD", IMAGE, 429, retry_after=1)  # the part's first request (its metadata)
    hub.state.fail_next("GET", f"/cdn/{release.files[IMAGE].sha256}", 429, retry_after=1)  # the bytes
    done = download_file(release.commit, IMAGE, tmp_path / "image.tar.gz", release.files[IMAGE])
    assert done.path.read_bytes() == DATA and hub.state.faults == []
    heads = [r for r in hub.state.requests if r.startswith("HEAD") and IMAGE in r]
    assert len(heads) == 2  # the 429, then huggingface_hub's own retry after the Retry-After


def test_a_503_on_the_download_and_on_the_listing_is_retried(hub: FakeHub, tmp_path: Path) -> None:
    hub.state.put_dataset(REPO, FILES)
    hub.state.fail_next("GET", f"/api/datasets/{REPO}", 503, retry_after=1)  # dataset_info: the library does not retry
    hub.state.fail_next("GET", f"/api/datasets/{REPO}/tree/", 502)  # nor the first page of the listing
    release = resolve_release(REPO)
    hub.state.fail_next("GET", IMAGE, 503)  # on the CDN: huggingface_hub's http_get raises it, we retry
    done = download_file(release.commit, IMAGE, tmp_path / "image.tar.gz", release.files[IMAGE])
    assert done.path.read_bytes() == DATA and hub.state.faults == []


def test_a_connection_cut_mid_part_resumes_from_the_bytes_written(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub writes what it received in chunks of `DOWNLOAD_CHUNK_SIZE` (10 MiB; 64 KiB here) and resumes
    a cut body from the bytes written, with a Range request: what a cut costs is the chunk it was in."""
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    release = _release(hub)
    hub.state.cut[IMAGE] = 5 * (1 << 16) + 1000
    done = download_file(release.commit, IMAGE, tmp_path / "image.tar.gz", release.files[IMAGE])
    assert done.path.read_bytes() == DATA and done.bytes_read == len(DATA)
    assert hub.state.ranges == [(IMAGE, 5 * (1 << 16))]  # one Range request for the rest
    assert hub.state.served[IMAGE] == len(DATA) + 1000  # the 1000 bytes of the unfinished chunk, twice


def test_a_gated_repo_without_a_token_fails_with_one_line_and_with_a_token_downloads(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.state.put_dataset(REPO, FILES, gated=True)
    with pytest.raises(HubAccessError) as raised:
        resolve_release(REPO)
    assert str(raised.value) == (
        f"hf://datasets/{REPO} is gated and no Hugging Face token is set: set HF_TOKEN (or run `hf auth login`) "
        "with a token of an account that accepted its terms"
    )
    monkeypatch.setenv("HF_TOKEN", "hf_fake_read")
    release = resolve_release(REPO)
    done = download_file(release.commit, MASK, tmp_path / "mask.tar.gz", release.files[MASK])
    assert done.path.read_bytes() == DATA[::-1]
    monkeypatch.delenv("HF_TOKEN")  # a download without one (the listing was read with one): the same kind of line
    with pytest.raises(HubAccessError, match=r"is gated and no Hugging Face token is set"):
        download_file(release.commit, IMAGE, tmp_path / "image.tar.gz", release.files[IMAGE])


def test_a_side_file_is_checked_against_its_git_blob_id(hub: FakeHub, tmp_path: Path) -> None:
    release = _release(hub)
    side = release.files[CSV]
    assert (side.sha256, side.blob_id) == (None, git_blob_sha1(FILES[CSV]))
    hub.state.corrupt[CSV] = 1  # once: the second fetch verifies
    done, _, problem = download_verified(release.commit, CSV, tmp_path / "meta.csv", side)
    assert done is not None and problem is None and done.path.read_bytes() == FILES[CSV]
    hub.state.corrupt[CSV] = 2
    done, _, problem = download_verified(release.commit, CSV, tmp_path / "again.csv", side)
    bad = FILES[CSV][:-1] + bytes([FILES[CSV][-1] ^ 0xFF])
    assert done is None and problem == f"{CSV}: got git blob id {git_blob_sha1(bad)}, the Hub lists {side.blob_id}"
    assert not (tmp_path / "again.csv").exists() and not (tmp_path / "again.csv.incomplete").exists()


def test_call_with_retry_waits_retry_after_then_backs_off_and_stops() -> None:
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    def answer(status: int, retry_after: str | None = None) -> HfHubHTTPError:
        headers = {"Retry-After": retry_after} if retry_after else {}
        request = httpx.Request("GET", "http://hub.test/x")
        return HfHubHTTPError(f"{status}", response=httpx.Response(status, headers=headers, request=request))

    waits: list[float] = []
    errors = [answer(429, "7"), answer(503), answer(503), answer(500)]

    def flaky() -> str:
        if errors:
            raise errors.pop(0)
        return "done"

    assert call_with_retry(flaky, "x", sleep=waits.append) == "done"
    assert waits == [7.0, 2.0, 4.0, 8.0]  # Retry-After first, then the backoff goes on doubling
    errors[:] = [answer(503)] * 3
    with pytest.raises(HfHubHTTPError):
        call_with_retry(flaky, "x", attempts=3, sleep=waits.append)
    errors[:] = [answer(404)]
    with pytest.raises(HfHubHTTPError):  # not transient: raised at once
        call_with_retry(flaky, "x", sleep=waits.append)
    assert waits == [7.0, 2.0, 4.0, 8.0, 1.0, 2.0]


def test_a_growing_file_reads_a_download_as_it_lands_and_stops_when_rewritten(tmp_path: Path) -> None:
    import threading
    import time

    from hub.download import DownloadStoppedError, GrowingFile

    partial, dest = tmp_path / "p.tar.gz.incomplete", tmp_path / "p.tar.gz"
    growing = GrowingFile(partial, dest, len(DATA), poll_s=0.005)

    def write() -> None:
        with partial.open("ab") as fh:
            for i in range(0, len(DATA), 1 << 16):
                fh.write(DATA[i : i + (1 << 16)])
                fh.flush()
                time.sleep(0.002)
        partial.replace(dest)  # verified and renamed, as download_file does
        growing.finish(None)

    threading.Thread(target=write).start()
    assert growing.read() == DATA and growing.offset == len(DATA)

    (tmp_path / "r.incomplete").write_bytes(b"abcdef")
    rewritten = GrowingFile(tmp_path / "r.incomplete", tmp_path / "r", 10, poll_s=0.005)
    assert rewritten.read(6) == b"abcdef"
    (tmp_path / "r.incomplete").write_bytes(b"ab")  # truncated under the reader (a Range answered by the whole file)
    with pytest.raises(DownloadStoppedError, match="rewritten under the reader"):
        rewritten.read(4)
