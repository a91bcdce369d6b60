"""Tests of the `publish-dataset` flow against the offline fake Hub (`tests/fakehub.py`) and a local target.

The real huggingface_hub and datasets clients talk HTTP to a fake Hub started on 127.0.0.1 for each test; flows run
under the test session's Prefect harness (`tests/conftest.py`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import datasets.config
import httpx
import huggingface_hub.constants
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from huggingface_hub import DatasetCard, HfApi
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError
from PIL import Image
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.logging.handlers import APILogHandler

from emrl_data.sources import Source
from emrl_data.tables.card import render_dataset_card
from emrl_data.tables.table_folder import write_table as write_library_table
from flows import publish, publish_hub
from flows.publish import (
    FileDigest,
    HubAuthError,
    HubUnreachableError,
    PublishError,
    TagExistsError,
    compare_files,
    is_network_error,
    local_release_dir,
    publish_dataset_flow,
    read_table,
    release_table,
    version_tag,
)
from publishing import local as publish_local
from tests.fakehub import FakeHub, serve_fake_hub
from tests.loopback import free_port


SECRET = "hf_SECRET_canary_7f3a9c1e"  # a recognisable token: it must reach the Hub and nothing else
READ_TOKEN = "hf_read_only_token"
FEATURES = {
    "case_id": {"dtype": "string", "_type": "Value"},
    "split": {"dtype": "string", "_type": "Value"},
    "frames": {"feature": {"_type": "Image"}, "_type": "List"},
}
SCHEMA = pa.schema(
    [
        ("case_id", pa.string()),
        ("split", pa.string()),
        ("frames", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
    ],
    metadata={"huggingface": json.dumps({"info": {"features": FEATURES}})},
)
# split -> shards -> one pixel value per row; each row has two 4x4 frames, valued v and 255 - v.
V1 = {"train": [[10, 20], [30]], "test": [[40]]}
V2 = {"train": [[11, 21, 31, 41]], "test": [[51]]}  # the train shard set shrank: 2 shards -> 1


def _png(value: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (4, 4), value).save(buffer, format="PNG")
    return buffer.getvalue()


def write_table(root: Path, shards: dict[str, list[list[int]]]) -> Path:
    """Write a table folder as the build flows do: data/ shards, README.md by render_dataset_card, manifest.json."""
    shutil.rmtree(root, ignore_errors=True)
    (root / "data").mkdir(parents=True)
    for split, split_shards in shards.items():
        for i, values in enumerate(split_shards):
            frames = [[{"bytes": _png(v), "path": None}, {"bytes": _png(255 - v), "path": None}] for v in values]
            rows = [
                {"case_id": f"BDMAP_{v:08d}", "split": split, "frames": f} for v, f in zip(values, frames, strict=True)
            ]
            path = root / "data" / f"{split}-{i:05d}-of-{len(split_shards):05d}.parquet"
            pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path, compression="zstd")
    counts = {split: {"total": sum(len(s) for s in split_shards)} for split, split_shards in shards.items()}
    card = render_dataset_card(
        table="sft",
        features=FEATURES,
        row_counts=counts,
        pipeline_version="0.1.0",
        git_sha="deadbeef",
        config_fingerprint="0123456789abcdef",
    )
    (root / "README.md").write_text(card)
    files = {
        p.relative_to(root).as_posix(): {
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            "bytes": p.stat().st_size,
        }
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
    manifest = {"pipeline_version": "0.1.0", "config_fingerprint": "0123456789abcdef", "git_sha": "deadbeef"}
    (root / "manifest.json").write_text(json.dumps({**manifest, "files": files, "row_counts": counts}))
    return root


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[FakeHub]:
    """A fresh fake Hub; HF_ENDPOINT and the caches point at it (the clients read both at import: patch them too)."""
    lfs_suffixes = getattr(request, "param", ())
    with serve_fake_hub(lfs_suffixes=lfs_suffixes, tokens={SECRET: "write", READ_TOKEN: "read"}) as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        monkeypatch.setenv("HF_TOKEN", SECRET)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))  # no login
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        constants = huggingface_hub.constants
        monkeypatch.setattr(constants, "ENDPOINT", fake.url)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", fake.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", bool(lfs_suffixes))  # this fake speaks LFS, not Xet
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", fake.url)
        monkeypatch.setattr(
            datasets.config, "HUB_DATASETS_URL", fake.url + "/datasets/{repo_id}/resolve/{revision}/{path}"
        )
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")
        yield fake
        assert fake.state.unknown == []  # the fake served every route the clients used


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retry the Hub tasks without waiting (`publish_hub` looks its tasks up in its module at call time)."""
    for name in (
        "inspect_hub_task",
        "prepare_repo_task",
        "upload_table_task",
        "tag_release_task",
        "verify_hub_release_task",
    ):
        monkeypatch.setattr(publish_hub, name, getattr(publish_hub, name).with_options(retry_delay_seconds=0))


def _run(**kwargs: Any) -> tuple[dict[str, Any], Any]:
    """Run the flow through the engine; return its result and its flow run id."""
    state = publish_dataset_flow(**kwargs, return_state=True)
    return state.result(), state.state_details.flow_run_id


def _first_pixels(path: str, revision: str | None) -> dict[str, list[tuple[int, int]]]:
    """Read a release fully (not streaming) and return per split the pixel values of each row's two frames."""
    loaded = datasets.load_dataset(path, revision=revision)
    return {
        split: [tuple(frame.getpixel((0, 0)) for frame in row["frames"]) for row in ds] for split, ds in loaded.items()
    }


def _commits(repo_id: str) -> list[str]:
    return [c.commit_id for c in HfApi().list_repo_commits(repo_id, repo_type="dataset")]


# ------------------------------------------------------------------------------------------------ plain functions
@pytest.mark.parametrize(
    ("version", "tag"),
    [
        ("1.0.0", "v1.0.0"),  # the usual case
        ("0.12.3", "v0.12.3"),  # multi-digit parts
    ],
)
def test_version_tag_valid_versions_get_v_prefix(version: str, tag: str) -> None:
    assert version_tag(version) == tag


@pytest.mark.parametrize(
    "version",
    [
        "v1.0.0",  # the tag, not the version
        "1.0",  # two parts
        "01.0.0",  # leading zero
        "1.0.0-rc1",  # pre-release suffix
        "",  # empty
    ],
)
def test_version_tag_bad_versions_raise(version: str) -> None:
    with pytest.raises(ValueError, match="is not X.Y.Z"):
        version_tag(version)


def _http_error(status: int) -> HfHubHTTPError:
    request = httpx.Request("POST", "https://hub.example/api/datasets/o/n/commit/main")
    return HfHubHTTPError(f"{status}", response=httpx.Response(status, request=request))


def _wrapped(inner: BaseException) -> RuntimeError:
    try:
        raise RuntimeError("wrapper") from inner
    except RuntimeError as err:
        return err


@pytest.mark.parametrize(
    ("exc", "retry"),
    [
        (_http_error(500), True),  # server error
        (_http_error(503), True),  # unavailable
        (_http_error(429), True),  # rate limited
        (_http_error(408), True),  # request timeout
        (_http_error(400), False),  # bad request: retrying repeats it
        (_http_error(401), False),  # bad token
        (_http_error(403), False),  # no write access
        (_http_error(409), False),  # tag exists
        (_http_error(412), False),  # main moved since the parent commit
        (httpx.ConnectError("refused"), True),  # connection refused
        (httpx.ReadTimeout("slow"), True),  # timeout
        (ConnectionResetError("reset"), True),  # socket error
        (_wrapped(httpx.ConnectError("refused")), True),  # a library wrapped the network error
        (_wrapped(_http_error(404)), False),  # a library wrapped a 404
        (RepositoryNotFoundError("no repo", response=_http_error(404).response), False),  # missing repo
        (OfflineModeIsEnabled("HF_HUB_OFFLINE=1"), False),  # offline mode is a ConnectionError, never a blip
        (TagExistsError("v1.0.0"), False),  # our own refusal
        (ValueError("bug"), False),  # a bug
    ],
)
def test_is_network_error_table(exc: BaseException, retry: bool) -> None:
    assert is_network_error(exc) is retry


@pytest.mark.parametrize(
    ("found", "problems"),
    [
        ({"a": FileDigest(3, "s", "g")}, []),  # identical
        ({"a": FileDigest(3, "s", "g"), ".gitattributes": FileDigest(9, None, "x")}, []),  # the Hub's own file
        ({"a": FileDigest(3, "s", None)}, []),  # LFS entry: sha256 only
        ({"a": FileDigest(3, None, "g")}, []),  # regular entry: git blob id only
        ({}, ["a: missing"]),  # not uploaded
        ({"a": FileDigest(4, "s", "g")}, ["a: 4 bytes, expected 3"]),  # size differs
        ({"a": FileDigest(3, "t", None)}, ["a: content differs"]),  # same size, other sha256
        ({"a": FileDigest(3, None, "h")}, ["a: content differs"]),  # same size, other blob
        (
            {"a": FileDigest(3, "s", "g"), "data/old.parquet": FileDigest(1, None, "o")},
            ["data/old.parquet: not in the table (stale or foreign file)"],
        ),  # a stale shard
    ],
)
def test_compare_files_table(found: dict[str, FileDigest], problems: list[str]) -> None:
    assert compare_files({"a": FileDigest(3, "s", "g")}, found) == problems


def test_read_table_counts_rows_per_split(tmp_path: Path) -> None:
    table = read_table(write_table(tmp_path / "sft", V1))
    assert table.rows == {"test": 1, "train": 3}
    assert sorted(table.files) == [
        "README.md",
        "data/test-00000-of-00001.parquet",
        "data/train-00000-of-00002.parquet",
        "data/train-00001-of-00002.parquet",
        "manifest.json",
    ]


def test_read_table_changed_or_stray_shards_raise(tmp_path: Path) -> None:
    root = write_table(tmp_path / "sft", V1)
    (root / "data" / "test-00000-of-00001.parquet").write_bytes(b"changed")
    shutil.copy(root / "data" / "train-00000-of-00002.parquet", root / "data" / "train-00002-of-00002.parquet")
    with pytest.raises(PublishError) as info:
        read_table(root)
    assert "data/test-00000-of-00001.parquet: size or sha256 differs" in str(info.value)
    assert "data/train-00002-of-00002.parquet: a shard the manifest does not list" in str(info.value)


def test_read_table_without_manifest_raises(tmp_path: Path) -> None:
    with pytest.raises(PublishError, match="manifest.json is missing"):
        read_table(tmp_path)


# ------------------------------------------------------------------------------------------------ Hub target
@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.slow
def test_publish_hub_versions_tag_and_read_back(hub: FakeHub, tmp_path: Path) -> None:
    repo = "emrl/sft-demo"
    first, _ = _run(table_dir=str(write_table(tmp_path / "sft", V1)), repo_id=repo, version="1.0.0")
    assert first["rows"] == {"test": 1, "train": 3}
    assert first["images_decoded"] == {"test": 2, "train": 2}  # both frames of each split's first row
    assert first["uploaded"] is True
    assert first["url"] == f"{hub.url}/datasets/{repo}/tree/v1.0.0"
    assert hub.state.repo("dataset", repo).private is True

    second, _ = _run(table_dir=str(write_table(tmp_path / "sft", V2)), repo_id=repo, version="1.1.0")
    assert second["rows"] == {"test": 1, "train": 4}

    refs = {t.name: t.target_commit for t in HfApi().list_repo_refs(repo, repo_type="dataset").tags}
    assert refs == {"v1.0.0": first["commit"], "v1.1.0": second["commit"]}
    commits = _commits(repo)
    assert commits[:2] == [second["commit"], first["commit"]] and len(commits) == 3  # initial + one per publish
    shards = {
        tag: sorted(
            f for f in HfApi().list_repo_files(repo, repo_type="dataset", revision=tag) if f.startswith("data/")
        )
        for tag in ("v1.0.0", "v1.1.0")
    }
    assert shards == {
        "v1.0.0": [
            "data/test-00000-of-00001.parquet",
            "data/train-00000-of-00002.parquet",
            "data/train-00001-of-00002.parquet",
        ],
        "v1.1.0": ["data/test-00000-of-00001.parquet", "data/train-00000-of-00001.parquet"],  # no stale shard
    }
    # The old tag still reads the old data, the new one the new data; frames decode to the written pixels.
    assert _first_pixels(repo, "v1.0.0") == {"train": [(10, 245), (20, 235), (30, 225)], "test": [(40, 215)]}
    assert _first_pixels(repo, "v1.1.0") == {
        "train": [(11, 244), (21, 234), (31, 224), (41, 214)],
        "test": [(51, 204)],
    }


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.slow
def test_publish_hub_existing_tag_is_refused(hub: FakeHub, tmp_path: Path) -> None:
    repo = "emrl/sft-refuse"
    first, _ = _run(table_dir=str(write_table(tmp_path / "sft", V1)), repo_id=repo, version="1.0.0")
    commits = _commits(repo)
    with pytest.raises(TagExistsError) as caught:
        publish_dataset_flow(table_dir=str(write_table(tmp_path / "sft", V2)), repo_id=repo, version="1.0.0")
    assert str(caught.value) == (
        "emrl/sft-refuse already has tag v1.0.0 with different content (6 file(s) differ, e.g. README.md: content "
        "differs); tags are never moved: publish a new version (e.g. 1.0.1)."
    )
    assert _commits(repo) == commits  # nothing uploaded
    refs = {t.name: t.target_commit for t in HfApi().list_repo_refs(repo, repo_type="dataset").tags}
    assert refs == {"v1.0.0": first["commit"]}  # not moved


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.slow
def test_publish_hub_interrupted_before_tag_resumes_without_new_commit(hub: FakeHub, tmp_path: Path) -> None:
    repo = "emrl/sft-resume"
    table_dir = str(write_table(tmp_path / "sft", V1))
    hub.state.fail_next("POST", "/tag/", 400)  # the upload lands, the tag request fails (a 4xx: not retried)
    with pytest.raises(HfHubHTTPError):
        publish_dataset_flow(table_dir=table_dir, repo_id=repo, version="1.0.0")
    uploaded = _commits(repo)
    assert len(uploaded) == 2  # initial commit + the upload
    assert HfApi().list_repo_refs(repo, repo_type="dataset").tags == []

    result, _ = _run(table_dir=table_dir, repo_id=repo, version="1.0.0")
    assert result["uploaded"] is False
    assert _commits(repo) == uploaded  # no duplicate commit
    assert result["commit"] == uploaded[0]
    assert result["rows"] == {"test": 1, "train": 3}


@pytest.mark.usefixtures("prefect_harness", "fast_retries")
@pytest.mark.slow
def test_publish_hub_retries_server_errors_only(hub: FakeHub, tmp_path: Path) -> None:
    table_dir = str(write_table(tmp_path / "sft", V1))
    hub.state.fail_next("GET", "/revision/main", 503)
    hub.state.fail_next("GET", "/revision/main", 502)
    result, flow_run_id = _run(table_dir=table_dir, repo_id="emrl/sft-retry", version="1.0.0")
    assert result["uploaded"] is True
    assert sum(r == "GET /api/datasets/emrl/sft-retry/revision/main" for r in hub.state.requests) == 3
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    assert {r.name.split("-")[0]: r.run_count for r in runs} == {
        "inspect_hub_task": 1,
        "prepare_repo_task": 1,
        "upload_table_task": 3,  # Prefect retried the task twice
        "tag_release_task": 1,
        "verify_hub_release_task": 1,
    }

    hub.state.fail_next("GET", "/revision/main", 403)
    with pytest.raises(HubAuthError, match=r"^the token may not write to emrl/sft-forbidden \(HTTP 403\)"):
        publish_dataset_flow(table_dir=table_dir, repo_id="emrl/sft-forbidden", version="1.0.0")
    assert sum(r == "GET /api/datasets/emrl/sft-forbidden/revision/main" for r in hub.state.requests) == 1


@pytest.mark.parametrize("hub", [(".parquet",)], indirect=True)
@pytest.mark.usefixtures("prefect_harness")
def test_publish_hub_lfs_shards_are_checked_by_sha256(hub: FakeHub, tmp_path: Path) -> None:
    repo = "emrl/sft-lfs"
    result, _ = _run(table_dir=str(write_table(tmp_path / "sft", V1)), repo_id=repo, version="1.0.0")
    entries = {f.path: f for f in HfApi().list_repo_tree(repo, repo_type="dataset", revision="v1.0.0", recursive=True)}
    manifest = json.loads((tmp_path / "sft" / "manifest.json").read_text())
    assert (
        entries["data/test-00000-of-00001.parquet"].lfs.sha256
        == (manifest["files"]["data/test-00000-of-00001.parquet"]["sha256"])
    )
    assert result["rows"] == {"test": 1, "train": 3}


@pytest.mark.usefixtures("prefect_harness")
def test_publish_hub_token_never_leaks(
    hub: FakeHub, tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    table_dir = write_table(tmp_path / "sft", V1)
    result, flow_run_id = _run(table_dir=str(table_dir), repo_id="emrl/sft-token", version="1.0.0")
    assert f"Bearer {SECRET}" in hub.state.authorizations  # the token was used...

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        flow_run = client.read_flow_run(flow_run_id)
    assert {a.key for a in artifacts} == {"dataset-publish-summary", "dataset-publish-link"}
    assert any("Published emrl/sft-token v1.0.0" in log.message for log in logs)
    stored = b"".join(hub.state.blobs.values())  # ...and nothing that was written anywhere holds it
    texts = {
        "captured logs": caplog.text,
        "stdout/stderr": "".join(capfd.readouterr()),
        "API logs": "\n".join(log.message for log in logs),
        "artifacts": "\n".join(f"{a.data} {a.description}" for a in artifacts),
        "flow parameters": json.dumps(flow_run.parameters),
        "result": json.dumps(result),
        "table folder": "".join(p.read_text(errors="replace") for p in table_dir.rglob("*") if p.is_file()),
        "Hub files": stored.decode(errors="replace"),
    }
    assert [where for where, text in texts.items() if SECRET in text] == []
    assert "Published `emrl/sft-token` v1.0.0" in texts["artifacts"]


# ------------------------------------------------------------------------------------------------ local target
@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.slow
def test_publish_local_versions_refusal_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    local_root = tmp_path / "releases"
    common = {"repo_id": "emrl/sft-local", "target": "local", "local_root": str(local_root)}
    root = local_root / "emrl" / "sft-local"

    first, _ = _run(table_dir=str(write_table(tmp_path / "sft", V1)), version="1.0.0", **common)
    assert first["uploaded"] is True and first["commit"] is None
    assert first["rows"] == {"test": 1, "train": 3}
    assert first["url"] == (root / ".tags" / "v1.0.0").resolve().as_uri()

    second, _ = _run(table_dir=str(write_table(tmp_path / "sft", V2)), version="1.1.0", **common)
    assert second["rows"] == {"test": 1, "train": 4}
    assert sorted(p.name for p in (root / "data").iterdir()) == [
        "test-00000-of-00001.parquet",
        "train-00000-of-00001.parquet",  # the stale train-00001-of-00002 is gone from main
    ]
    assert sorted(p.name for p in (root / ".tags").iterdir()) == ["v1.0.0", "v1.1.0"]
    # The old snapshot still reads the old data.
    assert _first_pixels(str(root / ".tags" / "v1.0.0"), None) == {
        "train": [(10, 245), (20, 235), (30, 225)],
        "test": [(40, 215)],
    }
    assert _first_pixels(str(root / ".tags" / "v1.1.0"), None)["train"][0] == (11, 244)

    with pytest.raises(TagExistsError, match="already has tag v1.0.0 with different content"):
        publish_dataset_flow(table_dir=str(tmp_path / "sft"), version="1.0.0", **common)

    # Interrupted after the copy, before the snapshot: the rerun copies nothing and makes the tag.
    monkeypatch.setattr(publish_local, "tag_local", _raise_interrupted)
    with pytest.raises(RuntimeError, match="interrupted before tagging"):
        publish_dataset_flow(table_dir=str(write_table(tmp_path / "sft", V1)), version="1.2.0", **common)
    monkeypatch.undo()
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    mtimes = {p: p.stat().st_mtime_ns for p in (root / "data").iterdir()}
    third, _ = _run(table_dir=str(tmp_path / "sft"), version="1.2.0", **common)
    assert third["uploaded"] is False
    assert {p: p.stat().st_mtime_ns for p in (root / "data").iterdir()} == mtimes
    assert third["rows"] == {"test": 1, "train": 3}


def _raise_interrupted(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("interrupted before tagging")


@pytest.mark.parametrize(
    "repo_id",
    [
        "../escape",  # climbs out of local_root
        "emrl/../../escape",  # climbs out through a namespace
        "/abs/path",  # absolute
        "a/b/c",  # more than namespace/name
    ],
)
def test_local_release_dir_rejects_unsafe_repo_ids(tmp_path: Path, repo_id: str) -> None:
    with pytest.raises(ValueError):
        local_release_dir(tmp_path, repo_id)


# ------------------------------------------------------------------------------------------------ idempotence, dry run
@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.slow
def test_publish_hub_same_version_same_content_is_a_noop(hub: FakeHub, tmp_path: Path) -> None:
    repo = "emrl/sft-again"
    table_dir = str(write_table(tmp_path / "sft", V1))
    first, _ = _run(table_dir=table_dir, repo_id=repo, version="1.0.0")
    assert first["status"] == "published"
    assert first["message"] == (
        f'Published {repo} v1.0.0 (commit {first["commit"][:12]}): load_dataset("{repo}", revision="v1.0.0").'
    )
    commits = _commits(repo)
    again, _ = _run(table_dir=table_dir, repo_id=repo, version="1.0.0")
    assert again["status"] == "already_published" and again["uploaded"] is False
    assert again["commit"] == first["commit"]
    assert again["message"] == (
        f"{repo} v1.0.0 already holds exactly this table (commit {first['commit'][:12]}): nothing to do."
    )
    assert {p["action"] for p in again["plan"]} == {"unchanged"}
    assert _commits(repo) == commits


@pytest.mark.usefixtures("prefect_harness")
def test_publish_hub_card_and_manifest_name_the_release(hub: FakeHub, tmp_path: Path) -> None:
    repo = "emrl/sft-card"
    table_dir = write_table(tmp_path / "sft", V1)
    local_card = (table_dir / "README.md").read_text()
    _run(table_dir=str(table_dir), repo_id=repo, version="2.3.4")
    card = Path(HfApi().hf_hub_download(repo, "README.md", repo_type="dataset", revision="v2.3.4")).read_text()
    manifest = json.loads(
        Path(HfApi().hf_hub_download(repo, "manifest.json", repo_type="dataset", revision="v2.3.4")).read_text()
    )
    assert f'ds = load_dataset("{repo}", revision="v2.3.4")' in card
    assert f"| release | `v2.3.4` of `{repo}` |" in card
    for placeholder in ("unreleased", "not released", "<repo_id>", "vX.Y.Z", "path/to/this/folder"):
        assert placeholder not in card
    assert manifest["release"] == {"repo_id": repo, "version": "2.3.4", "tag": "v2.3.4"}
    assert manifest["files"]["README.md"] == {
        "sha256": hashlib.sha256(card.encode()).hexdigest(),
        "bytes": len(card.encode()),
    }
    assert (table_dir / "README.md").read_text() == local_card  # the table folder is not changed


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.slow
def test_publish_hub_dry_run_lists_the_plan_and_writes_nothing(hub: FakeHub, tmp_path: Path) -> None:
    repo = "emrl/sft-dry"
    v1 = str(write_table(tmp_path / "v1", V1))
    dry, _ = _run(table_dir=v1, repo_id=repo, version="1.0.0", dry_run=True)
    assert hub.state.repo("dataset", repo) is None  # not even created
    assert dry["status"] == "dry_run" and dry["commit"] is None and dry["uploaded"] is False
    assert [(p["path"], p["action"]) for p in dry["plan"]] == [
        ("README.md", "add"),
        ("data/test-00000-of-00001.parquet", "add"),
        ("data/train-00000-of-00002.parquet", "add"),
        ("data/train-00001-of-00002.parquet", "add"),
        ("manifest.json", "add"),
    ]
    assert dry["message"].startswith(f"Dry run, nothing written: publishing {repo} v1.0.0 to {hub.url} would upload 5")
    _run(table_dir=v1, repo_id=repo, version="1.0.0")
    commits = _commits(repo)
    dry2, _ = _run(table_dir=str(write_table(tmp_path / "v2", V2)), repo_id=repo, version="1.1.0", dry_run=True)
    assert [(p["path"], p["action"]) for p in dry2["plan"]] == [
        ("README.md", "replace"),
        ("data/test-00000-of-00001.parquet", "replace"),
        ("data/train-00000-of-00001.parquet", "add"),
        ("manifest.json", "replace"),
        ("data/train-00000-of-00002.parquet", "delete"),
        ("data/train-00001-of-00002.parquet", "delete"),
    ]
    assert "delete 2 stale shard(s), keep 0 unchanged, then tag v1.1.0." in dry2["message"]
    assert _commits(repo) == commits
    assert [t.name for t in HfApi().list_repo_refs(repo, repo_type="dataset").tags] == ["v1.0.0"]
    dry3, _ = _run(table_dir=v1, repo_id=repo, version="1.0.0", dry_run=True)  # the existing, identical release
    assert dry3["status"] == "already_published"


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.slow
def test_publish_local_same_version_is_a_noop_and_dry_run_writes_nothing(tmp_path: Path) -> None:
    common = {"repo_id": "emrl/sft-local", "target": "local", "local_root": str(tmp_path / "releases")}
    table_dir = str(write_table(tmp_path / "sft", V1))
    dry, _ = _run(table_dir=table_dir, version="1.0.0", dry_run=True, **common)
    assert dry["status"] == "dry_run" and not (tmp_path / "releases").exists()
    assert {p["action"] for p in dry["plan"]} == {"add"}
    first, _ = _run(table_dir=table_dir, version="1.0.0", **common)
    assert first["status"] == "published"
    again, _ = _run(table_dir=table_dir, version="1.0.0", **common)
    assert again["status"] == "already_published"
    assert again["message"].endswith("emrl/sft-local/.tags/v1.0.0 already holds exactly this table: nothing to do.")
    card = (tmp_path / "releases" / "emrl" / "sft-local" / ".tags" / "v1.0.0" / "README.md").read_text()
    assert 'ds = load_dataset("emrl/sft-local", revision="v1.0.0")' in card


# ------------------------------------------------------------------------------------------------ auth and network
@pytest.mark.parametrize(
    ("token", "dry_run", "error", "message"),
    [
        (None, False, HubAuthError, "no Hugging Face token found: set HF_TOKEN to a write token"),
        ("hf_wrong", False, HubAuthError, "rejected the Hugging Face token (HTTP 401): set HF_TOKEN"),
        ("hf_wrong", True, HubAuthError, "rejected the Hugging Face token (HTTP 401)"),  # also before a dry run
        (READ_TOKEN, False, HubAuthError, "the Hugging Face token of tester is read-only"),
    ],
)
@pytest.mark.usefixtures("prefect_harness")
def test_publish_hub_checks_the_token_first(
    hub: FakeHub,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    token: str | None,
    dry_run: bool,
    error: type[Exception],
    message: str,
) -> None:
    if token is None:
        monkeypatch.delenv("HF_TOKEN")
    else:
        monkeypatch.setenv("HF_TOKEN", token)
    table_dir = str(write_table(tmp_path / "sft", V1))
    with pytest.raises(error) as caught:
        publish_dataset_flow(table_dir=table_dir, repo_id="emrl/sft-auth", version="1.0.0", dry_run=dry_run)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert [r for r in hub.state.requests if r != "GET /api/whoami-v2"] == []  # nothing else was tried


@pytest.mark.usefixtures("prefect_harness")
def test_publish_hub_read_token_may_dry_run(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", READ_TOKEN)
    result, _ = _run(
        table_dir=str(write_table(tmp_path / "sft", V1)), repo_id="emrl/sft-ro", version="1.0.0", dry_run=True
    )
    assert result["status"] == "dry_run"


def test_fake_hub_enforces_auth(hub: FakeHub) -> None:
    """The test server answers like the Hub: 401 without or with a wrong token, 403 for a write with a read token."""
    headers = {
        "without": {},
        "wrong": {"authorization": "Bearer hf_wrong"},
        "read": {"authorization": f"Bearer {READ_TOKEN}"},
    }
    create = {"type": "dataset", "name": "x", "organization": "emrl"}
    statuses = {
        who: (
            httpx.get(f"{hub.url}/api/whoami-v2", headers=h).status_code,
            httpx.post(f"{hub.url}/api/repos/create", json=create, headers=h).status_code,
        )
        for who, h in headers.items()
    }
    assert statuses == {"without": (401, 401), "wrong": (401, 401), "read": (200, 403)}
    with pytest.raises(HfHubHTTPError) as caught:
        HfApi(endpoint=hub.url, token="hf_wrong").list_repo_refs("emrl/none", repo_type="dataset")
    assert caught.value.response.status_code == 401
    HfApi(endpoint=hub.url, token=SECRET).create_repo("emrl/private", repo_type="dataset", private=True)
    with pytest.raises(RepositoryNotFoundError):  # a private repo is invisible without a token
        HfApi(endpoint=hub.url, token=False).list_repo_refs("emrl/private", repo_type="dataset")


@pytest.mark.usefixtures("prefect_harness")
def test_publish_hub_401_after_the_token_check_is_one_line_and_not_retried(hub: FakeHub, tmp_path: Path) -> None:
    hub.state.fail_next("GET", "/refs", 401)  # e.g. the token was revoked meanwhile
    with pytest.raises(HubAuthError) as caught:
        publish_dataset_flow(table_dir=str(write_table(tmp_path / "sft", V1)), repo_id="emrl/sft-401", version="1.0.0")
    assert str(caught.value) == (
        "the Hub answered 401 for emrl/sft-401: the token is invalid or cannot see the repo; set HF_TOKEN to a write "
        "token with access to it."
    )
    assert sum("/refs" in r for r in hub.state.requests) == 1


@pytest.mark.usefixtures("prefect_harness")
def test_publish_hub_unreachable_fails_fast_in_one_line(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # a port nobody listens on
    monkeypatch.setenv("HF_ENDPOINT", dead)
    with pytest.raises(HubUnreachableError) as caught:
        publish_dataset_flow(table_dir=str(write_table(tmp_path / "sft", V1)), repo_id="emrl/sft-off", version="1.0.0")
    assert str(caught.value) == f"cannot reach {dead} (ConnectError): check the network connection or HF_ENDPOINT."


def test_release_table_refuses_a_card_that_does_not_match_the_shards(tmp_path: Path) -> None:
    table_dir = write_table(tmp_path / "sft", V1)
    table = read_table(table_dir)
    card = (table_dir / "README.md").read_text().replace("num_examples: 3", "num_examples: 4")
    (table_dir / "README.md").write_text(card)  # changed after the check against the manifest
    with pytest.raises(PublishError, match=r"the card's split sizes \{'train': 4, 'test': 1\} differ from the shards"):
        release_table(table, "emrl/x", "1.0.0")


def test_check_token_in_offline_mode_is_one_line(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubUnreachableError) as caught:
        publish.check_token(publish.hub_api(), write=True)
    assert str(caught.value) == "HF_HUB_OFFLINE=1 is set: publishing to the Hub needs the network; unset it."
    assert hub.state.requests == []


@pytest.mark.usefixtures("prefect_harness")
def test_publish_hub_card_rejected_by_the_hub_stops_before_any_write(hub: FakeHub, tmp_path: Path) -> None:
    hub.state.fail_next("POST", "/api/validate-yaml", 400)
    with pytest.raises(PublishError, match="^the Hub rejects the dataset card's YAML metadata: "):
        publish_dataset_flow(
            table_dir=str(write_table(tmp_path / "sft", V1)), repo_id="emrl/sft-yaml", version="1.0.0"
        )
    assert hub.state.repo("dataset", "emrl/sft-yaml") is None
    assert "POST /api/validate-yaml" in hub.state.requests


# ------------------------------------------------------------------------------------------ sources and licences
MSD = Source("msd-task03", "CC-BY-SA-4.0", "Antonelli et al. 2022")
KITS = Source("kits23", "CC-BY-NC-SA-4.0", "Heller et al. 2023")
PANORAMA = Source("panorama", "CC-BY-NC-4.0", "Alves et al. 2024")


def write_mixture(root: Path, cases: dict[Source, list[str]]) -> Path:
    """A `rejections` table whose rows come from several sources, written by the library's writer (card, manifest)."""
    rows = [
        {"case_id": case_id, "organ": None, "step": "load", "reason": "missing_ct", "detail": case_id}
        | source.columns(case_id)
        for source, ids in cases.items()
        for case_id in ids
    ]
    provenance = {"pipeline_version": "0.1.0", "git_sha": None, "config_fingerprint": "f"}
    provenance["sources"] = [s.to_dict() for s in cases]  # type: ignore[assignment]
    return write_library_table("rejections", {"train": rows}, root, provenance=provenance)


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.slow
def test_publish_refuses_one_config_of_two_share_alike_licences_and_takes_one_config_each(
    hub: FakeHub, tmp_path: Path
) -> None:
    table_dir = write_mixture(tmp_path, {MSD: ["liver_0", "liver_1"], KITS: ["case_00000"]})
    repo = "emrl/mixture"
    with pytest.raises(PublishError) as refused:
        _run(table_dir=str(table_dir), repo_id=repo, version="1.0.0")
    assert str(refused.value) == (
        f"{table_dir}: CC-BY-NC-SA-4.0 and CC-BY-SA-4.0 are both share-alike with different terms: one config cannot "
        "carry both; publish one config per source"
    )
    assert ("dataset", repo) not in hub.state.repos  # refused before anything was created

    result, _ = _run(table_dir=str(table_dir), repo_id=repo, version="1.0.0", config_per_source=True)

    assert result["status"] == "published"
    assert result["rows"] == {"kits23/train": 1, "msd-task03/train": 2}
    files = sorted(HfApi().list_repo_files(repo, repo_type="dataset", revision="v1.0.0"))
    assert files == [
        ".gitattributes",
        "README.md",
        "kits23/train-00000-of-00001.parquet",
        "manifest.json",
        "msd-task03/train-00000-of-00001.parquet",
    ]
    card = DatasetCard.load(repo, repo_type="dataset")
    assert [c["config_name"] for c in card.data.to_dict()["configs"]] == ["kits23", "msd-task03"]
    assert "| `msd-task03` | CC-BY-SA-4.0 | Antonelli et al. 2022 |" in card.text
    assert "| `kits23` | CC-BY-NC-SA-4.0 | Heller et al. 2023 |" in card.text
    loaded = datasets.load_dataset(repo, "msd-task03", revision="v1.0.0", split="train")
    assert [(r["case_id"], r["source_dataset"], r["source_license"]) for r in loaded] == [
        ("liver_0", "msd-task03", "CC-BY-SA-4.0"),
        ("liver_1", "msd-task03", "CC-BY-SA-4.0"),
    ]

    # a later version without KiTS: its config's shards go from main, not left behind as a stale config
    msd_only = write_mixture(tmp_path / "msd", {MSD: ["liver_0", "liver_1"]})
    plan, _ = _run(table_dir=str(msd_only), repo_id=repo, version="1.1.0", config_per_source=True, dry_run=True)
    assert {(p["path"], p["action"]) for p in plan["plan"] if p["action"] == "delete"} == {
        ("kits23/train-00000-of-00001.parquet", "delete")
    }
    result, _ = _run(table_dir=str(msd_only), repo_id=repo, version="1.1.0", config_per_source=True)
    assert result["status"] == "published" and result["rows"] == {"msd-task03/train": 2}
    files = sorted(HfApi().list_repo_files(repo, repo_type="dataset", revision="v1.1.0"))
    assert files == [".gitattributes", "README.md", "manifest.json", "msd-task03/train-00000-of-00001.parquet"]
    assert "kits23/train-00000-of-00001.parquet" in HfApi().list_repo_files(
        repo, repo_type="dataset", revision="v1.0.0"
    )


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.slow
def test_publish_refuses_a_non_commercial_source_in_a_set_declared_commercial(tmp_path: Path) -> None:
    table_dir = write_mixture(tmp_path, {MSD: ["pancreas_001"], PANORAMA: ["100000_00001"]})
    local = tmp_path / "releases"
    for per_source in (False, True):  # a separate config is still the same set's commercial use
        with pytest.raises(PublishError) as refused:
            _run(
                table_dir=str(table_dir),
                repo_id="emrl/mix",
                version="1.0.0",
                target="local",
                local_root=str(local),
                commercial=True,
                config_per_source=per_source,
            )
        assert str(refused.value).endswith(
            "CC-BY-SA-4.0 (share-alike, commercial use allowed) cannot take a CC-BY-NC-4.0 (non-commercial) source: "
            "publish one config per source"
            if not per_source
            else "CC-BY-NC-4.0 is non-commercial and the set is declared for commercial use (--commercial)"
        )
    assert not local.exists()
    only_msd = write_mixture(tmp_path / "msd", {MSD: ["pancreas_001"]})
    result, _ = _run(
        table_dir=str(only_msd),
        repo_id="emrl/msd",
        version="1.0.0",
        target="local",
        local_root=str(local),
        commercial=True,
    )
    assert result["rows"] == {"train": 1}
    card = (local / "emrl" / "msd" / "README.md").read_text()
    assert "| `msd-task03` | CC-BY-SA-4.0 | Antonelli et al. 2022 |" in card


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.slow
def test_publish_local_one_config_per_source_and_a_table_without_sources(tmp_path: Path) -> None:
    table_dir = write_mixture(tmp_path / "mix", {MSD: ["pancreas_001"], PANORAMA: ["100000_00001", "100001_00002"]})
    local = tmp_path / "releases"
    result, _ = _run(
        table_dir=str(table_dir),
        repo_id="emrl/mix",
        version="1.0.0",
        target="local",
        local_root=str(local),
        config_per_source=True,
    )
    assert result["rows"] == {"msd-task03/train": 1, "panorama/train": 2}
    release = local / "emrl" / "mix"
    assert sorted(p.relative_to(release).as_posix() for p in release.rglob("*.parquet") if ".tags" not in p.parts) == [
        "msd-task03/train-00000-of-00001.parquet",
        "panorama/train-00000-of-00001.parquet",
    ]
    manifest = json.loads((release / "manifest.json").read_text())
    assert manifest["configs"] == {"msd-task03": {"train": 1}, "panorama": {"train": 2}}
    # one source as one config: the per-source shards go from main, the v1.0.0 snapshot keeps them
    msd = write_mixture(tmp_path / "msd", {MSD: ["pancreas_001"]})
    result, _ = _run(table_dir=str(msd), repo_id="emrl/mix", version="1.1.0", target="local", local_root=str(local))
    assert result["rows"] == {"train": 1}
    assert sorted(p.relative_to(release).as_posix() for p in release.rglob("*.parquet") if ".tags" not in p.parts) == [
        "data/train-00000-of-00001.parquet"
    ]
    assert (release / ".tags" / "v1.0.0" / "panorama" / "train-00000-of-00001.parquet").is_file()

    plain = write_table(tmp_path / "sft", V1)  # rows without source columns
    with pytest.raises(PublishError, match="its rows name no source dataset or licence, so --commercial cannot be"):
        _run(
            table_dir=str(plain),
            repo_id="emrl/plain",
            version="1.0.0",
            target="local",
            local_root=str(local),
            commercial=True,
        )
