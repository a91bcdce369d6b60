"""The `publish-dataset` flow: a built table folder -> an immutable, verified release `vX.Y.Z`.

A table folder (written by the build flows) holds `README.md` (the card), `data/{split}-{i:05d}-of-{n:05d}.parquet`
and `manifest.json` (sha256 and size of every other file). Publishing it:

1. checks the folder against its manifest (a changed or stray shard stops the publish);
2. refuses when the tag `vX.Y.Z` already exists on the target: tags are never moved;
3. makes the target's `main` equal to the folder: `upload_folder(delete_patterns=["data/*.parquet"])` on the Hub (so
   a shard set that shrank leaves no stale shards), a plain copy for `target="local"`. When `main` already holds
   exactly these files (a run interrupted after the upload, before the tag) nothing is uploaded, so a rerun makes no
   duplicate commit;
4. checks the file list, sizes and hashes at that commit against the manifest, then creates the tag;
5. reads the release back at the tag with `datasets.load_dataset` (streaming): rows per split, and every image of the
   first row of each split decoded.

Targets:

- `hub`: a dataset repo on the Hugging Face Hub (or any endpoint in `HF_ENDPOINT`). The token comes only from the
  environment (`HF_TOKEN`) or `hf auth login`, found by huggingface_hub itself: this module never reads, logs or
  writes it. Network errors (connection errors, timeouts, HTTP 5xx, 408, 429) are retried; other 4xx are not.
- `local`: the same layout under `local_root/<repo_id>/` (`main`), and each tag as a snapshot folder
  `local_root/<repo_id>/.tags/vX.Y.Z/`. Snapshot files are hard links to the `main` files of that release (copies where
  links are impossible) made read-only; publishing replaces `main` files by rename, never in place, so a snapshot keeps
  its content.

Logic lives in plain functions; the flow and its tasks only sequence them, retry and report.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import datasets
import httpx
import PIL.Image
import pyarrow.parquet as pq
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import validate_repo_id
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from emrl_data.card import VERSION_PATTERN


MANIFEST = "manifest.json"
CARD = "README.md"
DATA_PATTERN = "data/*.parquet"
TAGS_DIR = ".tags"
# Files the Hub adds on its own; never part of a table.
HUB_OWN_FILES = frozenset({".gitattributes"})
SHARD_NAME = re.compile(r"^data/(?P<split>[A-Za-z0-9_]+)-(?P<index>[0-9]{5})-of-(?P<count>[0-9]{5})\.parquet$")
RETRY_STATUS_CODES = frozenset({408, 429})  # and every 5xx
TARGETS = ("hub", "local")
HASH_CHUNK_BYTES = 8 * 1024**2


class PublishError(RuntimeError):
    """A publish cannot go on: the table folder, the target or the release is not as expected."""


class TagExistsError(PublishError):
    """The release tag already exists on the target; tags are never moved."""


class VerificationError(PublishError):
    """The published files or the read-back differ from the table."""


@dataclass(frozen=True, slots=True)
class FileDigest:
    """Size and content hashes of one file.

    Attributes:
        size: bytes.
        sha256: hex sha256 of the content (what the manifest and Hub LFS/Xet entries carry), or None when unknown.
        git_sha1: hex git blob id of the content (what the Hub reports for a regular file), or None when unknown.
    """

    size: int
    sha256: str | None
    git_sha1: str | None


@dataclass(frozen=True, slots=True)
class TableFolder:
    """A table folder checked against its manifest.

    Attributes:
        root: the folder.
        files: every file to publish (manifest entries, `README.md`, `manifest.json`), path relative to `root`.
        rows: rows per split, from the Parquet footers of the shards.
        manifest: the parsed `manifest.json`.
    """

    root: Path
    files: dict[str, FileDigest]
    rows: dict[str, int]
    manifest: dict[str, Any]


def version_tag(version: str) -> str:
    """Return the tag of a release version: `"1.2.0"` -> `"v1.2.0"`.

    Raises:
        ValueError: when `version` is not `X.Y.Z` with non-negative integers without leading zeros.
    """
    if not VERSION_PATTERN.fullmatch(version):
        raise ValueError(f"version={version!r} is not X.Y.Z (e.g. '1.2.0'); the release tag is 'v' + version.")
    return f"v{version}"


def digest_file(path: Path) -> FileDigest:
    """Return the size, sha256 and git blob id of a file, in one read."""
    size = path.stat().st_size
    sha256 = hashlib.sha256()
    git_sha1 = hashlib.sha1(b"blob %d\0" % size)
    with path.open("rb") as stream:
        while chunk := stream.read(HASH_CHUNK_BYTES):
            sha256.update(chunk)
            git_sha1.update(chunk)
    return FileDigest(size, sha256.hexdigest(), git_sha1.hexdigest())


def read_table(table_dir: Path) -> TableFolder:
    """Check a table folder against its `manifest.json` and return what is to be published.

    Every file the manifest lists must exist with its size and sha256; every `data/*.parquet` must be listed and
    named `data/{split}-{i:05d}-of-{n:05d}.parquet`; `README.md` must exist. Other local files are not published.

    Raises:
        PublishError: listing every problem found, when the folder does not match its manifest.
    """
    manifest_path = table_dir / MANIFEST
    if not manifest_path.is_file():
        raise PublishError(f"{manifest_path} is missing: {table_dir} is not a built table folder.")
    manifest = json.loads(manifest_path.read_text())
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not listed:
        raise PublishError(f"{manifest_path} has no 'files' mapping; rebuild the table.")
    problems: list[str] = []
    files: dict[str, FileDigest] = {}
    for rel, entry in sorted(listed.items()):
        path = table_dir / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts or rel in (MANIFEST, *HUB_OWN_FILES):
            problems.append(f"{rel}: not a publishable path")
        elif not path.is_file():
            problems.append(f"{rel}: listed in the manifest but missing")
        else:
            digest = digest_file(path)
            if digest.size != entry.get("bytes") or digest.sha256 != entry.get("sha256"):
                problems.append(f"{rel}: size or sha256 differs from the manifest (changed after the build?)")
            files[rel] = digest
    for path in sorted(table_dir.glob(DATA_PATTERN)):
        if path.relative_to(table_dir).as_posix() not in listed:
            problems.append(f"{path.relative_to(table_dir).as_posix()}: a shard the manifest does not list")
    if CARD not in listed:
        if (table_dir / CARD).is_file():
            files[CARD] = digest_file(table_dir / CARD)
        else:
            problems.append(f"{CARD}: missing (the dataset card)")
    shards = sorted(r for r in files if r.startswith("data/"))
    problems += [
        f"{rel}: not named data/{{split}}-{{i:05d}}-of-{{n:05d}}.parquet"
        for rel in shards
        if not SHARD_NAME.fullmatch(rel)
    ]
    if not shards:
        problems.append("no data/*.parquet shard")
    if problems:
        raise PublishError(f"{table_dir} does not match its manifest: " + "; ".join(problems))
    rows: dict[str, int] = {}
    for rel in shards:
        split = Path(rel).name.rsplit("-", 3)[0]  # a valid name: {split}-{i}-of-{n}.parquet
        try:
            rows[split] = rows.get(split, 0) + pq.ParquetFile(table_dir / rel).metadata.num_rows
        except (OSError, ValueError) as err:  # pyarrow raises ArrowInvalid (a ValueError) on a corrupt footer
            raise PublishError(f"{table_dir / rel} is not a readable Parquet file: {err}") from err
    files[MANIFEST] = digest_file(manifest_path)
    return TableFolder(root=table_dir, files=files, rows=rows, manifest=manifest)


def compare_files(expected: Mapping[str, FileDigest], found: Mapping[str, FileDigest]) -> list[str]:
    """Return the differences between the files to publish and the files found on a target (empty: identical).

    Sizes must match; a hash is compared when both sides know it. `.gitattributes` on the target is ignored.
    """
    problems = []
    for rel in sorted(expected.keys() | found.keys()):
        if rel in HUB_OWN_FILES:
            continue
        want, have = expected.get(rel), found.get(rel)
        if have is None:
            problems.append(f"{rel}: missing")
        elif want is None:
            problems.append(f"{rel}: not in the table (stale or foreign file)")
        elif want.size != have.size:
            problems.append(f"{rel}: {have.size} bytes, expected {want.size}")
        elif (want.sha256 and have.sha256 and want.sha256 != have.sha256) or (
            want.git_sha1 and have.git_sha1 and want.git_sha1 != have.git_sha1
        ):
            problems.append(f"{rel}: content differs")
    return problems


def is_network_error(exc: BaseException) -> bool:
    """Return True for errors worth retrying: connection errors, timeouts, HTTP 5xx, 408 and 429.

    Follows `__cause__` links, so a network error wrapped by a library still counts. Any other HTTP status (a 4xx:
    bad token, missing repo, existing tag) and offline mode are not retried.
    """
    current: BaseException | None = exc
    for _ in range(8):
        if current is None or isinstance(current, OfflineModeIsEnabled):
            return False
        if isinstance(current, (HfHubHTTPError, httpx.HTTPStatusError)):
            status = current.response.status_code
            return status in RETRY_STATUS_CODES or status >= 500
        if isinstance(current, (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)):
            return True
        if isinstance(current, (ConnectionError, TimeoutError)):
            return True
        current = current.__cause__
    return False


def retry_on_network_error(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn`: retry a failed task run only when it failed on a network error."""
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return isinstance(exc, BaseException) and is_network_error(exc)


# ----------------------------------------------------------------------------------------------------------- Hub
def hub_api() -> HfApi:
    """Return a client for `HF_ENDPOINT` (read now, not at import); the token is resolved by huggingface_hub."""
    return HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, library_name="emrl-data")


def hub_files(api: HfApi, repo_id: str, revision: str) -> dict[str, FileDigest]:
    """Return the files of a dataset repo at `revision` (LFS/Xet entries carry sha256, regular ones a git blob id)."""
    files = {}
    for entry in api.list_repo_tree(repo_id, repo_type="dataset", revision=revision, recursive=True):
        if isinstance(entry, RepoFile):
            lfs = entry.lfs
            files[entry.path] = FileDigest(entry.size, lfs.sha256 if lfs else None, None if lfs else entry.blob_id)
    return files


def hub_tags(api: HfApi, repo_id: str) -> dict[str, str]:
    """Return the tags of a dataset repo: name -> commit oid."""
    return {ref.name: ref.target_commit for ref in api.list_repo_refs(repo_id, repo_type="dataset").tags}


NETWORK_RETRIES: dict[str, Any] = {
    "retries": 3,
    "retry_delay_seconds": [2, 10, 30],
    "retry_condition_fn": retry_on_network_error,
    "cache_policy": NO_CACHE,  # side effects on a remote: always run
}


@task(**NETWORK_RETRIES)
def prepare_repo_task(repo_id: str, tag: str, private: bool) -> None:
    """Create the dataset repo if needed; refuse an existing tag."""
    api = hub_api()
    api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)
    tags = hub_tags(api, repo_id)
    if tag in tags:
        raise TagExistsError(f"{repo_id} already has tag {tag} (commit {tags[tag]}); publish a new version instead.")


@task(**NETWORK_RETRIES)
def upload_table_task(repo_id: str, table: TableFolder, commit_message: str) -> tuple[str, bool]:
    """Make `main` hold exactly the table's files; return the commit oid and whether anything was uploaded."""
    logger = get_run_logger()
    api = hub_api()
    head = api.repo_info(repo_id, repo_type="dataset", revision="main").sha
    if head is None:
        raise PublishError(f"the Hub gave no commit for main of {repo_id}; cannot compare before uploading.")
    differences = compare_files(table.files, hub_files(api, repo_id, head))
    if not differences:
        logger.info("main of %s (%s) already holds this table; nothing to upload.", repo_id, head)
        return head, False
    logger.info("Uploading to %s: %d difference(s), e.g. %s", repo_id, len(differences), differences[:3])
    info = api.upload_folder(
        repo_id=repo_id,
        repo_type="dataset",
        folder_path=table.root,
        allow_patterns=[glob.escape(rel) for rel in table.files],
        delete_patterns=[DATA_PATTERN],
        commit_message=commit_message,
        parent_commit=head,
    )
    return info.oid, True


@task(**NETWORK_RETRIES)
def tag_release_task(repo_id: str, tag: str, commit: str, table: TableFolder, message: str) -> None:
    """Check the files at `commit` against the table, then tag it (a retried request that already tagged is fine)."""
    api = hub_api()
    differences = compare_files(table.files, hub_files(api, repo_id, commit))
    if differences:
        raise VerificationError(f"{repo_id}@{commit} differs from the table, not tagged: {differences}")
    try:
        api.create_tag(repo_id, repo_type="dataset", tag=tag, revision=commit, tag_message=message)
    except HfHubHTTPError as err:
        if err.response.status_code != 409:
            raise
        target = hub_tags(api, repo_id).get(tag)
        if target != commit:
            raise TagExistsError(f"{repo_id} got tag {tag} -> {target} concurrently; not moving it.") from err


@task(**NETWORK_RETRIES)
def verify_hub_release_task(repo_id: str, tag: str, table: TableFolder) -> dict[str, dict[str, int]]:
    """Check the files at the tag against the table and read the release back; return rows and decoded images."""
    differences = compare_files(table.files, hub_files(hub_api(), repo_id, tag))
    if differences:
        raise VerificationError(f"{repo_id}@{tag} differs from the table: {differences}")
    return read_back(repo_id, revision=tag, table=table)


# ----------------------------------------------------------------------------------------------------------- read back
def _decoded_images(value: Any, feature: Any) -> int:
    """Return how many images `value` holds under `feature`; raise when an image did not decode to PIL."""
    if value is None:
        return 0
    if isinstance(feature, datasets.Image):
        if not isinstance(value, PIL.Image.Image):
            raise VerificationError(f"an image came back as {type(value).__name__}, not a decoded PIL image")
        value.load()
        return 1
    if isinstance(feature, (datasets.List, datasets.LargeList)):
        return sum(_decoded_images(item, feature.feature) for item in value)
    if isinstance(feature, dict):
        return sum(_decoded_images(value.get(name), sub) for name, sub in feature.items())
    return 0


def _table_features(table: TableFolder) -> datasets.Features | None:
    """Return the Hub features the table's first shard carries in its Parquet metadata, or None."""
    first = next(rel for rel in sorted(table.files) if rel.startswith("data/"))
    metadata = pq.read_schema(table.root / first).metadata or {}
    if b"huggingface" not in metadata:
        return None
    return datasets.Features.from_dict(json.loads(metadata[b"huggingface"])["info"]["features"])


def read_back(path: str, revision: str | None, table: TableFolder) -> dict[str, dict[str, int]]:
    """Read a release with `datasets.load_dataset(path, revision=revision, streaming=True)` and check it.

    Streaming reads only what is needed: every row of one small column to count rows, and the first row of each
    split with all columns, whose images must decode. The features must equal those the shards were written with.

    Args:
        path: a Hub repo id, or a local folder holding the card and `data/`.
        revision: the tag to read (Hub), or None (local folder).
        table: the published table (expected rows per split and features).

    Returns:
        `{"rows": {split: n}, "images_decoded": {split: n}}`.

    Raises:
        VerificationError: on other splits, row counts or features than the table's, or an undecoded image.
    """
    streams = datasets.load_dataset(path, revision=revision, streaming=True)
    if set(streams) != set(table.rows):
        raise VerificationError(
            f"{path}@{revision} reads back splits {sorted(streams)}, expected {sorted(table.rows)}"
        )
    expected_features = _table_features(table)
    images: dict[str, int] = {}
    count_column = None
    for split, stream in streams.items():
        features = dict(stream.features or {})  # None when datasets could not infer them
        if expected_features is not None and stream.features != expected_features:
            raise VerificationError(f"{path}@{revision} split {split} reads back features {stream.features}")
        first = next(iter(stream), None)
        images[split] = 0 if first is None else _decoded_images(first, features)
        count_column = next((n for n, f in features.items() if isinstance(f, datasets.Value)), None)
    counts = datasets.load_dataset(
        path, revision=revision, streaming=True, columns=[count_column] if count_column else None
    )
    rows = {split: sum(1 for _ in stream) for split, stream in counts.items()}
    if rows != table.rows:
        raise VerificationError(f"{path}@{revision} reads back rows {rows}, expected {table.rows}")
    return {"rows": rows, "images_decoded": images}


# ----------------------------------------------------------------------------------------------------------- local
def local_release_dir(local_root: Path, repo_id: str) -> Path:
    """Return `local_root/<repo_id>` after checking `repo_id` is a Hub-style id (so it is a safe relative path)."""
    validate_repo_id(repo_id)
    return local_root / repo_id


def local_files(root: Path) -> dict[str, FileDigest]:
    """Return the files under a local release folder, leaving out the tag snapshots and dot-files."""
    if not root.is_dir():
        return {}
    files = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and not any(part.startswith(".") for part in rel.parts):
            files[rel.as_posix()] = digest_file(path)
    return files


def local_tag_exists(root: Path, tag: str) -> bool:
    """Return True when the snapshot of `tag` exists under `root/.tags/`."""
    return (root / TAGS_DIR / tag).exists()


def sync_local_main(table: TableFolder, root: Path) -> bool:
    """Make `root` hold exactly the table's files (copy, rename into place, drop stale shards); True when changed."""
    current = local_files(root)
    if not compare_files(table.files, current):
        return False
    for rel, digest in table.files.items():
        if current.get(rel) == digest:
            continue
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        shutil.copyfile(table.root / rel, tmp)
        os.replace(tmp, target)  # a new inode: tag snapshots hard-linked to the old file keep their content
    for rel in current:
        if rel not in table.files and fnmatch(rel, DATA_PATTERN):
            (root / rel).unlink()
    return True


def tag_local(root: Path, tag: str, table: TableFolder) -> Path:
    """Snapshot the table's files of `root` into `root/.tags/<tag>/` (read-only hard links, else copies).

    The snapshot is assembled in a temporary folder and renamed into place, so it appears complete or not at all.

    Raises:
        TagExistsError: when the snapshot already exists.
    """
    tag_dir = root / TAGS_DIR / tag
    if tag_dir.exists():
        raise TagExistsError(f"{tag_dir} already exists; publish a new version instead.")
    tmp = root / TAGS_DIR / f".tmp-{tag}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for rel in table.files:
        target = tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(root / rel, target)
        except OSError:
            shutil.copy2(root / rel, target)
        target.chmod(0o444)
    try:
        tmp.rename(tag_dir)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TagExistsError(f"{tag_dir} appeared while tagging; not replacing it.") from err
    return tag_dir


# ----------------------------------------------------------------------------------------------------------- flow
def summary_markdown(result: Mapping[str, Any]) -> str:
    """Return the markdown artifact of a release: repo, tag, commit, rows and files."""
    lines = [
        f"# Published `{result['repo_id']}` {result['tag']}",
        "",
        "| field | value |",
        "| --- | --- |",
        f"| target | {result['target']} |",
        f"| location | {result['url']} |",
        f"| commit | `{result['commit'] or '-'}` |",
        f"| uploaded | {'yes' if result['uploaded'] else 'no (already identical)'} |",
        "",
        "| split | rows | images decoded (first row) |",
        "| --- | ---: | ---: |",
        *(f"| {s} | {n} | {result['images_decoded'].get(s, 0)} |" for s, n in sorted(result["rows"].items())),
        "",
        "| file | bytes |",
        "| --- | ---: |",
        *(f"| `{rel}` | {size} |" for rel, size in sorted(result["files"].items())),
    ]
    return "\n".join(lines) + "\n"


@flow(name="publish-dataset")
def publish_dataset_flow(
    table_dir: str,
    repo_id: str,
    version: str,
    target: str = "hub",
    local_root: str | None = None,
    private: bool = True,
    commit_message: str | None = None,
) -> dict:
    """Publish a built table folder as the immutable release `v{version}` of a dataset repo, then verify it.

    Args:
        table_dir: the table folder (`README.md`, `data/*.parquet`, `manifest.json`).
        repo_id: the dataset repo, `namespace/name`.
        version: `X.Y.Z`; the release is tagged `vX.Y.Z` and an existing tag is never moved.
        target: `hub` (Hugging Face Hub at `HF_ENDPOINT`) or `local` (a folder, see `local_root`).
        local_root: with `target="local"`: releases go to `local_root/<repo_id>/`, tags to `.tags/vX.Y.Z/` there.
        private: visibility of a repo created by this publish (an existing repo keeps its visibility).
        commit_message: the commit title; default names the tag, pipeline version and config fingerprint.

    Returns:
        `{"target", "repo_id", "tag", "commit", "uploaded", "url", "files": {path: bytes}, "rows": {split: n},
        "images_decoded": {split: n}}`.

    Raises:
        ValueError: on a bad version, target or repo id, or `target="local"` without `local_root`.
        TagExistsError: when the tag exists on the target.
        PublishError: when the folder does not match its manifest; VerificationError when the release does not.
    """
    logger = get_run_logger()
    tag = version_tag(version)
    if target not in TARGETS:
        raise ValueError(f"target={target!r} is not one of {TARGETS}.")
    validate_repo_id(repo_id)
    table = read_table(Path(table_dir))
    manifest = table.manifest
    provenance = (
        f"pipeline {manifest.get('pipeline_version', '?')}, config {manifest.get('config_fingerprint', '?')}, "
        f"git {manifest.get('git_sha') or 'unknown'}"
    )
    logger.info("Publishing %s (%s rows per split) as %s %s to %s", table_dir, table.rows, repo_id, tag, target)

    if target == "hub":
        prepare_repo_task(repo_id, tag, private)
        commit, uploaded = upload_table_task(repo_id, table, commit_message or f"Publish {tag} ({provenance})")
        tag_release_task(repo_id, tag, commit, table, f"{repo_id} {tag}: {provenance}")
        readback = verify_hub_release_task(repo_id, tag, table)
        url = f"{hub_api().endpoint}/datasets/{repo_id}/tree/{tag}"
    else:
        if local_root is None:
            raise ValueError("target='local' needs local_root (the folder that holds <repo_id>/).")
        root = local_release_dir(Path(local_root), repo_id)
        if local_tag_exists(root, tag):
            raise TagExistsError(f"{root / TAGS_DIR / tag} already exists; publish a new version instead.")
        commit, uploaded = None, sync_local_main(table, root)
        tag_dir = tag_local(root, tag, table)
        differences = compare_files(table.files, local_files(tag_dir))
        if differences:
            raise VerificationError(f"{tag_dir} differs from the table: {differences}")
        readback = read_back(str(tag_dir), revision=None, table=table)
        url = tag_dir.resolve().as_uri()

    result = {
        "target": target,
        "repo_id": repo_id,
        "tag": tag,
        "commit": commit,
        "uploaded": uploaded,
        "url": url,
        "files": {rel: digest.size for rel, digest in sorted(table.files.items())},
        **readback,
    }
    create_markdown_artifact(
        key="dataset-publish-summary", markdown=summary_markdown(result), description=f"{repo_id} {tag}"
    )
    create_link_artifact(key="dataset-publish-link", link=url, link_text=f"{repo_id} {tag}")
    logger.info("Published %s %s: %s", repo_id, tag, result["rows"])
    return result
