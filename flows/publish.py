"""The `publish-dataset` flow: a built table folder -> an immutable, verified release `vX.Y.Z`.

A table folder (written by the build flows) holds `README.md` (the card), `data/{split}-{i:05d}-of-{n:05d}.parquet`
and `manifest.json` (sha256 and size of every other file). Publishing it:

1. checks the folder against its manifest (a changed or stray shard stops the publish), and stamps the card and the
   manifest with the release (`emrl_data.tables.card.release_card`: the card names the real repo id and `vX.Y.Z`; the card is
   then parsed with huggingface_hub's `DatasetCard` and its splits checked against the shards);
2. on the Hub, checks the token first (`whoami`: one-line `HubAuthError` / `HubUnreachableError`, no retries);
3. when the tag `vX.Y.Z` already exists: identical content is a no-op that says so (`status="already_published"`),
   different content is a one-line `TagExistsError` (tags are never moved). `dry_run=True` stops here and returns the
   plan (files to add, replace, delete, keep) without writing anything;
4. makes the target's `main` equal to the folder: `upload_folder(delete_patterns=["data/*.parquet"])` on the Hub (so
   a shard set that shrank leaves no stale shards), a plain copy for `target="local"`. When `main` already holds
   exactly these files (a run interrupted after the upload, before the tag) nothing is uploaded, so a rerun makes no
   duplicate commit;
5. checks the file list, sizes and hashes at that commit against the manifest, then creates the tag;
6. reads the release back at the tag with `datasets.load_dataset` (streaming): rows per split, and every image of the
   first row of each split decoded.

Targets:

- `hub`: a dataset repo on the Hugging Face Hub (or any endpoint in `HF_ENDPOINT`). The token comes only from the
  environment (`HF_TOKEN`) or `hf auth login`, found by huggingface_hub itself: this module never reads, logs or
  writes it. Network errors (connection errors, timeouts, HTTP 5xx, 408, 429) are retried; other 4xx are not.
- `local`: the same layout under `local_root/<repo_id>/` (`main`), and each tag as a snapshot folder
  `local_root/<repo_id>/.tags/vX.Y.Z/`. Snapshot files are hard links to the `main` files of that release (copies where
  links are impossible) made read-only; publishing replaces `main` files by rename, never in place, so a snapshot keeps
  its content.

Every error a user can cause is a `PublishError` subclass with a one-line message naming the problem and the fix
(`HubAuthError`, `HubUnreachableError`, `TagExistsError`, `VerificationError`); the CLI prints it.

Logic lives in plain functions; the flow and its tasks only sequence them, retry and report.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import datasets
import httpx
import PIL.Image
import pyarrow.parquet as pq
from huggingface_hub import DatasetCard, HfApi
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalTokenNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import get_session, hf_raise_for_status, validate_repo_id
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from emrl_data.tables.card import VERSION_PATTERN, release_card


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


MAX_MESSAGE_CHARS = 400


def one_line(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """Return `text` on one line (whitespace runs collapsed), cut to `limit` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


class PublishError(RuntimeError):
    """A publish cannot go on: the table folder, the target or the release is not as expected.

    `str(err)` is one line that names the problem and the fix (the CLI prints it without a traceback).
    """

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


class HubAuthError(PublishError):
    """The Hub refused the token (none, invalid, read-only, or no access to the repo)."""


class HubUnreachableError(PublishError):
    """The Hub could not be reached (offline mode, connection errors, retries exhausted)."""


class TagExistsError(PublishError):
    """The release tag already exists on the target with different content; tags are never moved."""


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
        overrides: files published with other content than the folder's (path -> bytes): the release card and
            manifest made by `release_table`; `files` holds their digests.
    """

    root: Path
    files: dict[str, FileDigest]
    rows: dict[str, int]
    manifest: dict[str, Any]
    overrides: dict[str, bytes] = field(default_factory=dict)


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


def digest_bytes(data: bytes) -> FileDigest:
    """Return the size, sha256 and git blob id of in-memory content."""
    git_sha1 = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    return FileDigest(len(data), hashlib.sha256(data).hexdigest(), git_sha1)


def check_release_card(card_text: str, rows: Mapping[str, int]) -> None:
    """Parse a card with huggingface_hub's `DatasetCard`; check its config splits and split sizes against the shards.

    Raises:
        PublishError: when the YAML does not parse, or its `configs` splits or `dataset_info.splits` num_examples
            differ from the rows per split found in the shards.
    """
    try:
        data = DatasetCard(card_text).data.to_dict()
    except ValueError as err:
        raise PublishError(f"the dataset card's YAML front matter does not parse ({err}); rebuild the table.") from err
    configs = [c for c in data.get("configs") or [] if c.get("config_name") == "default"]
    splits = sorted(f.get("split") for c in configs for f in c.get("data_files") or [])
    if splits != sorted(rows):
        raise PublishError(
            f"the card's default config lists splits {splits}, the shards hold {sorted(rows)}; rebuild."
        )
    sizes = {s.get("name"): s.get("num_examples") for s in (data.get("dataset_info") or {}).get("splits") or []}
    if sizes != dict(rows):
        raise PublishError(
            f"the card's split sizes {sizes} differ from the shards' rows {dict(rows)}; rebuild the table."
        )


def release_table(table: TableFolder, repo_id: str, version: str) -> TableFolder:
    """Return the table as released: the card stamped with `repo_id` and `v{version}`, the manifest updated to match.

    The published `manifest.json` lists the stamped card's sha256 and size and carries
    `release: {repo_id, version, tag}`; the table folder itself is not changed.

    Raises:
        PublishError: when the card is not an unreleased card of this pipeline or does not match the shards.
    """
    try:
        card = release_card((table.root / CARD).read_text(encoding="utf-8"), repo_id=repo_id, version=version)
    except ValueError as err:
        raise PublishError(f"{table.root / CARD}: {err} Rebuild the table with this pipeline.") from err
    check_release_card(card, table.rows)
    card_bytes = card.encode("utf-8")
    card_digest = digest_bytes(card_bytes)
    listed = dict(table.manifest.get("files") or {})
    listed[CARD] = {"sha256": card_digest.sha256, "bytes": card_digest.size}
    release = {"repo_id": repo_id, "version": version, "tag": version_tag(version)}
    manifest = {**table.manifest, "files": listed, "release": release}
    manifest_bytes = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")
    overrides = {CARD: card_bytes, MANIFEST: manifest_bytes}
    files = {**table.files, **{rel: digest_bytes(data) for rel, data in overrides.items()}}
    return replace(table, files=files, manifest=manifest, overrides=overrides)


def write_release_file(table: TableFolder, rel: str, target: Path, *, link: bool = False) -> None:
    """Write the released content of `rel` to `target` (a hard link to the folder's file when `link` and possible)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if rel in table.overrides:
        target.write_bytes(table.overrides[rel])
        return
    if link:
        try:
            os.link(table.root / rel, target)
            return
        except OSError:
            pass
    shutil.copyfile(table.root / rel, target)


def upload_plan(expected: Mapping[str, FileDigest], found: Mapping[str, FileDigest]) -> list[dict[str, Any]]:
    """Return what publishing changes on a target holding `found`: one `{path, action, bytes}` per file.

    Actions: `add` (not on the target), `replace` (differs), `unchanged`, `delete` (a stale `data/*.parquet`).
    """
    plan = []
    for rel, want in sorted(expected.items()):
        have = found.get(rel)
        action = "add" if have is None else ("replace" if compare_files({rel: want}, {rel: have}) else "unchanged")
        plan.append({"path": rel, "action": action, "bytes": want.size})
    for rel, have in sorted(found.items()):
        if rel not in expected and fnmatch(rel, DATA_PATTERN):
            plan.append({"path": rel, "action": "delete", "bytes": have.size})
    return plan


def _next_version(version: str) -> str:
    major, minor, patch = version.split(".")
    return f"{major}.{minor}.{int(patch) + 1}"


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


def check_token(api: HfApi, *, write: bool) -> str:
    """Check the token with `whoami` before anything else; return the user name. No retries: fail fast.

    Raises:
        HubAuthError: no token, a token the Hub rejects (401/403), or a read-only token when `write`.
        HubUnreachableError: offline mode or a network error.
    """
    fix = "set HF_TOKEN to a write token (https://huggingface.co/settings/tokens) or run `hf auth login`"
    try:
        info = api.whoami()
    except LocalTokenNotFoundError as err:
        raise HubAuthError(f"no Hugging Face token found: {fix}.") from err
    except OfflineModeIsEnabled as err:
        raise HubUnreachableError(
            "HF_HUB_OFFLINE=1 is set: publishing to the Hub needs the network; unset it."
        ) from err
    except HfHubHTTPError as err:
        status = err.response.status_code
        if status in (401, 403):
            raise HubAuthError(f"{api.endpoint} rejected the Hugging Face token (HTTP {status}): {fix}.") from err
        if not is_network_error(err):
            raise PublishError(f"{api.endpoint} refused the token check (HTTP {status}): {err}") from err
        raise HubUnreachableError(f"{api.endpoint} is unavailable (HTTP {status}); try again later.") from err
    except Exception as err:
        if is_network_error(err):
            raise HubUnreachableError(
                f"cannot reach {api.endpoint} ({type(err).__name__}): check the network connection or HF_ENDPOINT."
            ) from err
        raise
    name = str(info.get("name") or "?")
    role = ((info.get("auth") or {}).get("accessToken") or {}).get("role")
    if write and role == "read":
        raise HubAuthError(f"the Hugging Face token of {name} is read-only: {fix}.")
    return name


def validate_card_on_hub(api: HfApi, card_text: str) -> None:
    """Have the Hub validate the card's YAML metadata (`POST /api/validate-yaml`, what the Hub runs on a commit).

    `DatasetCard.validate` always asks huggingface.co; this asks `api.endpoint`, so `HF_ENDPOINT` is honoured.

    Raises:
        PublishError: when the Hub rejects the metadata (HTTP 400), with its first message.
    """
    response = get_session().post(
        f"{api.endpoint}/api/validate-yaml",
        json={"repoType": "dataset", "content": card_text},
        headers=api._build_hf_headers(),
    )
    if response.status_code == 400:
        try:
            errors = response.json().get("errors") or [{"message": response.text}]
            detail = errors[0].get("message", errors[0])
        except ValueError:
            detail = response.text
        raise PublishError(f"the Hub rejects the dataset card's YAML metadata: {detail}")
    hf_raise_for_status(response)


@contextmanager
def hub_errors(repo_id: str) -> Iterator[None]:
    """Turn the Hub's 401/403 answers into a one-line `HubAuthError` (never retried); let the rest through."""
    try:
        yield
    except HfHubHTTPError as err:
        status = err.response.status_code
        if status == 401:
            raise HubAuthError(
                f"the Hub answered 401 for {repo_id}: the token is invalid or cannot see the repo; set HF_TOKEN to a "
                "write token with access to it."
            ) from err
        if status == 403:
            raise HubAuthError(
                f"the token may not write to {repo_id} (HTTP 403): use a write token of the repo's owner or org."
            ) from err
        raise


@task(**NETWORK_RETRIES)
def inspect_hub_task(repo_id: str, tag: str) -> tuple[str | None, dict[str, FileDigest]]:
    """Return what the target holds: `(tag commit, files at the tag)` when the tag exists, else `(None, files of
    main)` (`{}` when the repo does not exist yet)."""
    api = hub_api()
    with hub_errors(repo_id):
        try:
            tags = hub_tags(api, repo_id)
        except RepositoryNotFoundError:
            return None, {}
        if tag in tags:
            return tags[tag], hub_files(api, repo_id, tags[tag])
        return None, hub_files(api, repo_id, "main")


@task(**NETWORK_RETRIES)
def prepare_repo_task(repo_id: str, private: bool) -> None:
    """Create the dataset repo if needed (an existing repo keeps its visibility)."""
    with hub_errors(repo_id):
        hub_api().create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)


def stage_release(table: TableFolder) -> Path:
    """Return a temporary folder holding the released files (hard links to the shards, the stamped card and manifest).

    It sits beside the table folder when possible (same file system: links, no copies); the caller removes it.
    """
    try:
        stage = Path(tempfile.mkdtemp(prefix=f".publish-{table.root.name}-", dir=table.root.parent))
    except OSError:
        stage = Path(tempfile.mkdtemp(prefix="emrl-publish-"))
    for rel in table.files:
        write_release_file(table, rel, stage / rel, link=True)
    return stage


@task(**NETWORK_RETRIES)
def upload_table_task(repo_id: str, table: TableFolder, commit_message: str) -> tuple[str, bool]:
    """Make `main` hold exactly the table's files; return the commit oid and whether anything was uploaded."""
    logger = get_run_logger()
    api = hub_api()
    with hub_errors(repo_id):
        head = api.repo_info(repo_id, repo_type="dataset", revision="main").sha
        if head is None:
            raise PublishError(f"the Hub gave no commit for main of {repo_id}; cannot compare before uploading.")
        differences = compare_files(table.files, hub_files(api, repo_id, head))
        if not differences:
            logger.info("main of %s (%s) already holds this table; nothing to upload.", repo_id, head)
            return head, False
        logger.info("Uploading to %s: %d difference(s), e.g. %s", repo_id, len(differences), differences[:3])
        stage = stage_release(table)
        try:
            info = api.upload_folder(
                repo_id=repo_id,
                repo_type="dataset",
                folder_path=stage,
                allow_patterns=[glob.escape(rel) for rel in table.files],
                delete_patterns=[DATA_PATTERN],
                commit_message=commit_message,
                parent_commit=head,
            )
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    return info.oid, True


@task(**NETWORK_RETRIES)
def tag_release_task(repo_id: str, tag: str, commit: str, table: TableFolder, message: str) -> None:
    """Check the files at `commit` against the table, then tag it (a retried request that already tagged is fine)."""
    api = hub_api()
    with hub_errors(repo_id):
        differences = compare_files(table.files, hub_files(api, repo_id, commit))
        if differences:
            raise VerificationError(
                f"{repo_id}@{commit} differs from the table ({len(differences)}: {differences[:3]}), not tagged."
            )
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
    with hub_errors(repo_id):
        differences = compare_files(table.files, hub_files(hub_api(), repo_id, tag))
        if differences:
            raise VerificationError(f"{repo_id}@{tag} differs from the table ({len(differences)}: {differences[:3]}).")
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
        write_release_file(table, rel, tmp)
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
def _human_bytes(n: int) -> str:
    """Return a byte count for people: `512 B`, `3.2 MiB`."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def plan_message(repo_id: str, tag: str, plan: list[dict[str, Any]], where: str) -> str:
    """Return the one-line summary of a dry run."""
    sending = [p for p in plan if p["action"] in ("add", "replace")]
    count = {a: sum(p["action"] == a for p in plan) for a in ("delete", "unchanged")}
    return (
        f"Dry run, nothing written: publishing {repo_id} {tag} to {where} would upload {len(sending)} file(s) "
        f"({_human_bytes(sum(p['bytes'] for p in sending))}), delete {count['delete']} stale shard(s), keep "
        f"{count['unchanged']} unchanged, then tag {tag}."
    )


def summary_markdown(result: Mapping[str, Any]) -> str:
    """Return the markdown artifact of a release (or of a dry run's plan): repo, tag, commit, rows and files."""
    lines = [
        f"# Published `{result['repo_id']}` {result['tag']}"
        if result["status"] != "dry_run"
        else f"# Dry run: `{result['repo_id']}` {result['tag']}",
        "",
        result["message"],
        "",
        f"- location: {result['url']}",
        f"- target: {result['target']}; status: {result['status']}; uploaded: {'yes' if result['uploaded'] else 'no'}",
        f"- commit: `{result['commit'] or '-'}`",
        "",
        "| split | rows | images |",
        "| --- | ---: | ---: |",
        *(f"| {s} | {n} | {result['images_decoded'].get(s, '-')} |" for s, n in sorted(result["rows"].items())),
        "",
        "images: pictures of the split's first row decoded back from the release (the read-back check).",
        "",
        "| file | action | bytes |",
        "| --- | --- | ---: |",
        *(f"| `{p['path']}` | {p['action']} | {p['bytes']} |" for p in result["plan"]),
    ]
    return "\n".join(lines) + "\n"


def _outcome(status: str, message: str, **fields: Any) -> dict[str, Any]:
    """Return the target-specific part of a flow result with defaults for what a status does not produce."""
    return {"status": status, "message": message, "commit": None, "uploaded": False, "images_decoded": {}, **fields}


def _tag_conflict(where: str, tag: str, version: str, differences: list[str]) -> TagExistsError:
    return TagExistsError(
        f"{where} already has tag {tag} with different content ({len(differences)} file(s) differ, e.g. "
        f"{differences[0]}); tags are never moved: publish a new version (e.g. {_next_version(version)})."
    )


def publish_hub(table: TableFolder, repo_id: str, version: str, private: bool, message: str, dry_run: bool) -> dict:
    """Publish to the Hub (token check, tag check, dry run or upload + tag + verification); see the flow."""
    tag = version_tag(version)
    api = hub_api()
    user = check_token(api, write=not dry_run)
    get_run_logger().info("Hub %s: token of %s accepted.", api.endpoint, user)
    url = f"{api.endpoint}/datasets/{repo_id}/tree/{tag}"
    try:
        with hub_errors(repo_id):
            validate_card_on_hub(api, table.overrides[CARD].decode("utf-8"))
        tag_commit, found = inspect_hub_task(repo_id, tag)
        if tag_commit is not None:
            differences = compare_files(table.files, found)
            if differences:
                raise _tag_conflict(repo_id, tag, version, differences)
            text = f"{repo_id} {tag} already holds exactly this table (commit {tag_commit[:12]}): nothing to do."
            return _outcome(
                "already_published", text, commit=tag_commit, url=url, plan=upload_plan(table.files, found)
            )
        plan = upload_plan(table.files, found)
        if dry_run:
            return _outcome("dry_run", plan_message(repo_id, tag, plan, api.endpoint), url=url, plan=plan)
        prepare_repo_task(repo_id, private)
        commit, uploaded = upload_table_task(repo_id, table, message)
        tag_release_task(repo_id, tag, commit, table, f"{repo_id} {tag}: {message}")
        readback = verify_hub_release_task(repo_id, tag, table)
    except PublishError:
        raise
    except Exception as err:
        if is_network_error(err):
            raise HubUnreachableError(
                f"lost {api.endpoint} while publishing {repo_id} {tag} ({type(err).__name__}), retries exhausted: "
                "rerun the same command; it resumes without a duplicate commit."
            ) from err
        raise
    text = f'Published {repo_id} {tag} (commit {commit[:12]}): load_dataset("{repo_id}", revision="{tag}").'
    return _outcome("published", text, commit=commit, uploaded=uploaded, url=url, plan=plan, **readback)


def publish_local(table: TableFolder, root: Path, repo_id: str, version: str, dry_run: bool) -> dict:
    """Publish to a local folder (`root` = `local_root/<repo_id>`); the same statuses as `publish_hub`."""
    tag = version_tag(version)
    tag_dir = root / TAGS_DIR / tag
    url = tag_dir.resolve().as_uri()
    if tag_dir.exists():
        found = local_files(tag_dir)
        differences = compare_files(table.files, found)
        if differences:
            raise _tag_conflict(str(tag_dir), tag, version, differences)
        text = f"{tag_dir} already holds exactly this table: nothing to do."
        return _outcome("already_published", text, url=url, plan=upload_plan(table.files, found))
    plan = upload_plan(table.files, local_files(root))
    if dry_run:
        return _outcome("dry_run", plan_message(repo_id, tag, plan, str(root)), url=url, plan=plan)
    uploaded = sync_local_main(table, root)
    tag_dir = tag_local(root, tag, table)
    differences = compare_files(table.files, local_files(tag_dir))
    if differences:
        raise VerificationError(f"{tag_dir} differs from the table ({len(differences)}: {differences[:3]}).")
    readback = read_back(str(tag_dir), revision=None, table=table)
    text = f"Published {repo_id} {tag} to {tag_dir}."
    return _outcome("published", text, uploaded=uploaded, url=url, plan=plan, **readback)


@flow(name="publish-dataset")
def publish_dataset_flow(
    table_dir: str,
    repo_id: str,
    version: str,
    target: str = "hub",
    local_root: str | None = None,
    private: bool = True,
    commit_message: str | None = None,
    dry_run: bool = False,
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
        dry_run: check the token, the table and the tag, then list what would be uploaded; write nothing.

    Returns:
        `{"target", "repo_id", "tag", "status", "message", "commit", "uploaded", "url", "files": {path: bytes},
        "plan": [{path, action, bytes}], "rows": {split: n}, "images_decoded": {split: n}}`. `status` is
        `published`, `already_published` (the tag holds exactly this table: nothing done) or `dry_run`; `message` is
        one line for the user.

    Raises:
        ValueError: on a bad version, target or repo id, or `target="local"` without `local_root`.
        HubAuthError, HubUnreachableError: the token check or a Hub request failed (one-line messages).
        TagExistsError: when the tag exists on the target with different content.
        PublishError: when the folder does not match its manifest; VerificationError when the release does not.
    """
    logger = get_run_logger()
    tag = version_tag(version)
    if target not in TARGETS:
        raise ValueError(f"target={target!r} is not one of {TARGETS}.")
    if target == "local" and local_root is None:
        raise ValueError("target='local' needs local_root (the folder that holds <repo_id>/).")
    validate_repo_id(repo_id)
    table = release_table(read_table(Path(table_dir)), repo_id, version)
    manifest = table.manifest
    provenance = (
        f"pipeline {manifest.get('pipeline_version', '?')}, config {manifest.get('config_fingerprint', '?')}, "
        f"git {manifest.get('git_sha') or 'unknown'}"
    )
    logger.info("Publishing %s (%s rows per split) as %s %s to %s", table_dir, table.rows, repo_id, tag, target)
    if target == "hub":
        message = commit_message or f"Publish {tag} ({provenance})"
        outcome = publish_hub(table, repo_id, version, private, message, dry_run)
    else:
        root = local_release_dir(Path(str(local_root)), repo_id)
        outcome = publish_local(table, root, repo_id, version, dry_run)
    result = {
        "target": target,
        "repo_id": repo_id,
        "tag": tag,
        "files": {rel: digest.size for rel, digest in sorted(table.files.items())},
        "rows": dict(sorted(table.rows.items())),
        **outcome,
    }
    key = "dataset-publish-plan" if outcome["status"] == "dry_run" else "dataset-publish-summary"
    create_markdown_artifact(key=key, markdown=summary_markdown(result), description=f"{repo_id} {tag}")
    if outcome["status"] != "dry_run":
        create_link_artifact(key="dataset-publish-link", link=result["url"], link_text=f"{repo_id} {tag}")
    logger.info("%s", result["message"])
    return result
