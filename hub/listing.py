"""The release at one commit: the revision resolved to its sha, every file listed with its size, sha256 and git blob
id, the part pairs planned from the names (`emrl_data.reading.release.pair_parts`)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError
from huggingface_hub.hf_api import RepoFile

from emrl_data.reading.release import HubFile, PartPair, pair_parts
from hub.retry import call_with_retry


HUB_PREFIX = "hf://datasets/"


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

    @property
    def source(self) -> str:
        """`hf://datasets/OWNER/NAME@SHA`: what the run read, pinned."""
        return f"{HUB_PREFIX}{self.repo_id}@{self.sha}"

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
