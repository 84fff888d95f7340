"""GPU health as nvidia-smi, the kernel log and dcgmi report it: the facts that read a
host, and which saved output a text is (``detect_kind``, for tools/gpu_health.py).

Every parser returns the one per-GPU record of facts/gpu_health_record.py, which says
why one shape and how a GPU that cannot be read is kept (fail closed). The parsers, a
module per output: facts/gpu_health_smi.py (``nvidia-smi -q`` text and XML),
facts/gpu_health_csv.py (the ``--query-*`` CSVs), facts/gpu_health_nvlink.py
(``nvidia-smi nvlink -e`` and ``-s``) and facts/gpu_health_logs.py (the kernel log and
``dcgmi diag``); each bounds its lines first (facts/gpu_health_input.py).
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from facts.base import FactBase
from facts.gpu_health_csv import csv_kind
from facts.gpu_health_input import MAX_LINE_CHARS
from facts.gpu_health_logs import DIAG_ROW_RE, diag_heading, is_kernel_log_line, read_kernel_log
from facts.gpu_health_nvlink import nvlink_kind, parse_nvlink_errors
from facts.gpu_health_record import DEVICE_HANDLE_RE
from facts.gpu_health_smi import is_query_text, parse_query_text
from facts.nvidia_smi import NvidiaSmiFact, nvml_failure, split_smi_output


def _detect_smi(lines: list[str]) -> str | None:
    """The kind of an nvidia-smi or dcgmi output among ``lines`` (no device-handle
    errors among them), None for none."""
    if lines[0].lstrip().startswith("<") and any("nvidia_smi_log" in line for line in lines):
        return "query_xml"
    if nvml_failure(lines[:2]) is not None:
        return "nvml_error"
    if is_query_text(lines):
        return "query_text"
    if any(diag_heading(line) or DIAG_ROW_RE.match(line) for line in lines):
        return "dcgmi_diag"
    return nvlink_kind(lines)


def detect_kind(text: str) -> str | None:
    """Which saved output ``text`` is: ``"query_text"``, ``"query_xml"``,
    ``"health_csv"``, ``"remapped_rows_csv"``, ``"retired_pages_csv"``,
    ``"nvlink_errors"``, ``"nvlink_status"``, ``"kernel_log"``, ``"dcgmi_diag"``,
    ``"nvml_error"`` (nvidia-smi saying NVML cannot work), ``"device_error"`` (only
    nvidia-smi's device-handle errors, unreadable_gpus reads them), or None (empty or
    not recognised). Only the first MAX_LINE_CHARS characters of a line are looked at:
    the parser of the kind found refuses a longer line."""
    lines, _status = split_smi_output(line[:MAX_LINE_CHARS] for line in text.splitlines())
    lines = [line for line in lines if line.strip()]
    others = [line for line in lines if DEVICE_HANDLE_RE.match(line.strip()) is None]
    if not lines:
        return None
    kind = _detect_smi(others) if others else None
    if kind is None and any(is_kernel_log_line(line) for line in others):
        kind = "kernel_log"
    if kind is None and others and "," in others[0]:
        kind = csv_kind(others)
    if kind is None and len(others) < len(lines):
        kind = "device_error"
    return kind


class GpuHealth(NvidiaSmiFact[dict[str, dict[str, Any]] | None]):
    """
    Returns every GPU's health record from the whole ``nvidia-smi -q`` (ECC, remapped
    rows, retired pages, clocks event reasons, PCIe link and replays, temperature,
    power), keyed by PCI bus id; None without nvidia-smi or on an NVML error. See
    facts/gpu_health_record.py for the record:

    .. code:: python

        {"00000000:00:06.0": {"bus_id": "00000000:00:06.0", "index": 0,
                              "name": "NVIDIA H200", "ecc_mode": "Enabled", ...}}
    """

    arguments = "-q"

    @override
    def process(self, output: list[str]) -> dict[str, dict[str, Any]] | None:
        return parse_query_text(output)


class NvlinkErrors(NvidiaSmiFact[dict[int, dict[int, dict[str, int | None]]] | None]):
    """
    Returns each GPU's NVLink error counters from ``nvidia-smi nvlink -e``:

    .. code:: python

        {0: {0: {"replay": 0, "recovery": 0, "crc_flit": 0}, 1: {...}}}

    ``{}`` when NVLink is not exposed (nothing printed), None without nvidia-smi or on
    an NVML error.
    """

    arguments = "nvlink -e"

    @override
    def process(self, output: list[str]) -> dict[int, dict[int, dict[str, int | None]]] | None:
        return parse_nvlink_errors(output)


SOURCE_MARKER = "##SOURCE "

# The journal when it has this boot's kernel messages, else dmesg; grep's "no match"
# (exit 1) is not a failure; a host with neither prints nothing (the fact is None).
_XID_COMMAND = (
    "if command -v journalctl >/dev/null 2>&1"
    ' && [ -n "$(journalctl -k -b -q --no-pager -n 1 2>/dev/null)" ]; then'
    f" echo '{SOURCE_MARKER}journal';"
    " journalctl -k -b -q --no-pager -o short-iso 2>/dev/null | grep -F 'NVRM:' || true;"
    # A dmesg that may not read the log (dmesg_restrict without root) prints nothing:
    # unknown, not "no Xid".
    " elif command -v dmesg >/dev/null 2>&1"
    " && log=$(dmesg --time-format iso 2>/dev/null || dmesg 2>/dev/null); then"
    f" echo '{SOURCE_MARKER}dmesg';"
    " printf '%s\\n' \"$log\" | grep -F 'NVRM:' || true;"
    " fi"
)


class XidEvents(FactBase[dict[str, Any] | None]):
    """
    Returns the NVRM Xid events of the kernel log since boot, and the notices that
    name a failing GPU without an Xid (facts/gpu_health_logs.py; root: run it with sudo):

    .. code:: python

        {"source": "journal",
         "events": [{"time": "2024-11-15T12:02:03,470068+00:00", "pci": "0000:19:00",
                     "code": 48, "pid": None, "process": None, "text": "An uncorrectable..."}],
         "notices": [{"time": "...", "pci": "0000:91:00", "notice": "fallen_off_bus",
                      "text": "GPU has fallen off the bus."}]}

    ``events`` is ``[]`` on a clean log; ``notices`` is there only when there is one.
    None where neither journalctl nor dmesg exists or dmesg may not read the log
    (unknown, never "no Xid"). A log line it cannot read (over the bound, an Xid line
    without a PCI address or code) fails the host (facts/base.py).
    """

    @override
    def command(self) -> str:
        return _XID_COMMAND

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        if not output:
            return None
        source: str | None = None
        lines: list[str] = []
        for line in output:
            if line.startswith(SOURCE_MARKER):
                source = line[len(SOURCE_MARKER):].strip()
            else:
                lines.append(line)
        if source is None:
            return None
        log = read_kernel_log(lines)
        result: dict[str, Any] = {"source": source, "events": log["events"]}
        if log["notices"]:
            result["notices"] = log["notices"]
        return result
