"""Facts about NVIDIA GPUs and their driver: topology, NVLink, inventory, kernel module, packages.

Every fact here is safe on a host without a driver: the nvidia-smi facts use
``requires_command`` (absent binary -> the fact's default, ``None``), and the commands
exit 0 when nvidia-smi itself fails. nvidia-smi's failure is data for these facts (a
"Driver/library version mismatch" is exactly what the audit must report), so each
nvidia-smi command folds stderr into stdout and appends one marker line carrying the
exit status::

    nvidia-smi topo -m 2>&1; echo "##NVIDIA_SMI_EXIT=$?"

The marker keeps the command's own exit status 0 (pyinfra fails a host whose fact
command exits non-zero), keeps the real status for the parser, and guarantees one line
of output (pyinfra only calls ``process`` when there is output, and an empty
``nvlink --status`` means "NVLink not exposed", which is not the same as "no nvidia-smi").

The parsers are module-level functions so the audit and the simulator tests can reuse
them on recorded output; they accept lines with or without the marker and never raise on
truncated or unexpected text: they parse what is there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from itertools import combinations
from typing import Any, TypeVar

from typing_extensions import override

from pyinfra.api import FactBase

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

_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_GPU_LABEL_RE = re.compile(r"^GPU\d+$")
_NVLINK_CODE_RE = re.compile(r"^NV(\d+)$")
_NIC_LEGEND_RE = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
_EMPTY_CELLS = ("", "N/A")

# PCIe path codes from `nvidia-smi topo -m`'s legend, best first; SOC is the pre-2017
# name of SYS. NV# ranks above all of them, by link count.
_PCIE_RANK = {"PIX": 5, "PXB": 4, "PHB": 3, "NODE": 2, "SYS": 1, "SOC": 1}


def smi_command(arguments: str) -> str:
    """The shell command for ``nvidia-smi <arguments>`` with the exit-status marker."""
    invocation = f"nvidia-smi {arguments}" if arguments else "nvidia-smi"
    return f'{invocation} 2>&1; echo "{SMI_EXIT_MARKER}$?"'


# Output helpers
#


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


def _device_error(lines: Iterable[str]) -> str | None:
    for line in lines:
        text = line.strip()
        if any(pattern.search(text) for pattern in NVML_DEVICE_ERROR_PATTERNS):
            return text
    return None


def _cell_value(cell: str | None) -> str | None:
    if cell is None:
        return None
    cell = cell.strip()
    return None if cell in _EMPTY_CELLS else cell


# nvidia-smi topo -m / topo -p2p
#


def _split_cells(line: str) -> list[str]:
    """Cells of one matrix line: tab separated, or (copied output) 2+ spaces."""
    if "\t" in line:
        cells = [cell.strip() for cell in line.split("\t")]
    else:
        cells = [cell.strip() for cell in re.split(r" {2,}", line.strip())]
    # The header's corner cell and a leading space are not data.
    while cells and cells[0] == "":
        cells.pop(0)
    return cells


def _surplus_empty_index(values: list[str]) -> int | None:
    """Which empty cell to drop when a row has more cells than the header.

    nvidia-smi prints an extra empty cell before ``GPU NUMA ID`` (``0\\t\\tN/A`` under
    ``NUMA Affinity\\tGPU NUMA ID``): prefer an empty cell that has a value after it.
    """
    empties = [i for i, value in enumerate(values) if value == ""]
    if not empties:
        return None
    for index in reversed(empties):
        if any(value != "" for value in values[index + 1 :]):
            return index
    return empties[-1]


def _align_attributes(values: list[str], names: list[str]) -> dict[str, str | None]:
    values = list(values)
    while len(values) > len(names):
        index = _surplus_empty_index(values)
        if index is None:
            values = values[: len(names)]
            break
        del values[index]
    values += [""] * (len(names) - len(values))
    return {name: _cell_value(value) for name, value in zip(names, values)}


def parse_matrix(lines: Iterable[str]) -> dict[str, Any] | None:
    """The generic shape of ``nvidia-smi topo -m`` and ``topo -p2p X`` output.

    Returns ``{"columns": [labels], "attributes": [names], "rows": {label: {"cells":
    {column: code}, "attributes": {name: value|None}}}, "nic_legend": {NIC: name}}``,
    or None when there is no matrix header. Device columns are the header's leading
    cells without spaces (``GPU0``, ``NIC3``, ``mlx5_1``); the rest (``CPU Affinity``,
    ``NUMA Affinity``, ``GPU NUMA ID``) are attributes. Legend lines are skipped.
    """
    columns: list[str] | None = None
    attributes: list[str] = []
    rows: dict[str, dict[str, Any]] = {}
    legend: dict[str, str] = {}
    for raw in lines:
        line = _ANSI_RE.sub("", raw).rstrip("\r\n")
        legend_match = _NIC_LEGEND_RE.match(line)
        if legend_match is not None:
            legend[legend_match.group(1)] = legend_match.group(2)
            continue
        cells = _split_cells(line)
        if not cells:
            continue
        if columns is None:
            if _GPU_LABEL_RE.match(cells[0]):
                columns, attributes = _split_header(cells)
            continue
        label = cells[0]
        if label not in columns or label in rows:
            continue
        values = cells[1:]
        matrix_cells = values[: len(columns)]
        rows[label] = {
            "cells": {
                column: cell
                for column, cell in zip(columns, matrix_cells)
                if column != label and cell != ""
            },
            "attributes": _align_attributes(values[len(columns) :], attributes),
        }
    if columns is None:
        return None
    return {"columns": columns, "attributes": attributes, "rows": rows, "nic_legend": legend}


def _split_header(cells: list[str]) -> tuple[list[str], list[str]]:
    columns: list[str] = []
    index = 0
    while index < len(cells) and cells[index] != "" and " " not in cells[index]:
        columns.append(cells[index])
        index += 1
    attributes = [cell for cell in cells[index:] if cell != ""]
    return columns, attributes


def parse_topology(lines: Iterable[str]) -> dict[str, Any] | None:
    """Parse ``nvidia-smi topo -m``.

    Returns ``{"gpus": ["GPU0", ...], "links": {gpu: {other_gpu: code}},
    "cpu_affinity": {gpu: str|None}, "numa_affinity": {gpu: str|None},
    "gpu_numa_id": {gpu: str|None}, "nics": [...], "nic_links": {nic: {gpu_or_nic: code}},
    "nic_legend": {"NIC0": "mlx5_0"}}``, or None on an NVML error or without a matrix.
    Codes are exactly as printed (``NV12``, ``SYS``...). Affinity values are None where
    the column is absent, the cell empty, or ``N/A``. ``nic_links`` comes from the NIC
    rows; a cell missing there (truncated output) is taken from the GPU row, the matrix
    being symmetric.
    """
    lines, _status = split_smi_output(lines)
    if nvml_failure(lines) is not None:
        return None
    matrix = parse_matrix(lines)
    if matrix is None:
        return None
    columns, rows = matrix["columns"], matrix["rows"]
    gpus = [label for label in columns if _GPU_LABEL_RE.match(label)]
    nics = [label for label in columns if not _GPU_LABEL_RE.match(label)]

    def attribute(gpu: str, name: str) -> str | None:
        return rows.get(gpu, {}).get("attributes", {}).get(name)

    links = {
        gpu: {
            other: code
            for other, code in rows.get(gpu, {}).get("cells", {}).items()
            if other in gpus and other != gpu
        }
        for gpu in gpus
    }
    nic_links: dict[str, dict[str, str]] = {}
    for nic in nics:
        cells = dict(rows.get(nic, {}).get("cells", {}))
        for gpu in gpus:
            code = rows.get(gpu, {}).get("cells", {}).get(nic)
            if gpu not in cells and code is not None:
                cells[gpu] = code
        nic_links[nic] = {label: cells[label] for label in columns if label in cells}
    return {
        "gpus": gpus,
        "links": links,
        "cpu_affinity": {gpu: attribute(gpu, "CPU Affinity") for gpu in gpus},
        "numa_affinity": {gpu: attribute(gpu, "NUMA Affinity") for gpu in gpus},
        "gpu_numa_id": {gpu: attribute(gpu, "GPU NUMA ID") for gpu in gpus},
        "nics": nics,
        "nic_links": nic_links,
        "nic_legend": matrix["nic_legend"],
    }


def parse_p2p(lines: Iterable[str]) -> dict[str, dict[str, str]] | None:
    """Parse ``nvidia-smi topo -p2p r|w|n|a|p``: ``{gpu: {other_gpu: "OK"|"NS"|...}}``."""
    lines, _status = split_smi_output(lines)
    if nvml_failure(lines) is not None:
        return None
    matrix = parse_matrix(lines)
    if matrix is None:
        return None
    gpus = [label for label in matrix["columns"] if _GPU_LABEL_RE.match(label)]
    return {
        gpu: {
            other: code
            for other, code in matrix["rows"].get(gpu, {}).get("cells", {}).items()
            if other in gpus
        }
        for gpu in gpus
    }


# Link verdicts over a parsed topology
#


def is_nvlink(code: str | None) -> bool:
    return code is not None and _NVLINK_CODE_RE.match(code) is not None


def _link_rank(code: str | None) -> int:
    """Higher is better: NV# by link count above every PCIe path; unknown lowest."""
    if code is None:
        return 0
    match = _NVLINK_CODE_RE.match(code)
    if match is not None:
        return 100 + int(match.group(1))
    return _PCIE_RANK.get(code, 0)


def _code(topology: dict[str, Any], a: str, b: str) -> str | None:
    links = topology.get("links") or {}
    code = (links.get(a) or {}).get(b)
    if code is None:
        code = (links.get(b) or {}).get(a)
    return code


def nvlink_joined(topology: dict[str, Any] | None, gpu_labels: list[str]) -> bool:
    """True when there are at least two GPUs and every pair of them shows ``NV#``."""
    if topology is None or len(gpu_labels) < 2:
        return False
    return all(is_nvlink(_code(topology, a, b)) for a, b in combinations(gpu_labels, 2))


def _gpu_index(label: str) -> int | None:
    match = re.match(r"^GPU(\d+)$", label)
    return int(match.group(1)) if match is not None else None


def _verdict(topology: dict[str, Any], labels: list[str], nvlink: bool) -> dict[str, Any]:
    codes = {}
    for a, b in combinations(labels, 2):
        code = _code(topology, a, b)
        if code is not None:
            codes[f"{a}-{b}"] = code
    return {
        "gpus": list(labels),
        "indices": [_gpu_index(label) for label in labels],
        "codes": codes,
        "nvlink": nvlink,
    }


def tp_link_verdict(topology: dict[str, Any] | None, n: int) -> dict[str, Any]:
    """Which ``n`` GPUs a tensor-parallel group of size ``n`` should use, and over what.

    Returns ``{"gpus": ["GPU0", "GPU1"], "indices": [0, 1], "codes": {"GPU0-GPU1":
    "NV12"}, "nvlink": True}`` for the first set (in GPU order) whose pairs are all
    ``NV#``. Without one, the set with the best worst link (then the best total;
    NV# > PIX > PXB > PHB > NODE > SYS), with ``"nvlink": False``. With fewer than
    ``n`` GPUs (or no topology): ``{"gpus": [], "indices": [], "codes": {}, "nvlink":
    False}``. With ``n`` < 2 no link is involved: the first ``n`` GPUs, no codes and
    ``"nvlink": False``.
    """
    gpus = list((topology or {}).get("gpus") or [])
    if topology is None or n < 1 or len(gpus) < n:
        return {"gpus": [], "indices": [], "codes": {}, "nvlink": False}
    if n < 2:
        return _verdict(topology, gpus[:n], False)
    best: tuple[tuple[int, int], tuple[str, ...]] | None = None
    for group in combinations(gpus, n):
        ranks = [_link_rank(_code(topology, a, b)) for a, b in combinations(group, 2)]
        if all(rank > 100 for rank in ranks):
            return _verdict(topology, list(group), True)
        score = (min(ranks), sum(ranks))
        if best is None or score > best[0]:
            best = (score, group)
    # best is set: len(gpus) >= n >= 2 gives at least one group.
    return _verdict(topology, list(best[1]) if best is not None else [], False)


# nvidia-smi nvlink --status
#

_NVLINK_GPU_RE = re.compile(r"^GPU (\d+):")
_NVLINK_LINK_RE = re.compile(r"^Link (\d+):\s*(.*)$")
_NVLINK_SPEED_RE = re.compile(r"^([\d.]+)\s*GB/s")


def parse_nvlink_status(lines: Iterable[str]) -> dict[int, list[dict[str, Any]]] | None:
    """Parse ``nvidia-smi nvlink --status``.

    Returns ``{gpu_index: [{"link": int, "active": bool, "speed_gbps": float|None}]}``;
    a GPU whose links are all inactive ("NVML: Unable to retrieve NVLink information as
    all links are inActive") maps to ``[]``, and no output at all (NVLink not exposed)
    to ``{}``. None on an NVML error, or when nvidia-smi exited non-zero and printed
    nothing this parser understands (an nvidia-smi without the subcommand).
    """
    lines, status = split_smi_output(lines)
    if nvml_failure(lines) is not None:
        return None
    result: dict[int, list[dict[str, Any]]] = {}
    current: int | None = None
    for line in lines:
        text = line.strip()
        gpu = _NVLINK_GPU_RE.match(text)
        if gpu is not None:
            current = int(gpu.group(1))
            result[current] = []
            continue
        link = _NVLINK_LINK_RE.match(text)
        if link is not None and current is not None:
            speed = _NVLINK_SPEED_RE.match(link.group(2).strip())
            result[current].append(
                {
                    "link": int(link.group(1)),
                    "active": speed is not None,
                    "speed_gbps": float(speed.group(1)) if speed is not None else None,
                }
            )
    if not result and status not in (None, 0) and any(line.strip() for line in lines):
        return None
    return result


# nvidia-smi --query-*=... --format=csv
#


def split_unit(header: str) -> tuple[str, str | None]:
    """``"memory.total [MiB]"`` -> ``("memory.total", "MiB")``; no unit -> None."""
    match = re.match(r"^(.*?)\s*\[([^\]]*)\]\s*$", header.strip())
    if match is None:
        return header.strip(), None
    return match.group(1), match.group(2)


def _csv_value(value: str, unit: str | None) -> str | None:
    value = value.strip()
    # nvidia-smi's "no value" spellings: N/A, [N/A], [Not Supported], [Unknown Error]...
    if value in _EMPTY_CELLS or (value.startswith("[") and value.endswith("]")):
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
    if not processes and status not in (None, 0) and _device_error(lines) is not None:
        return None
    return processes


# nvidia-smi (default table), nvidia-smi -L
#

_DRIVER_RE = re.compile(r"(?:Driver|KMD) Version\s*:\s*([0-9][\w.]*)")
_CUDA_RE = re.compile(r"CUDA (?:UMD )?Version\s*:\s*([0-9][\w.]*)")


def parse_driver_info(lines: Iterable[str]) -> dict[str, str | None] | None:
    """Driver and supported CUDA version from nvidia-smi's table header (or ``-q``).

    Reads ``Driver Version: X  CUDA Version: Y`` and R610's ``KMD Version: X  CUDA UMD
    Version: Y``. Returns ``{"driver_version": str, "cuda_version": str|None}`` or None.
    """
    lines, _status = split_smi_output(lines)
    if nvml_failure(lines) is not None:
        return None
    driver: str | None = None
    cuda: str | None = None
    for line in lines:
        if driver is None:
            match = _DRIVER_RE.search(line)
            driver = match.group(1) if match is not None else None
        if cuda is None:
            match = _CUDA_RE.search(line)
            cuda = match.group(1) if match is not None else None
        if driver is not None and cuda is not None:
            break
    if driver is None:
        return None
    return {"driver_version": driver, "cuda_version": cuda}


_NVML_LIBRARY_RE = re.compile(r"^NVML library version:\s*(\S+)")


def parse_nvml_error(lines: Iterable[str]) -> dict[str, str | None] | None:
    """Why ``nvidia-smi -L`` fails: ``{"error": str, "nvml_library_version": str|None}``.

    None when it works. Without the exit marker (raw recorded output) only the known
    error lines count; with it, any non-zero exit is an error (its first line).
    """
    lines, status = split_smi_output(lines)
    error = nvml_failure(lines) or _device_error(lines)
    if error is None and status not in (None, 0):
        first = next((line.strip() for line in lines if line.strip()), None)
        error = first if first is not None else f"nvidia-smi -L exited {status}"
    if error is None:
        return None
    library = None
    for line in lines:
        match = _NVML_LIBRARY_RE.match(line.strip())
        if match is not None:
            library = match.group(1)
            break
    return {"error": error, "nvml_library_version": library}


# /proc/driver/nvidia/version
#

_MODULE_VERSION_RE = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)")


def parse_kernel_module(lines: Iterable[str]) -> dict[str, Any] | None:
    """``NVRM version: NVIDIA UNIX [Open ]Kernel Module ... 565.57.01 ...`` ->
    ``{"version": "565.57.01", "open": True}``; None without an NVRM line."""
    for line in lines:
        if not line.startswith("NVRM version:"):
            continue
        match = _MODULE_VERSION_RE.search(line)
        if match is None:
            return None
        return {"version": match.group(1), "open": "Open Kernel Module" in line}
    return None


# dpkg packages
#

_UPSTREAM_VERSION_RE = re.compile(r"^(?:\d+:)?(\d+(?:\.\d+)+)")
# Which package says which userspace driver is installed, most telling first: Ubuntu's
# nvidia-utils-<branch>[-server], libnvidia-compute-<branch>[-server], then Debian's names.
_USERSPACE_PACKAGES = (
    re.compile(r"^nvidia-utils-\d+(-server)?$"),
    re.compile(r"^libnvidia-compute-\d+(-server)?$"),
    re.compile(r"^nvidia-smi$"),
    re.compile(r"^libnvidia-ml1$"),
    re.compile(r"^nvidia-driver-\d+(-server)?$"),
    re.compile(r"^nvidia-headless-no-dkms-\d+(-server)?$"),
)


def parse_dpkg_packages(lines: Iterable[str]) -> dict[str, str]:
    """``package<TAB>version<TAB>status`` lines -> ``{package: version}`` for installed
    (``ii``) and held (``hi``) packages."""
    packages: dict[str, str] = {}
    for line in lines:
        parts = line.rstrip("\r\n").split("\t")
        if len(parts) < 3:
            continue
        name, version, status = parts[0].strip(), parts[1].strip(), parts[2].strip()
        if status[:2] in ("ii", "hi") and name != "" and version != "":
            packages[name] = version
    return packages


def parse_held_dpkg(lines: Iterable[str]) -> list[str]:
    """Held packages (status ``h?``) from the same dpkg-query lines."""
    held = []
    for line in lines:
        parts = line.rstrip("\r\n").split("\t")
        if len(parts) >= 3 and parts[2].strip().startswith("h"):
            held.append(parts[0].strip())
    return held


def upstream_version(version: str | None) -> str | None:
    """``535.129.03-0ubuntu0.22.04.1`` -> ``535.129.03`` (epoch and revision dropped)."""
    if version is None:
        return None
    match = _UPSTREAM_VERSION_RE.match(version.strip())
    return match.group(1) if match is not None else None


def userspace_driver(packages: dict[str, str] | None) -> tuple[str, str] | None:
    """``(package, upstream_version)`` of the installed userspace driver, or None."""
    if not packages:
        return None
    for pattern in _USERSPACE_PACKAGES:
        for name in sorted(packages):
            if pattern.match(name) is None:
                continue
            version = upstream_version(packages[name])
            if version is not None:
                return name, version
    return None


def userspace_driver_version(packages: dict[str, str] | None) -> str | None:
    """The upstream driver version of the installed userspace (nvidia-utils...), or None."""
    found = userspace_driver(packages)
    return found[1] if found is not None else None


def version_tuple(version: str | None) -> tuple[int, ...]:
    """``"535.129.03"`` -> ``(535, 129, 3)``; stops at the first non-numeric part
    (``"0.6.3.post1"`` -> ``(0, 6, 3)``), so versions compare as numbers."""
    parts: list[int] = []
    for piece in (version or "").strip().split("."):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def _same_release(a: str, b: str) -> bool:
    """Equal over the parts both give: NVML prints ``580.178`` for ``580.178.xx``."""
    left, right = version_tuple(a), version_tuple(b)
    common = min(len(left), len(right))
    return common > 0 and left[:common] == right[:common]


def module_mismatch(
    kernel_module: dict[str, Any] | None,
    packages: dict[str, str] | None,
    nvml_error: dict[str, Any] | None,
) -> str | None:
    """A sentence when the loaded kernel module is not the installed userspace driver.

    This is the "Driver/library version mismatch" state an apt upgrade leaves until the
    next reboot. Compares the module with the userspace package, then with the NVML
    library version nvidia-smi printed; NVML's own mismatch message counts even when
    no version is known. None when consistent or unknown.
    """
    module = (kernel_module or {}).get("version")
    userspace = userspace_driver(packages)
    if module is not None and userspace is not None:
        name, version = userspace
        if version != module:
            return (
                f"loaded kernel module {module} but installed {name} is {version}: reboot required"
            )
        return None
    error = (nvml_error or {}).get("error") or ""
    library = (nvml_error or {}).get("nvml_library_version")
    if module is not None and library is not None and not _same_release(module, library):
        return f"loaded kernel module {module} but the NVML library is {library}: reboot required"
    if "version mismatch" in error.lower():
        loaded = f" (loaded kernel module {module})" if module is not None else ""
        return f"nvidia-smi reports {error}{loaded}: reboot required"
    return None


# Facts
#



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

class GpuTopology(NvidiaSmiFact[dict[str, Any] | None]):
    """
    Returns the GPU interconnect matrix from ``nvidia-smi topo -m``, or None without
    nvidia-smi or on an NVML error. See ``parse_topology`` for the shape:

    .. code:: python

        {
            "gpus": ["GPU0", "GPU1"],
            "links": {"GPU0": {"GPU1": "NV12"}, "GPU1": {"GPU0": "NV12"}},
            "cpu_affinity": {"GPU0": "0-51,104-155", "GPU1": "0-51,104-155"},
            "numa_affinity": {"GPU0": "0", "GPU1": "0"},
            "gpu_numa_id": {"GPU0": None, "GPU1": None},
            "nics": [], "nic_links": {}, "nic_legend": {},
        }
    """

    arguments = "topo -m"

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        return parse_topology(output)


class P2pRead(NvidiaSmiFact[dict[str, dict[str, str]] | None]):
    """
    Returns peer-to-peer read support between GPUs from ``nvidia-smi topo -p2p r``:
    ``{"GPU0": {"GPU1": "OK"}}`` (``OK``, ``NS``, ``CNS``, ``GNS``, ``TNS``, ``U``), or None.
    """

    arguments = "topo -p2p r"

    @override
    def process(self, output: list[str]) -> dict[str, dict[str, str]] | None:
        return parse_p2p(output)


class NvlinkStatus(NvidiaSmiFact[dict[int, list[dict[str, Any]]] | None]):
    """
    Returns each GPU's NVLink links from ``nvidia-smi nvlink --status``:

    .. code:: python

        {0: [{"link": 0, "active": True, "speed_gbps": 25.0}, ...], 1: []}

    ``[]`` for a GPU whose links are all inactive, ``{}`` when NVLink is not exposed
    (no output), None without nvidia-smi or on an NVML error.
    """

    arguments = "nvlink --status"

    @override
    def process(self, output: list[str]) -> dict[int, list[dict[str, Any]]] | None:
        return parse_nvlink_status(output)


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


class DriverInfo(NvidiaSmiFact[dict[str, str | None] | None]):
    """
    Returns the driver version and the CUDA version it supports, from the header of
    nvidia-smi's default table: ``{"driver_version": "535.129.03", "cuda_version":
    "12.2"}``, or None without nvidia-smi or on an NVML error.
    """

    # The default table: its header is the one place both versions are printed.
    arguments = ""

    @override
    def process(self, output: list[str]) -> dict[str, str | None] | None:
        return parse_driver_info(output)


class NvmlError(NvidiaSmiFact[dict[str, str | None] | None]):
    """
    Returns why ``nvidia-smi -L`` fails, or None when it works or is absent:

    .. code:: python

        {"error": "Failed to initialize NVML: Driver/library version mismatch",
         "nvml_library_version": "580.178"}
    """

    arguments = "-L"

    @override
    def process(self, output: list[str]) -> dict[str, str | None] | None:
        return parse_nvml_error(output)


KERNEL_MODULE_VERSION_FILE = "/proc/driver/nvidia/version"


class KernelModule(FactBase[dict[str, Any] | None]):
    """
    Returns the loaded NVIDIA kernel module from ``/proc/driver/nvidia/version``:
    ``{"version": "565.57.01", "open": True}``, or None when no module is loaded.
    """

    @override
    def command(self) -> str:
        path = KERNEL_MODULE_VERSION_FILE
        return f"! test -e {path} || cat {path}"

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        return parse_kernel_module(output)


DRIVER_PACKAGE_PATTERNS = ("nvidia-*", "libnvidia-*", "cuda-*")


class DriverPackageQuery(FactBase[T]):
    """
    Base of the facts read from one ``dpkg-query`` over the NVIDIA driver and CUDA
    packages (``DRIVER_PACKAGE_PATTERNS``); absent (the fact's default) without dpkg.
    """

    @override
    def requires_command(self) -> str:
        return "dpkg-query"

    @override
    def command(self) -> str:
        patterns = " ".join(f"'{pattern}'" for pattern in DRIVER_PACKAGE_PATTERNS)
        # dpkg-query exits 1 when a pattern matches nothing (a host without CUDA
        # packages), 2 on real errors: only the first is normal.
        return (
            "dpkg-query -W -f '${Package}\\t${Version}\\t${db:Status-Abbrev}\\n' "
            f"{patterns} 2>/dev/null || test $? -eq 1"
        )


class DriverPackages(DriverPackageQuery[dict[str, str]]):
    """
    Returns the installed NVIDIA driver and CUDA packages (status ``ii`` or ``hi``),
    ``{}`` when there are none or dpkg is absent:

    .. code:: python

        {"nvidia-utils-535-server": "535.129.03-0ubuntu0.22.04.1"}
    """

    @override
    @staticmethod
    def default() -> dict[str, str]:
        return {}

    @override
    def process(self, output: list[str]) -> dict[str, str]:
        return parse_dpkg_packages(output)


class HeldPackages(DriverPackageQuery[list[str]]):
    """
    Returns the NVIDIA driver and CUDA packages on hold (dpkg selection ``hold``, what
    ``apt-mark hold`` sets), ``[]`` when none or dpkg is absent.
    """

    @override
    @staticmethod
    def default() -> list[str]:
        return []

    @override
    def process(self, output: list[str]) -> list[str]:
        return parse_held_dpkg(output)
