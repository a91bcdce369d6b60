"""Parts as the Hub stores them now: Xet files read by the real hf_xet client from the fake Hub's Xet storage
(tests/fakehub.py, `xet=True`), and the faults of a long transfer on both storage kinds: a reset connection, a 503
storm longer than the client's own retries, an expired signed URL, a resume from the bytes on disk."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub.utils import _xet

from emrl_data.reading.release import part_name
from hub.download import download_file
from hub.listing import HubAccessError, HubRelease, resolve_release
from tests.fakehub import FakeHub, client_on_fake_hub
from tests.fakehub_xet import CHUNK_HEADER_BYTES, XetStore


REPO = "AbdomenAtlas/AbdomenAtlas3.0Mini"
IMAGE = part_name("image_only", 1, 3)
CHUNK, PER_XORB = 1 << 14, 8  # 16 KiB chunks, 128 KiB xorbs
DATA = random.Random(0).randbytes(1 << 20)  # 1 MiB: 8 xorbs, no two chunks alike (hf_xet fetches a chunk once)
TERM_BYTES = PER_XORB * (CHUNK + CHUNK_HEADER_BYTES)  # one xorb range as it goes over the wire


@pytest.fixture
def fresh_xet_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """hf_xet tries each request once (the outer retry is what these tests watch), in a XetSession made anew."""
    monkeypatch.setenv("HF_XET_CLIENT_RETRY_MAX_ATTEMPTS", "1")
    monkeypatch.setattr(_xet, "_GLOBAL_XET_HOLDER", _xet.XetSessionHolder())
    monkeypatch.setattr(_xet, "XET_CONNECTION_INFO_CACHE", {})


@pytest.fixture(params=["xet", "http"])
def hub(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_xet_session: None
) -> Iterator[FakeHub]:
    xet = XetStore(chunk_bytes=CHUNK, chunks_per_xorb=PER_XORB) if request.param == "xet" else False
    with client_on_fake_hub(monkeypatch, tmp_path / "hf", xet=xet) as fake:
        yield fake


def _release(hub: FakeHub, **kwargs: object) -> HubRelease:
    hub.state.put_dataset(REPO, {IMAGE: DATA}, **kwargs)  # type: ignore[arg-type]
    return resolve_release(REPO)


def _storage(hub: FakeHub) -> str:
    return "cas" if hub.state.xet is not None else "cdn"


def _fetch(hub: FakeHub, release: HubRelease, dest: Path, seen: list[int] | None = None) -> bytes:
    done = download_file(
        release.commit, IMAGE, dest, release.files[IMAGE], on_bytes=None if seen is None else seen.append
    )
    return done.path.read_bytes()


def test_a_gated_part_is_read_with_the_token_which_the_storage_never_receives(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_fake_read")
    release = _release(hub, gated=True, granted={"hf_fake_read"})
    seen: list[int] = []
    assert _fetch(hub, release, tmp_path / "image.tar.gz", seen) == DATA
    assert sum(seen) == len(DATA)
    if hub.state.xet is not None:  # reported as the bytes arrive (http_get writes 10 MB at a time)
        assert len(seen) >= 8
    storage = hub.state.cas_authorizations if hub.state.xet is not None else hub.state.cdn_authorizations
    assert storage and not any("hf_fake_read" in a for a in storage)  # the user's token stayed with the Hub
    if hub.state.xet is not None:  # the Xet token went there instead, and the Hub's refresh route got the user's
        assert all(a.startswith("Bearer xet_") for a in storage if a)
        refresh = [e for e in hub.state.log if "/xet-read-token/" in e["path"]]
        assert [e["status"] for e in refresh] == [200]
        assert hub.state.sent("cas", "/xorb/") == len(DATA) + 64 * CHUNK_HEADER_BYTES  # every chunk once


def test_a_gated_part_without_access_is_one_line_naming_the_repository(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.state.tokens["hf_other"] = "read"
    monkeypatch.setenv("HF_TOKEN", "hf_other")
    release = _release(hub, gated=True, granted={"hf_fake_read"})
    with pytest.raises(HubAccessError) as caught:
        _fetch(hub, release, tmp_path / "image.tar.gz")
    assert str(caught.value) == (
        f"hf://datasets/{REPO} is gated and the token's account has not been granted access (HTTP 403): "
        "accept its terms on the Hub with that account"
    )
    assert hub.state.sent(_storage(hub)) == 0


def test_a_part_resumes_from_the_bytes_on_disk(hub: FakeHub, tmp_path: Path) -> None:
    release = _release(hub)
    dest = tmp_path / "image.tar.gz"
    cut = int(0.6 * len(DATA)) + 1000  # inside the fifth xorb
    dest.with_name(dest.name + ".incomplete").write_bytes(DATA[:cut])
    done = download_file(release.commit, IMAGE, dest, release.files[IMAGE])
    assert done.path.read_bytes() == DATA and done.resumed_from == cut and done.bytes_read == len(DATA) - cut
    sent = hub.state.sent(_storage(hub), "/xorb/" if hub.state.xet is not None else "/cdn/")
    assert len(DATA) - cut <= sent <= len(DATA) - cut + TERM_BYTES  # at most one range again


@pytest.mark.parametrize("fault", ["reset", "503 storm", "expired URL", "429 RateLimit"])
def test_a_transfer_fault_is_retried_and_resumes(hub: FakeHub, tmp_path: Path, fault: str) -> None:
    release = _release(hub)
    xet = hub.state.xet is not None
    storage_get = "/xorb/" if xet else f"/cdn/{release.files[IMAGE].sha256}"
    if fault == "reset":
        hub.state.cut["xorb" if xet else IMAGE] = 3 * TERM_BYTES // 2
    elif fault == "503 storm":  # more than one try of the client: every try of its own, then ours
        for _ in range(4):
            hub.state.fail_next("GET", storage_get, 503)
    elif fault == "expired URL":
        hub.state.fail_next("GET", storage_get, 403)
    else:
        hub.state.fail_next("GET", storage_get, 429, ratelimit_reset=0)
    assert _fetch(hub, release, tmp_path / "image.tar.gz") == DATA
    assert hub.state.faults == [] and hub.state.cut == {}
    sent = hub.state.sent(_storage(hub), "/xorb/" if xet else "/cdn/")
    wire = len(DATA) + (64 * CHUNK_HEADER_BYTES if xet else 0)
    assert wire <= sent <= wire + 2 * TERM_BYTES  # what a reset cut is fetched again, no more


def test_the_retry_statuses_are_the_librarys() -> None:
    from huggingface_hub.utils._http import _DEFAULT_RETRY_ON_STATUS_CODES

    from hub.retry import RETRY_STATUSES

    assert RETRY_STATUSES == _DEFAULT_RETRY_ON_STATUS_CODES


def test_whether_hf_xet_is_installed_is_known_before_two_parts_ask_at_once() -> None:
    """huggingface_hub caches the answer on first use and writes "N/A" before it looks, so a thread asking meanwhile
    is told no; `hub.download` asks once at import, so no part pair meets that moment."""
    from huggingface_hub.utils import _runtime

    import hub.download  # noqa: F401

    assert _runtime._package_versions["hf_xet"] not in ("", "N/A")
