"""A small in-memory, Hub-compatible HTTP server for offline tests of publishing code (test-only, not the product).

It speaks the real protocol to the real clients (huggingface_hub 1.33, hf_xet 1.8, datasets 5.2) for the calls
`HfApi.create_repo` / `upload_folder` / `create_commit` / `create_tag` / `create_branch` / `list_repo_refs` /
`list_repo_tree` / `list_repo_commits` / `repo_info` / `hf_hub_download` and `datasets.load_dataset(repo, revision=...)`
make.

How it avoids Xet and LFS: `/preupload` answers `uploadMode: "regular"` for every file, so the client inlines the bytes
(base64) in the NDJSON `/commit` call. With `lfs_suffixes=(".parquet",)` those files get `uploadMode: "lfs"` and go
through the legacy LFS "basic" batch API served here; clients must then run with `HF_HUB_DISABLE_XET=1`, since this
server does not speak Xet.

Auth is enforced as on the Hub: `state.tokens` maps each known token to its role (`write` or `read`). A request with an
unknown bearer token gets 401 on every route; `whoami` and every write (create, preupload, commit, tag, branch, LFS
batch) need a token (401 without one) with the `write` role (403 with a `read` token); a private repo is not readable
without a token (401, error code `RepoNotFound`, like the Hub). Default tokens: `hf_fake` (write), `hf_fake_read` (read).

Downloads answer as on the Hub on a busy day: `resolve/` of an LFS file answers 302 to a signed URL on a second
server on another loopback address (`127.0.0.2`, a CDN: `state.cdn_url`), which serves the bytes with Range support and
records every `Authorization` header it receives in `state.cdn_authorizations` (the client must send none there).
`state.fail_next(method, needle, status, retry_after=...)` makes the next matching request (on either host) answer
`status` with an optional `Retry-After`; `state.cut[path] = n` makes the next GET of a file send `n` bytes and drop the
connection; a repository put with `gated=True` is listed to anyone but its files need a token (401 `GatedRepo`).

Xet (`serve_fake_hub(xet=True)`, `--xet`): LFS files are also stored as Xet files (`tests/fakehub_xet.py`) and
answered as the Hub answers a Xet file: the resolve HEAD carries `X-Xet-Hash` and the refresh route in `Link`
(`rel="xet-auth"`) and redirects to a third host (`127.0.0.3`, the CAS: `state.cas_url`); the refresh route
(`/api/datasets/NS/NAME/xet-read-token/REV`) hands out a Xet read token only to a request the repository accepts
(a gated one: a token in `repo.granted`); the CAS serves reconstructions and xorb ranges to hf_xet with the same
faults, cuts and bandwidth cap as the CDN. The tree listing gives each such file's `xetHash`.

Every request on every host is logged (`state.log`, and one JSON line per request to `state.log_path` when set):
host, method, path, status and the body bytes sent (counted as they go out, so a cut connection counts what left).
`state.bandwidth_bps` caps the bytes of file bodies (CDN, CAS and `resolve/`) of every host together, one link.

What it does not do: validate cards like the Hub, run the viewer, accept Xet uploads (uploads go through LFS "basic").
Unknown routes are recorded in `state.unknown`, every request in `state.requests` and every `Authorization` header in
`state.authorizations`.

Use from tests: `with serve_fake_hub() as hub: ... hub.url ... hub.state.commit_count("datasets", "org/name")`.
Run by hand: `python -m tests.fakehub --port 8765 [--xet] [--dataset REPO_ID=DIR] [--gated REPO_ID] [--log FILE]
[--mb-per-s R]`, then `HF_ENDPOINT=http://127.0.0.1:8765 HF_TOKEN=hf_fake ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import uvicorn
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tests.fakehub_xet import XetStore
from tests.loopback import free_port


DEFAULT_TOKENS = {"hf_fake": "write", "hf_fake_read": "read"}
# POST routes that only read; every other POST, PUT or DELETE writes.
READ_ONLY_POSTS = ("/api/validate-yaml", "/paths-info/")
CDN_HOST = "127.0.0.2"  # another loopback address: another host to the client, which must not send it the token
CAS_HOST = "127.0.0.3"  # the Xet storage: a third host


def git_blob_sha1(data: bytes) -> str:
    """Return the git blob id of `data` (what the Hub reports as `oid` of a regular file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(seconds))


@dataclass
class Commit:
    """One commit: the full file map (path -> blob key) and its parent."""

    oid: str
    parent: str | None
    files: dict[str, str]
    title: str
    date: float


@dataclass
class Repo:
    """One repository: commits, branches and tags (name -> commit oid)."""

    repo_type: str  # "model" | "dataset" | "space"
    repo_id: str
    private: bool
    gated: bool = False
    granted: set[str] | None = None  # tokens a gated repo accepts (None: every known token)
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    created: float = field(default_factory=time.time)


@dataclass
class HubState:
    """Everything the fake Hub holds. Blobs are keyed by git sha1 (regular files) or sha256 (LFS objects)."""

    lfs_suffixes: tuple[str, ...] = ()
    tokens: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_TOKENS))
    blobs: dict[str, bytes] = field(default_factory=dict)
    lfs_blobs: set[str] = field(default_factory=set)
    repos: dict[tuple[str, str], Repo] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    authorizations: set[str] = field(default_factory=set)
    faults: list[tuple[str, str, int, dict[str, str]]] = field(default_factory=list)
    cut: dict[str, int] = field(default_factory=dict)  # file path -> bytes sent before the next GET drops the line
    cdn_url: str = ""  # the second host LFS downloads are redirected to ("" : no redirect)
    cdn_authorizations: list[str] = field(default_factory=list)  # the Authorization header of every CDN request
    cas_authorizations: list[str] = field(default_factory=list)  # the same for every Xet storage request
    corrupt: dict[str, int] = field(default_factory=dict)  # file path -> downloads still served with a flipped byte
    served: dict[str, int] = field(default_factory=dict)  # file path -> bytes served by resolve/
    ranges: list[tuple[str, int]] = field(default_factory=list)  # (file path, first byte) of each Range request
    bandwidth_bps: float | None = None  # file bytes go out at this total rate, both hosts together (None: no limit)
    link_free_at: float = 0.0  # when the shared link is free again (time.monotonic)
    xet: XetStore | None = None  # LFS files also stored and served as Xet files (None: LFS over HTTP only)
    cas_url: str = ""  # the Xet storage host
    log: list[dict[str, Any]] = field(default_factory=list)  # one entry per request, every host
    log_path: str | None = None  # the same as JSON lines in this file
    lock: threading.Lock = field(default_factory=threading.Lock)

    def put_dataset(
        self,
        repo_id: str,
        files: dict[str, bytes],
        title: str = "upload",
        *,
        regular: tuple[str, ...] = (".csv",),
        gated: bool = False,
        granted: set[str] | None = None,
    ) -> str:
        """Commit `files` (path -> bytes) on `main` of a public dataset repo, created when missing; files of the previous
        commit stay. Files ending in `regular` are git blobs (listed with their blob id), the others LFS objects
        (listed with their sha256). `gated`: files need a token, one of `granted` when given. Returns the commit
        oid."""
        with self.lock:
            repo = self.repos.setdefault(("dataset", repo_id), Repo("dataset", repo_id, False))
            repo.gated, repo.granted = gated, granted
            head = repo.commits[repo.branches["main"]].files if "main" in repo.branches else {}
            tree = dict(head)
            for path, data in files.items():
                if path.endswith(regular):
                    oid = git_blob_sha1(data)
                else:
                    oid = hashlib.sha256(data).hexdigest()
                    self.lfs_blobs.add(oid)
                    if self.xet is not None:
                        self.xet.add(oid, data)
                self.blobs[oid] = data
                tree[path] = oid
            commit = self.new_commit(repo, repo.branches.get("main"), tree, title)
            repo.branches["main"] = commit.oid
            return commit.oid

    def sent(self, host: str, path_contains: str = "") -> int:
        """Body bytes sent by `host` (`hub`, `cdn`, `cas`) on requests whose path contains `path_contains`."""
        with self.lock:
            return sum(e["bytes"] for e in self.log if e["host"] == host and path_contains in e["path"])

    def gate(self, repo: Repo, request: Request) -> JSONResponse | None:
        """The Hub's answer to a request for a gated repo's file without access: 401 without a token, 403 with a
        token the repo has not granted; None when allowed."""
        if not repo.gated:
            return None
        token = _bearer(request) or ""
        if self.tokens.get(token) is None:
            msg = f"Access to dataset {repo.repo_id} is restricted. You must have access to it and be authenticated."
            return _err(401, msg, code="GatedRepo")
        if repo.granted is not None and token not in repo.granted:
            msg = f"Access to dataset {repo.repo_id} is restricted and you are not in the authorized list."
            return _err(403, msg, code="GatedRepo")
        return None

    def fail_next(
        self,
        method: str,
        path_contains: str,
        status: int,
        retry_after: int | None = None,
        *,
        ratelimit_reset: int | None = None,
    ) -> None:
        """Make the next `method` request (any host) whose path contains `path_contains` answer `status` (once), with
        a `Retry-After: retry_after` header, or the Hub's `RateLimit: "api";r=0;t=ratelimit_reset`, when given."""
        headers = {}
        if retry_after is not None:
            headers["Retry-After"] = str(retry_after)
        if ratelimit_reset is not None:
            headers["RateLimit"] = f'"api";r=0;t={ratelimit_reset}'
            headers["RateLimit-Policy"] = '"fixed window";"api";q=500;w=300'
        self.faults.append((method.upper(), path_contains, status, headers))

    def repo(self, repo_type: str, repo_id: str) -> Repo | None:
        """Return a repository by type (`dataset` or `datasets`) and id, or None."""
        return self.repos.get((repo_type.rstrip("s"), repo_id))

    def commit_count(self, repo_type: str, repo_id: str, branch: str = "main") -> int:
        """Return the number of commits on `branch` (the initial commit included)."""
        repo = self.repo(repo_type, repo_id)
        if repo is None:
            raise KeyError(f"no repo {repo_type}/{repo_id}")
        n = 0
        parent: str | None = repo.branches[branch]
        while parent is not None:
            n, parent = n + 1, repo.commits[parent].parent
        return n

    def new_commit(self, repo: Repo, parent: str | None, files: dict[str, str], title: str) -> Commit:
        """Record a commit with a fresh oid."""
        payload = json.dumps([parent, sorted(files.items()), title, time.time_ns()]).encode()
        commit = Commit(hashlib.sha1(payload).hexdigest(), parent, files, title, time.time())
        repo.commits[commit.oid] = commit
        return commit

    def resolve(self, repo: Repo, rev: str) -> Commit | None:
        """Return the commit a branch, tag, `refs/...` name or (abbreviated) oid points to."""
        rev = unquote(rev)
        for prefix, refs in (("refs/heads/", repo.branches), ("refs/tags/", repo.tags)):
            if rev.startswith(prefix) and rev[len(prefix) :] in refs:
                return repo.commits[refs[rev[len(prefix) :]]]
        if rev in repo.branches:
            return repo.commits[repo.branches[rev]]
        if rev in repo.tags:
            return repo.commits[repo.tags[rev]]
        if len(rev) >= 7:
            for oid, commit in repo.commits.items():
                if oid.startswith(rev):
                    return commit
        return None


def _err(status: int, msg: str, code: str | None = None, extra: dict[str, str] | None = None) -> JSONResponse:
    # huggingface_hub maps X-Error-Code to RepositoryNotFoundError / RevisionNotFoundError / EntryNotFoundError.
    headers = {"X-Error-Message": msg, **(extra or {})}
    if code:
        headers["X-Error-Code"] = code
    return JSONResponse({"error": msg}, status_code=status, headers=headers)


def _split_repo(path: str) -> tuple[str, str]:
    """'ns/name/rest...' -> ('ns/name', 'rest...'); repo ids here always have a namespace."""
    parts = path.split("/")
    return "/".join(parts[:2]), "/".join(parts[2:])


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    return header[len("Bearer ") :] if header.startswith("Bearer ") else None


def _path_repo(state: HubState, path: str) -> Repo | None:
    """Return the repo a `/api/datasets/ns/name/...` or `/datasets/ns/name/...` path is about, or None."""
    parts = path.strip("/").split("/")
    if parts and parts[0] == "api":
        parts = parts[1:]
    if len(parts) >= 3 and parts[0] in ("datasets", "spaces", "models"):
        return state.repo(parts[0], f"{parts[1]}/{parts[2]}")
    return None


def _auth_failure(state: HubState, request: Request) -> JSONResponse | None:
    """Return the Hub's 401/403 answer when the request's token does not allow it, else None."""
    path = request.url.path
    if path.startswith("/_fakehub/"):  # LFS object storage: pre-signed URLs, no token (as on S3)
        return None
    token = _bearer(request)
    role = state.tokens.get(token) if token else None
    if token and role is None:
        return _err(401, "Invalid credentials in Authorization header")
    writes = request.method in ("POST", "PUT", "DELETE") and not any(s in path for s in READ_ONLY_POSTS)
    if (writes or path == "/api/whoami-v2") and role is None:
        return _err(401, "Invalid username or password.")
    if writes and role != "write":
        return _err(403, "You don't have the rights to write here: the token is read-only.")
    repo = _path_repo(state, path)
    if repo is not None and repo.private and role is None:
        return _err(401, "Repository not found", code="RepoNotFound")
    return None


def make_app(state: HubState) -> FastAPI:
    """Return the ASGI app serving `state`."""
    app = FastAPI()

    @app.middleware("http")
    async def faults(request: Request, call_next: Any) -> Any:
        state.requests.append(f"{request.method} {request.url.path}")
        state.authorizations.add(request.headers.get("authorization", ""))
        return _injected(state, request) or _auth_failure(state, request) or await call_next(request)

    def info(repo: Repo, commit: Commit) -> dict[str, Any]:
        readme = commit.files.get("README.md")
        card = None
        if readme:
            text = state.blobs[readme].decode()
            card = (yaml.safe_load(text.split("---")[1]) or {}) if text.startswith("---") else None
        return {
            "_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": commit.oid,
            "lastModified": _utc(commit.date),
            "createdAt": _utc(repo.created),
            "private": repo.private,
            "gated": "auto" if repo.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "cardData": card,
            "siblings": [{"rfilename": p, "size": len(state.blobs[b])} for p, b in sorted(commit.files.items())],
        }

    def file_entry(commit: Commit, path: str) -> dict[str, Any]:
        key = commit.files[path]
        data = state.blobs[key]
        if key in state.lfs_blobs:
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{key}\nsize {len(data)}\n".encode()
            lfs = {"oid": key, "size": len(data), "pointerSize": len(pointer)}
            entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_sha1(pointer), "lfs": lfs}
            if state.xet is not None:
                entry["xetHash"] = state.xet.add(key, data).file_hash
            return entry
        return {"type": "file", "path": path, "size": len(data), "oid": key}

    @app.get("/api/whoami-v2")
    def whoami(request: Request) -> dict[str, Any]:
        role = state.tokens[_bearer(request) or ""]  # the middleware let only known tokens through
        return {"type": "user", "name": "tester", "auth": {"accessToken": {"role": role}}, "orgs": []}

    @app.post("/api/validate-yaml")
    async def validate_yaml(request: Request) -> Any:
        content = (await request.json()).get("content", "")
        if content.startswith("---"):
            try:
                yaml.safe_load(content.split("---")[1])
            except yaml.YAMLError as err:
                return JSONResponse({"errors": [{"message": str(err)}]}, status_code=400)
        return {"errors": [], "warnings": []}

    @app.post("/api/repos/create")
    async def create_repo(request: Request) -> Any:
        body = await request.json()
        rtype = body.get("type") or "model"
        repo_id = f"{body.get('organization') or 'tester'}/{body['name']}"
        url = f"{request.base_url}{'' if rtype == 'model' else rtype + 's/'}{repo_id}"
        with state.lock:
            if (rtype, repo_id) in state.repos:
                return JSONResponse({"error": "You already created this repo", "url": url}, status_code=409)
            repo = Repo(rtype, repo_id, body.get("visibility") == "private" or bool(body.get("private")))
            attributes = b"*.parquet filter=lfs diff=lfs merge=lfs -text\n"
            state.blobs[git_blob_sha1(attributes)] = attributes
            commit = state.new_commit(repo, None, {".gitattributes": git_blob_sha1(attributes)}, "initial commit")
            repo.branches["main"] = commit.oid
            state.repos[(rtype, repo_id)] = repo
        return {"url": url, "name": repo_id, "id": repo_id}

    @app.api_route("/api/{rtype}/{path:path}", methods=["GET", "POST", "HEAD", "DELETE"])
    async def api(rtype: str, path: str, request: Request) -> Any:
        if rtype not in ("models", "datasets", "spaces"):
            state.unknown.append(f"{request.method} {request.url.path}")
            return _err(404, "unknown route")
        repo_id, rest = _split_repo(path)
        repo = state.repo(rtype, repo_id)
        if repo is None:
            return _err(404, "Repository not found", code="RepoNotFound")
        verb, _, tail = rest.partition("/")
        method = request.method

        if verb in ("", "revision") and method in ("GET", "HEAD"):
            commit = state.resolve(repo, tail or "main")
            if commit is None:
                return _err(404, "Invalid rev id", code="RevisionNotFound")
            return info(repo, commit)

        if verb == "xet-read-token" and method == "GET" and state.xet is not None:
            refused = state.gate(repo, request)
            if refused is not None:
                return refused
            token, expiry = state.xet.issue()
            headers = {"X-Xet-Cas-Url": state.cas_url, "X-Xet-Access-Token": token}
            headers["X-Xet-Token-Expiration"] = str(int(expiry))
            return Response(b"{}", headers=headers, media_type="application/json")

        if verb == "refs":

            def ref(kind: str, name: str, oid: str) -> dict[str, str]:
                return {"name": name, "ref": f"refs/{kind}/{name}", "targetCommit": oid}

            return {
                "branches": [ref("heads", n, o) for n, o in repo.branches.items()],
                "tags": [ref("tags", n, o) for n, o in repo.tags.items()],
                "converts": [],
                "pullRequests": [],
            }

        if verb == "preupload" and method == "POST":
            body = await request.json()
            commit = state.resolve(repo, tail)
            files = commit.files if commit else {}
            lfs = state.lfs_suffixes or ("\0",)
            return {
                "files": [
                    {
                        "path": f["path"],
                        "uploadMode": "lfs" if f["path"].endswith(lfs) else "regular",
                        "shouldIgnore": False,
                        "oid": files.get(f["path"]),
                    }
                    for f in body["files"]
                ],
                "commitOid": commit.oid if commit else None,
            }

        if verb == "commit" and method == "POST":
            branch = unquote(tail)
            lines = [json.loads(line) for line in (await request.body()).splitlines() if line.strip()]
            with state.lock:
                if branch not in repo.branches:
                    return _err(404, f"Invalid rev id: {branch}", code="RevisionNotFound")
                head = repo.commits[repo.branches[branch]]
                header = lines[0]["value"]
                if header.get("parentCommit") and not head.oid.startswith(header["parentCommit"]):
                    return _err(412, "A commit has happened since. Please refresh and try again.")
                files = dict(head.files)
                for item in lines[1:]:
                    key, value = item["key"], item["value"]
                    if key == "file":
                        data = base64.b64decode(value["content"])
                        state.blobs[git_blob_sha1(data)] = data
                        files[value["path"]] = git_blob_sha1(data)
                    elif key == "deletedFile":
                        if value["path"] not in files:
                            return _err(404, "A file with this name doesn't exist", code="EntryNotFound")
                        files.pop(value["path"])
                    elif key == "deletedFolder":
                        prefix = value["path"].rstrip("/") + "/"
                        files = {p: b for p, b in files.items() if not p.startswith(prefix)}
                    elif key == "lfsFile":
                        if value["oid"] not in state.blobs:
                            return _err(422, f"LFS object {value['oid']} was not uploaded")
                        files[value["path"]] = value["oid"]  # LFS objects are keyed by sha256
                    else:
                        return _err(400, f"unsupported commit op {key}")
                commit = state.new_commit(repo, head.oid, files, header.get("summary", ""))
                repo.branches[branch] = commit.oid
            base = str(request.base_url).rstrip("/")
            prefix = "" if repo.repo_type == "model" else f"/{repo.repo_type}s"
            url = f"{base}{prefix}/{repo.repo_id}/commit/{commit.oid}"
            return {"commitUrl": url, "commitOid": commit.oid, "pullRequestUrl": None}

        if verb == "branch":
            name = unquote(tail)
            with state.lock:
                if method == "DELETE":
                    repo.branches.pop(name, None)
                    return {}
                if name in repo.branches:
                    return _err(409, "Reference already exists")
                body = await request.json() if (await request.body()) else {}
                commit = state.resolve(repo, body.get("startingPoint") or "main")
                if commit is None:
                    return _err(404, "Invalid rev id", code="RevisionNotFound")
                repo.branches[name] = commit.oid
            return {}

        if verb == "tag":
            with state.lock:
                if method == "DELETE":
                    repo.tags.pop(unquote(tail), None)
                    return {}
                body = await request.json()
                if body["tag"] in repo.tags:  # tags are never moved
                    return _err(409, f"Tag reference refs/tags/{body['tag']} already exists")
                commit = state.resolve(repo, tail)
                if commit is None:
                    return _err(404, "Invalid rev id", code="RevisionNotFound")
                repo.tags[body["tag"]] = commit.oid
            return {}

        if verb in ("tree", "paths-info"):
            rev, _, sub = tail.partition("/")
            commit = state.resolve(repo, rev)
            if commit is None:
                return _err(404, "Invalid rev id", code="RevisionNotFound")
            dirs = {"/".join(p.split("/")[:i]) for p in commit.files for i in range(1, p.count("/") + 1)}

            def dir_entry(d: str) -> dict[str, str]:
                return {"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()}

            if verb == "paths-info":
                form = await request.form() if "form" in request.headers.get("content-type", "") else None
                paths = form.getlist("paths") if form else (await request.json()).get("paths", [])
                out = [file_entry(commit, p) for p in paths if p in commit.files]
                return out + [dir_entry(p) for p in paths if p in dirs]
            recursive = request.query_params.get("recursive") in ("1", "true", "True")
            sub = unquote(sub).strip("/")
            if sub and sub not in dirs:
                return _err(404, "Entry not found", code="EntryNotFound")
            prefix = sub + "/" if sub else ""

            def listed(p: str) -> bool:
                return p.startswith(prefix) and (recursive or "/" not in p[len(prefix) :])

            return [dir_entry(d) for d in sorted(dirs) if listed(d)] + [
                file_entry(commit, p) for p in sorted(commit.files) if listed(p)
            ]

        if verb == "commits":
            commit = state.resolve(repo, tail or "main")
            out = []
            while commit is not None:
                out.append(
                    {
                        "id": commit.oid,
                        "title": commit.title,
                        "message": "",
                        "authors": [{"user": "tester"}],
                        "date": _utc(commit.date),
                    }
                )
                commit = repo.commits.get(commit.parent) if commit.parent else None
            return out

        state.unknown.append(f"{method} {request.url.path}")
        return _err(404, f"fakehub: unsupported {method} {verb}")

    @app.post("/{prefix:path}.git/info/lfs/objects/batch")
    async def lfs_batch(prefix: str, request: Request) -> dict[str, Any]:
        body = await request.json()
        base = str(request.base_url).rstrip("/")
        objects = []
        for obj in body["objects"]:
            entry: dict[str, Any] = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in state.blobs:
                entry["actions"] = {"upload": {"href": f"{base}/_fakehub/lfs/{obj['oid']}"}}
            objects.append(entry)
        return {"transfer": "basic", "objects": objects}

    @app.put("/_fakehub/lfs/{oid}")
    async def lfs_put(oid: str, request: Request) -> Any:
        data = await request.body()
        if hashlib.sha256(data).hexdigest() != oid:
            return _err(400, "sha256 mismatch")
        state.blobs[oid] = data
        state.lfs_blobs.add(oid)
        return {}

    @app.api_route("/{rtype}/{path:path}", methods=["GET", "HEAD"])
    async def resolve(rtype: str, path: str, request: Request) -> Any:
        # /datasets/ns/name/resolve/<rev>/<file>; models: /ns/name/resolve/... (rtype is then the namespace)
        if rtype in ("datasets", "spaces"):
            repo_id, rest = _split_repo(path)
            repo = state.repo(rtype, repo_id)
        else:
            repo_id, rest = f"{rtype}/{path.split('/')[0]}", "/".join(path.split("/")[1:])
            repo = state.repo("models", repo_id)
        if repo is None:
            return _err(404, "Repository not found", code="RepoNotFound")
        verb, _, tail = rest.partition("/")
        if verb != "resolve":
            state.unknown.append(f"{request.method} {request.url.path}")
            return _err(404, "unsupported")
        rev, _, fpath = tail.partition("/")
        commit = state.resolve(repo, rev)
        if commit is None:
            return _err(404, "Invalid rev id", code="RevisionNotFound")
        fpath = unquote(fpath)
        if fpath not in commit.files:
            return _err(404, "Entry not found", code="EntryNotFound")
        refused = state.gate(repo, request)
        if refused is not None:
            return refused
        key = commit.files[fpath]
        if key in state.lfs_blobs and state.xet is not None:  # as on the Hub: Xet headers, a redirect to its bridge
            xet = state.xet.add(key, state.blobs[key])
            base = str(request.base_url).rstrip("/")
            route = f"{base}/api/{rtype}/{repo.repo_id}/xet-read-token/{commit.oid}"
            headers = {
                "X-Repo-Commit": commit.oid,
                "X-Linked-Etag": f'"{key}"',
                "X-Linked-Size": str(xet.size),
                "ETag": f'"{key}"',
                "X-Xet-Hash": xet.file_hash,
                "Link": f'<{route}>; rel="xet-auth"',
                "Location": f"{state.cas_url}/bridge/{xet.file_hash}?signature=unused",
            }
            return Response(b"", status_code=302, headers=headers)
        if key in state.lfs_blobs and state.cdn_url:  # as on the Hub: a signed URL on another host
            signature = hashlib.sha256(f"{key}/{time.time_ns()}".encode()).hexdigest()[:16]
            headers = {
                "X-Repo-Commit": commit.oid,
                "X-Linked-Etag": f'"{key}"',
                "X-Linked-Size": str(len(state.blobs[key])),
                "ETag": f'"{key}"',
                "Location": f"{state.cdn_url}/cdn/{key}/{quote(fpath)}?signature={signature}",
            }
            return Response(b"", status_code=302, headers=headers)
        return _serve_bytes(state, request, fpath, key, {"X-Repo-Commit": commit.oid})

    return app


def _injected(state: HubState, request: Request) -> JSONResponse | None:
    """The fault `fail_next` queued for this request, if any (taken off the queue)."""
    with state.lock:
        for i, (method, needle, status, headers) in enumerate(state.faults):
            if request.method == method and needle in unquote(request.url.path):
                del state.faults[i]
                return _err(status, f"fakehub: injected {status}", extra=headers)
    return None


def make_cdn_app(state: HubState) -> FastAPI:
    """The second host: `/cdn/<oid>/<path>?signature=...` serves an LFS object's bytes (no token wanted or checked)."""
    app = FastAPI()

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Any:
        state.requests.append(f"CDN {request.method} {request.url.path}")
        state.cdn_authorizations.append(request.headers.get("authorization", ""))
        return _injected(state, request) or await call_next(request)

    @app.api_route("/cdn/{oid}/{fpath:path}", methods=["GET", "HEAD"])
    async def cdn(oid: str, fpath: str, request: Request) -> Any:
        if oid not in state.blobs or not request.query_params.get("signature"):
            return _err(403, "fakehub CDN: unsigned or unknown object")
        return _serve_bytes(state, request, unquote(fpath), oid, {})

    return app


def make_cas_app(state: HubState) -> FastAPI:
    """The third host, Xet storage (`tests/fakehub_xet.py`): reconstructions for a valid Xet token, xorb ranges for
    a valid signature."""
    app = FastAPI()
    xet = state.xet
    assert xet is not None

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Any:
        state.requests.append(f"CAS {request.method} {request.url.path}")
        state.cas_authorizations.append(request.headers.get("authorization", ""))
        return _injected(state, request) or await call_next(request)

    @app.get("/v2/reconstructions/{file_hash}")
    async def reconstruction_v2(file_hash: str) -> Any:
        return _err(404, "fakehub CAS: V1 only")

    @app.get("/v1/reconstructions/{file_hash}")
    async def reconstruction(file_hash: str, request: Request) -> Any:
        if not xet.token_ok(request.headers.get("authorization", "")):
            return _err(401, "fakehub CAS: no valid Xet token")
        if file_hash not in xet.files:
            return _err(404, "fakehub CAS: unknown file")
        first, last = 0, xet.files[file_hash].size - 1
        byte_range = request.headers.get("range", "")
        if byte_range.startswith("bytes="):
            a, _, b = byte_range[6:].partition("-")
            first, last = int(a or 0), int(b) if b else last
        body = xet.reconstruction(file_hash, first, last, str(request.base_url).rstrip("/"))
        return _err(416, "fakehub CAS: range past the end") if body is None else JSONResponse(body)

    @app.get("/xorb/{xorb}")
    async def xorb(xorb: str, request: Request) -> Any:
        query = request.query_params
        if not xet.signed(xorb, query.get("expires", ""), query.get("signature", "")):
            return _err(403, "fakehub CAS: the URL expired or is not signed")
        data = xet.xorbs[xorb]
        first, _, last = request.headers.get("range", "bytes=0-").removeprefix("bytes=").partition("-")
        chunk = data[int(first or 0) : int(last) + 1 if last else len(data)]
        headers = {
            "Content-Length": str(len(chunk)),
            "Content-Range": f"bytes {first}-{int(first or 0) + len(chunk) - 1}/{len(data)}",
        }
        return _body(state, request, f"xorb:{xorb}", chunk, state.cut.pop("xorb", None), headers, 206)

    return app


class _Logged:
    """An ASGI app wrapped so that each request is logged: host, method, path (no query: no signature), status and
    the body bytes handed to the connection, counted before they go out (a client that has them sees them counted);
    the JSON line is written once the request ends."""

    def __init__(self, app: Any, state: HubState, host: str) -> None:
        self.app, self.state, self.host = app, state, host

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        entry: dict[str, Any] = {"host": self.host, "method": scope["method"], "path": scope["path"]}
        entry.update(status=None, bytes=0, t=round(time.time(), 3))
        with self.state.lock:
            self.state.log.append(entry)

        async def counting(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                entry["status"] = message["status"]
            elif message["type"] == "http.response.body":
                with self.state.lock:
                    entry["bytes"] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counting)
        finally:
            if self.state.log_path:
                with self.state.lock, open(self.state.log_path, "a") as fh:
                    fh.write(json.dumps(entry) + "\n")


def _serve_bytes(state: HubState, request: Request, fpath: str, key: str, extra: dict[str, str]) -> Any:
    """A file's bytes (whole or a Range), with the injected corruption, cut and bandwidth."""
    data = state.blobs[key]
    if request.method == "GET" and state.corrupt.get(fpath, 0) > 0:
        state.corrupt[fpath] -= 1
        data = data[:-1] + bytes([data[-1] ^ 0xFF])
    headers = {
        **extra,
        "ETag": f'"{key}"',
        "Content-Length": str(len(data)),
        "Accept-Ranges": "bytes",
    }
    cut = state.cut.pop(fpath, None) if request.method == "GET" else None
    byte_range = request.headers.get("range")
    if byte_range and byte_range.startswith("bytes="):
        first, _, last = byte_range[6:].partition("-")
        start = int(first) if first else 0
        stop = int(last) + 1 if last else len(data)
        chunk = data[start:stop]
        headers["Content-Range"] = f"bytes {start}-{start + len(chunk) - 1}/{len(data)}"
        headers["Content-Length"] = str(len(chunk))
        if request.method == "GET":
            state.ranges.append((fpath, start))
        return _body(state, request, fpath, chunk, cut, headers, 206)
    return _body(state, request, fpath, data, cut, headers, 200)


def _body(
    state: HubState, request: Request, fpath: str, data: bytes, cut: int | None, headers: dict[str, str], status: int
) -> Any:
    if request.method == "HEAD":
        return Response(b"", status_code=status, headers=headers)
    sent = data if cut is None else data[:cut]
    state.served[fpath] = state.served.get(fpath, 0) + len(sent)
    if cut is not None:
        return StreamingResponse(_cut_after(sent), status_code=status, headers=headers)
    if state.bandwidth_bps:
        return StreamingResponse(_throttled(state, data, state.bandwidth_bps), status_code=status, headers=headers)
    return Response(data, status_code=status, headers=headers)


class _ConnectionCut(Exception):
    """Raised inside a streamed body: the server drops the connection before the bytes its header announced."""


async def _cut_after(sent: bytes) -> Any:
    yield sent
    raise _ConnectionCut("fakehub: connection cut mid-body")


async def _throttled(state: HubState, data: bytes, bandwidth_bps: float, chunk: int = 1 << 16) -> Any:
    """`data` in chunks, paced so that every response of both hosts together gets `bandwidth_bps` bytes per second
    (one shared link: two downloads at once each get half)."""
    for i in range(0, len(data), chunk):
        piece = data[i : i + chunk]
        with state.lock:
            start = max(time.monotonic(), state.link_free_at)
            state.link_free_at = start + len(piece) / bandwidth_bps
            sent_at = state.link_free_at
        await asyncio.sleep(max(0.0, sent_at - time.monotonic()))
        yield piece


@dataclass
class FakeHub:
    """A running fake Hub: its base URL (use as `HF_ENDPOINT`) and its state."""

    url: str
    state: HubState


@contextmanager
def _serving(app: Any, host: str, port: int | None = None) -> Iterator[str]:
    """Run `app` on `port` (default: a free one) of `host` in a thread; yield its base URL; stop it on exit."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True, name=f"fakehub-{host}-{port}")
    thread.start()
    try:
        deadline = time.monotonic() + 10.0
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"fake Hub did not start on {host}:{port}")
            time.sleep(0.02)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(10.0)


@contextmanager
def serve_fake_hub(
    lfs_suffixes: tuple[str, ...] = (),
    tokens: dict[str, str] | None = None,
    *,
    cdn: bool = True,
    xet: XetStore | bool = False,
    port: int | None = None,
    log_path: str | None = None,
    mb_per_s: float | None = None,
) -> Iterator[FakeHub]:
    """Run a fresh fake Hub on 127.0.0.1 (`port`, default a free one), its CDN on 127.0.0.2 (`cdn=False`: none, LFS
    bytes served by `resolve/` itself) and, with `xet` (True or a `XetStore` with its chunk sizes), its Xet storage on
    127.0.0.3; stop them on exit, also when the body raises.

    `tokens` maps the accepted tokens to their role (`write` or `read`); default `DEFAULT_TOKENS`. `log_path`: one
    JSON line per request; `mb_per_s`: the total bandwidth of file bodies, every host together.
    """
    state = HubState(lfs_suffixes=lfs_suffixes, tokens=dict(DEFAULT_TOKENS if tokens is None else tokens))
    state.log_path, state.bandwidth_bps = log_path, mb_per_s * 1e6 if mb_per_s else None
    if xet:
        state.xet = xet if isinstance(xet, XetStore) else XetStore()
    with ExitStack() as stack:
        if cdn:
            state.cdn_url = stack.enter_context(_serving(_Logged(make_cdn_app(state), state, "cdn"), CDN_HOST))
        if state.xet is not None:
            state.cas_url = stack.enter_context(_serving(_Logged(make_cas_app(state), state, "cas"), CAS_HOST))
        url = stack.enter_context(_serving(_Logged(make_app(state), state, "hub"), "127.0.0.1", port))
        yield FakeHub(url, state)


@contextmanager
def client_on_fake_hub(monkeypatch: Any, hf_home: Any, **options: Any) -> Iterator[FakeHub]:
    """A fresh fake Hub (`serve_fake_hub`) that this process's huggingface_hub client talks to: `HF_ENDPOINT` and the
    library's cached endpoint point at it, no token (`HF_TOKEN` unset, the token file under `hf_home`), no telemetry.
    `monkeypatch` is pytest's; every setting is undone with it. `options` go to `serve_fake_hub`."""
    import huggingface_hub.constants as hub_constants  # the client library only where a test asks for it

    with serve_fake_hub(**options) as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setenv("HF_HOME", str(hf_home))
        monkeypatch.setattr(hub_constants, "HF_TOKEN_PATH", str(hf_home / "token"))
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.setattr(hub_constants, "ENDPOINT", fake.url)
        yield fake


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--lfs-suffix", action="append", default=[], help="uploads with these suffixes go through LFS (e.g. .parquet)"
    )
    parser.add_argument("--xet", action="store_true", help="serve LFS files as Xet files from a CAS on 127.0.0.3")
    parser.add_argument("--gated", action="append", default=[], help="REPO_ID: a dataset whose files need a token")
    parser.add_argument("--log", help="one JSON line per request, every host")
    parser.add_argument("--mb-per-s", type=float, help="total bandwidth of file bodies, every host together")
    parser.add_argument(
        "--dataset", action="append", default=[], metavar="REPO_ID=DIR", help="serve DIR's files as this dataset"
    )
    args = parser.parse_args()
    with serve_fake_hub(
        tuple(args.lfs_suffix), xet=args.xet, port=args.port, log_path=args.log, mb_per_s=args.mb_per_s
    ) as hub:
        for spec in args.dataset:
            repo_id, _, folder = spec.partition("=")
            tree = {p.relative_to(folder).as_posix(): p.read_bytes() for p in Path(folder).rglob("*") if p.is_file()}
            hub.state.put_dataset(repo_id, tree, gated=repo_id in args.gated)
        for repo_id in (r for r in args.gated if ("dataset", r) not in hub.state.repos):
            hub.state.repos[("dataset", repo_id)] = Repo("dataset", repo_id, False, gated=True)
            commit = hub.state.new_commit(hub.state.repos[("dataset", repo_id)], None, {}, "initial commit")
            hub.state.repos[("dataset", repo_id)].branches["main"] = commit.oid
        print(f"fake Hub on {hub.url} (CDN {hub.state.cdn_url or '-'}, Xet storage {hub.state.cas_url or '-'})")
        threading.Event().wait()
