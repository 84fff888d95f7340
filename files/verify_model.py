#!/usr/bin/env python3
"""Re-hash a downloaded model against its lock and name every file that no longer matches.

Run on the GPU server (Python 3.8+, standard library only), by the ModelContent fact
(facts/model.py) or by hand:

    python3 verify_model.py --dest DIR --lock LOCK.json [--jobs N]
    python3 verify_model.py --dest DIR --manifest '[{"path", "size", "algo", "digest"}, ...]'

Every file the lock names is read in full and hashed the way the lock says (sha256, or
git's blob sha1 for small files), whatever its size and mtime, so a file whose bytes
changed under an unchanged size and mtime (a bad sector read back, a copy made with
``touch -r``) is found. Files are hashed in parallel, one thread per file up to the
CPUs this process may run on: hashlib releases the GIL while it hashes a buffer of 2048
bytes or more (CPython Modules/hashlib.h, HASHLIB_GIL_MINSIZE), so the threads hash on
separate cores. Each file is read 16 MiB at a time into two reused buffers (readinto:
no copy, no allocation per read) by a reader thread that fills one while the hashing
thread hashes the other, so one file's reading and hashing overlap; the kernel is told
the read is sequential (POSIX_FADV_SEQUENTIAL doubles Linux's read-ahead window:
posix_fadvise(2)).

Output on stdout, never a byte of any file's content: one line per file that does not
match, ``PROBLEM<TAB>PATH``, PROBLEM one of

* ``mismatch``: the lock's size, another checksum;
* ``size``: another size than the lock's (not read);
* ``missing``: no such file;
* ``unreadable``: it cannot be read (the reason follows, after another tab);

then one line ``summary<TAB>{"files": N, "bytes": N, "seconds": S, "bad": N, "jobs": N}``
(files and bytes: what was read and hashed). Exit 0 every file matches, 1 some file
does not, 2 bad arguments or manifest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

BLOCK = 16 * 1024 * 1024  # large sequential reads: few syscalls, full read-ahead windows
ALGOS = ("sha256", "git-blob-sha1")
EXIT_OK, EXIT_MISMATCH, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad arguments or manifest (exit 2)."""


def load_files(lock_path: str | None, manifest: str | None) -> list:
    """The lock's file entries, checked: a relative path inside DIR, a known algorithm."""
    try:
        if manifest is not None:
            files = json.loads(manifest)
        else:
            with open(lock_path or "", encoding="utf-8") as handle:
                files = json.load(handle).get("files")
    except (OSError, ValueError, AttributeError) as exc:
        raise UsageError(f"cannot read the file list: {exc}") from exc
    if not isinstance(files, list) or not files:
        raise UsageError("the lock lists no files")
    for entry in files:
        path = str(entry.get("path") or "") if isinstance(entry, dict) else ""
        norm = os.path.normpath(path)
        if not path or os.path.isabs(path) or norm == "." or norm.startswith(".."):
            raise UsageError(f"file path {path!r} is not a plain relative path")
        if entry.get("algo") not in ALGOS or not isinstance(entry.get("size"), int) \
                or not isinstance(entry.get("digest"), str):
            raise UsageError(f"bad entry for {path}: needs size, algo ({', '.join(ALGOS)}) "
                             "and digest")
    return files


def new_hash(algo: str, size: int):
    """sha256 of the content, or git's blob id: sha1 over 'blob <size>\\0' + content."""
    if algo == "sha256":
        return hashlib.sha256()
    digest = hashlib.sha1()
    digest.update(b"blob %d\0" % size)
    return digest


_BUFFERS = threading.local()


def hash_file(path: str, algo: str, size: int) -> tuple:
    """(hex digest, bytes read) of one file, read sequentially into this thread's two
    buffers: a reader thread fills one while this thread hashes the other."""
    buffers = getattr(_BUFFERS, "pair", None)
    if buffers is None:
        buffers = _BUFFERS.pair = (memoryview(bytearray(BLOCK)), memoryview(bytearray(BLOCK)))
    digest = new_hash(algo, size)
    done = 0
    with open(path, "rb", buffering=0) as handle, ThreadPoolExecutor(1) as reader:
        try:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass  # a hint only: not every platform or file system has it
        current = 0
        pending = reader.submit(handle.readinto, buffers[current])
        while True:
            count = pending.result()
            if not count:
                break
            pending = reader.submit(handle.readinto, buffers[1 - current])
            digest.update(buffers[current][:count])
            done += count
            current = 1 - current
    return digest.hexdigest(), done


def check(dest: str, entry: dict) -> tuple:
    """(problem or None, detail, bytes read) for one file of the lock."""
    path = os.path.join(dest, entry["path"])
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return "missing", "", 0
    except OSError as exc:
        return "unreadable", exc.strerror or str(exc), 0
    if size != entry["size"]:
        return "size", "", 0
    try:
        actual, done = hash_file(path, entry["algo"], size)
    except OSError as exc:
        return "unreadable", exc.strerror or str(exc), 0
    if done != entry["size"]:  # shrank or grew while being read
        return "size", "", done
    return (None if actual == entry["digest"] else "mismatch"), "", done


def default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def run(dest: str, files: list, jobs: int, out=sys.stdout) -> dict:
    """Hash every file, print the problems and the summary; return the summary."""
    started = time.monotonic()
    jobs = max(1, min(jobs, len(files)))
    # Largest first: the big shards start at once and the small files fill the gaps.
    ordered = sorted(files, key=lambda entry: -entry["size"])
    bad = 0
    total = 0
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for entry, (problem, detail, done) in pool.map(
                lambda entry: (entry, check(dest, entry)), ordered):
            total += done
            if problem is not None:
                bad += 1
                out.write(f"{problem}\t{entry['path']}" + (f"\t{detail}" if detail else "")
                          + "\n")
                out.flush()
    summary = {"files": len(files), "bytes": total, "bad": bad, "jobs": jobs,
               "seconds": round(time.monotonic() - started, 3)}
    out.write("summary\t" + json.dumps(summary, sort_keys=True) + "\n")
    out.flush()
    return summary


def parse_args(argv: list | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Re-hash a downloaded model against its lock.")
    parser.add_argument("--dest", required=True, help="the model's directory")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--lock", help="lock file (tools.model_lock)")
    source.add_argument("--manifest", help="the lock's files list, as JSON")
    parser.add_argument("--jobs", type=int, default=0,
                        help="files hashed at once (default: the CPUs this may run on)")
    return parser.parse_args(argv)


def main(argv: list | None = None) -> int:
    args = parse_args(argv)
    try:
        files = load_files(args.lock, args.manifest)
    except UsageError as exc:
        print(f"verify_model: {exc}", file=sys.stderr)
        return EXIT_USAGE
    summary = run(args.dest, files, args.jobs or default_jobs())
    return EXIT_MISMATCH if summary["bad"] else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
