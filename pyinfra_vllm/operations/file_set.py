"""Several small files kept in place with one remote read: a set of files, each with its
content and mode, compared by sha256 in one command and uploaded only where it differs.

pyinfra's ``files.put`` reads two or three facts per file (File, Sha1File, Directory),
a remote round trip each; a stage that owns several small files (a unit, its
environment file, two helper scripts) pays that on every run, changed or not. Here the
whole set costs one command when nothing changed. With ``--diff`` each file whose
content differs gets its diff printed (pyinfra_vllm/operations/util/file_diff.py: one more read per
such file, none when the set is in place); a secret file's (mode 0600) values are masked, so the set
may hold one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Generator, Iterator
from pathlib import Path

from pyinfra import host, state
from pyinfra.api import (
    FileUploadCommand,
    OperationValueError,
    QuoteString,
    StringCommand,
    operation,
)

from facts.files import FileDigests, PathTypes
from pyinfra_vllm.operations.util import file_diff
from pyinfra_vllm.operations.util.rolling import STAGED_SUFFIX
from pyinfra_vllm.operations.util.uploads import private_upload
from pyinfra_vllm.plans import access


def _content(source: str | bytes) -> bytes:
    """A file's content: bytes as given, or the local file a ``str`` names."""
    return source if isinstance(source, bytes) else Path(source).read_bytes()


def _private(mode: str) -> bool:
    """A file only its owner may read (0600, 0400): the suite keeps secrets in those."""
    return not int(mode, 8) & 0o077


def _owner_and_mode_kept(path: str, have: dict[str, str], mode: str, user: str,
                         group: str) -> Generator[StringCommand, None, bool]:
    """``chown`` and ``chmod`` for a file whose content is right (``have``: its FileDigests
    entry) where its owner or mode differs; returns whether one ran. A path of the access
    table is left to pyinfra_vllm/operations/access.py."""
    if path in access.ROWS:
        return False
    changed = False
    if have["owner"] != f"{user}:{group}":
        yield StringCommand("chown", QuoteString(f"{user}:{group}"), QuoteString(path))
        changed = True
    if int(have["mode"], 8) != int(mode, 8):
        yield StringCommand("chmod", QuoteString(mode), QuoteString(path))
        changed = True
    return changed


def _written(path: str, data: bytes, mode: str, owner: str, stage: bool,
             parent_mode: str | None) -> Iterator[StringCommand | FileUploadCommand]:
    """``data`` uploaded beside ``path`` with its owner and mode, then renamed over it; with
    ``stage``, left beside it under STAGED_SUFFIX for the caller to move."""
    if stage:
        yield from private_upload(data, f"{path}{STAGED_SUFFIX}", mode=mode,
                                  owner=owner, parent_mode=parent_mode)
        return
    temporary = f"{path}.pyinfra-new"
    yield from private_upload(data, temporary, mode=mode, owner=owner,
                              parent_mode=parent_mode)
    yield StringCommand("mv -f", QuoteString(temporary), QuoteString(path))


@operation()
def present(files: dict[str, tuple[str | bytes, str]], user: str = "root", group: str = "root",
            stage: bool = False, parent_mode: str | None = None):
    """
    Keep a set of files in place: content and mode, owned by ``user``:``group``.

    + files: ``{remote path: (local path or bytes, octal mode)}``
    + user: owner of every file
    + group: group of every file
    + stage: a file whose content differs is uploaded beside its path, under
      pyinfra_vllm/operations/util/rolling.py's ``STAGED_SUFFIX``, and left there: the caller moves
      it into place (``rolling.promote_command``), so the live file changes only then
    + parent_mode: each written file's directory made root's with this mode (a directory
      the suite owns: node_exporter's textfiles'); None: created 0755 where missing

    Every file with the wanted content, owner and mode: no command (one remote read for
    the set). A file whose content differs is uploaded to a temporary name beside it that
    already has its owner and mode (pyinfra_vllm/operations/util/uploads.py: never readable by
    another user, not even under sudo), then renamed over the old one; one whose owner or mode alone
    differs gets ``chown`` or ``chmod``, but for a path of the access table
    (pyinfra_vllm/plans/access.py), whose owner and mode pyinfra_vllm/operations/access.py keeps
    without following a link. Parent directories are created (0755). With ``--diff``, each file
    whose content differs is diffed before any command, values masked in a file only its owner may
    read (0600); contents appear in no command.
    """
    found = host.get_fact(FileDigests, paths=sorted(files))
    wanted = {path: _content(files[path][0]) for path in sorted(files)}
    differing = [
        path for path, data in wanted.items()
        if (found.get(path) or {}).get("sha256") != hashlib.sha256(data).hexdigest()
    ]
    # Before the first command: pyinfra's change detection stops at the first one.
    file_diff.show_changes(state, host, [
        (path, wanted[path], _private(files[path][1]), found.get(path) is not None)
        for path in differing
    ])
    changed = []
    for path, data in wanted.items():
        mode = files[path][1]
        have = found.get(path)
        if path not in differing and have is not None:
            if (yield from _owner_and_mode_kept(path, have, mode, user, group)):
                changed.append(path)
            continue
        yield from _written(path, data, mode, f"{user}:{group}", stage, parent_mode)
        changed.append(path)
    if not changed:
        host.noop(f"{len(files)} file(s) in place")


@operation()
def absent(paths: list[str]):
    """
    Keep a set of paths absent: files, symbolic links and whole directories.

    + paths: absolute paths to remove; a directory goes with everything below it, without
      crossing into another mounted file system (``rm --one-file-system``)

    One remote read for the set (facts.files.PathTypes); every path already absent: no
    command. A symbolic link is removed, never what it points to.
    """
    unsafe = [path for path in paths if not path.startswith("/") or path.rstrip("/") == ""]
    if unsafe:
        raise OperationValueError(f"absent: {unsafe} is not an absolute path below /")
    found = host.get_fact(PathTypes, paths=sorted(paths))
    present = [path for path in sorted(paths) if found.get(path)]
    for path in present:
        if found[path] == "directory":
            yield StringCommand("rm -rf --one-file-system --", QuoteString(path))
        else:
            yield StringCommand("rm -f --", QuoteString(path))
    if not present:
        host.noop(f"{len(paths)} path(s) absent")
