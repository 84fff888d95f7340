"""Several small files kept in place with one remote read: a set of files, each with its
content and mode, compared by sha256 in one command and uploaded only where it differs.

pyinfra's ``files.put`` reads two or three facts per file (File, Sha1File, Directory),
a remote round trip each; a stage that owns several small files (a unit, its
environment file, two helper scripts) pays that on every run, changed or not. Here the
whole set costs one command when nothing changed. Contents are never printed, not even
with ``--diff``, so the set may hold a secret file (mode 0600).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation

from facts.files import FileDigests
from operations.uploads import private_upload


def _content(source: str | bytes) -> bytes:
    """A file's content: bytes as given, or the local file a ``str`` names."""
    return source if isinstance(source, bytes) else Path(source).read_bytes()


@operation()
def present(files: dict[str, tuple[str | bytes, str]], user: str = "root", group: str = "root"):
    """
    Keep a set of files in place: content and mode, owned by ``user``:``group``.

    + files: ``{remote path: (local path or bytes, octal mode)}``
    + user: owner of every file
    + group: group of every file

    Every file with the wanted content, owner and mode: no command (one remote read for
    the set). A file whose content differs is uploaded to a temporary name beside it that
    already has its owner and mode (operations/uploads.py: never readable by another user,
    not even under sudo), then renamed over the old one; one whose owner or mode
    alone differs gets ``chown`` or ``chmod``. Parent directories are created (0755). Contents never appear in output.
    """
    found = host.get_fact(FileDigests, paths=sorted(files))
    changed = []
    for path in sorted(files):
        source, mode = files[path]
        data = _content(source)
        have = found.get(path)
        if have is not None and have["sha256"] == hashlib.sha256(data).hexdigest():
            if have["owner"] != f"{user}:{group}":
                yield StringCommand("chown", QuoteString(f"{user}:{group}"), QuoteString(path))
                changed.append(path)
            if int(have["mode"], 8) != int(mode, 8):
                yield StringCommand("chmod", QuoteString(mode), QuoteString(path))
                if path not in changed:
                    changed.append(path)
            continue
        temporary = f"{path}.pyinfra-new"
        yield from private_upload(data, temporary, mode=mode, owner=f"{user}:{group}")
        yield StringCommand("mv -f", QuoteString(temporary), QuoteString(path))
        changed.append(path)
    if not changed:
        host.noop(f"{len(files)} file(s) in place")
