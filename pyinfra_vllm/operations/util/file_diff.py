"""``pyinfra --diff`` for the files the suite writes itself, secrets masked.

pyinfra's ``files.put`` and ``files.template`` print a unified diff of a file they would
change when the CLI runs with ``--diff`` (``state.config.DIFF``, pyinfra 3.10
``operations/files.py``): they read the old content with the ``FileContents`` fact and
print ``generate_color_diff`` of it. The suite's own file operations (file_set.present,
gateway.site) compare digests instead and never read content; ``show`` (``show_changes``
for a set of files) gives them the same diff, in pyinfra's own format, read only for a
file whose digest already differs.

A file that holds secrets (mode 0600: the engine's environment file, nginx's API-key
map, the TLS key) is never read: its lines come from ``SecretFileLines``, a variable name
and a digest per line, computed on the host, so neither pyinfra's ``-vvv`` fact output
nor the diff ever carries a value, old or new. Its diff shows ``NAME=<secret, changed>``
for a value that changes, ``<secret, unchanged>`` for one that does not. The file's
whole-content sha256 (FileDigests) was already in ``-vvv`` output; a digest per line
tells no more about a value than that one.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import re
from typing import Any

from pyinfra.api.util import format_text
from pyinfra.facts.files import FileContents
from pyinfra.operations.util.files import generate_color_diff

from facts.files import SecretFileLines

logger = logging.getLogger("pyinfra")

# A line SecretFileLines names: ``NAME=...`` with a shell variable's name.
_NAMED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=")
_EMPTY = hashlib.sha256(b"").hexdigest()


def wanted(state: Any) -> bool:
    """Print diffs now? With ``--diff``, once per run: while pyinfra detects changes, or,
    with ``-y`` (no change detection), while it executes."""
    if not state.config.DIFF:
        return False
    return not (state.is_executing and state.should_check_for_changes())


def secret_lines(data: bytes) -> list[tuple[str | None, str]]:
    """(variable name or None, sha256 of the line) per line of ``data``: what
    SecretFileLines reads on the host, computed the same way here."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    found: list[tuple[str | None, str]] = []
    for line in lines:
        named = _NAMED.match(line.decode(errors="replace"))
        found.append((named.group(1) if named else None, hashlib.sha256(line).hexdigest()))
    return found


def _masked(line: tuple[str | None, str], status: str) -> str:
    name, digest = line
    if name is None and digest == _EMPTY:
        return ""
    return f"{name}=<secret, {status}>" if name else f"<secret, {status}>"


def _range(start: int, stop: int) -> str:
    """A hunk's line range as pyinfra (and difflib.unified_diff) write it."""
    length = stop - start
    if length == 1:
        return f"{start + 1}"
    return f"{start + 1 if length else start},{length}"


def masked_diff(old: list[tuple[str | None, str]], new: list[tuple[str | None, str]]) -> list[str]:
    """A unified diff of two secret files, lines compared by digest, values masked; in
    pyinfra's ``generate_color_diff`` format."""
    out: list[str] = []
    matcher = difflib.SequenceMatcher(None, [d for _n, d in old], [d for _n, d in new])
    for group in matcher.get_grouped_opcodes(2):
        first, last = group[0], group[-1]
        out.append(f"@@ -{_range(first[1], last[2])} +{_range(first[3], last[4])} @@")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                out.extend("  " + _masked(line, "unchanged") for line in old[i1:i2])
                continue
            removed = {name for name, _d in old[i1:i2] if name}
            for line in old[i1:i2]:
                out.append(format_text("- " + _masked(line, "old"), "red"))
            for line in new[j1:j2]:
                status = "changed" if line[0] in removed else "new"
                out.append(format_text("+ " + _masked(line, status), "green"))
    return out


def lines(host: Any, path: str, data: bytes, secret: bool, exists: bool) -> list[str]:
    """The diff lines for ``path`` becoming ``data``: one remote read (none for a file
    that does not exist yet)."""
    if secret:
        old = (host.get_fact(SecretFileLines, path=path) or []) if exists else []
        return masked_diff(old, secret_lines(data))
    try:
        desired = data.decode().splitlines(keepends=True)
    except UnicodeDecodeError:
        return [f"binary file, {len(data)} bytes"]
    current = (host.get_fact(FileContents, path=path) or []) if exists else []
    return list(generate_color_diff([f"{line}\n" for line in current], desired))


def show(host: Any, path: str, data: bytes, secret: bool, exists: bool) -> None:
    """Print, as pyinfra's ``files.put`` does with ``--diff``, how ``path`` would change.

    + path: the file on the host
    + data: its wanted content
    + secret: a file holding secrets: values masked, its content never read
    + exists: whether the file is there now (else every line is new, nothing is read)
    """
    verb = "modify" if exists else "create"
    note = " (secret: values masked)" if secret else ""
    logger.info("%sWill %s %s%s", host.print_prefix, verb, format_text(path, bold=True), note)
    for line in lines(host, path, data, secret, exists):
        logger.info("  %s", line)
    logger.info("")


def show_changes(state: Any, host: Any, changes: list[tuple[str, bytes, bool, bool]]) -> None:
    """``show`` each of ``changes``, ``(path, data, secret, exists)``, when diffs are
    ``wanted``: an operation calls it before its first command, since pyinfra's change
    detection stops at the first one."""
    if changes and wanted(state):
        for path, data, secret, exists in changes:
            show(host, path, data, secret=secret, exists=exists)
