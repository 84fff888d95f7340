"""The persistence stage's verification."""

from __future__ import annotations


def test_persistence_verification(inventory_host):
    from pyinfra_vllm.operations.persistence import _verify_persistence

    host = inventory_host([{"index": 0, "persistence_mode": "Enabled"},
                  {"index": 1, "persistence_mode": "Disabled"}])
    assert _verify_persistence(None, host, [0], "Enabled") is True
    assert _verify_persistence(None, host, [0, 1], "Enabled") is False
    assert host.logged[0].startswith("persistence mode is Disabled on GPU 1, wanted Enabled")
