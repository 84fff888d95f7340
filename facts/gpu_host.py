"""Everything the preflight and the audit read about a GPU host, in one remote command.

Each fact in ``facts.driver``, ``facts.gpus``, ``facts.topology``, ``facts.gpu_health``
and ``facts.cuda`` is one round trip; read one by one, the thirteen of them cost
thirteen. ``GpuHostState`` runs their commands in one shell, each
output behind a section marker, and hands each section to that fact's own parser, so
the values are the same as the single facts give (tests/unit/test_gpu_host.py
checks this on the real H200 capture).
"""

from __future__ import annotations

from typing import Any

from pyinfra.api import FactBase
from typing_extensions import override

from facts.cuda import CudaToolkit
from facts.driver import DriverInfo, DriverPackages, KernelModule, NvmlError, parse_held_dpkg
from facts.gpu_health import GpuHealth, NvlinkErrors, XidEvents
from facts.gpus import GpuInventory, GpuProcesses
from facts.host_state import side_by_side
from facts.topology import GpuTopology, NvlinkStatus

SECTION_MARKER = "##SECTION "
END_MARKER = "##END"

# Section name: (fact, binary the fact needs or None). The section names are the keys
# of the returned dict, and of pyinfra_vllm.run.context.collect's.
SECTIONS: dict[str, tuple[type[FactBase], str | None]] = {
    "kernel_module": (KernelModule, None),
    "driver_packages": (DriverPackages, "dpkg-query"),
    "cuda_toolkit": (CudaToolkit, None),
    "driver": (DriverInfo, "nvidia-smi"),
    "nvml_error": (NvmlError, "nvidia-smi"),
    "gpus": (GpuInventory, "nvidia-smi"),
    "processes": (GpuProcesses, "nvidia-smi"),
    "topology": (GpuTopology, "nvidia-smi"),
    "nvlink": (NvlinkStatus, "nvidia-smi"),
    "gpu_health": (GpuHealth, "nvidia-smi"),
    "nvlink_errors": (NvlinkErrors, "nvidia-smi"),
    "xid": (XidEvents, None),
}


def _section_command(fact: type[FactBase], needs: str | None) -> str:
    command = str(fact().command())
    if needs is not None:
        # A missing binary leaves the section empty: the fact's absent value.
        command = f"if command -v {needs} >/dev/null 2>&1; then {command}; fi"
    return command


def split_sections(lines: list[str]) -> dict[str, list[str]]:
    """Output lines by section name; lines before the first marker are dropped."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lines:
        if line.startswith(SECTION_MARKER):
            current = sections.setdefault(line[len(SECTION_MARKER) :].strip(), [])
        elif line.strip() == END_MARKER:
            current = None
        elif current is not None:
            current.append(line)
    return sections


def parse_gpu_host(lines: list[str]) -> dict[str, Any]:
    sections = split_sections(lines)
    state: dict[str, Any] = {}
    for name, (fact, _needs) in SECTIONS.items():
        section = sections.get(name) or []
        # As pyinfra does for a single fact: no output is the fact's default.
        state[name] = fact().process(section) if section else fact.default()
    dpkg = sections.get("driver_packages") or []
    state["held_packages"] = parse_held_dpkg(dpkg)
    return state


class GpuHostState(FactBase[dict[str, Any]]):
    """
    Returns, from one remote command, what these facts return one by one:
    ``kernel_module`` (KernelModule), ``driver_packages`` (DriverPackages),
    ``held_packages`` (HeldPackages), ``cuda_toolkit`` (CudaToolkit), ``driver``
    (DriverInfo), ``nvml_error`` (NvmlError), ``gpus`` (GpuInventory), ``processes``
    (GpuProcesses), ``topology`` (GpuTopology), ``nvlink`` (NvlinkStatus),
    ``gpu_health`` (GpuHealth), ``nvlink_errors`` (NvlinkErrors), ``xid`` (XidEvents). Each is
    absent exactly where the single fact is: on a host without a driver every
    nvidia-smi section is None.
    """

    @override
    def command(self) -> str:
        names = list(SECTIONS)
        commands = [_section_command(*SECTIONS[name]) for name in names]
        in_order = "; ".join(f"echo '{SECTION_MARKER}{name}'; {command}"
                             for name, command in zip(names, commands, strict=True))

        def show(index: int, output: str, _status: str) -> str:
            return f"echo '{SECTION_MARKER}{names[index]}'; cat {output}"

        # The sections run side by side (eight nvidia-smi calls and the kernel log). The end marker is the
        # last command: the whole command exits 0.
        return f"{side_by_side(commands, show, in_order)}; echo '{END_MARKER}'"

    @override
    def process(self, output: list[str]) -> dict[str, Any]:
        return parse_gpu_host(output)
