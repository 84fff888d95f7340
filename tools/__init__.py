"""Operator-side commands (run on the operator's machine, not on the servers)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def repository_env() -> dict[str, str]:
    """This process's environment, with the repository first on PYTHONPATH: for the
    pyinfra (and tools) runs the commands start from the repository root, whose deploy
    files import the suite."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
