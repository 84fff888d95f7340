"""What every nvidia-smi fact shares: the command wrapper, the output split and NVML's
failure messages.

Every nvidia-smi fact is safe on a host without a driver: it uses ``requires_command``
(absent binary -> the fact's default, ``None``), and its command exits 0 when nvidia-smi
itself fails. nvidia-smi's failure is data for these facts (a "Driver/library version
mismatch" is exactly what the audit must report), so each command folds stderr into
stdout and appends one marker line carrying the exit status::

    nvidia-smi topo -m 2>&1; echo "##NVIDIA_SMI_EXIT=$?"

The marker keeps the command's own exit status 0 (pyinfra fails a host whose fact
command exits non-zero), keeps the real status for the parser, and guarantees one line
of output (pyinfra only calls ``process`` when there is output, and an empty
``nvlink --status`` means "NVLink not exposed", which is not the same as "no nvidia-smi").

The parsers of the fact modules (facts/topology.py, facts/gpus.py, facts/driver.py) are
module-level functions so the audit and the simulator tests can reuse them on recorded
output; they accept lines with or without the marker and never raise on truncated or
unexpected text: they parse what is there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TypeVar

from typing_extensions import override

from facts.base import FactBase

T = TypeVar("T")


SMI_EXIT_MARKER = "##NVIDIA_SMI_EXIT="


# nvidia-smi and NVML messages that mean "no usable driver / no GPUs": nothing else in
# the output can be trusted after one of these.
NVML_FATAL_PATTERNS = (
    re.compile(r"^Failed to initialize NVML"),
    re.compile(r"^NVIDIA-SMI has failed"),
    re.compile(r"couldn't communicate with the NVIDIA driver"),
    re.compile(r"^NVIDIA-SMI couldn't find libnvidia-ml"),
    re.compile(r"^No devices were found"),
    re.compile(r"^Driver/library version mismatch"),
    re.compile(r"^GPU access blocked by the operating system"),
    re.compile(r"^Insufficient Permissions"),
)


# A GPU that fell off the bus: the other GPUs still answer, but nvidia-smi is not healthy.
NVML_DEVICE_ERROR_PATTERNS = (
    re.compile(r"^Unable to determine the device handle"),
    re.compile(r"^GPU is lost"),
)
# nvidia-smi's spellings of "no value" in a table or CSV cell.
EMPTY_CELLS = ("", "N/A")


def smi_command(arguments: str) -> str:
    """The shell command for ``nvidia-smi <arguments>`` with the exit-status marker."""
    invocation = f"nvidia-smi {arguments}" if arguments else "nvidia-smi"
    return f'{invocation} 2>&1; echo "{SMI_EXIT_MARKER}$?"'


def split_smi_output(lines: Iterable[str]) -> tuple[list[str], int | None]:
    """Drop the exit marker (and CRs from a PTY); return the lines and the exit status.

    The status is None when there is no marker (raw recorded output).
    """
    kept: list[str] = []
    status: int | None = None
    for line in lines:
        line = line.rstrip("\r\n")
        if line.startswith(SMI_EXIT_MARKER):
            value = line[len(SMI_EXIT_MARKER) :].strip()
            status = int(value) if value.isdigit() else None
            continue
        kept.append(line)
    return kept, status


def nvml_failure(lines: Iterable[str]) -> str | None:
    """The first line saying nvidia-smi/NVML cannot work at all, or None."""
    for line in lines:
        text = line.strip()
        if any(pattern.search(text) for pattern in NVML_FATAL_PATTERNS):
            return text
    return None


def device_error(lines: Iterable[str]) -> str | None:
    for line in lines:
        text = line.strip()
        if any(pattern.search(text) for pattern in NVML_DEVICE_ERROR_PATTERNS):
            return text
    return None


class NvidiaSmiFact(FactBase[T]):
    """
    Base of the facts read from one ``nvidia-smi <arguments>`` call: absent (the
    fact's default, None) where nvidia-smi is not installed; the command always exits
    0 and carries nvidia-smi's own exit status in its last line (``smi_command``).
    """

    arguments = ""

    @override
    def requires_command(self) -> str:
        return "nvidia-smi"

    @override
    def command(self) -> str:
        return smi_command(self.arguments)
