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
4. makes the target's `main` equal to the folder: `upload_folder(delete_patterns=["*.parquet"])` on the Hub (so a
   shard set that shrank, or a source's config dropped since the last version, leaves no stale shards), a plain copy
   for `target="local"` that drops them too. When `main` already holds
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

Logic lives in plain functions; the flow and its tasks only sequence them, retry and report. The folder check and the
plan are pure (`emrl_data/tables/table_folder.py`); the targets are `flows/publish_hub.py` and `publishing/local.py`,
and both end with the read-back of `publishing/readback.py`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from huggingface_hub import DatasetCard
from huggingface_hub.utils import validate_repo_id
from prefect import flow, get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact

from emrl_data.tables.card import release_card
from emrl_data.tables.shards import digest_bytes
from emrl_data.tables.source_configs import check_licences, release_per_source
from emrl_data.tables.table_folder import (  # noqa: F401 - the publish API is importable from here
    CARD,
    MANIFEST,
    FileDigest,
    PublishError,
    TableFolder,
    TagExistsError,
    VerificationError,
    compare_files,
    read_table,
    upload_plan,
    version_tag,
)
from flows.publish_hub import (  # noqa: F401 - re-exported with the rest of the publish API
    HubAuthError,
    HubUnreachableError,
    check_token,
    hub_api,
    is_network_error,
    publish_hub,
)
from publishing.local import local_release_dir, publish_local
from publishing.readback import read_back  # noqa: F401


TARGETS = ("hub", "local")


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
    commercial: bool = False,
    config_per_source: bool = False,
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
        commercial: the set is declared for commercial use: a non-commercial source is refused.
        config_per_source: one config per source dataset (`emrl_data.tables.source_configs`) instead of `default`;
            one config's sources must have licences that combine (`emrl_data.sources.licence_conflict`).

    Returns:
        `{"target", "repo_id", "tag", "status", "message", "commit", "uploaded", "url", "files": {path: bytes},
        "plan": [{path, action, bytes}], "rows": {split: n}, "images_decoded": {split: n}}`. `status` is
        `published`, `already_published` (the tag holds exactly this table: nothing done) or `dry_run`; `message` is
        one line for the user.

    Raises:
        ValueError: on a bad version, target or repo id, or `target="local"` without `local_root`.
        HubAuthError, HubUnreachableError: the token check or a Hub request failed (one-line messages).
        TagExistsError: when the tag exists on the target with different content.
        PublishError: when the folder does not match its manifest, or its sources' licences cannot be published as
            asked; VerificationError when the release does not match.
    """
    logger = get_run_logger()
    tag = version_tag(version)
    if target not in TARGETS:
        raise ValueError(f"target={target!r} is not one of {TARGETS}.")
    if target == "local" and local_root is None:
        raise ValueError("target='local' needs local_root (the folder that holds <repo_id>/).")
    validate_repo_id(repo_id)
    table = release_table(read_table(Path(table_dir)), repo_id, version)
    sources = check_licences(table, commercial=commercial, config_per_source=config_per_source)
    table = release_per_source(table) if config_per_source else table
    manifest = table.manifest
    provenance = (
        f"pipeline {manifest.get('pipeline_version', '?')}, config {manifest.get('config_fingerprint', '?')}, "
        f"git {manifest.get('git_sha') or 'unknown'}"
    )
    logger.info("Publishing %s (%s rows per split; sources %s) as %s %s", table_dir, table.rows, sources, repo_id, tag)
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
