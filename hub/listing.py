"""The release at one commit: the revision resolved to its sha, every file listed with its size, sha256 and git blob
id, the part pairs planned from the names (`emrl_data.reading.release.pair_parts`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils.sha import sha_fileobj

from emrl_data.reading.release import IMAGE_DIR, MASK_DIR, SIDE_FILES, HubFile, PartPair, pair_parts
from hub.logs import route_library_logs
from hub.retry import call_with_retry


HUB_PREFIX = "hf://datasets/"
RELEASE_REPO = "AbdomenAtlas/AbdomenAtlas3.0Mini"  # what a folder of parts is checked against (`--revision`)


class HubAccessError(RuntimeError):
    """The Hub refuses the repository or a file to this client (gated, private, refused token): one line, no retry."""


def hub_repo(atlas_root: str) -> str | None:
    """The dataset repo of an `hf://datasets/OWNER/NAME` atlas root, None for a local path.

    >>> hub_repo("hf://datasets/AbdomenAtlas/AbdomenAtlas3.0Mini")
    'AbdomenAtlas/AbdomenAtlas3.0Mini'
    """
    if not atlas_root.startswith(HUB_PREFIX):
        return None
    repo = atlas_root[len(HUB_PREFIX) :].strip("/")
    if repo.count("/") != 1 or "@" in repo:
        raise ValueError(f"{atlas_root!r}: expected hf://datasets/OWNER/NAME (the revision goes in --revision).")
    return repo


@dataclass(frozen=True)
class HubCommit:
    """Where a file of the release is read: the repository, the commit sha, the endpoint (small, picklable)."""

    repo_id: str
    sha: str
    endpoint: str

    def url(self, path: str) -> str:
        """The `resolve/` URL of a file of this commit."""
        return f"{self.endpoint.rstrip('/')}/datasets/{self.repo_id}/resolve/{self.sha}/{quote(path)}"


@dataclass(frozen=True)
class HubRelease:
    """One revision of the release: its commit, every file with size and checksums, the part pairs."""

    repo_id: str
    revision: str  # as asked (branch, tag or sha)
    sha: str  # the commit it resolved to
    endpoint: str
    files: dict[str, HubFile]
    pairs: tuple[PartPair, ...]
    warnings: tuple[str, ...]
    local_root: str | None = None  # a folder of parts on disk (as `hf download` leaves them), read in place

    @property
    def source(self) -> str:
        """`hf://datasets/OWNER/NAME@SHA` (what the run read, pinned), or the folder of parts."""
        return self.local_root or f"{HUB_PREFIX}{self.repo_id}@{self.sha}"

    @property
    def commit(self) -> HubCommit:
        """The pinned commit, without the listing."""
        return HubCommit(self.repo_id, self.sha, self.endpoint)


def access_error(repo_id: str, err: HfHubHTTPError) -> HubAccessError | None:
    """The one-line `HubAccessError` of a gated, private or refused answer, None for any other error."""
    status = err.response.status_code if err.response is not None else None
    fix = "set HF_TOKEN (or run `hf auth login`) with a token of an account that may read it"
    if isinstance(err, GatedRepoError):
        if get_token() is None:
            return HubAccessError(f"{HUB_PREFIX}{repo_id} is gated and no Hugging Face token is set: {fix}")
        return HubAccessError(
            f"{HUB_PREFIX}{repo_id} is gated and the token's account has not been granted access (HTTP {status}): "
            "accept its terms on the Hub with that account"
        )
    if isinstance(err, RepositoryNotFoundError) or status in (401, 403):
        return HubAccessError(f"{HUB_PREFIX}{repo_id} is not readable here (HTTP {status}: missing or private): {fix}")
    return None


def resolve_release(repo_id: str, revision: str | None = None) -> HubRelease:
    """Resolve `revision` (default `main`) to its commit and list the files of that commit (no part is read).

    A gated repository with no token set fails here, before any task starts.

    Raises:
        HubAccessError: gated, private or a refused token.
        ValueError: the revision holds no released part.
        huggingface_hub errors: revision not found; the Hub unreachable or failing after the retries.
    """
    route_library_logs()
    api = HfApi()
    try:
        info = call_with_retry(lambda: api.dataset_info(repo_id, revision=revision), f"{repo_id}: dataset info")
        if info.gated and get_token() is None:
            fix = "set HF_TOKEN (or run `hf auth login`) with a token of an account that accepted its terms"
            raise HubAccessError(f"{HUB_PREFIX}{repo_id} is gated and no Hugging Face token is set: {fix}")
        sha = info.sha
        assert sha is not None  # the Hub always answers a sha
        entries = call_with_retry(
            lambda: list(api.list_repo_tree(repo_id, recursive=True, revision=sha, repo_type="dataset")),
            f"{repo_id}@{sha[:12]}: file listing",
        )
    except HfHubHTTPError as err:
        refused = access_error(repo_id, err)
        if refused is not None:
            raise refused from None
        raise
    files = {
        e.path: HubFile(e.path, e.size, e.lfs.sha256 if e.lfs is not None else None, e.blob_id)
        for e in entries
        if isinstance(e, RepoFile)
    }
    pairs, warnings = pair_parts(files.values())
    if not pairs:
        raise ValueError(
            f"{HUB_PREFIX}{repo_id}@{sha[:12]} holds no image_only/AbdomenAtlas3_images_BDMAP_BDMAP_*.tar.gz or "
            "mask_only/AbdomenAtlas3_masks_BDMAP_BDMAP_*.tar.gz part"
        )
    return HubRelease(repo_id, revision or "main", sha, api.endpoint, files, tuple(pairs), tuple(warnings))


def is_parts_folder(root: Path) -> bool:
    """Whether `root` holds release parts as `hf download` leaves them (`image_only/*.tar.gz`, `mask_only/*.tar.gz`)."""
    return root.is_dir() and any(any((root / kind).glob("*.tar.gz")) for kind in (IMAGE_DIR, MASK_DIR))


def local_release(root: Path, revision: str | None = None, repo_id: str = RELEASE_REPO) -> HubRelease:
    """A folder of release parts read in place, as a release: its parts paired by name, its side files beside them.

    With `revision`, every part and side file is checked against that revision's listing (size, then sha256 or git
    blob id: the whole file is read once) and takes its checksums, so the run's ledger is the `hf://` run's; without
    it, a part is known by its path, size and modification time.

    Raises:
        ValueError: a file differs from the listing (named with both sizes or checksums), or no part is there.
    """
    root = root.resolve()
    paths = sorted(p for kind in (IMAGE_DIR, MASK_DIR) for p in (root / kind).glob("*.tar.gz"))
    paths += [root / side for side in SIDE_FILES if (root / side).is_file()]
    files: dict[str, HubFile] = {}
    for path in paths:
        rel, stat = path.relative_to(root).as_posix(), path.stat()
        stamp = hashlib.sha1(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
        files[rel] = HubFile(rel, stat.st_size, None, f"local-{stamp}")
    sha = "local"
    if revision is not None:
        listed = resolve_release(repo_id, revision)
        sha = listed.sha
        for rel, here in files.items():
            there = listed.files.get(rel)
            if there is None:
                raise ValueError(f"{root / rel}: not in {listed.source}")
            problem = _differs(root / rel, here.size, there)
            if problem is not None:
                raise ValueError(f"{root / rel}: {problem} (checked against {listed.source})")
            files[rel] = there
    pairs, warnings = pair_parts(files.values())
    if not pairs:
        raise ValueError(f"{root} holds no image_only/ or mask_only/ part")
    return HubRelease(repo_id, revision or "local", sha, "", files, tuple(pairs), tuple(warnings), str(root))


def _differs(path: Path, size: int, listed: HubFile) -> str | None:
    if size != listed.size:
        return f"{size} bytes, the listing has {listed.size}"
    if listed.sha256 is not None:
        with path.open("rb") as fh:
            got = sha_fileobj(fh).hex()
        return None if got == listed.sha256 else f"sha256 {got}, the listing has {listed.sha256}"
    return None


def cached_blob(repo_id: str, part: HubFile) -> Path | None:
    """The part in the Hugging Face cache (`HF_HUB_CACHE/datasets--OWNER--NAME/blobs/<sha256>`, where `hf download`
    and `hf_hub_download` keep it) when it is there with the listed size and sha256 (read once to check), else None."""
    if part.sha256 is None:
        return None
    blob = (
        Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="dataset") / "blobs" / part.sha256
    )
    if not blob.is_file() or blob.stat().st_size != part.size:
        return None
    with blob.open("rb") as fh:
        return blob if sha_fileobj(fh).hex() == part.sha256 else None
