"""Secrets on the operator's machine: files that hold them, and URLs that may carry them.

A file holding a secret (API keys, the Hugging Face token) is refused when its group or
others may read it, as ssh refuses such a private key: ``chmod 600 FILE`` is the fix.
Nothing here ever returns or prints a secret's value in a message; a URL's credentials
are masked before it is shown.
"""

from __future__ import annotations

import os
import re
import stat

# scheme://user:password@ or scheme://token@ in any text shown to the operator. The
# credentials run to the last "@" before the host (urllib splits there too), so an "@"
# written unencoded in a password ("p@ss") is masked with the rest of it.
_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/\s'\"]*)@")


def mask_credentials(text: str) -> str:
    """``text`` with the credentials of every URL in it masked: ``user:***@``, ``***@``."""

    def masked(match: re.Match[str]) -> str:
        user, colon, _password = match.group("userinfo").partition(":")
        # A user with an "@" of its own is no plain user name: masked whole.
        if colon and "@" not in user:
            return f"{match.group('scheme')}{user}:***@"
        return f"{match.group('scheme')}***@"

    return _CREDENTIALS.sub(masked, text)


def private_file_problem(path: str) -> str | None:
    """Why ``path`` cannot hold a secret (missing, not a file, readable by others), or None."""
    try:
        status = os.stat(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if not stat.S_ISREG(status.st_mode):
        return "is not a regular file"
    if status.st_mode & 0o077:
        return (f"its mode {stat.S_IMODE(status.st_mode):04o} lets group or others read "
                f"the secret in it: chmod 600 {path}")
    if not os.access(path, os.R_OK):
        return "cannot be read (Permission denied)"
    return None


def read_key_lines(path: str) -> list[tuple[int, str]]:
    """(line number, key) for each key in a key file: one key per line, blank lines and
    lines starting with ``#`` ignored, surrounding whitespace stripped."""
    with open(path, encoding="utf-8") as lines:
        found = []
        for number, line in enumerate(lines, start=1):
            key = line.strip()
            if key and not key.startswith("#"):
                found.append((number, key))
        return found
