"""One table folder in the Hub layout: `data/` shards per split, the card (`README.md`) and `manifest.json`.

Every table a run writes (`findings`, `sft`, `rejections`, `predictions`, `rl_hardset`) goes through this module:
`write_split` streams one split's rows into its shards (rows produced lazily, e.g. with their frames), then
`finish_table` writes the card and the manifest; `write_table` does both for rows held in memory. Rows are written in
`row_order` (split, organ, case id) so shards are deterministic; `count_rows` and `count_rejections` give the counts the
cards, manifests and run summaries state. Shard names are spelled and read by `emrl_data.tables.shards`.

A built table folder is read back by `read_table`: checked against its manifest (`TableFolder`, `FileDigest`), then
compared with what a publish target holds (`compare_files`, `upload_plan`). That plan is pure; the targets that carry
it out are `flows/publish_hub.py` and `publishing/local.py`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from emrl_data.atomic_write import write_json_atomic, write_text_atomic
from emrl_data.outcome import Rejection
from emrl_data.tables.card import VERSION_PATTERN, parquet_split_bytes, render_dataset_card
from emrl_data.tables.records import SCHEMAS, check_required, column_descriptions, hub_features
from emrl_data.tables.shards import (
    DATA_DIR,
    DATA_PATTERN,
    RELEASE_SHARD_PATTERN,
    FileDigest,
    digest_file,
    parse_shard_name,
    table_manifest,
    write_split_shards,
    write_split_streaming,
)


MANIFEST = "manifest.json"
CARD = "README.md"
# Files the Hub adds on its own; never part of a table.
HUB_OWN_FILES = frozenset({".gitattributes"})


def row_order(row: Mapping[str, Any]) -> tuple[str, str, str]:
    """The order rows are written in: split, organ, case id (deterministic shards)."""
    return (row["split"], row["organ"], row["case_id"])


def count_rows(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """Counts per split -> "organ/positive|negative" (and "total")."""
    counts: dict[str, Counter[str]] = {}
    for r in rows:
        c = counts.setdefault(r["split"], Counter())
        c[f"{r['organ']}/{'positive' if r['has_lesion'] else 'negative'}"] += 1
        c["total"] += 1
    return {split: dict(sorted(c.items())) for split, c in sorted(counts.items())}


def count_rejections(rejections: Iterable[Rejection]) -> dict[str, int]:
    """Counts per "step/reason"."""
    return dict(sorted(Counter(f"{r.step}/{r.reason}" for r in rejections).items()))


def write_table(
    name: str,
    rows_by_split: Mapping[str, Sequence[Mapping[str, Any]]],
    out_dir: Path,
    *,
    provenance: Mapping[str, Any],
    counts: Mapping[str, Mapping[str, int]] | None = None,
) -> Path:
    """Write one table folder in the Hub layout from rows held in memory: `data/` shards per split (each split
    streamed as `write_split` does), then `README.md` and `manifest.json` (`finish_table`)."""
    for split, rows in rows_by_split.items():
        for row in rows:
            check_required(name, row)
        write_split_shards(rows, table_schema(name), out_dir / name / DATA_DIR, split)
    if counts is None:
        counts = {split: {"total": len(rows)} for split, rows in rows_by_split.items()}
    return finish_table(name, out_dir, provenance=provenance, counts=counts)


def write_split(
    name: str, split: str, rows: Iterable[Mapping[str, Any]], row_bytes: Sequence[int], out_dir: Path
) -> list[Path]:
    """Stream the rows of one split of table `name` into its shards under `out_dir/name/data/`; return the shards.

    `row_bytes` estimates each row's size (e.g. the PNG bytes of its frames) and fixes the shards before a row is
    produced (`emrl_data.tables.shards.write_split_streaming`). Shards of the split left by an earlier run with another
    count are removed. The card and manifest follow with `finish_table`, once every split is written.
    """
    return write_split_streaming(rows, row_bytes, table_schema(name), out_dir / name / DATA_DIR, split)


def finish_table(
    name: str,
    out_dir: Path,
    *,
    provenance: Mapping[str, Any],
    counts: Mapping[str, Mapping[str, int]],
    metrics_markdown: str | None = None,
) -> Path:
    """Write the card and the manifest of a table folder whose shards are in place; return the folder.

    `provenance` needs `pipeline_version`, `git_sha` and `config_fingerprint`; it is also copied into the manifest.
    """
    table_dir = out_dir / name
    card = render_dataset_card(
        table=name,
        features=table_features(name),
        row_counts={split: dict(c) for split, c in counts.items()},
        pipeline_version=provenance["pipeline_version"],
        git_sha=provenance["git_sha"],
        config_fingerprint=provenance["config_fingerprint"],
        metrics_markdown=metrics_markdown,
        splits=tuple(counts),
        descriptions=column_descriptions(name),
        split_bytes=parquet_split_bytes(table_dir / DATA_DIR, tuple(counts)),
        atlas_source=provenance.get("atlas_source"),
        sources=provenance.get("sources"),
    )
    write_text_atomic(card, table_dir / CARD)
    manifest = table_manifest(table_dir, {**provenance, "row_counts": {s: dict(c) for s, c in counts.items()}})
    write_json_atomic(manifest, table_dir / MANIFEST)
    return table_dir


def table_schema(name: str) -> pa.Schema:
    """Return the schema of a table by name."""
    return SCHEMAS[name]


def table_features(name: str) -> dict[str, Any]:
    """Return the Hub features of a table by name."""
    return hub_features(table_schema(name))


# --------------------------------------------------------------------------------------------------------------------
# Reading a built table folder back and planning its publish (pure: the targets are in flows/)


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


class TagExistsError(PublishError):
    """The release tag already exists on the target with different content; tags are never moved."""


class VerificationError(PublishError):
    """The published files or the read-back differ from the table."""


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
        configs: rows per split of each config when released as one config per source
            (`emrl_data.tables.source_configs`); {} for the one `default` config.
    """

    root: Path
    files: dict[str, FileDigest]
    rows: dict[str, int]
    manifest: dict[str, Any]
    overrides: dict[str, bytes] = field(default_factory=dict)
    configs: dict[str, dict[str, int]] = field(default_factory=dict)


def version_tag(version: str) -> str:
    """Return the tag of a release version: `"1.2.0"` -> `"v1.2.0"`.

    Raises:
        ValueError: when `version` is not `X.Y.Z` with non-negative integers without leading zeros.
    """
    if not VERSION_PATTERN.fullmatch(version):
        raise ValueError(f"version={version!r} is not X.Y.Z (e.g. '1.2.0'); the release tag is 'v' + version.")
    return f"v{version}"


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

    Actions: `add` (not on the target), `replace` (differs), `unchanged`, `delete` (a stale shard: a Parquet file the
    table does not hold, `RELEASE_SHARD_PATTERN`).
    """
    plan = []
    for rel, want in sorted(expected.items()):
        have = found.get(rel)
        action = "add" if have is None else ("replace" if compare_files({rel: want}, {rel: have}) else "unchanged")
        plan.append({"path": rel, "action": action, "bytes": want.size})
    for rel, have in sorted(found.items()):
        if rel not in expected and fnmatch(rel, RELEASE_SHARD_PATTERN):
            plan.append({"path": rel, "action": "delete", "bytes": have.size})
    return plan


def next_version(version: str) -> str:
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
    shards = sorted(rel for rel in files if rel.startswith(f"{DATA_DIR}/"))
    split_of = {rel: parsed[0] for rel in shards if (parsed := parse_shard_name(rel)) is not None}
    problems += [
        f"{rel}: not named {DATA_DIR}/{{split}}-{{i:05d}}-of-{{n:05d}}.parquet"
        for rel in shards
        if rel not in split_of
    ]
    if not shards:
        problems.append(f"no {DATA_PATTERN} shard")
    if problems:
        raise PublishError(f"{table_dir} does not match its manifest: " + "; ".join(problems))
    rows: dict[str, int] = {}
    for rel, split in split_of.items():
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


def human_bytes(n: int) -> str:
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
        f"({human_bytes(sum(p['bytes'] for p in sending))}), delete {count['delete']} stale shard(s), keep "
        f"{count['unchanged']} unchanged, then tag {tag}."
    )


def tag_conflict(where: str, tag: str, version: str, differences: list[str]) -> TagExistsError:
    return TagExistsError(
        f"{where} already has tag {tag} with different content ({len(differences)} file(s) differ, e.g. "
        f"{differences[0]}); tags are never moved: publish a new version (e.g. {next_version(version)})."
    )
