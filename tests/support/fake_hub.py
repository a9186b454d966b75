"""A local stand-in for the Hugging Face Hub, and hand-made HF caches, so Hub code is tested without a network.

`FakeHub` serves repos held in memory over HTTP on 127.0.0.1 (a free port), implementing only the parts of the
Hub's protocol that huggingface_hub's download functions use (read from huggingface_hub 2.4's source:
hf_api.py, file_download.py, _snapshot_download.py, utils/_http.py, utils/_pagination.py):

    GET  /api/models/{repo_id}                   repo info at the default branch     HfApi.model_info / repo_info
    GET  /api/models/{repo_id}/revision/{rev}    repo info at a revision (rev percent-encoded, '/' included):
                                                 JSON {"id", "sha", "siblings": [{"rfilename"}], "private", "gated"}
    GET  /api/models/{repo_id}/tree/{rev}[/{path}]?recursive=&expand=
                                                 file listing (HfApi.list_repo_tree; snapshot_download lists the
                                                 whole tree once per commit): JSON [{"type": "file"|"directory",
                                                 "path", "oid", "size", "lfs": {"oid", "size", "pointerSize"}}],
                                                 paginated with a `Link: <url>; rel="next"` header
    HEAD /{repo_id}/resolve/{rev}/{path}         file metadata (get_hf_file_metadata): `X-Repo-Commit` (required),
                                                 `ETag` (git blob sha1; quoted), for LFS files `X-Linked-Etag`
                                                 (sha256, the cache's blob name) and `X-Linked-Size`, `Content-Length`
    GET  /{repo_id}/resolve/{rev}/{path}         the bytes (http_get), honouring `Range: bytes=a-b` / `a-` / `-n`
                                                 with 206 and `Content-Range` (parse_safetensors_file_metadata reads
                                                 a safetensors header with `Range: bytes=0-100000`)

Errors carry the `X-Error-Code` header that `hf_raise_for_status` maps to huggingface_hub's exceptions:
`RepoNotFound` (401 without a token, 404 with one; also a private repo the token cannot read), `RevisionNotFound`
(404), `EntryNotFound` (404, with `X-Repo-Commit`), `GatedRepo` (file downloads of a gated repo: 401 without a token,
403 with a token that has no access; repo info and listings of a gated repo stay public, as on the Hub). Any other
path (e.g. `/api/agent-harnesses`, fetched when telemetry is on) is a plain 404. No redirects and no Xet headers are
ever sent, so the library never leaves this server or switches transport.

Every request is recorded (`FakeHub.log()`) as it arrives: method, decoded path, query, Range and Authorization
headers, then status and body bytes sent once the answer is made, so tests can assert exactly what was fetched,
and count the requests a client gave up on (a slow answer) without timing anything.

`FakeHub.fail(kind, ...)` makes the next matching requests stumble as a real Hub or proxy does: `status` (answer
e.g. 503, or 429 with `Retry-After`), `close` (send the headers and half the body, then drop the connection),
`short` (a complete answer whose body and Content-Length are half the file's), `slow` (wait before answering) and
`commit` (an `X-Repo-Commit` that is no commit hash). Each fault hits `times` requests (None: every one).

`make_hf_cache` builds the standard cache layout by hand (`hub/models--org--name/{blobs,snapshots,refs}`), for
offline tests that must not depend on a download having happened first.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".distcp", ".gguf", ".msgpack", ".h5")
RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a file's bytes (what the Hub reports as `oid` and as the ETag of a non-LFS file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: str) -> bool:
    return path.endswith(LFS_SUFFIXES)


def file_etag(path: str, data: bytes) -> str:
    """The ETag huggingface_hub names the cached blob after: sha256 for LFS files, the git blob sha1 otherwise."""
    return hashlib.sha256(data).hexdigest() if is_lfs(path) else git_blob_sha1(data)


def fake_commit(*parts: object) -> str:
    """A deterministic 40-hex commit id."""
    return hashlib.sha1(repr(parts).encode()).hexdigest()


@dataclass
class Request:
    method: str
    path: str  # percent-decoded, without the query
    query: dict[str, str]
    range: str | None
    authorization: str | None
    status: int = 0  # 0 while the answer is not made yet (a slow one)
    sent: int = 0  # body bytes sent (HEAD: 0)
    fault: str | None = None  # the kind of fault injected into the answer, if any


FAULT_KINDS = ("status", "close", "short", "slow", "commit")


@dataclass
class Fault:
    """A stumble injected into the answers to matching requests (see `FakeHub.fail`)."""

    kind: str
    method: str | None  # "GET", "HEAD" or None (any)
    path_suffix: str  # matched against the end of the decoded request path ("" matches every request)
    times: int | None  # requests still to hit (None: every one)
    status: int = 503
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    commit: str = "not-a-commit"

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and path.endswith(self.path_suffix)


@dataclass
class FakeRepo:
    repo_id: str
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    private: bool = False
    gated: bool = False
    tokens: set[str] = field(default_factory=set)  # tokens that may read a private repo / passed a gated repo's gate
    # Bytes sent in place of a file's own (its headers, ETag and X-Linked-Etag, stay the file's): a damaged download.
    served: dict[str, bytes] = field(default_factory=dict)

    def commit_for(self, revision: str) -> str | None:
        if revision in self.refs:
            return self.refs[revision]
        if revision in self.commits:
            return revision
        if re.fullmatch(r"[0-9a-f]{7,39}", revision):
            matches = [sha for sha in self.commits if sha.startswith(revision)]
            if len(matches) == 1:
                return matches[0]
        return None


class FakeHub:
    """An HTTP server speaking the Hub's download protocol for the repos added to it. Use as a context manager."""

    def __init__(self, page_size: int = 1000) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.page_size = page_size
        self._log: list[Request] = []
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._server = _QuietServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread: threading.Thread | None = None

    # lifecycle

    def start(self) -> FakeHub:
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-hub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # content

    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        private: bool = False,
        gated: bool = False,
        tokens: tuple[str, ...] | set[str] = (),
        branch: str = "main",
    ) -> str:
        """Create a repo whose `branch` holds `files` ({repo path: bytes}); returns the commit sha."""
        self.repos[repo_id] = FakeRepo(repo_id, private=private, gated=gated, tokens=set(tokens))
        return self.add_commit(repo_id, files, branch=branch)

    def add_commit(self, repo_id: str, files: dict[str, bytes], *, branch: str = "main") -> str:
        """A new commit whose whole tree is `files`; `branch` moves to it, older commits stay reachable by sha."""
        repo = self.repos[repo_id]
        sha = fake_commit(repo_id, len(repo.commits), sorted((p, file_etag(p, d)) for p, d in files.items()))
        repo.commits[sha] = dict(files)
        repo.refs[branch] = sha
        return sha

    def set_ref(self, repo_id: str, name: str, commit: str) -> None:
        self.repos[repo_id].refs[name] = commit

    # faults

    def fail(
        self,
        kind: str,
        *,
        path: str = "",
        method: str | None = None,
        times: int | None = 1,
        status: int = 503,
        retry_after: float | None = None,
        delay: float = 0.0,
        commit: str = "not-a-commit",
    ) -> Fault:
        """Make the next `times` requests whose path ends with `path` (and of `method`) stumble as `kind` says.

        kind: "status" (answer `status`, with `Retry-After: retry_after` when given), "close" (headers and half
        the body, then the connection dropped), "short" (half the body, with a Content-Length that says so),
        "slow" (wait `delay` seconds, then answer) or "commit" (the answer's X-Repo-Commit is `commit`).
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; one of {FAULT_KINDS}")
        headers = {} if retry_after is None else {"Retry-After": f"{retry_after:g}"}
        fault = Fault(kind, method, path, times, status, headers, delay, commit)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.matches(method, path) and (fault.times is None or fault.times > 0):
                    if fault.times is not None:
                        fault.times -= 1
                    return fault
        return None

    # the request log

    def faulted(self, path_suffix: str = "", kind: str | None = None) -> list[Request]:
        """Requests whose answer a fault changed (of `kind`), for paths ending with `path_suffix`."""
        return [
            r
            for r in self.log()
            if r.fault is not None and r.path.endswith(path_suffix) and (kind is None or r.fault == kind)
        ]

    def log(self) -> list[Request]:
        with self._lock:
            return list(self._log)

    def clear_log(self) -> None:
        with self._lock:
            self._log.clear()

    def calls(self) -> list[tuple[str, str]]:
        """(method, path) of every request so far, in order."""
        return [(r.method, r.path) for r in self.log()]

    def file_requests(self, repo_id: str) -> list[Request]:
        """Requests for the repo's files (`/resolve/`), any method and status."""
        prefix = f"/{repo_id}/resolve/"
        return [r for r in self.log() if r.path.startswith(prefix)]

    def downloaded(self, repo_id: str) -> list[str]:
        """Repo paths of the repo's files whose bytes were sent: GETs answered 200 or 206 (revision stripped)."""
        out = []
        for r in self.file_requests(repo_id):
            if r.method == "GET" and r.status in (200, 206):
                out.append(r.path[len(f"/{repo_id}/resolve/") :].split("/", 1)[1])
        return out

    def bytes_sent(self, repo_id: str, path_suffix: str = "") -> int:
        """Body bytes sent for the repo's files whose repo path ends with `path_suffix`."""
        return sum(r.sent for r in self.file_requests(repo_id) if r.path.endswith(path_suffix))

    def _record(self, request: Request) -> None:
        with self._lock:
            self._log.append(request)


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that dropped a connection (after an injected fault) is no error of the fake's


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as huggingface_hub's pooled client expects

        def do_GET(self) -> None:  # noqa: N802
            self._handle("GET")

        def do_HEAD(self) -> None:  # noqa: N802
            self._handle("HEAD")

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

        def _handle(self, method: str) -> None:
            split = urlsplit(self.path)
            parts = [unquote(p) for p in split.path.split("/")[1:]]
            record = Request(
                method,
                unquote(split.path),
                dict(parse_qsl(split.query)),
                self.headers.get("Range"),
                self.headers.get("Authorization"),
            )
            fault = hub._take_fault(method, record.path)
            record.fault = fault.kind if fault is not None else None
            hub._record(record)  # on arrival: a request the client gave up on (a slow answer) is in the log too
            if fault is not None and fault.kind == "slow":
                time.sleep(fault.delay)
            try:
                if fault is not None and fault.kind == "status":
                    status, headers, body = _error(fault.status, None, f"injected HTTP {fault.status}", fault.headers)
                else:
                    status, headers, body = _route(hub, method, parts, record, split.path)
            except Exception as exc:  # a bug in the fake: answer 500 so the test sees it
                status, headers, body = 500, {}, repr(exc).encode()
            cut = fault is not None and fault.kind in ("close", "short") and method == "GET" and len(body) > 1
            if cut:
                if fault is not None and fault.kind == "short":
                    headers["Content-Length"] = str(len(body) // 2)
                else:
                    headers["Content-Length"] = str(len(body))
                body = body[: len(body) // 2]
            if fault is not None and fault.kind == "commit" and "X-Repo-Commit" in headers:
                headers["X-Repo-Commit"] = fault.commit
            record.status = status
            record.sent = 0 if method == "HEAD" else len(body)
            try:
                self.send_response(status)
                headers.setdefault("Content-Length", str(len(body)))
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                if method != "HEAD" and body:
                    self.wfile.write(body)
                if cut and fault is not None and fault.kind == "close":
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)  # the rest of the body never comes
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass

    return Handler


Response = tuple[int, dict[str, str], bytes]


def _error(status: int, code: str | None, message: str, extra: dict[str, str] | None = None) -> Response:
    headers = {"Content-Type": "application/json", "X-Error-Message": message, **(extra or {})}
    if code is not None:
        headers["X-Error-Code"] = code
    return status, headers, json.dumps({"error": message}).encode()


def _json(data: object, extra: dict[str, str] | None = None) -> Response:
    return 200, {"Content-Type": "application/json", **(extra or {})}, json.dumps(data).encode()


def _split_repo(hub: FakeHub, parts: list[str], markers: tuple[str, ...]) -> tuple[str, list[str]]:
    """Split `org/name/<marker>/...` or `name/<marker>/...` into the repo id and the rest, preferring known repos."""
    two = "/".join(parts[:2])
    if len(parts) >= 2 and two in hub.repos:
        return two, parts[2:]
    if parts and parts[0] in hub.repos:
        return parts[0], parts[1:]
    if len(parts) >= 2 and parts[1] not in markers:
        return two, parts[2:]
    return (parts[0] if parts else ""), parts[1:]


def _access(repo: FakeRepo | None, repo_id: str, token: str | None, files: bool) -> Response | None:
    """The error a request gets for this repo and token, or None when it may proceed."""
    if repo is None or (repo.private and token not in repo.tokens):
        return _error(401 if token is None else 404, "RepoNotFound", "Repository not found")
    if files and repo.gated and token not in repo.tokens:
        message = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated."
        return _error(401 if token is None else 403, "GatedRepo", message)
    return None


def _route(hub: FakeHub, method: str, parts: list[str], record: Request, raw_path: str) -> Response:
    auth = record.authorization or ""
    token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
    if parts[:2] == ["api", "models"] and method == "GET":
        repo_id, rest = _split_repo(hub, parts[2:], ("revision", "tree"))
        repo = hub.repos.get(repo_id)
        denied = _access(repo, repo_id, token, files=False)
        if denied:
            return denied
        assert repo is not None
        if not rest:
            return _info(repo, "main")
        if rest[0] == "revision" and len(rest) == 2:
            return _info(repo, rest[1])
        if rest[0] == "tree" and len(rest) >= 2:
            return _tree(hub, repo, rest[1], "/".join(rest[2:]), record.query, raw_path)
        return _error(404, None, "Not found")
    if "resolve" in parts[1:3]:
        repo_id, rest = _split_repo(hub, parts, ("resolve",))
        if len(rest) < 3 or rest[0] != "resolve":
            return _error(404, None, "Not found")
        repo = hub.repos.get(repo_id)
        denied = _access(repo, repo_id, token, files=True)
        if denied:
            return denied
        assert repo is not None
        return _resolve(repo, method, rest[1], "/".join(rest[2:]), record.range)
    return _error(404, None, "Not found")


def _info(repo: FakeRepo, revision: str) -> Response:
    commit = repo.commit_for(revision)
    if commit is None:
        return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
    files = repo.commits[commit]
    return _json(
        {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "sha": commit,
            "private": repo.private,
            "gated": "auto" if repo.gated else False,
            "disabled": False,
            "tags": [],
            "siblings": [{"rfilename": path} for path in sorted(files)],
        }
    )


def _tree(hub: FakeHub, repo: FakeRepo, revision: str, path: str, query: dict[str, str], raw_path: str) -> Response:
    commit = repo.commit_for(revision)
    if commit is None:
        return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
    files = repo.commits[commit]
    recursive = query.get("recursive", "").lower() == "true"
    prefix = f"{path.strip('/')}/" if path.strip("/") else ""
    entries: dict[str, dict] = {}
    for file_path, data in files.items():
        if not file_path.startswith(prefix):
            continue
        rest = file_path[len(prefix) :].split("/")
        depth = len(rest) if recursive else 1
        for i in range(1, min(depth, len(rest) - 1) + 1):  # the folders on the way
            folder = prefix + "/".join(rest[:i])
            entries[folder] = {"type": "directory", "oid": git_blob_sha1(folder.encode()), "size": 0, "path": folder}
        if recursive or len(rest) == 1:
            entry = {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": file_path}
            if is_lfs(file_path):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries[file_path] = entry
    if prefix and not entries:
        return _error(404, "EntryNotFound", f"{path} does not exist on {revision}", {"X-Repo-Commit": commit})
    listing = [entries[k] for k in sorted(entries)]
    cursor = int(query.get("cursor", "0") or 0)
    page = listing[cursor : cursor + hub.page_size]
    extra = {}
    if cursor + hub.page_size < len(listing):
        params = f"recursive={quote(query.get('recursive', 'False'))}&expand={quote(query.get('expand', 'False'))}"
        extra["Link"] = f'<{hub.endpoint}{raw_path}?{params}&cursor={cursor + hub.page_size}>; rel="next"'
    return _json(page, extra)


def _resolve(repo: FakeRepo, method: str, revision: str, path: str, range_header: str | None) -> Response:
    commit = repo.commit_for(revision)
    if commit is None:
        return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
    data = repo.commits[commit].get(path)
    if data is None:
        return _error(404, "EntryNotFound", f"{path} does not exist on {revision}", {"X-Repo-Commit": commit})
    headers = {
        "Content-Type": "application/octet-stream",
        "Accept-Ranges": "bytes",
        "X-Repo-Commit": commit,
        "ETag": f'"{git_blob_sha1(data)}"',
    }
    if is_lfs(path):
        headers["X-Linked-Etag"] = f'"{hashlib.sha256(data).hexdigest()}"'
        headers["X-Linked-Size"] = str(len(data))
    if method == "HEAD":
        headers["Content-Length"] = str(len(data))
        return 200, headers, b""
    data = repo.served.get(path, data)
    if range_header is None:
        return 200, headers, data
    match = RANGE.match(range_header.strip())
    size = len(data)
    if match is None or match.groups() == ("", ""):
        return 416, {"Content-Range": f"bytes */{size}"}, b""
    first, last = match.groups()
    if first == "":  # the last n bytes
        start, end = max(size - int(last), 0), size - 1
    else:
        start, end = int(first), (min(int(last), size - 1) if last else size - 1)
    if start >= size or start > end:
        return 416, {"Content-Range": f"bytes */{size}"}, b""
    headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    return 206, headers, data[start : end + 1]


def make_hf_cache(
    hf_home: Path, repo_id: str, commit: str, files: dict[str, bytes], refs: dict[str, str] | None = None
) -> Path:
    """Write `files` as the snapshot `commit` of `repo_id` in the HF cache under `hf_home`, as huggingface_hub does.

    Layout: `hf_home/hub/models--org--name/blobs/<etag>` (the bytes), `snapshots/<commit>/<path>` (relative symlinks
    to the blobs, or copies where symlinks are not supported) and `refs/<name>` (the commit sha, no newline).
    `refs` defaults to {"main": commit}; pass {} for a snapshot reachable only by its sha. Returns the snapshot folder.
    Several calls may add several commits of one repo.
    """
    repo_dir = Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    for path, data in files.items():
        blob = repo_dir / "blobs" / file_etag(path, data)
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / path
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        try:
            link.symlink_to(os.path.relpath(blob, link.parent))
        except OSError:
            shutil.copyfile(blob, link)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, sha in ({"main": commit} if refs is None else refs).items():
        ref = repo_dir / "refs" / name
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(sha)
    return snapshot
