"""Facts about how the GPUs are joined: ``nvidia-smi topo -m``, ``topo -p2p r`` and
``nvlink --status``, and their parsers (the tensor-parallel link verdict built on them is
pyinfra_vllm/plans/topology.py).

Absent (None) without nvidia-smi or when NVML fails (facts/nvidia_smi.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from typing_extensions import override

from facts.nvidia_smi import EMPTY_CELLS, NvidiaSmiFact, nvml_failure, split_smi_output

_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


_GPU_LABEL_RE = re.compile(r"^GPU\d+$")


_NIC_LEGEND_RE = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")


def _cell_value(cell: str | None) -> str | None:
    if cell is None:
        return None
    cell = cell.strip()
    return None if cell in EMPTY_CELLS else cell


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
    return {name: _cell_value(value) for name, value in zip(names, values, strict=True)}


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
                # A truncated row has fewer cells than columns: what is there is kept.
                for column, cell in zip(columns, matrix_cells, strict=False)
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


# A GPU's header line in the output of `nvidia-smi nvlink` (-s, -e): "GPU 0: NVIDIA ...".
NVLINK_GPU_RE = re.compile(r"^GPU (\d+):")


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
        gpu = NVLINK_GPU_RE.match(text)
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
