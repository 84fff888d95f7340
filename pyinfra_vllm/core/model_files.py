"""The model's paths on the operator side: where a model's directory is, and which file
paths of a model cannot be written under it.

The names the model downloader (files/fetch_model.py) reserves inside a model's
directory are defined with the fact that reads what it left (facts/model.py) and used
here from there.
"""

from __future__ import annotations

import posixpath

from facts.model import FETCH_LOCK, INCOMING, VERIFIED_NAME

__all__ = ["FETCH_LOCK", "INCOMING", "VERIFIED_NAME", "model_path", "unsafe_model_path"]


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
