#!/usr/bin/env python3
"""Re-hash a Python environment's installed files against its wheels' RECORD files and
name every file that no longer matches.

Run on the GPU server (Python 3.8+, standard library only), by the EnvironmentContent
fact (facts/python_env.py) or by hand:

    python3 verify_env.py --env /opt/vllm/envs/vllm-0.6.3-1a2b3c4d [--jobs N]

Every installed distribution of the environment's site-packages
(``lib/pythonX.Y/site-packages/*.dist-info/RECORD``) lists its files as
``path,sha256=<urlsafe base64 without padding>,size`` (the wheel format, PEP 376 and
PEP 427; pip and uv write it at install time, with the hashes of what they installed,
console scripts included). Each file with a hash is read in full and hashed, whatever
its size and mtime, so a file whose bytes changed under an unchanged size and mtime is
found. Entries without a hash (RECORD itself, byte code written after the install,
INSTALLER where the installer left it out) are passed over, and so is every file no
RECORD lists: this judges the wheels' files only. A RECORD path is relative to
site-packages (``../../../bin/vllm`` for a script); one that leaves the environment is
passed over. A file is opened without following a symbolic link.

Output on stdout, never a byte of any file's content: one line per file that does not
match, ``PROBLEM<TAB>PATH<TAB>DISTRIBUTION`` (PATH relative to the environment,
DISTRIBUTION the dist-info's name), PROBLEM one of

* ``mismatch``: another checksum (the size may be the same);
* ``missing``: no such file;
* ``unreadable``: it cannot be read, or is a symbolic link (the reason follows, after
  another tab);
* ``unknown-hash``: its RECORD names a hash this Python does not have;

then one line ``summary<TAB>{"files": N, "bytes": N, "seconds": S, "bad": N, "jobs": N,
"records": N}`` (files and bytes: what was read and hashed; records: the RECORD files
read). Exit 0 every file matches, 1 some file does not, 2 no environment or no RECORD.
"""

from __future__ import annotations

import argparse
import base64
import csv
import glob
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

BLOCK = 1024 * 1024
EXIT_OK, EXIT_MISMATCH, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """No environment, or nothing to check in it (exit 2)."""


def records(env: str) -> list:
    """Every ``*.dist-info/RECORD`` of the environment's site-packages."""
    if not os.path.isdir(env):
        raise UsageError(f"{env} is no directory")
    found = sorted(glob.glob(os.path.join(glob.escape(env), "lib", "python*", "site-packages",
                                          "*.dist-info", "RECORD")))
    if not found:
        raise UsageError(f"no installed distribution (*.dist-info/RECORD) in {env}")
    return found


def entries(env: str, record: str) -> list:
    """(path relative to env, algorithm, expected digest, distribution) per hashed entry
    of one RECORD; entries without a hash, or outside the environment, left out."""
    site = os.path.dirname(os.path.dirname(record))
    dist = os.path.basename(os.path.dirname(record))[: -len(".dist-info")].split("-")[0]
    listed = []
    with open(record, newline="", encoding="utf-8") as handle:
        for row in csv.reader(handle):
            if len(row) < 2 or "=" not in row[1]:
                continue
            algo, _, digest = row[1].partition("=")
            path = os.path.normpath(os.path.join(site, row[0]))
            inside = os.path.relpath(path, env)
            if not os.path.isabs(row[0]) and not inside.startswith(".."):
                listed.append((inside, algo, digest, dist))
    return listed


def digest_of(path: str, algo: str) -> tuple:
    """(urlsafe base64 digest without padding, bytes read), the file opened without
    following a link."""
    digest = hashlib.new(algo)
    done = 0
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb", buffering=0) as handle:
        while True:
            block = handle.read(BLOCK)
            if not block:
                break
            digest.update(block)
            done += len(block)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode(), done


def check(env: str, entry: tuple) -> tuple:
    """(problem or None, detail, bytes read) for one RECORD entry."""
    inside, algo, expected, _dist = entry
    if algo not in hashlib.algorithms_available:
        return "unknown-hash", algo, 0
    path = os.path.join(env, inside)
    try:
        actual, done = digest_of(path, algo)
    except FileNotFoundError:
        return "missing", "", 0
    except OSError as exc:
        return "unreadable", exc.strerror or str(exc), 0
    return (None if actual == expected.rstrip("=") else "mismatch"), "", done


def default_jobs() -> int:
    try:
        return min(16, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return min(16, os.cpu_count() or 1)


def run(env: str, jobs: int, out=sys.stdout) -> dict:
    """Hash every RECORD entry with a hash; print the problems and the summary."""
    started = time.monotonic()
    found = records(env)
    listed = sorted({entry for record in found for entry in entries(env, record)})
    jobs = max(1, min(jobs, len(listed) or 1))
    bad = 0
    total = 0
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for entry, (problem, detail, done) in pool.map(
                lambda entry: (entry, check(env, entry)), listed):
            total += done
            if problem is not None:
                bad += 1
                out.write(f"{problem}\t{entry[0]}\t{entry[3]}" + (f"\t{detail}" if detail else "")
                          + "\n")
                out.flush()
    summary = {"files": len(listed), "bytes": total, "bad": bad, "jobs": jobs,
               "records": len(found), "seconds": round(time.monotonic() - started, 3)}
    out.write("summary\t" + json.dumps(summary, sort_keys=True) + "\n")
    out.flush()
    return summary


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Re-hash an environment's files against its wheels' RECORD files.")
    parser.add_argument("--env", required=True, help="the environment's directory")
    parser.add_argument("--jobs", type=int, default=0,
                        help="files hashed at once (default: the CPUs this may run on, 16 at most)")
    args = parser.parse_args(argv)
    try:
        summary = run(args.env, args.jobs or default_jobs())
    except UsageError as exc:
        print(f"verify_env: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_MISMATCH if summary["bad"] else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
