"""`sandbox up --routers`: front doors after the serving hosts, in the inventory's routers
group with the gateways' certificate, and refused without TLS (no containers, no root)."""

from __future__ import annotations

import runpy

import pytest

from sandbox import hosts as sbx
from sandbox.util import SandboxError


def test_front_doors_come_after_the_serving_hosts_in_the_routers_group(tmp_path, monkeypatch):
    hosts = sbx.plan(2, ["seed"], routers=1)
    assert [(host.name, host.scenario, host.router) for host in hosts] == [
        ("gpu-sbx-1", "seed", False), ("gpu-sbx-2", "seed", False), ("gpu-sbx-3", "bare", True)]
    for host in hosts:
        host.data = {"ssh_hostname": host.address}
    monkeypatch.setattr(sbx, "INVENTORY_FILE", tmp_path / "inventory.py")
    sbx.write_inventory(hosts)
    groups = runpy.run_path(str(tmp_path / "inventory.py"))
    assert [name for name, _ in groups["seed"]] == ["gpu-sbx-1", "gpu-sbx-2"]
    assert groups["routers"] == [("gpu-sbx-3", {"ssh_hostname": "10.213.3.2"})]
    assert "bare" not in groups
    assert [name for name, _ in groups["sandbox"]] == ["gpu-sbx-1", "gpu-sbx-2", "gpu-sbx-3"]


def test_each_serving_host_of_a_fleet_gets_a_cpu_of_its_own(monkeypatch):
    monkeypatch.setattr(sbx.os, "sched_getaffinity", lambda _pid: {0, 1})
    hosts = sbx.plan(3, ["seed"], routers=1)
    assert [sbx._own_cpu(host) for host in hosts[:3]] == ["0", "1", "0"]


def test_front_doors_need_tls_and_a_count_of_zero_or_more():
    with pytest.raises(SandboxError, match="--routers needs --tls"):
        sbx.up(2, ["seed"], routers=1)
    with pytest.raises(SandboxError, match="--routers must be 0 or more"):
        sbx.plan(2, ["seed"], routers=-1)
