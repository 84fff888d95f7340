"""The persistence stage's verification."""

from __future__ import annotations


class _Host:
    """Just what the execute-time checks use of a pyinfra host."""

    def __init__(self, inventory):
        self.inventory = inventory
        self.logged = []

    def get_fact(self, fact, *args, **kwargs):
        return self.inventory

    def log_styled(self, message, **kwargs):
        self.logged.append(message)


def test_persistence_verification():
    from operations.persistence import _verify_persistence

    host = _Host([{"index": 0, "persistence_mode": "Enabled"},
                  {"index": 1, "persistence_mode": "Disabled"}])
    assert _verify_persistence(None, host, [0], "Enabled") is True
    assert _verify_persistence(None, host, [0, 1], "Enabled") is False
    assert host.logged[0].startswith("persistence mode is Disabled on GPU 1, wanted Enabled")
