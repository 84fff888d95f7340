"""The files of one Python environment as each host has it, and what makes two hosts'
copies the same (tests/e2e/test_rolling.py; tests/unit/test_env_files.py runs it on real
environments in tmp_path).

Two fresh hosts that install the same whole lock get the same environment: the same
files, links and RECORD entries (each wheel's files with the hashes the lock's wheels
carry), and each file the same bytes. A file with the same inode on every host is one
file, the same bytes on each: sandbox hosts with their own caches
(sandbox/hosts.py _own_caches) hard-link them from their copies of the shared caches,
themselves hard links of one cache entry, and uv hard-links the environment from there.
Every other file is hashed on each host, and where a RECORD lists it, against RECORD.

Which files share an inode depends on what the shared caches held when the hosts booted
(a wheel no earlier host downloaded is downloaded and unpacked by each host, into its
own cache entry: the same bytes, other inodes), so it is never counted: on a machine
whose caches lack the stack, every file is hashed.
"""

from __future__ import annotations

import base64
import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from facts.python_env import MANIFEST, MARKER

VERIFY_ENV = Path(__file__).resolve().parents[2] / "files" / "verify_env.py"
# A shell command line run on a host as root -> its stdout; fails the test when the
# command fails (tests/e2e/conftest.py Sandbox.ssh, or a local shell in the unit tests).
Run = Callable[[str], str]
# The most characters of paths in one sha256sum command: a command line reaches the
# host's shell as one argument (ssh, then ``sudo sh -c``), at most 128 KiB on Linux
# (MAX_ARG_STRLEN), quoted twice on the way.
PATHS_PER_COMMAND = 16_000

# Run on the host by its system python3 (-I: nothing of the environment, the current
# directory or the variables imported): every regular file with its inode and size, every
# link with its target, anything else by name, never following a link or leaving the
# environment's file system; and every RECORD entry with a hash, read by the deep
# check's own functions (files/verify_env.py records and entries).
_READ_SCRIPT = r"""
import json, os, sys
verify_env = {"__name__": "verify_env"}
exec(compile(VERIFY_ENV, "verify_env.py", "exec"), verify_env)
env = sys.argv[1]
device = os.lstat(env).st_dev
files, links, others, folders = {}, {}, [], [""]
while folders:
    folder = folders.pop()
    with os.scandir(os.path.join(env, folder)) as found:
        for entry in found:
            path = os.path.join(folder, entry.name)
            info = entry.stat(follow_symlinks=False)
            if entry.is_symlink():
                links[path] = os.readlink(entry.path)
            elif entry.is_dir(follow_symlinks=False) and info.st_dev == device:
                folders.append(path)
            elif entry.is_file(follow_symlinks=False):
                files[path] = [info.st_ino, info.st_size]
            else:
                others.append(path)
records = verify_env["records"](env)
entries = sorted({entry for record in records for entry in verify_env["entries"](env, record)})
json.dump({"files": files, "links": links, "others": sorted(others),
           "records": sorted(os.path.relpath(record, env) for record in records),
           "entries": entries}, sys.stdout)
"""


def history_dependent(path: str) -> bool:
    """Whether ``path`` (relative to the environment) is a file whose presence or bytes
    depend on what ran in the environment since it was installed, not on the lock, and
    so is left out of the comparison:

    * byte code (``__pycache__/``, ``*.pyc``): written by whoever imports a module first
      and may write there (the probe and ``pip freeze`` as root; the engine's user may
      not), only for the modules imported, each with its source's mtime in its header
      (the cache entry's for a hard-linked source, the install's for a copied one);
      numba's caches are in ``__pycache__`` too;
    * the suite's records of the build at the top (facts/python_env.py): the manifest,
      every file's mtime, and the marker, what the probe found. The probe and the lock
      the suite uploaded are compared like every other file.
    """
    return "__pycache__" in path.split("/")[:-1] or path.endswith(".pyc") or path in (
        MARKER, MANIFEST)


@dataclass(frozen=True)
class EnvironmentFiles:
    """One host's copy of an environment, history-dependent files left out."""

    files: dict[str, tuple[int, int]]  # path -> (inode, size)
    links: dict[str, str]  # path -> target
    others: list[str]  # neither a regular file, a link nor a directory of its file system
    records: list[str]  # the RECORD files
    # (path, distribution) -> (algorithm, digest): each RECORD entry with a hash
    entries: dict[tuple[str, str], tuple[str, str]]


def read_command(env: str) -> str:
    script = f"VERIFY_ENV = {VERIFY_ENV.read_text(encoding='utf-8')!r}\n{_READ_SCRIPT}"
    return f"python3 -I -c {shlex.quote(script)} {shlex.quote(env)}"


def read_environment(run: Run, env: str) -> EnvironmentFiles:
    """The environment at ``env`` as the host ``run`` reaches has it: stat only, no file
    read but the RECORD files."""
    found = json.loads(run(read_command(env)))
    return EnvironmentFiles(
        files={path: (inode, size) for path, (inode, size) in found["files"].items()
               if not history_dependent(path)},
        links={path: target for path, target in found["links"].items()
               if not history_dependent(path)},
        others=[path for path in found["others"] if not history_dependent(path)],
        records=found["records"],
        entries={(path, dist): (algo, digest.rstrip("="))
                 for path, algo, digest, dist in found["entries"]
                 if not history_dependent(path)},
    )


def differing(first: dict, other: dict, most: int = 20) -> list:
    """The keys (at most ``most``, sorted) that one of the two lacks or maps elsewhere."""
    keys = sorted(key for key in first.keys() | other.keys()
                  if key not in first or key not in other or first[key] != other[key])
    return keys[:most]


def unshared(copies: list[EnvironmentFiles]) -> list[str]:
    """The files (of the first copy) whose inode is not the same on every host: what each
    host wrote itself (the installer's RECORD, INSTALLER and scripts, the venv's own
    files), and the wheels each host unpacked into a cache entry of its own."""
    return sorted(path for path in copies[0].files
                  if len({copy.files.get(path, (None, None))[0] for copy in copies}) > 1)


def _chunks(paths: list[str]) -> list[list[str]]:
    chunks: list[list[str]] = [[]]
    length = 0
    for path in paths:
        quoted = len(shlex.quote(path)) + 1
        if chunks[-1] and length + quoted > PATHS_PER_COMMAND:
            chunks.append([])
            length = 0
        chunks[-1].append(path)
        length += quoted
    return [chunk for chunk in chunks if chunk]


def sha256_of(run: Run, env: str, paths: list[str]) -> dict[str, str]:
    """path -> sha256 (hex) of each of ``paths`` (relative to ``env``), by ``sha256sum``
    on the host, in commands of at most PATHS_PER_COMMAND characters of paths."""
    hashes = {}
    for chunk in _chunks(paths):
        listed = " ".join(shlex.quote(path) for path in chunk)
        for line in run(f"cd {shlex.quote(env)} && sha256sum -- {listed}").splitlines():
            digest, _, path = line.partition("  ")
            hashes[path] = digest
    return hashes


def record_mismatches(copy: EnvironmentFiles, hashes: dict[str, str]) -> dict[str, str]:
    """Of the files hashed (``hashes``: path -> sha256 hex), each whose bytes are not
    those its RECORD entry names, with the distribution: path -> distribution."""
    bad = {}
    for (path, dist), (algo, digest) in copy.entries.items():
        if algo == "sha256" and path in hashes:
            found = base64.urlsafe_b64encode(bytes.fromhex(hashes[path])).rstrip(b"=").decode()
            if found != digest:
                bad[path] = dist
    return bad


def record_missing(copy: EnvironmentFiles) -> list[str]:
    """The files a RECORD lists with a hash that are not regular files of the copy."""
    return sorted({path for path, _dist in copy.entries if path not in copy.files})
