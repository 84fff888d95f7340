"""An HTTP server that looks like the Hugging Face Hub for the repos ``model.generate`` wrote.

Endpoints (see README.md for details):

* ``GET|HEAD /{repo_id}/resolve/{revision}/{path}``: the file, with single ``Range`` support,
  ``ETag`` (LFS: sha256, also in ``X-Linked-Etag``; others: git blob sha1) and ``X-Repo-Commit``.
  ``revision`` is the branch name or the commit sha.
* ``GET /api/models/{repo_id}[/revision/{revision}][?blobs=true]``: the Hub's model-info answer.
* ``GET|POST|DELETE /_faults``, ``GET|DELETE /_stats``, ``GET /_health``: test controls. They are
  never behind the token: they stand for the test harness, not for a Hub feature.

With a token configured, repo requests need ``Authorization: Bearer <token>`` (401 otherwise,
like a gated repo). The token is never logged or echoed.
"""

from __future__ import annotations

import hmac
import json
import re
import socket
import ssl
import sys
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from sandbox.mirror import faults as faults_mod
from sandbox.mirror import model

CHUNK = 64 * 1024
# A slow body goes out in slices of about a tenth of a second at its rate: a steady trickle
# rather than a chunk and a long silence (a client's read timeout sees bytes every 0.1 s).
SLOW_SLICES_PER_S = 10
MAX_ADMIN_BODY = 64 * 1024
_RESOLVE = re.compile(r"^/(?P<repo>.+?)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_API = re.compile(r"^/api/models/(?P<repo>.+?)(?:/revision/(?P<rev>[^/]+))?/?$")
_CONTENT_TYPES = {".json": "application/json", ".txt": "text/plain; charset=utf-8",
                  ".md": "text/markdown; charset=utf-8"}


@dataclass(frozen=True)
class Repo:
    """One generated repository on disk, as the server sees it."""

    repo_id: str
    directory: Path
    revision: str
    sha: str
    files: dict[str, dict[str, object]]
    api: dict[str, object]

    def knows_revision(self, revision: str) -> bool:
        return revision in (self.revision, self.sha)


def load_repo(directory: Path) -> Repo:
    """Load a repo written by ``model.generate`` and check the files are still that size."""
    manifest = model.load_manifest(directory)
    api = json.loads((directory / model.METADATA_DIR / model.API_NAME).read_text("utf-8"))
    files = {str(f["path"]): f for f in manifest["files"]}  # type: ignore[union-attr]
    for name, entry in files.items():
        actual = (directory / name).stat().st_size
        if actual != entry["size"]:
            raise RuntimeError(f"{directory / name}: {actual} bytes, manifest says {entry['size']}")
    return Repo(str(manifest["repo_id"]), directory, str(manifest["revision"]),
                str(manifest["sha"]), files, api)


def discover(root: Path) -> dict[str, Repo]:
    """Every generated repo under ``root`` (found by its ``.mirror/manifest.json``)."""
    repos: dict[str, Repo] = {}
    for manifest in sorted(Path(root).rglob(f"{model.METADATA_DIR}/{model.MANIFEST_NAME}")):
        repo = load_repo(manifest.parent.parent)
        repos[repo.repo_id] = repo
    return repos


class RangeNotSatisfiable(Exception):
    """The Range header names no byte of the file (answer 416)."""


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """Parse one ``bytes=`` range into ``(start, end_exclusive)``; None means "send it all".

    Per RFC 9110 a server may ignore a Range it does not support or cannot parse: multiple
    ranges and malformed values are answered with the whole file (200).
    """
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    first, sep, last = (part.strip() for part in header[len("bytes="):].partition("-"))
    malformed = (not sep or not (first or last) or (first and not first.isdigit())
                 or (last and not last.isdigit()))
    if malformed:
        return None
    if not first:  # suffix range: the last N bytes
        length = int(last)
        if length == 0 or size == 0:
            raise RangeNotSatisfiable
        return max(size - length, 0), size
    start = int(first)
    if last and int(last) < start:
        return None
    if start >= size:
        raise RangeNotSatisfiable
    end = min(int(last) + 1, size) if last else size
    return start, end


class MirrorHTTPServer(ThreadingHTTPServer):
    """The listening server plus the state its handler threads share."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], repos: dict[str, Repo],
                 token: str | None = None, quiet: bool = True, ranges: bool = True) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.repos = repos
        self.token = token
        self.quiet = quiet
        self.ranges = ranges  # False: every Range is ignored (200, whole file), like some CDNs
        self.faults = faults_mod.FaultTable()
        self.stats = faults_mod.Stats()
        super().__init__(address, MirrorHandler)


class MirrorHandler(BaseHTTPRequestHandler):
    """Routes one request; see the module docstring for the endpoints."""

    server: MirrorHTTPServer
    protocol_version = "HTTP/1.1"  # keep-alive, like the Hub; every answer has a length
    server_version = "sandbox-mirror/1"

    # --- plumbing -----------------------------------------------------------------------
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib name)
        # The request line never holds the token (it travels in a header), so this is safe.
        if not self.server.quiet:
            sys.stderr.write(f"mirror {self.address_string()} {format % args}\n")

    def _send_json(self, status: int, body: object, headers: dict[str, str] | None = None,
                   head: bool = False) -> None:
        data = (json.dumps(body, indent=1) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str, head: bool = False,
               headers: dict[str, str] | None = None) -> None:
        if status == 404:
            self.server.stats.bump("not_found")
        self._send_json(status, {"error": message},
                        {"X-Error-Code": code, "X-Error-Message": message, **(headers or {})},
                        head)

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_ADMIN_BODY:
            raise faults_mod.FaultError("request body too large")
        return self.rfile.read(length) if length else b""

    def _authorized(self) -> bool:
        token = self.server.token
        if token is None:
            return True
        given = self.headers.get("Authorization", "")
        # Constant-time compare: the mirror stands in for a real gated repo.
        return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())

    # --- verbs --------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._route("GET")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def do_POST(self) -> None:
        self._route("POST")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def _route(self, method: str) -> None:
        url = urlsplit(self.path)
        if url.path.startswith("/_"):
            self._admin(method, url.path)
            return
        if method not in ("GET", "HEAD"):
            self._error(405, "MethodNotAllowed", f"{method} not allowed")
            return
        if not self._authorized():
            self.server.stats.bump("unauthorized")
            self._error(401, "GatedRepo", "Access to this repository is restricted: "
                        "send Authorization: Bearer <token>.", head=method == "HEAD")
            return
        api = _API.match(url.path)
        if api:
            self._api(unquote(api["repo"]), unquote(api["rev"] or "main"),
                      parse_qs(url.query), head=method == "HEAD")
            return
        resolve = _RESOLVE.match(url.path)
        if resolve:
            self._resolve(method, unquote(resolve["repo"]), unquote(resolve["rev"]),
                          unquote(resolve["file"]))
            return
        self._error(404, "NotFound", "no such endpoint", head=method == "HEAD")

    # --- test controls ------------------------------------------------------------------
    def _admin(self, method: str, path: str) -> None:
        try:
            if path == "/_faults" and method == "POST":
                spec = json.loads(self._read_body())
                fault = self.server.faults.add(faults_mod.parse_fault(spec))
                self._send_json(201, {"id": fault.id, "fault": asdict(fault)})
            elif path == "/_faults" and method == "GET":
                self._send_json(200, {"faults": self.server.faults.snapshot()})
            elif path == "/_faults" and method == "DELETE":
                self.server.faults.clear()
                self._send_json(200, {"faults": []})
            elif path == "/_stats" and method == "GET":
                self._send_json(200, self.server.stats.snapshot())
            elif path == "/_stats" and method == "DELETE":
                self.server.stats.reset()
                self._send_json(200, self.server.stats.snapshot())
            elif path == "/_health" and method in ("GET", "HEAD"):
                self._send_json(200, {"repos": sorted(self.server.repos)}, head=method == "HEAD")
            else:
                self._error(404, "NotFound", f"no admin endpoint {method} {path}")
        except (ValueError, TypeError) as exc:  # bad JSON or a bad fault spec
            self._error(400, "BadRequest", str(exc))

    # --- Hub API ------------------------------------------------------------------------
    def _lookup(self, repo_id: str, revision: str, head: bool) -> Repo | None:
        repo = self.server.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository {repo_id} not found", head)
            return None
        if not repo.knows_revision(revision):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head)
            return None
        return repo

    def _api(self, repo_id: str, revision: str, query: dict[str, list[str]],
             head: bool) -> None:
        repo = self._lookup(repo_id, revision, head)
        if repo is None:
            return
        self.server.stats.bump("api")
        body = dict(repo.api)
        # Without blobs=true the Hub lists only file names.
        if query.get("blobs", [""])[-1].lower() not in ("1", "true"):
            body["siblings"] = [{"rfilename": s["rfilename"]} for s in repo.api["siblings"]]
        self._send_json(200, body, head=head)

    def _file_headers(self, repo: Repo, entry: dict[str, object]) -> dict[str, str]:
        headers = {"Accept-Ranges": "bytes" if self.server.ranges else "none",
                   "X-Repo-Commit": repo.sha,
                   "Content-Type": _CONTENT_TYPES.get(Path(str(entry["path"])).suffix,
                                                      "application/octet-stream")}
        if entry["lfs"]:
            headers["ETag"] = f'"{entry["sha256"]}"'
            headers["X-Linked-Etag"] = f'"{entry["sha256"]}"'
            headers["X-Linked-Size"] = str(entry["size"])
        else:
            headers["ETag"] = f'"{entry["git_sha1"]}"'
        return headers

    def _resolve(self, method: str, repo_id: str, revision: str, path: str) -> None:
        head = method == "HEAD"
        repo = self._lookup(repo_id, revision, head)
        if repo is None:
            return
        entry = repo.files.get(path)
        if entry is None:
            self._error(404, "EntryNotFound", f"{path} does not exist at {revision}", head)
            return
        key = f"{repo_id}/{path}"
        self.server.stats.file(key, **{method.lower(): 1})
        size = int(entry["size"])
        headers = self._file_headers(repo, entry)
        try:
            span = parse_range(self.headers.get("Range") if self.server.ranges else None, size)
        except RangeNotSatisfiable:
            # RFC 9110: a 416 names the current length so the client can recover.
            self._error(416, "RangeNotSatisfiable", "range not satisfiable", head,
                        {"Content-Range": f"bytes */{size}", "X-Repo-Commit": repo.sha})
            return
        start, end = span if span else (0, size)
        fault = self.server.faults.take(repo_id, path, method=method, start=start,
                                        length=end - start)
        if fault is not None:
            self.server.stats.bump("faults_fired")
            if fault.mode == "status":
                self._error(fault.status, "InjectedFault", "fault injected by /_faults", head)
                return
        self.send_response(206 if span else 200)
        for name, value in headers.items():
            self.send_header(name, value)
        if span:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            self.server.stats.file(key, ranged=1)
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        if not head:
            self._send_body(repo.directory / path, key, start, end, fault)

    def _send_body(self, file: Path, key: str, start: int, end: int,
                   fault: faults_mod.Fault | None) -> None:
        limit = end
        if fault is not None and fault.mode == "drop":
            limit = start + fault.after_bytes
        pace = fault.rate if fault is not None and fault.mode == "slow" else 0
        size = max(1, min(CHUNK, pace // SLOW_SLICES_PER_S)) if pace else CHUNK
        began = time.monotonic()
        chunk = bytearray()
        try:
            with open(file, "rb") as handle:
                handle.seek(start)
                position = start
                while position < limit:
                    chunk = bytearray(handle.read(min(size, limit - position)))
                    if not chunk:
                        break
                    if pace:
                        # Each byte leaves no earlier than its place in the body allows at
                        # the rate, so the whole body takes its length / rate, Range or not.
                        due = began + (position + len(chunk) - start) / pace
                        time.sleep(max(0.0, due - time.monotonic()))
                    if fault is not None and fault.mode == "corrupt" and \
                            position <= fault.offset < position + len(chunk):
                        chunk[fault.offset - position] ^= 0xFF
                    # Counted before the write: a client that has the last byte must already
                    # see it in /_stats (no race between its read and our bookkeeping).
                    self.server.stats.file(key, bytes_sent=len(chunk))
                    self.wfile.write(chunk)
                    position += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            # The client went away mid-chunk; count that chunk as not sent.
            self.server.stats.file(key, bytes_sent=-len(chunk))
            self.close_connection = True
        if limit < end:
            # Fewer bytes than Content-Length, then close: exactly what a dropped link looks like.
            self.wfile.flush()
            self.close_connection = True


class MirrorServer:
    """Run the mirror in a background thread (for tests and the CLI).

    >>> with MirrorServer(root) as mirror:    # doctest: +SKIP
    ...     urlopen(mirror.url + "/sandbox/tiny-qwen2/resolve/main/config.json")
    """

    def __init__(self, root: Path, *, bind: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, quiet: bool = True, ranges: bool = True,
                 tls: ssl.SSLContext | None = None) -> None:
        repos = discover(Path(root))
        if not repos:
            raise RuntimeError(f"no generated repos under {root} (run `generate` first)")
        self.httpd = MirrorHTTPServer((bind, port), repos, token=token, quiet=quiet,
                                      ranges=ranges)
        # HTTPS with ``tls`` (a server context holding its certificate): a mirror a
        # token may be sent to. The handshake is done in the handler's thread.
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True,
                                                do_handshake_on_connect=False)
        self.scheme = "https" if tls is not None else "http"
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        host = self.httpd.server_address[0]
        host = f"[{host}]" if ":" in host else host
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def faults(self) -> faults_mod.FaultTable:
        return self.httpd.faults

    @property
    def stats(self) -> faults_mod.Stats:
        return self.httpd.stats

    @property
    def repos(self) -> dict[str, Repo]:
        return self.httpd.repos

    def start(self) -> MirrorServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever,
                                        name="sandbox-mirror", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()

    def __enter__(self) -> MirrorServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
