"""The local target of `publish-dataset` (flows/publish.py): a release folder with read-only tag snapshots.

The layout of a Hub dataset repo under `local_root/<repo_id>/` (`main`), each tag a snapshot folder
`local_root/<repo_id>/.tags/vX.Y.Z/`. Snapshot files are hard links to the `main` files of that release (copies where
links are impossible) made read-only; publishing replaces `main` files by rename, never in place, so a snapshot keeps
its content.
"""

from __future__ import annotations

import os
import shutil
from fnmatch import fnmatch
from pathlib import Path

from huggingface_hub.utils import validate_repo_id

from emrl_data.atomic_write import temporary_path, writing
from emrl_data.tables.table_folder import (
    RELEASE_SHARD_PATTERN,
    FileDigest,
    TableFolder,
    TagExistsError,
    VerificationError,
    compare_files,
    digest_file,
    plan_message,
    tag_conflict,
    upload_plan,
    version_tag,
    write_release_file,
)
from publishing.readback import outcome, read_back


TAGS_DIR = ".tags"


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
        tmp = temporary_path(target)
        with writing(target, tmp):  # no room: `OutputWriteError` naming the file, no temporary file left
            write_release_file(table, rel, tmp)
            os.replace(tmp, target)  # a new inode: tag snapshots hard-linked to the old file keep their content
    for rel in current:
        if rel not in table.files and fnmatch(rel, RELEASE_SHARD_PATTERN):
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


def publish_local(table: TableFolder, root: Path, repo_id: str, version: str, dry_run: bool) -> dict:
    """Publish to a local folder (`root` = `local_root/<repo_id>`); the same statuses as `publish_hub`."""
    tag = version_tag(version)
    tag_dir = root / TAGS_DIR / tag
    url = tag_dir.resolve().as_uri()
    if tag_dir.exists():
        found = local_files(tag_dir)
        differences = compare_files(table.files, found)
        if differences:
            raise tag_conflict(str(tag_dir), tag, version, differences)
        text = f"{tag_dir} already holds exactly this table: nothing to do."
        return outcome("already_published", text, url=url, plan=upload_plan(table.files, found))
    plan = upload_plan(table.files, local_files(root))
    if dry_run:
        return outcome("dry_run", plan_message(repo_id, tag, plan, str(root)), url=url, plan=plan)
    uploaded = sync_local_main(table, root)
    tag_dir = tag_local(root, tag, table)
    differences = compare_files(table.files, local_files(tag_dir))
    if differences:
        raise VerificationError(f"{tag_dir} differs from the table ({len(differences)}: {differences[:3]}).")
    readback = read_back(str(tag_dir), revision=None, table=table)
    text = f"Published {repo_id} {tag} to {tag_dir}."
    return outcome("published", text, uploaded=uploaded, url=url, plan=plan, **readback)
