"""The names the model downloader (files/fetch_model.py) reserves inside a model's
directory, for the operator side that reads what it left.

files/fetch_model.py runs alone on the host and imports nothing of this repository, so
it carries the same two names; tests/unit/test_model.py holds them equal.
"""

from __future__ import annotations

import posixpath

# The record of the files verified against the lock: path, size, mtime, checksum.
VERIFIED_NAME = ".verified.json"
# Where partial downloads wait, under their path in the lock plus ".part".
INCOMING = ".incoming"
# The lock file that keeps two downloads into one directory apart.
FETCH_LOCK = ".fetch.lock"


def unsafe_model_path(path: str) -> str | None:
    """Why ``path`` (a file of a model, from a lock or the Hub's answer) cannot be written
    under the model's directory, or None: it must be relative, stay inside, and not be
    one of the downloader's own names (``.verified.json`` and its ``.tmp`` included)."""
    norm = posixpath.normpath(path) if path else ""
    first = norm.split("/")[0]
    if not path or path.startswith("/") or norm in (".", "..") or norm.startswith("../"):
        return "not a plain relative path inside the model's directory"
    if first in (INCOMING, FETCH_LOCK) or first.startswith(VERIFIED_NAME):
        return f"{first} is a name the downloader keeps for itself"
    return None


def model_path(model_dir: str, model_id: str) -> str:
    """``/srv/models/Qwen/Qwen3.6-27B``: the model's directory on the volume."""
    return f"{model_dir.rstrip('/')}/{model_id}"
