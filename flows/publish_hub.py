"""The Hub target of `publish-dataset` (flows/publish.py): token check, tag check, upload, tag, verification.

The token comes only from the environment (`HF_TOKEN`) or `hf auth login`, found by huggingface_hub itself: this module
never reads, logs or writes it. Network errors (connection errors, timeouts, HTTP 5xx, 408, 429) are retried by the
tasks; other 4xx are not. Logic lives in plain functions; the tasks only retry and report.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from huggingface_hub import HfApi
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalTokenNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import get_session, hf_raise_for_status
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from emrl_data.tables.table_folder import (
    CARD,
    RELEASE_SHARD_PATTERN,
    FileDigest,
    PublishError,
    TableFolder,
    TagExistsError,
    VerificationError,
    compare_files,
    plan_message,
    tag_conflict,
    upload_plan,
    version_tag,
    write_release_file,
)
from publishing.readback import outcome, read_back


RETRY_STATUS_CODES = frozenset({408, 429})  # and every 5xx


class HubAuthError(PublishError):
    """The Hub refused the token (none, invalid, read-only, or no access to the repo)."""


class HubUnreachableError(PublishError):
    """The Hub could not be reached (offline mode, connection errors, retries exhausted)."""


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
                delete_patterns=[RELEASE_SHARD_PATTERN],
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
                raise tag_conflict(repo_id, tag, version, differences)
            text = f"{repo_id} {tag} already holds exactly this table (commit {tag_commit[:12]}): nothing to do."
            return outcome("already_published", text, commit=tag_commit, url=url, plan=upload_plan(table.files, found))
        plan = upload_plan(table.files, found)
        if dry_run:
            return outcome("dry_run", plan_message(repo_id, tag, plan, api.endpoint), url=url, plan=plan)
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
    return outcome("published", text, commit=commit, uploaded=uploaded, url=url, plan=plan, **readback)
