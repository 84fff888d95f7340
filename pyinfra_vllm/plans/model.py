"""Where the model stage keeps its tools on a host, what it says of model files that no
longer match their lock (pyinfra_vllm/operations/model.py downloads them), and which files of a
model's directory are the downloader's to remove."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pyinfra_vllm.core.model_files import (
    FETCH_LOCK,
    INCOMING,
    VERIFIED_NAME,
    model_path,
    unsafe_model_path,
)

# Where the downloader and the lock live on the host (root only).
TOOL_DIR = "/var/lib/pyinfra-vllm"
# What the downloader keeps for itself in a model's directory, its record's temporary
# name included (files/fetch_model.py).
DOWNLOADER_NAMES = (INCOMING, VERIFIED_NAME, f"{VERIFIED_NAME}.tmp", FETCH_LOCK)


@dataclass(frozen=True)
class ModelRemoval:
    """What deploys/remove.py takes out of a model's directory, as paths."""

    # Directories removed with everything in them: the download area.
    trees: list[str]
    # Files (and links, never followed) removed.
    files: list[str]
    # Directories removed where they are directories (no link) and that left them empty,
    # deepest first: those of the listed files, the model's, its organisation's.
    emptied: list[str]
    # Files that are not the downloader's, left in the model's directory.
    kept: int


def model_removal(model_dir: str, model_id: str, found: dict[str, Any] | None,
                  kinds: dict[str, str | None], listed: list[str]) -> ModelRemoval:
    """What of ``{model_dir}/{model_id}`` is the downloader's to remove: the files of
    ``listed`` (the model lock's) and of the host's record (facts.model.ModelFiles
    ``found``) that are plain files there, and its own names (DOWNLOADER_NAMES, their
    types in ``kinds``: facts.files.PathTypes); then the directories of the listed
    files, the model's directory and its organisation's, where that left them empty.
    model_dir itself (the mount point) is never removed. A file of another name stays,
    and a file reached through a link (never followed)."""
    if found is None:
        return ModelRemoval([], [], [], 0)
    path = model_path(model_dir, model_id)
    named = {name for name in (*listed, *found["verified"]) if unsafe_model_path(name) is None}
    present = sorted(name for name in named if name in found["files"])
    kept = len(set(found["files"]) - set(present) - {FETCH_LOCK})
    own = {name: kinds.get(f"{path}/{name}") for name in DOWNLOADER_NAMES}
    trees = [f"{path}/{name}" for name, kind in own.items()
             if name == INCOMING and kind == "directory"]
    files = [f"{path}/{name}" for name, kind in own.items() if kind in ("file", "link")]
    files += [f"{path}/{name}" for name in present]
    if not trees and not files:
        return ModelRemoval([], [], [], kept)
    parents = {"/".join(name.split("/")[:depth]) for name in named
               for depth in range(1, name.count("/") + 1)}
    organisations = ["/".join(model_id.split("/")[:depth])
                     for depth in range(model_id.count("/"), 0, -1)]
    emptied = [f"{path}/{name}" for name in sorted(parents, key=lambda n: (-n.count("/"), n))]
    emptied += [path, *(f"{model_dir.rstrip('/')}/{name}" for name in organisations)]
    return ModelRemoval(trees, files, emptied, kept)


def corrupt_reason(model_id: str, dest: str, corrupt: list[str]) -> str:
    """Why the model stage refuses a host whose files a deep check found changed under an
    unchanged size and mtime, and the setting that repairs them."""
    return (f"model: {len(corrupt)} file(s) of {model_id} in {dest} no longer match the "
            f"lock under an unchanged size and mtime: {', '.join(corrupt)}; set "
            "model_repair=true to fetch exactly them again (the engine then restarts)")
