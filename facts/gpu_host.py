"""Everything the preflight and the audit read about a GPU host, in one remote command.

Each fact in ``facts.driver``, ``facts.gpus``, ``facts.topology``, ``facts.gpu_health``
and ``facts.cuda`` is one round trip; read one by one, the fourteen of them cost
fourteen. ``GpuHostState.facts`` lists them: a run reads them in its one read
(pyinfra_vllm/run/host_reads.py), side by side as one group, and ``GpuHostState`` reads
them alone the same way (``pyinfra HOST fact facts.gpu_host.GpuHostState``, the
captures of a real GPU host), each output behind a section marker of
facts.host_state and parsed by its own fact, so the values are the same as the single
facts give (tests/unit/test_gpu_host.py checks this on the real H200 capture).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pyinfra.api import facts as pyinfra_facts
from typing_extensions import override

from facts.base import FactBase
from facts.cuda import CudaToolkit
from facts.driver import DriverInfo, DriverPackages, HeldPackages, KernelModule, NvmlError
from facts.gpu_health import GpuHealth, NvlinkErrors, XidEvents
from facts.gpus import GpuComputeCapability, GpuInventory, GpuProcesses
from facts.host_state import arrange, fact_command, fact_value, sections_command, split_sections
from facts.topology import GpuTopology, NvlinkStatus

# The name of the group the GPU facts run side by side in (facts.host_state.arrange).
GPU_GROUP = "gpu"
# GpuHostState's marker lines: a fixed word, for a command that is the same every time
# (pyinfra-testing pins it); nvidia-smi prints no line that starts with a marker.
NONCE = "gpu-host"


class GpuHostState(FactBase[dict[str, Any]]):
    """
    Returns, from one remote command, what these facts return one by one:
    ``kernel_module`` (KernelModule), ``driver_packages`` (DriverPackages),
    ``cuda_toolkit`` (CudaToolkit), ``driver`` (DriverInfo), ``nvml_error`` (NvmlError),
    ``gpus`` (GpuInventory), ``compute_caps`` (GpuComputeCapability), ``processes`` (GpuProcesses), ``topology`` (GpuTopology),
    ``nvlink`` (NvlinkStatus), ``gpu_health`` (GpuHealth), ``nvlink_errors``
    (NvlinkErrors), ``xid`` (XidEvents), ``held_packages`` (HeldPackages, from the same
    dpkg-query as DriverPackages). Each is absent exactly where the single fact is: on a
    host without a driver every nvidia-smi section is None. A fact whose parser fails
    fails this one (pyinfra's "could not process fact").
    """

    # Key in the returned dict (and in pyinfra_vllm.run.context.collect's state): fact.
    facts: ClassVar[dict[str, type[pyinfra_facts.FactBase]]] = {
        "kernel_module": KernelModule,
        "driver_packages": DriverPackages,
        "cuda_toolkit": CudaToolkit,
        "driver": DriverInfo,
        "nvml_error": NvmlError,
        "gpus": GpuInventory,
        "compute_caps": GpuComputeCapability,
        "processes": GpuProcesses,
        "topology": GpuTopology,
        "nvlink": NvlinkStatus,
        "gpu_health": GpuHealth,
        "nvlink_errors": NvlinkErrors,
        "xid": XidEvents,
        "held_packages": HeldPackages,
    }

    @staticmethod
    def arranged() -> tuple[list[str | list[str]], list[int]]:
        """The facts' commands as one group (nine nvidia-smi calls and the kernel log
        side by side), and each fact's section in the output."""
        return arrange([(fact_command(fact(), {}), GPU_GROUP)
                        for fact in GpuHostState.facts.values()])

    @override
    def command(self) -> str:
        return sections_command(self.arranged()[0], NONCE)

    @override
    def process(self, output: list[str]) -> dict[str, Any]:
        sections = split_sections(output, NONCE)
        state: dict[str, Any] = {}
        for (name, fact), position in zip(self.facts.items(), self.arranged()[1], strict=True):
            # As the combined command always did: a section is parsed whatever its exit
            # status; one that did not come back is the fact's default.
            _status, lines = sections.get(position, (0, []))
            state[name] = fact_value(fact(), lines)
        return state
