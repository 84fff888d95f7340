"""Facts about the GPUs themselves: the inventory (one ``--query-gpu`` call), each GPU's
compute capability and the compute processes on them, with their CSV parsers.

Absent (None) without nvidia-smi or when NVML fails (facts/nvidia_smi.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from typing_extensions import override

from facts.nvidia_smi import (
    EMPTY_CELLS,
    NvidiaSmiFact,
    device_error,
    nvml_failure,
    split_smi_output,
)


def split_unit(header: str) -> tuple[str, str | None]:
    """``"memory.total [MiB]"`` -> ``("memory.total", "MiB")``; no unit -> None."""
    match = re.match(r"^(.*?)\s*\[([^\]]*)\]\s*$", header.strip())
    if match is None:
        return header.strip(), None
    return match.group(1), match.group(2)


def _csv_value(value: str, unit: str | None) -> str | None:
    value = value.strip()
    # nvidia-smi's "no value" spellings: N/A, [N/A], [Not Supported], [Unknown Error]...
    if value in EMPTY_CELLS or (value.startswith("[") and value.endswith("]")):
        return None
    if unit is not None and value.endswith(" " + unit):
        value = value[: -len(unit) - 1].strip()
    return value


def parse_query_csv(
    lines: Iterable[str],
    fields: list[str] | None = None,
    text_field: str | None = None,
) -> list[dict[str, str | None]] | None:
    """Parse ``nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]``.

    With ``fields`` None the first CSV line is the header (``index, name, memory.total
    [MiB]``), otherwise ``fields`` names the columns (``noheader``). Keys are the field
    names without units; values are strings with a unit named in the header removed
    (``143771 MiB`` -> ``"143771"``), None for ``N/A``/``[N/A]``/``[Not Supported]``
    and for cells missing in a truncated row. ``text_field`` absorbs surplus commas
    (a process name with a comma). Lines without a comma (nvidia-smi's messages) are
    skipped. None on an NVML error.
    """
    lines, _status = split_smi_output(lines)
    if nvml_failure(lines) is not None:
        return None
    names: list[str] | None = None
    units: list[str | None] = []
    if fields is not None:
        names, units = list(fields), [None] * len(fields)
    rows: list[dict[str, str | None]] = []
    for line in lines:
        if "," not in line:
            continue
        # nvidia-smi separates with ", "; a bare "," can be part of a value.
        cells = [cell.strip() for cell in line.split(", " if ", " in line else ",")]
        if names is None:
            parsed = [split_unit(cell) for cell in cells]
            names, units = [name for name, _ in parsed], [unit for _, unit in parsed]
            continue
        cells = _merge_surplus(cells, names, text_field)
        rows.append(
            {
                name: _csv_value(cells[i], units[i]) if i < len(cells) else None
                for i, name in enumerate(names)
            }
        )
    return rows


def _merge_surplus(cells: list[str], names: list[str], text_field: str | None) -> list[str]:
    surplus = len(cells) - len(names)
    if surplus <= 0 or text_field is None or text_field not in names:
        return cells
    at = names.index(text_field)
    return cells[:at] + [", ".join(cells[at : at + surplus + 1])] + cells[at + surplus + 1 :]


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    match = re.match(r"^\s*(-?\d+)", value)
    return int(match.group(1)) if match is not None else None


def _enabled(value: str | None) -> str | None:
    return value if value in ("Enabled", "Disabled") else None


INVENTORY_FIELDS = [
    "index",
    "name",
    "uuid",
    "pci.bus_id",
    "memory.total",
    "mig.mode.current",
    "mig.mode.pending",
    "persistence_mode",
    "driver_version",
]


def parse_gpu_inventory(lines: Iterable[str]) -> list[dict[str, Any]] | None:
    """Parse the GpuInventory query (``INVENTORY_FIELDS``, csv,noheader,nounits).

    Returns ``[{"index": int, "name", "uuid", "pci_bus_id", "memory_total_mib": int,
    "mig_current": "Enabled"|"Disabled"|None, "mig_pending": ..., "persistence_mode":
    "Enabled"|"Disabled"|None, "driver_version"}]``; None on an NVML error or when
    nvidia-smi failed without printing any GPU.
    """
    lines, status = split_smi_output(lines)
    rows = parse_query_csv(lines, INVENTORY_FIELDS)
    if rows is None or (not rows and status not in (None, 0)):
        return None
    gpus = []
    for row in rows:
        index = _int(row["index"])
        if index is None:
            continue
        gpus.append(
            {
                "index": index,
                "name": row["name"],
                "uuid": row["uuid"],
                "pci_bus_id": row["pci.bus_id"],
                "memory_total_mib": _int(row["memory.total"]),
                "mig_current": _enabled(row["mig.mode.current"]),
                "mig_pending": _enabled(row["mig.mode.pending"]),
                "persistence_mode": _enabled(row["persistence_mode"]),
                "driver_version": row["driver_version"],
            }
        )
    return gpus


PROCESS_FIELDS = ["gpu_uuid", "pid", "process_name", "used_memory"]


def parse_gpu_processes(lines: Iterable[str]) -> list[dict[str, Any]] | None:
    """Parse the GpuProcesses query: ``[{"gpu_uuid", "pid": int, "process_name",
    "used_memory_mib": int|None}]``, ``[]`` when none run, None on an NVML error."""
    lines, status = split_smi_output(lines)
    rows = parse_query_csv(lines, PROCESS_FIELDS, text_field="process_name")
    if rows is None:
        return None
    processes = []
    for row in rows:
        pid = _int(row["pid"])
        if pid is None:
            continue
        processes.append(
            {
                "gpu_uuid": row["gpu_uuid"],
                "pid": pid,
                "process_name": row["process_name"],
                "used_memory_mib": _int(row["used_memory"]),
            }
        )
    if not processes and status not in (None, 0) and device_error(lines) is not None:
        return None
    return processes


class GpuInventory(NvidiaSmiFact[list[dict[str, Any]] | None]):
    """
    Returns one dict per GPU from a single ``nvidia-smi --query-gpu`` call, or None
    without nvidia-smi or on an NVML error:

    .. code:: python

        [{
            "index": 0, "name": "NVIDIA H200", "uuid": "GPU-...",
            "pci_bus_id": "00000000:00:06.0", "memory_total_mib": 143771,
            "mig_current": "Disabled", "mig_pending": "Disabled",
            "persistence_mode": "Enabled", "driver_version": "580.159.04",
        }]
    """

    arguments = f"--query-gpu={','.join(INVENTORY_FIELDS)} --format=csv,noheader,nounits"

    @override
    def process(self, output: list[str]) -> list[dict[str, Any]] | None:
        return parse_gpu_inventory(output)


COMPUTE_CAP_FIELDS = ["pci.bus_id", "compute_cap"]
_COMPUTE_CAP = re.compile(r"^\d+\.\d+$")


def parse_compute_caps(lines: Iterable[str]) -> dict[str, str] | None:
    """Parse the GpuComputeCapability query (``COMPUTE_CAP_FIELDS``, csv,noheader):
    ``{"00000000:00:06.0": "9.0"}``. None on an NVML error, when nvidia-smi does not know
    the field (it prints ``Field "compute_cap" is not a valid field to query.`` and exits
    2: an older driver), and for a GPU whose cell is not a capability (N/A)."""
    lines, status = split_smi_output(lines)
    rows = parse_query_csv(lines, COMPUTE_CAP_FIELDS)
    if rows is None or (not rows and status not in (None, 0)):
        return None
    caps = {}
    for row in rows:
        bus_id, cap = row["pci.bus_id"], row["compute_cap"]
        if bus_id and cap and _COMPUTE_CAP.match(cap):
            caps[bus_id] = cap
    return caps


class GpuComputeCapability(NvidiaSmiFact[dict[str, str] | None]):
    """
    Returns each GPU's compute capability by PCI bus id, or None without nvidia-smi, on
    an NVML error, or from a driver whose nvidia-smi has no ``compute_cap`` field (a
    separate query, so such a driver still gives GpuInventory):

    .. code:: python

        {"00000000:00:06.0": "9.0"}
    """

    arguments = f"--query-gpu={','.join(COMPUTE_CAP_FIELDS)} --format=csv,noheader"

    @override
    def process(self, output: list[str]) -> dict[str, str] | None:
        return parse_compute_caps(output)


class GpuProcesses(NvidiaSmiFact[list[dict[str, Any]] | None]):
    """
    Returns the compute processes on the GPUs, ``[]`` when none, None without
    nvidia-smi or on an NVML error:

    .. code:: python

        [{"gpu_uuid": "GPU-...", "pid": 4242, "process_name": "python3",
          "used_memory_mib": 70000}]
    """

    arguments = (
        f"--query-compute-apps={','.join(PROCESS_FIELDS)} --format=csv,noheader,nounits"
    )

    @override
    def process(self, output: list[str]) -> list[dict[str, Any]] | None:
        return parse_gpu_processes(output)
