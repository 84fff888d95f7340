"""Eight sandbox hosts at once, as the fleet tests need: all boot, all answer pyinfra
over SSH with their own name and their own GPUs, and teardown leaves nothing."""

from __future__ import annotations

import json

import pytest

from sandbox import hosts as sbx
from tests.e2e.conftest import booted

pytestmark = pytest.mark.e2e

SCENARIOS = ["seed", "pcie", "mig", "mismatch", "bare", "seed", "pcie", "seed"]


def test_eight_hosts_boot_and_answer():
    with booted(SCENARIOS) as sandbox:
        proc = sandbox.pyinfra(
            "fact", "server.Hostname", "facts.topology.GpuTopology", "--json", timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        facts = json.loads(proc.stdout)
        names = [f"gpu-sbx-{n}" for n in range(1, 9)]
        assert facts["server.Hostname"] == {name: name for name in names}
        links = {
            name: (topology or {}).get("links", {}).get("GPU0", {}).get("GPU1")
            for name, topology in facts["facts.topology.GpuTopology"].items()
        }
        assert links == {
            "gpu-sbx-1": "NV12", "gpu-sbx-2": "PHB", "gpu-sbx-3": "NV12",
            "gpu-sbx-4": None,  # mismatch: nvidia-smi fails, the fact is absent
            "gpu-sbx-5": None,  # bare: no driver
            "gpu-sbx-6": "NV12", "gpu-sbx-7": "PHB", "gpu-sbx-8": "NV12",
        }
        if sandbox.reused:
            return
    assert sbx.leftovers() == []
