"""Read everything the preflight and the audit judge, from one host, in one place.

Every fact here returns an absent value (None) rather than failing when the thing it
reads is missing (no driver, no NVLink, no nvcc), so a bare host is collected too. The
NVIDIA, CUDA and package state comes from one remote command (GpuHostState), not ten.
"""

from __future__ import annotations

from typing import Any

from pyinfra.facts.server import KernelVersion, LinuxDistribution

from facts.gpu_host import GpuHostState


def collect(host: Any) -> dict[str, Any]:
    """The host's OS, driver, GPUs, topology and NVLink state, as plain data."""
    return {
        "os": host.get_fact(LinuxDistribution),
        "kernel": host.get_fact(KernelVersion),
        **host.get_fact(GpuHostState),
    }
