#!/usr/bin/env python3
"""Download a locked model onto this host: parallel, resumable, verified, atomic.

Uploaded by the deploy and run on the GPU server (Python 3.10+, standard library only):

    python3 fetch_model.py --lock LOCK.json --dest DIR --base-url URL \
        [--token-file F] [--jobs 4] [--connections 8] [--ca-bundle PEM] [--timeout 60]
        [--refetch PATH ...]

For every file of the lock (written by ``tools.model_lock`` on the operator's machine)
it fetches ``{base}/{model_id}/resolve/{commit}/{path}`` into
``DIR/.incoming/{path}.part``, resuming a partial ``.part`` with ``Range: bytes=N-``
(206 appends, 200 restarts), checks the size and checksum the lock names (sha256 for
LFS files, the git blob sha1 for small files), fsyncs, and ``os.replace``s it to
``DIR/{path}``. So nothing unverified ever sits under a final name. A file of at least
``SPLIT_MIN_BYTES`` comes over ``--connections`` Range connections at once, each piece
written at its offset and the whole hashed in order as it lands; its progress per piece
is kept beside the ``.part`` in ``.part.ranges`` for a restart (``RangedFetch``). A
server that answers a Range request with the whole file (200) gets one connection. A
file that fails
verification is fetched once more from scratch; failing twice stops the run (exit 1)
naming the file and both checksums.

``DIR/.verified.json`` records what was verified (path -> size, mtime_ns, checksum): a
re-run re-hashes only files whose size or mtime changed, instead of tens of gigabytes.
``--refetch PATH`` (repeatable) names files of the lock whose content is known bad
(files/verify_model.py found it, under an unchanged size and mtime): each is forgotten
by the record, removed, and fetched again like a missing file.

Output: progress lines on stderr; on stdout exactly one line, the JSON summary
``{"downloaded": [...], "verified": [...], "skipped": [...], "bytes": N,
"hashed_files": N, "hashed_bytes": N, "changed": bool, "ok": bool, "error": str|null}``
(downloaded: fetched now; verified: already present, re-hashed and matched; skipped:
unchanged since a verified run, not re-hashed; bytes: body bytes received).
Exit codes: 0 ok, 1 verification failed twice, 2 bad arguments or lock, 3 network or
disk failure. The token (``--token-file`` or ``HF_TOKEN``) is never printed and is only
sent to the base URL's host, not to redirect targets elsewhere (CDN links are signed).
Proxies come from the environment (``https_proxy`` ...), as urllib reads them.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import http.client
import json
import os
import shutil
import ssl
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed

CHUNK = 1024 * 1024  # 1 MiB reads: large enough for throughput, small for progress
NETWORK_RETRIES = 5  # resumes per attempt after a dropped connection
PROGRESS_SECONDS = 10.0  # a progress line for a long file at most this often
VERIFIED_NAME = ".verified.json"
INCOMING = ".incoming"
FETCH_LOCK = ".fetch.lock"
LOCK_VERSION = 1
# Large files: several Range connections each (see RangedFetch).
PIECE_BYTES = 8 * 2**20  # the unit of claims and of the resume record
CLAIM_PIECES = 8  # the most pieces one Range request asks for (64 MiB)
SPLIT_MIN_BYTES = 64 * 2**20  # smaller files: one connection (two pieces at least)
SYNC_SECONDS = 1.0  # fdatasync the .part and save its piece record at most this often
HASH_READ = 4 * 2**20  # the hasher's reads of the landed prefix
RANGES_SUFFIX = ".ranges"  # beside a split .part: bytes received per piece
ALGOS = ("sha256", "git-blob-sha1")

EXIT_OK, EXIT_VERIFY, EXIT_USAGE, EXIT_IO = 0, 1, 2, 3


class UsageError(Exception):
    """Bad arguments or a bad lock file (exit 2)."""


class VerifyError(Exception):
    """A file failed verification twice (exit 1)."""


class FetchError(Exception):
    """Network or disk failure that retries did not cure (exit 3)."""


def retry_or_raise(log, path: str, position: int, exc: BaseException, failures: int,
                   what: str = "") -> int:
    """After a lost connection: FetchError once NETWORK_RETRIES are spent, else log,
    back off (exponentially, at most 5 s) and return the failures counted so far."""
    failures += 1
    if failures > NETWORK_RETRIES:
        raise FetchError(f"{path}: {exc!r} after {failures} attempts") from exc
    log(f"{path}: connection lost at {position} bytes ({exc!r}); "
        f"resuming{' ' + what if what else ''} (retry {failures}/{NETWORK_RETRIES})")
    time.sleep(min(0.2 * 2 ** failures, 5.0))
    return failures


# --- lock ---------------------------------------------------------------------------
def safe_relpath(path: str) -> str:
    """Refuse absolute paths and '..': a lock must not write outside --dest."""
    norm = os.path.normpath(path)
    if (not path or os.path.isabs(path) or norm.startswith("..") or norm == "."
            or norm.split(os.sep)[0] in (INCOMING, FETCH_LOCK)
            or norm.split(os.sep)[0].startswith(VERIFIED_NAME)):
        raise UsageError(f"lock file path {path!r} is not a plain relative path")
    return norm


def load_lock(path: str) -> dict:
    """Read and check a lock written by tools.model_lock."""
    try:
        with open(path, encoding="utf-8") as handle:
            lock = json.load(handle)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read lock {path}: {exc}") from exc
    if lock.get("lock_version") != LOCK_VERSION:
        raise UsageError(f"{path}: lock_version {lock.get('lock_version')!r}, "
                         f"this script reads {LOCK_VERSION}")
    commit = str(lock.get("commit") or "")
    if len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
        raise UsageError(f"{path}: commit {commit!r} is not a 40-hex commit id")
    for entry in lock.get("files") or []:
        entry["path"] = safe_relpath(str(entry["path"]))
        if entry.get("algo") not in ALGOS or not isinstance(entry.get("size"), int):
            raise UsageError(f"{path}: bad entry for {entry['path']}")
    return lock


# --- hashing ------------------------------------------------------------------------
class Digest:
    """sha256 of the content, or git's blob id: sha1 over 'blob <size>\\0' + content."""

    def __init__(self, algo: str, size: int) -> None:
        if algo == "sha256":
            self._hash = hashlib.sha256()
        else:
            self._hash = hashlib.sha1()
            self._hash.update(b"blob %d\0" % size)

    def update(self, data: bytes | memoryview) -> None:
        self._hash.update(data)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


class Counters:
    """Run-wide totals, shared by the worker threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.received = 0
        self.hashed_files = 0
        self.hashed_bytes = 0

    def add(self, **deltas: int) -> None:
        with self.lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)


def hash_file(path: str, algo: str, size: int, counters: Counters,
              digest: Digest | None = None, limit: int | None = None) -> Digest:
    """Feed a file's first ``limit`` bytes (all by default) into a digest."""
    digest = digest or Digest(algo, size)
    done = 0
    with open(path, "rb") as handle:
        while limit is None or done < limit:
            want = CHUNK if limit is None else min(CHUNK, limit - done)
            block = handle.read(want)
            if not block:
                break
            digest.update(block)
            done += len(block)
    counters.add(hashed_bytes=done)
    return digest


# --- HTTP ---------------------------------------------------------------------------
class SameHostAuthRedirect(urllib.request.HTTPRedirectHandler):
    """Follow redirects, but send the token only to the host it was meant for."""

    def __init__(self, auth_host: str, token: str | None, auth_scheme: str = "https") -> None:
        self.auth_host = auth_host
        self.auth_scheme = auth_scheme
        self.token = token

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: N802 (stdlib)
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            # urllib copies every header to the new request, whatever its host or scheme.
            new.remove_header("Authorization")
            target = urllib.parse.urlsplit(newurl)
            if self.token and (target.scheme, target.netloc) == (self.auth_scheme,
                                                                self.auth_host):
                new.add_header("Authorization", f"Bearer {self.token}")
        return new


class Http:
    """urllib with a CA bundle, environment proxies and the bearer token."""

    def __init__(self, base_url: str, token: str | None, ca_bundle: str | None,
                 timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout
        context = ssl.create_default_context(cafile=ca_bundle)
        base = urllib.parse.urlsplit(self.base_url)
        self.opener = urllib.request.build_opener(
            urllib.request.ProxyHandler(),  # http(s)_proxy / no_proxy from the environment
            urllib.request.HTTPSHandler(context=context),
            SameHostAuthRedirect(base.netloc, token, base.scheme),
        )

    def url(self, model_id: str, commit: str, path: str) -> str:
        quoted = urllib.parse.quote(path)
        return f"{self.base_url}/{model_id}/resolve/{commit}/{quoted}"

    def open(self, url: str, start: int, end: int | None = None):
        """GET ``url`` from byte ``start`` (to ``end``, exclusive, when given: a piece)."""
        request = urllib.request.Request(url)
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        if end is not None:
            request.add_header("Range", f"bytes={start}-{end - 1}")
        elif start:
            request.add_header("Range", f"bytes={start}-")
        # Identity encoding: a transparently compressed body would break Range offsets.
        request.add_header("Accept-Encoding", "identity")
        return self.opener.open(request, timeout=self.timeout)


def resume_offset(response, start: int) -> int:
    """Where the body starts: ``start`` for a matching 206, 0 for a 200 (full body)."""
    if response.status == 206:
        content_range = response.headers.get("Content-Range", "")
        first = content_range.removeprefix("bytes ").split("-", 1)[0]
        if not first.isdigit() or int(first) != start:
            raise FetchError(f"server answered Range {start}- with {content_range!r}")
        return start
    return 0


# --- one file -----------------------------------------------------------------------
class Job:
    """Fetch and verify one file of the lock."""

    def __init__(self, entry: dict, lock: dict, dest: str, http: Http, counters: Counters,
                 log, connections: int = 1) -> None:
        self.entry = entry
        self.connections = connections
        self.path = entry["path"]
        self.size = int(entry["size"])
        self.algo = entry["algo"]
        self.expected = entry["digest"]
        self.final = os.path.join(dest, self.path)
        self.part = os.path.join(dest, INCOMING, self.path + ".part")
        self.url = http.url(lock["model_id"], lock["commit"], self.path)
        self.http = http
        self.counters = counters
        self.log = log

    def _stream(self, response, handle, digest: Digest, position: int, started: float) -> int:
        last = time.monotonic()
        while True:
            block = response.read(CHUNK)
            if not block:
                return position
            handle.write(block)
            digest.update(block)
            position += len(block)
            self.counters.add(received=len(block), hashed_bytes=len(block))
            now = time.monotonic()
            if now - last >= PROGRESS_SECONDS:
                last = now
                rate = position / max(now - started, 1e-6)
                self.log(f"{self.path}: {position / 2**20:.0f}/{self.size / 2**20:.0f} MiB "
                         f"({100 * position / max(self.size, 1):.0f}%) {rate / 2**20:.1f} MiB/s")

    def _fetch(self) -> str:
        """Download (resuming the .part) and return the content's checksum: a large file
        over several connections when the server honours Range, else one."""
        if self.connections > 1 and self.size >= SPLIT_MIN_BYTES:
            try:
                return RangedFetch(self, self.connections).fetch()
            except NoRanges as exc:
                self.log(f"{exc}: the server does not serve ranges; one connection")
        os.makedirs(os.path.dirname(self.part), exist_ok=True)
        RangedFetch.settle(self.part)
        start = os.path.getsize(self.part) if os.path.exists(self.part) else 0
        if start > self.size:
            os.unlink(self.part)
            start = 0
        digest = Digest(self.algo, self.size)
        if start:
            # Hash the bytes already on disk once, then only what arrives.
            hash_file(self.part, self.algo, self.size, self.counters, digest, limit=start)
            self.log(f"{self.path}: resuming at {start} of {self.size} bytes")
        position, started, failures = start, time.monotonic(), 0
        while position < self.size:
            try:
                with self.http.open(self.url, position) as response:
                    offset = resume_offset(response, position)
                    if offset != position:  # a 200: the server sent it all again
                        digest, position = Digest(self.algo, self.size), 0
                    # Append to a resumed .part; a fresh start (or a 200) rewrites it.
                    mode = "r+b" if position and os.path.exists(self.part) else "wb"
                    with open(self.part, mode) as handle:
                        handle.seek(position)
                        handle.truncate()
                        try:
                            position = self._stream(response, handle, digest, position, started)
                        finally:
                            handle.flush()
                            os.fsync(handle.fileno())
                            position = handle.tell()
                if position < self.size:
                    raise http.client.IncompleteRead(b"", self.size - position)
            except urllib.error.HTTPError as exc:
                if exc.code == 416 and position:
                    # Our .part is not a prefix the server knows: start from zero.
                    os.unlink(self.part)
                    digest, position = Digest(self.algo, self.size), 0
                    continue
                raise FetchError(f"{self.path}: HTTP {exc.code} {exc.reason} from "
                                 f"{self.url}") from exc
            except (OSError, http.client.HTTPException) as exc:
                failures = retry_or_raise(self.log, self.path, position, exc, failures)
        elapsed = max(time.monotonic() - started, 1e-6)
        self.log(f"{self.path}: {self.size} bytes in {elapsed:.1f}s "
                 f"({(self.size - start) / elapsed / 2**20:.1f} MiB/s)")
        self.counters.add(hashed_files=1)
        return digest.hexdigest()

    def _install(self) -> None:
        os.makedirs(os.path.dirname(self.final), exist_ok=True)
        os.replace(self.part, self.final)
        fd = os.open(os.path.dirname(self.final), os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a power cut
        finally:
            os.close(fd)

    def download(self) -> None:
        """Two attempts; the second starts from scratch. Raise VerifyError after both."""
        got = []
        for attempt in (1, 2):
            actual = self._fetch()
            size = os.path.getsize(self.part)
            if size == self.size and actual == self.expected:
                self._install()
                return
            got.append(f"{actual} ({size} bytes)")
            self.log(f"{self.path}: verification failed on attempt {attempt}: expected "
                     f"{self.algo} {self.expected}, got {actual}")
            os.unlink(self.part)
            if os.path.exists(self.part + RANGES_SUFFIX):
                os.unlink(self.part + RANGES_SUFFIX)
        raise VerifyError(
            f"{self.path}: {self.algo} mismatch twice: expected {self.expected} "
            f"({self.size} bytes), got {got[0]} then {got[1]}"
        )


# --- one large file over several connections ------------------------------------------
class NoRanges(Exception):
    """The server answered a piece's Range request with the whole file: one connection."""


class RangedFetch:
    """One large file over several HTTP Range connections, hashed in order as it lands.

    The file is cut into pieces of ``PIECE_BYTES``; up to ``connections`` threads claim
    runs of them in order, each run one ``Range: bytes=a-b`` request, and ``os.pwrite``
    what arrives at its offset in the ``.part``, preallocated to the full size. A run is
    an even share of what is left among the connections, at most ``CLAIM_PIECES``: long
    requests while much is left, single pieces at the end, so the connections finish
    together. sha256 cannot be split, so one hasher thread reads back (``os.pread``, from
    the page cache) the contiguous prefix that has landed and hashes it while the
    connections fill the rest: runs are claimed in order, so that prefix trails the
    newest byte by about ``connections`` runs, and by single pieces at the end, when
    what it trails by is left to hash after the last byte.

    Resume: ``<part>.ranges`` records the bytes received of each piece. It is written
    only after an ``fdatasync`` of the ``.part`` (every ``SYNC_SECONDS`` and when a run
    stops), so it never names bytes that are not on disk. A restart re-hashes the
    contiguous prefix the record names, from disk, and continues every piece where it
    stopped; bytes past the prefix are hashed when the prefix reaches them. Nothing is
    trusted without being hashed: the caller compares the whole file's checksum with
    the lock before the file takes its final name.
    """

    def __init__(self, job: Job, connections: int) -> None:
        self.job = job
        self.size = job.size
        self.record = job.part + RANGES_SUFFIX
        self.connections = connections
        self.starts = list(range(0, self.size, PIECE_BYTES))
        self.done = [0] * len(self.starts)
        self.cond = threading.Condition()
        self.claimed = 0  # pieces before this index are done or claimed
        self.front = 0  # pieces before this index are complete
        self.error: BaseException | None = None
        self.probed = threading.Event()
        self.fd = -1

    # -- the record ------------------------------------------------------------------
    def length(self, index: int) -> int:
        return min(PIECE_BYTES, self.size - self.starts[index])

    def frontier(self) -> int:
        """End of the contiguous landed prefix (called under ``cond``)."""
        while self.front < len(self.starts) and \
                self.done[self.front] == self.length(self.front):
            self.front += 1
        if self.front == len(self.starts):
            return self.size
        return self.starts[self.front] + self.done[self.front]

    def _load(self) -> bool:
        """Take the progress of an earlier run from the record, if it is one of ours."""
        try:
            with open(self.record, encoding="utf-8") as handle:
                data = json.load(handle)
            done = [int(n) for n in data["done"]]
            fits = (data.get("size") == self.size and data.get("piece") == PIECE_BYTES
                    and os.path.getsize(self.job.part) == self.size
                    and len(done) == len(self.starts)
                    and all(0 <= n <= self.length(i) for i, n in enumerate(done)))
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if fits:
            self.done = done
        return fits

    def _save(self, done: list[int]) -> None:
        tmp = self.record + ".tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump({"size": self.size, "piece": PIECE_BYTES, "done": done}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.record)

    def checkpoint(self) -> None:
        """Make the landed bytes durable, then record them (never the other way round)."""
        with self.cond:
            done = list(self.done)
        os.fdatasync(self.fd)
        self._save(done)

    @staticmethod
    def settle(part: str) -> None:
        """Turn a split ``.part`` into a plain prefix for the one-connection path: cut it
        at the contiguous prefix its record names and drop the record."""
        record = part + RANGES_SUFFIX
        if not os.path.exists(record):
            return
        prefix = 0
        try:
            with open(record, encoding="utf-8") as handle:
                data = json.load(handle)
            for index, got in enumerate(data["done"]):
                prefix = index * int(data["piece"]) + int(got)
                if int(got) < min(int(data["piece"]), int(data["size"]) - index * int(data["piece"])):
                    break
        except (OSError, ValueError, KeyError, TypeError):
            prefix = 0
        if os.path.exists(part):
            os.truncate(part, min(prefix, os.path.getsize(part)))
        os.unlink(record)

    # -- the run ---------------------------------------------------------------------
    def fetch(self) -> str:
        """Download every piece, hash in order, fsync; return the content's checksum."""
        job = self.job
        os.makedirs(os.path.dirname(job.part), exist_ok=True)
        resumed = self._load()
        if not resumed:
            # A record of another layout (another PIECE_BYTES): keep what it proves.
            self.settle(job.part)
            # A plain .part from a one-connection run is a prefix: keep it. The record is
            # written before the file grows, so a longer .part always has one.
            have = os.path.getsize(job.part) if os.path.exists(job.part) else 0
            have = have if have <= self.size else 0
            self.done = [max(0, min(have - start, self.length(i)))
                         for i, start in enumerate(self.starts)]
            if os.path.exists(job.part) and not have:
                os.unlink(job.part)
            self._save(list(self.done))
        self.fd = os.open(job.part, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not resumed:
                try:
                    os.posix_fallocate(self.fd, 0, self.size)
                except OSError:  # a file system without fallocate: a sparse file will do
                    os.ftruncate(self.fd, self.size)
            return self._run()
        finally:
            os.close(self.fd)

    def _run(self) -> str:
        job, started = self.job, time.monotonic()
        digest = Digest(job.algo, self.size)
        resumed_bytes = sum(self.done)
        with self.cond:
            prefix = self.frontier()
        if prefix:
            # Bytes an earlier run wrote are trusted only once hashed: the prefix now,
            # pieces beyond it when the prefix reaches them.
            self.job.log(f"{job.path}: resuming {sum(self.done)} of {self.size} bytes "
                         f"({prefix} contiguous) over {self.connections} connections")
        hasher = threading.Thread(target=self._hasher, args=(digest,), daemon=True)
        hasher.start()
        pending = sum(1 for i in range(len(self.starts)) if self.done[i] < self.length(i))
        workers = [threading.Thread(target=self._worker, daemon=True)
                   for _ in range(max(1, min(self.connections, pending)))]
        # The first connection alone tells whether the server honours Range at all.
        workers[0].start()
        self.probed.wait()
        for worker in workers[1:]:
            worker.start()
        for worker in workers:
            worker.join()
        with self.cond:
            self.cond.notify_all()
        hasher.join()
        if self.error is not None:
            self.checkpoint()  # a later run continues each piece where it stopped
            raise self.error
        os.fsync(self.fd)
        os.unlink(self.record)
        elapsed = max(time.monotonic() - started, 1e-6)
        job.log(f"{job.path}: {self.size} bytes in {elapsed:.1f}s "
                f"({(self.size - resumed_bytes) / elapsed / 2**20:.1f} MiB/s, "
                f"{len(workers)} connections)")
        job.counters.add(hashed_files=1)
        return digest.hexdigest()

    def _fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = exc
            self.cond.notify_all()
        self.probed.set()

    def _claim(self) -> tuple[int, int] | None:
        """The next run of pieces for one request, ``(first, stop)``: the first piece not
        done, and after it the untouched ones, as many as an even share of the pieces
        left among the connections (1 to CLAIM_PIECES)."""
        count = len(self.starts)
        with self.cond:
            while self.claimed < count and self.done[self.claimed] >= self.length(self.claimed):
                self.claimed += 1
            if self.error is not None or self.claimed >= count:
                return None
            left = sum(1 for i in range(self.claimed, count) if self.done[i] < self.length(i))
            share = max(1, min(CLAIM_PIECES, left // self.connections))
            first = stop = self.claimed
            stop += 1
            while stop < count and stop - first < share and self.done[stop] == 0:
                stop += 1
            self.claimed = stop
            return first, stop

    def _worker(self) -> None:
        try:
            claim = self._claim()
            if claim is None:
                self.probed.set()
            while claim is not None:
                self._run_of_pieces(*claim)
                claim = self._claim()
        except BaseException as exc:  # noqa: BLE001 (handed to the main thread)
            self._fail(exc)

    def _landed(self, first: int, stop: int, position: int) -> None:
        """Record the run's bytes up to ``position`` (called under ``cond``)."""
        for index in range(first, stop):
            if self.done[index] < self.length(index):
                self.done[index] = max(self.done[index], min(
                    position - self.starts[index], self.length(index)))
                if self.done[index] < self.length(index):
                    break
        if first <= self.front:
            self.cond.notify_all()

    def _run_of_pieces(self, first: int, stop: int) -> None:
        """Fetch what is missing of pieces ``first`` to ``stop - 1`` in one request,
        resuming after a dropped connection where the bytes stopped."""
        job, failures = self.job, 0
        end = self.starts[stop - 1] + self.length(stop - 1)
        while True:
            with self.cond:
                index = next((i for i in range(first, stop)
                              if self.done[i] < self.length(i)), stop)
                first = index
            if index >= stop or self.error is not None:
                return
            position = self.starts[index] + self.done[index]
            try:
                with job.http.open(job.url, position, end) as response:
                    if response.status != 206:
                        raise NoRanges(f"{job.path}: HTTP {response.status} to a Range request")
                    if resume_offset(response, position) != position:
                        raise FetchError(f"{job.path}: bad answer to Range {position}-")
                    self.probed.set()
                    while position < end and self.error is None:
                        block = response.read(min(CHUNK, end - position))
                        if not block:
                            break
                        view, at = memoryview(block), position
                        while view:
                            written = os.pwrite(self.fd, view, at)
                            view, at = view[written:], at + written
                        position += len(block)
                        job.counters.add(received=len(block))
                        with self.cond:
                            self._landed(first, stop, position)
                if position < end and self.error is None:
                    raise http.client.IncompleteRead(b"", end - position)
                return
            except urllib.error.HTTPError as exc:
                raise FetchError(f"{job.path}: HTTP {exc.code} {exc.reason} from "
                                 f"{job.url} (bytes {position}-{end - 1})") from exc
            except (OSError, http.client.HTTPException) as exc:
                failures = retry_or_raise(job.log, job.path, position, exc, failures,
                                          "that piece")

    def _hasher(self, digest: Digest) -> None:
        """Hash the contiguous landed prefix as it grows; checkpoint now and then."""
        job, hashed = self.job, 0
        last_sync = last_log = time.monotonic()
        try:
            while hashed < self.size:
                with self.cond:
                    frontier = self.frontier()
                    while frontier <= hashed and self.error is None:
                        self.cond.wait(SYNC_SECONDS)
                        frontier = self.frontier()
                    if self.error is not None:
                        return
                while hashed < frontier:
                    want = min(HASH_READ, frontier - hashed)
                    data = os.pread(self.fd, want, hashed)
                    if len(data) != want:
                        raise FetchError(f"{job.path}: short read at {hashed} of the .part")
                    digest.update(data)
                    hashed += want
                    job.counters.add(hashed_bytes=want)
                now = time.monotonic()
                if now - last_sync >= SYNC_SECONDS and hashed < self.size:
                    last_sync = now
                    self.checkpoint()
                if now - last_log >= PROGRESS_SECONDS:
                    last_log = now
                    with self.cond:
                        landed = sum(self.done)
                    job.log(f"{job.path}: {landed / 2**20:.0f}/{self.size / 2**20:.0f} MiB "
                            f"({100 * landed / max(self.size, 1):.0f}%), "
                            f"{hashed / 2**20:.0f} MiB hashed")
        except BaseException as exc:  # noqa: BLE001 (handed to the main thread)
            self._fail(exc)


# --- the verified-state cache -------------------------------------------------------
class VerifiedCache:
    """``DIR/.verified.json``: path -> {size, mtime_ns, algo, digest}, saved atomically."""

    def __init__(self, dest: str) -> None:
        self.file = os.path.join(dest, VERIFIED_NAME)
        self.lock = threading.Lock()
        try:
            with open(self.file, encoding="utf-8") as handle:
                self.entries = json.load(handle).get("files", {})
        except (OSError, ValueError):
            self.entries = {}

    def fresh(self, path: str, final: str, entry: dict) -> bool:
        """Verified before, unchanged since (size and mtime), same expected checksum."""
        known = self.entries.get(path)
        try:
            stat = os.stat(final)
        except OSError:
            return False
        return bool(known) and known.get("digest") == entry["digest"] and \
            known.get("size") == stat.st_size == entry["size"] and \
            known.get("mtime_ns") == stat.st_mtime_ns

    def record(self, path: str, final: str, entry: dict) -> None:
        stat = os.stat(final)
        with self.lock:
            self.entries[path] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                  "algo": entry["algo"], "digest": entry["digest"]}
            self._save()

    def forget(self, path: str) -> None:
        with self.lock:
            if self.entries.pop(path, None) is not None:
                self._save()

    def _save(self) -> None:
        tmp = self.file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump({"version": 1, "files": self.entries}, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.file)


# --- the run ------------------------------------------------------------------------
def process(entry: dict, job: Job, cache: VerifiedCache, counters: Counters,
            refetch: bool = False) -> str:
    """Bring one file to its verified final state; return skipped/verified/downloaded.
    ``refetch``: its content is known bad, so it is removed and downloaded again."""
    if refetch:
        job.log(f"{job.path}: content known not to match the lock; fetching again")
        cache.forget(job.path)
        if os.path.lexists(job.final):
            os.unlink(job.final)
        job.download()
        cache.record(job.path, job.final, entry)
        return "downloaded"
    if cache.fresh(job.path, job.final, entry):
        return "skipped"
    if os.path.exists(job.final):
        if os.path.getsize(job.final) == job.size:
            actual = hash_file(job.final, job.algo, job.size, counters).hexdigest()
            counters.add(hashed_files=1)
            if actual == job.expected:
                cache.record(job.path, job.final, entry)
                return "verified"
            job.log(f"{job.path}: present but {job.algo} {actual} != {job.expected}; "
                    "fetching again")
        cache.forget(job.path)
        os.unlink(job.final)  # unverified content never stays under the final name
    job.download()
    cache.record(job.path, job.final, entry)
    return "downloaded"


def check_space(dest: str, lock: dict, refetch: frozenset = frozenset()) -> None:
    """Fail early when the missing files cannot fit on the volume."""
    missing = 0
    for entry in lock["files"]:
        final = os.path.join(dest, entry["path"])
        part = os.path.join(dest, INCOMING, entry["path"] + ".part")
        if entry["path"] in refetch:
            # Removed before its download starts: its space comes back first.
            continue
        have = os.path.getsize(final) if os.path.exists(final) else (
            os.path.getsize(part) if os.path.exists(part) else 0)
        missing += max(int(entry["size"]) - have, 0)
    free = shutil.disk_usage(dest).free
    if missing > free:
        raise FetchError(f"{dest}: {missing} bytes still to download, {free} free")


def run(lock: dict, dest: str, http: Http, jobs: int, log,
        refetch: frozenset = frozenset(), connections: int = 1) -> dict:
    """Download and verify every file (``refetch``: paths fetched again whatever the
    record says; ``connections``: Range connections per large file); return the
    summary dict."""
    unknown = sorted(refetch - {entry["path"] for entry in lock["files"]})
    if unknown:
        raise UsageError(f"--refetch {', '.join(unknown)}: not a file of the lock")
    os.makedirs(dest, exist_ok=True)
    counters = Counters()
    cache = VerifiedCache(dest)
    result: dict = {"downloaded": [], "verified": [], "skipped": []}
    check_space(dest, lock, refetch)
    errors: list[Exception] = []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {
            pool.submit(process, entry,
                        Job(entry, lock, dest, http, counters, log, connections), cache,
                        counters, entry["path"] in refetch): entry["path"]
            for entry in lock["files"]
        }
        for future in as_completed(futures):
            try:
                result[future.result()].append(futures[future])
            except (VerifyError, FetchError, UsageError, OSError) as exc:
                errors.append(exc)
    for key in ("downloaded", "verified", "skipped"):
        result[key].sort()
    result.update(bytes=counters.received, hashed_files=counters.hashed_files,
                  hashed_bytes=counters.hashed_bytes,
                  changed=bool(result["downloaded"]), ok=not errors,
                  error="; ".join(str(e) for e in errors) or None)
    if errors:
        result["exit"] = EXIT_VERIFY if any(isinstance(e, VerifyError) for e in errors) \
            else EXIT_IO
    return result


def read_token(token_file: str | None) -> str | None:
    if token_file:
        with open(token_file, encoding="utf-8") as handle:
            return handle.read().strip() or None
    return os.environ.get("HF_TOKEN") or None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Download and verify a locked model.")
    parser.add_argument("--lock", required=True, help="lock file (tools.model_lock)")
    parser.add_argument("--dest", required=True, help="model directory")
    parser.add_argument("--base-url", required=True, help="Hub or mirror base URL")
    parser.add_argument("--token-file", help="file holding the bearer token (else HF_TOKEN)")
    parser.add_argument("--jobs", type=int, default=4, help="parallel downloads")
    parser.add_argument("--connections", type=int, default=8,
                        help="Range connections per file of at least "
                             f"{SPLIT_MIN_BYTES // 2**20} MiB (1: one per file)")
    parser.add_argument("--ca-bundle", help="PEM file of CAs to trust for HTTPS")
    parser.add_argument("--timeout", type=float, default=60.0, help="socket timeout, s")
    parser.add_argument("--refetch", action="append", default=[], metavar="PATH",
                        help="a file of the lock to remove and fetch again (repeatable)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def log(line: str) -> None:
        print(f"fetch_model: {line}", file=sys.stderr, flush=True)

    summary: dict = {"downloaded": [], "verified": [], "skipped": [], "bytes": 0,
                     "hashed_files": 0, "hashed_bytes": 0, "changed": False}
    code = EXIT_OK
    try:
        lock = load_lock(args.lock)
        http = Http(args.base_url, read_token(args.token_file), args.ca_bundle, args.timeout)
        os.makedirs(args.dest, exist_ok=True)
        with open(os.path.join(args.dest, FETCH_LOCK), "w") as guard:
            # One run per directory: two would race on the same .part files.
            fcntl.flock(guard, fcntl.LOCK_EX)
            summary = run(lock, args.dest, http, args.jobs, log,
                          frozenset(safe_relpath(path) for path in args.refetch),
                          max(1, args.connections))
        code = summary.pop("exit", EXIT_OK)
    except UsageError as exc:
        summary.update(ok=False, error=str(exc))
        code = EXIT_USAGE
    except (FetchError, OSError) as exc:
        summary.update(ok=False, error=str(exc))
        code = EXIT_IO
    if summary.get("error"):
        log(f"FAILED: {summary['error']}")
    summary.setdefault("ok", code == EXIT_OK)
    summary.setdefault("error", None)
    print(json.dumps(summary, sort_keys=True), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
