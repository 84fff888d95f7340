"""Read everything the preflight and the audit judge, from one host, in one place.

Every fact here returns an absent value (None) rather than failing when the thing it
reads is missing (no driver, no NVLink, no nvcc), so a bare host is collected too.
"""

from __future__ import annotations

from typing import Any

from pyinfra.facts.server import KernelVersion, LinuxDistribution

from facts.cuda import CudaToolkit
from facts.nvidia import (
    DriverInfo,
    DriverPackages,
    GpuInventory,
    GpuProcesses,
    GpuTopology,
    HeldPackages,
    KernelModule,
    NvlinkStatus,
    NvmlError,
)


def collect(host: Any) -> dict[str, Any]:
    """The host's OS, driver, GPUs, topology and NVLink state, as plain data."""
    return {
        "os": host.get_fact(LinuxDistribution),
        "kernel": host.get_fact(KernelVersion),
        "kernel_module": host.get_fact(KernelModule),
        "driver": host.get_fact(DriverInfo),
        "driver_packages": host.get_fact(DriverPackages),
        "held_packages": host.get_fact(HeldPackages),
        "nvml_error": host.get_fact(NvmlError),
        "gpus": host.get_fact(GpuInventory),
        "processes": host.get_fact(GpuProcesses),
        "topology": host.get_fact(GpuTopology),
        "nvlink": host.get_fact(NvlinkStatus),
        "cuda_toolkit": host.get_fact(CudaToolkit),
    }
