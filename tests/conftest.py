"""Fixtures shared by test modules in several folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pyinfra_testing.util import FakeFact, FakeHost

from sandbox.mirror import model
from sandbox.mirror.server import MirrorServer

MIRROR_REPO = model.DEFAULT_REPO_ID

_get_fact = FakeHost.get_fact


def _get_fact_none_aware(self, fact_cls, *args, **kwargs):
    # pyinfra-testing 0.2.1 wraps an argument-less fact's value in a FakeFact, even a
    # JSON null, so ``fact is None`` (how the operations read "no driver") never holds.
    # Hand None back as None, like a real host does; and a boolean as itself (a FakeFact
    # of False is true: ``if host.get_fact(SystemdBooted)`` would always hold).
    value = _get_fact(self, fact_cls, *args, **kwargs)
    if isinstance(value, FakeFact) and (value.data is None or isinstance(value.data, bool)):
        return value.data
    return value


FakeHost.get_fact = _get_fact_none_aware


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


# The audit's default audit_report_dir, in the checkout (tests run from its root).
CHECKOUT_REPORTS = Path(__file__).resolve().parents[1] / "reports"


def _checkout_report_files() -> set[str]:
    return set(os.listdir(CHECKOUT_REPORTS)) if CHECKOUT_REPORTS.is_dir() else set()


@pytest.fixture(scope="session", autouse=True)
def _checkout_reports_untouched():
    """No test writes into the checkout's reports/: each audit a test runs is given a
    temporary audit_report_dir (the e2e sandbox's is ``Sandbox.reports``)."""
    before = _checkout_report_files()
    yield
    added = sorted(_checkout_report_files() - before)
    if added:
        pytest.fail(f"the tests wrote {len(added)} file(s) into {CHECKOUT_REPORTS}: "
                    f"{', '.join(added)}; give the audit audit_report_dir in a temporary "
                    "directory")
