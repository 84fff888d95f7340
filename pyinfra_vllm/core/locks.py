"""The model lock on the operator's machine: found, read and checked once per run.

``python -m tools.model_lock`` writes it (every file with size and checksum, the
commit, config.json); the model stage downloads exactly that, and preflight judges the
model from its config.json before any host changes. A missing or mismatched lock is an
operator error, the same on every host, so it stops the whole run (exit 1) naming the
file and the command that makes it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pyinfra.api.exceptions import DeployError

from pyinfra_vllm.core.settings import Settings

# The lock format python -m tools.model_lock writes; a lock of another version is refused.
LOCK_VERSION = 1

_LOADED: dict[str, dict[str, Any]] = {}


def default_out(model_id: str) -> Path:
    """Where the lock of ``model_id`` lives when the model_lock setting names none."""
    return Path("locks") / (model_id.replace("/", "--") + ".json")


class LockFileError(DeployError):
    """The model lock is missing, unreadable, or for another model."""


def lock_path(settings: Settings) -> Path:
    return Path(settings.model_lock) if settings.model_lock else default_out(settings.model_id)


def _remedy(settings: Settings) -> str:
    return (f"run `python -m tools.model_lock {settings.model_id} --revision "
            f"{settings.model_revision} --base-url {settings.model_base_url}"
            + (f" --out {settings.model_lock}" if settings.model_lock else "") + "`")


def load_lock(settings: Settings, required: bool = True) -> dict[str, Any] | None:
    """The checked lock for these settings; None when absent and not ``required``."""
    path = lock_path(settings)
    key = str(path.resolve())
    if key in _LOADED:
        found = _LOADED[key]
    elif not path.is_file():
        if not required:
            return None
        raise LockFileError(f"model lock {path} not found for model_id {settings.model_id}: "
                            + _remedy(settings))
    else:
        try:
            found = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise LockFileError(f"model lock {path}: unreadable ({exc}): "
                                + _remedy(settings)) from exc
        _LOADED[key] = found
    problems = []
    if found.get("lock_version") != LOCK_VERSION:
        problems.append(f"lock_version {found.get('lock_version')!r}, expected {LOCK_VERSION}")
    if found.get("model_id") != settings.model_id:
        problems.append(f"it locks {found.get('model_id')!r}, model_id is {settings.model_id!r}")
    if settings.model_revision not in (found.get("revision"), found.get("commit")):
        problems.append(f"it locks revision {found.get('revision')!r} "
                        f"({found.get('commit')}), model_revision is {settings.model_revision!r}")
    if not isinstance(found.get("config"), dict):
        problems.append("it carries no config.json (written by an older tools.model_lock)")
    if not isinstance(found.get("files"), list) or not found.get("files"):
        problems.append("it lists no files")
    if problems:
        raise LockFileError(f"model lock {path}: " + "; ".join(problems) + ": "
                            + _remedy(settings))
    return found


def safetensors_bytes(lock: dict[str, Any]) -> int | None:
    """Total size of the weights (*.safetensors) the lock lists; None when it has none."""
    sizes = [f["size"] for f in lock["files"] if f["path"].endswith(".safetensors")]
    return sum(sizes) if sizes else None


def hf_token(settings: Settings) -> str | None:
    """The token: hf_token, else the file hf_token_file names, else HF_TOKEN."""
    if settings.hf_token:
        return settings.hf_token.get_secret_value()
    if settings.hf_token_file:
        path = Path(settings.hf_token_file)
        try:
            return path.read_text(encoding="utf-8").strip() or None
        except OSError as exc:
            raise LockFileError(f"hf_token_file {path}: cannot be read ({exc.strerror}); "
                              "point it at a file holding the token") from exc
    return os.environ.get("HF_TOKEN") or None
