"""``nvidia-smi nvlink -e`` and ``-s`` as GPU health sources: each link's error
counters, and whether a GPU's NVLink applies at all.

``nvidia-smi nvlink -e`` (``--errorcounters``) prints, per GPU, one line per link and
counter, as on an 8x H100 node quoted in stas00/ml-engineering's NVIDIA debugging
notes::

    GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-abcdefab-cdef-abdc-abcd-abababababab)
             Link 0: Replay Errors: 0
             Link 0: Recovery Errors: 0
             Link 0: CRC Errors: 0

Other drivers name the CRC counters ``Data CRC Errors`` / ``Flit CRC Errors``, and
Blackwell-era drivers print other counters in the same ``Link N: <name>: <value>``
form; every such counter is kept (snake_case name), non-numeric values as None.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from facts.gpu_health_input import bounded_lines
from facts.gpu_health_record import cell_value
from facts.nvidia_smi import nvml_failure, split_smi_output
from facts.topology import NVLINK_GPU_RE, parse_nvlink_status

_NVLINK_COUNTER_RE = re.compile(r"^Link (\d+): ([^:]+):\s*(\S.*)$")

_NVLINK_LINK_RE = re.compile(r"^Link \d+: ")

_NOT_SNAKE_RE = re.compile(r"[^a-z0-9]+")

_NVLINK_KEYS = {
    "replay errors": "replay",
    "recovery errors": "recovery",
    "crc errors": "crc_flit",
    "flit crc errors": "crc_flit",
    "data crc errors": "crc_data",
}


def parse_nvlink_errors(lines: Iterable[str]) -> dict[int, dict[int, dict[str, int | None]]] | None:
    """Parse ``nvidia-smi nvlink -e``: ``{gpu_index: {link: {"replay": 0, "recovery": 0,
    "crc_flit": 0, ...}}}``. The one-number ``CRC Errors`` line of older drivers is the
    flow-control (flit) CRC counter; other counters keep a snake_case name. ``{}`` for
    no output (NVLink not exposed), None on an NVML error. Raises UnreadableOutput for a
    line over the bound."""
    kept, _status = split_smi_output(bounded_lines(lines, "nvidia-smi nvlink -e"))
    if nvml_failure(kept) is not None:
        return None
    result: dict[int, dict[int, dict[str, int | None]]] = {}
    current: int | None = None
    for line in kept:
        text = line.strip()
        gpu = NVLINK_GPU_RE.match(text)
        if gpu is not None:
            current = int(gpu.group(1))
            result[current] = {}
            continue
        counter = _NVLINK_COUNTER_RE.match(text)
        if counter is None or current is None:
            continue
        label = counter.group(2).strip().lower()
        key = _NVLINK_KEYS.get(label) or _NOT_SNAKE_RE.sub("_", label).strip("_")
        value = cell_value(counter.group(3))
        number = int(value) if value is not None and value.isascii() and value.isdigit() else None
        result[current].setdefault(int(counter.group(1)), {})[key] = number
    return result


_NVLINK_NOT_APPLICABLE = ("does not have or support nvlink", "nvlink is not supported")

_NVLINK_UNKNOWN = ("not supported for devices in mig mode",)


def nvlink_applicability(lines: Iterable[str]) -> dict[int, dict[str, Any]] | None:
    """``nvidia-smi nvlink -s`` per GPU: ``{index: {"status": ..., "links": [...]}}``
    with status ``"links"`` (links listed, ``links`` as facts.topology.parse_nvlink_status
    gives them), ``"all_inactive"`` ("all links are inActive": a fault on an NVLink
    part, normal on a PCIe card without a bridge), ``"not_applicable"`` ("Device does
    not have or support Nvlink") or ``"unknown"`` (MIG mode: not queryable). Neither
    of the last two is a link failure. None on an NVML error. Raises UnreadableOutput
    for a line over the bound."""
    kept, _status = split_smi_output(bounded_lines(lines, "nvidia-smi nvlink -s"))
    parsed = parse_nvlink_status(kept)
    if parsed is None:
        return None
    result: dict[int, dict[str, Any]] = {}
    current: int | None = None
    for line in kept:
        text = line.strip()
        gpu = NVLINK_GPU_RE.match(text)
        if gpu is not None:
            current = int(gpu.group(1))
            links = parsed.get(current, [])
            result[current] = {"status": "links" if links else "unknown", "links": links}
            continue
        if current is None or result[current]["links"]:
            continue
        lowered = text.lower()
        if "all links are inactive" in lowered:
            result[current]["status"] = "all_inactive"
        elif any(phrase in lowered for phrase in _NVLINK_NOT_APPLICABLE):
            result[current]["status"] = "not_applicable"
        elif any(phrase in lowered for phrase in _NVLINK_UNKNOWN):
            result[current]["status"] = "unknown"
    return result


def _nvlink_message(line: str) -> bool:
    lowered = line.lower()
    return "all links are inactive" in lowered or any(
        phrase in lowered for phrase in _NVLINK_NOT_APPLICABLE + _NVLINK_UNKNOWN
    )


def nvlink_kind(lines: list[str]) -> str | None:
    """``"nvlink_errors"`` (``nvidia-smi nvlink -e``) or ``"nvlink_status"`` (``-s``)
    for such an output among ``lines`` (not blank), None for any other."""
    if NVLINK_GPU_RE.match(lines[0].strip()):
        if any(_NVLINK_COUNTER_RE.match(line.strip()) for line in lines):
            return "nvlink_errors"
        if any(_NVLINK_LINK_RE.match(line.strip()) or _nvlink_message(line)
               for line in lines):
            return "nvlink_status"
        # nvidia-smi -L prints the same GPU lines and nothing else: not health.
    return None
