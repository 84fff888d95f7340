"""Fixtures shared by test modules in several folders."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox.mirror import model
from sandbox.mirror.server import MirrorServer

MIRROR_REPO = model.DEFAULT_REPO_ID


@pytest.fixture(scope="module")
def mirror_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the generated tiny model at ``MIRROR_REPO``."""
    base = tmp_path_factory.mktemp("mirror")
    model.generate(base / MIRROR_REPO)
    return base


@pytest.fixture(scope="module")
def mirror(mirror_root: Path):
    """The model mirror serving ``mirror_root`` on 127.0.0.1 (a free port)."""
    with MirrorServer(mirror_root) as server:
        yield server


class InventoryHost:
    """Just what the execute-time checks of the GPU operations use of a pyinfra host: the
    GPU inventory as its one fact, and the lines it logs."""

    def __init__(self, inventory):
        self.inventory = inventory
        self.logged = []

    def get_fact(self, fact, *args, **kwargs):
        return self.inventory

    def log_styled(self, message, **kwargs):
        self.logged.append(message)


@pytest.fixture
def inventory_host():
    """``inventory_host(gpus)``: a host whose GPU inventory is ``gpus``."""
    return InventoryHost
