"""GPU health as nvidia-smi, the kernel log and dcgmi report it: the parsers, one
per-GPU record shape for all of them, and the facts that read a host.

Why one shape: the same question ("does this GPU need a reset, a reboot or an RMA?")
is answered by ``nvidia-smi -q`` text, its XML (``-q -x``) and ``--query-gpu`` CSV,
each in several driver-dependent layouts. Every parser here returns, per GPU::

    {"bus_id": "00000000:17:00.0", "index": 0, "name": "NVIDIA H200",
     "ecc_mode": "Enabled",
     "ecc": {"volatile": {"correctable": 0, "uncorrectable": 0},
             "aggregate": {"correctable": 0, "uncorrectable": 0}, "pending": False},
     "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False,
                       "failure": False},
     "retired_pages": {"single_bit": None, "double_bit": None, "pending": None},
     "clocks_event_reasons": {"active": ["idle"], "counters_us": {"sw_power_cap": 0}},
     "pcie": {"gen_current": 5, "gen_max": 5, "width_current": 16, "width_max": 16,
              "replays": 0},
     "temperature_c": 37, "memory_temperature_c": 39, "power_draw_w": 78.56,
     "power_limit_w": 700.0, "pstate": "P0", "utilization_gpu": 0}

Every leaf is None where the source does not say (absent, ``N/A``, not supported),
never 0 by default: "no page retirement on this GPU" is not "0 retired pages".

Layouts handled, from the real outputs the tests carry: ``Clocks Throttle Reasons``
(older drivers) and ``Clocks Event Reasons`` (535 and later); the ECC counters as
``Single Bit``/``Double Bit`` tables with a ``Total`` row (Kepler to Volta) or as
``SRAM``/``DRAM`` lines (Ampere and later; 535+ splits ``SRAM Uncorrectable`` into
``Parity`` and ``SEC-DED``; 580 adds ``Channel Repair Pending``, ``TPC Repair Pending``
and ``Unrepairable Memory``); ``Power Readings`` and ``GPU Power Readings``; -q
excerpts without their GPU header; ``[...]`` elision lines. The clocks event reason
bits are NVML's ``nvmlClocksEventReasons`` (nvml.h,
https://docs.nvidia.com/deploy/nvml-api/group__nvmlClocksEventReasons.html); the
query fields are those of ``nvidia-smi --help-query-gpu``
(https://docs.nvidia.com/deploy/nvidia-smi/index.html).

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

The kernel log and dcgmi diag parsers are in facts/gpu_health_logs.py.

Fail closed. A GPU the output names but that cannot be read keeps its record, every
leaf None, with ``"unreadable": {"code", "detail"}`` (the key is absent on a record read
whole): ``gpu_unreadable`` (nvidia-smi's "Unable to determine the device handle for GPU
<bus id>: <error>"), ``gpu_lost`` (the same, saying "GPU is lost"), ``gpu_no_data`` (a
GPU block, or ``<gpu>`` element, with nothing in it). GPUs that ``Attached GPUs`` /
``<attached_gpus>`` counts but the output does not list are one record under the key
``"missing"`` (MISSING_KEY), code ``gpu_missing``, with ``attached`` and ``listed``. An
output that cannot be read at all (a line over the bound of facts/gpu_health_input.py,
XML that is not well-formed or that declares a DTD of its own or an entity) raises
UnreadableOutput: a fact raising it fails its host with pyinfra's "could not process
fact" and the reason (facts/base.py), never a host read as healthy.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterable
from typing import Any

from typing_extensions import override

from facts.base import FactBase
from facts.gpu_health_input import MAX_LINE_CHARS, UnreadableOutput, bounded_lines
from facts.gpu_health_logs import DIAG_ROW_RE, diag_heading, is_kernel_log_line, read_kernel_log
from facts.gpus import parse_query_csv
from facts.nvidia_smi import EMPTY_CELLS, NvidiaSmiFact, nvml_failure, split_smi_output
from facts.topology import NVLINK_GPU_RE, parse_nvlink_status

# NVML's clocks event reason bits (nvmlClocksEventReason*), lowest first.
REASON_BITS: dict[str, int] = {
    "idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clocks_setting": 0x100,
}
REASON_NAMES = list(REASON_BITS)

# The ``nvidia-smi -q`` labels of the reasons and of their 580 counters.
_TEXT_REASONS = {
    "idle": "idle",
    "applications clocks setting": "applications_clocks_setting",
    "sw power cap": "sw_power_cap",
    "hw slowdown": "hw_slowdown",
    "hw thermal slowdown": "hw_thermal_slowdown",
    "hw power brake slowdown": "hw_power_brake_slowdown",
    "sync boost": "sync_boost",
    "sw thermal slowdown": "sw_thermal_slowdown",
    "display clock setting": "display_clocks_setting",
}
_TEXT_COUNTERS = {
    "sw power capping": "sw_power_cap",
    "sync boost": "sync_boost",
    "sw thermal slowdown": "sw_thermal_slowdown",
    "hw thermal slowdown": "hw_thermal_slowdown",
    "hw power braking": "hw_power_brake_slowdown",
}
# XML element suffixes, and query-field suffixes, that differ from REASON_NAMES.
_REASON_ALIASES = {
    "gpu_idle": "idle",
    "sw_therm_slowdown": "sw_thermal_slowdown",
    "hw_therm_slowdown": "hw_thermal_slowdown",
    "hw_power_brake": "hw_power_brake_slowdown",
}

# 580's ECC lines that say a repair waits for a reset (or cannot be done).
_REPAIR_KEYS = ("channel repair pending", "tpc repair pending", "unrepairable memory")

_BUS_ID_RE = re.compile(r"^([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})(?:\.([0-7]))?$")
_GPU_HEADER_RE = re.compile(r"^GPU\s+([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$")
# nvidia-smi, for a GPU whose NVML handle it cannot get (one fallen off the bus), in
# place of its block or row: "Unable to determine the device handle for GPU
# 0000:0B:00.0: Unknown Error" (also "for gpu", "GPU0000:...", "GPU is lost. Reboot the
# system to recover this GPU"; NVIDIA/open-gpu-kernel-modules#387, NVIDIA/nvidia-docker#1553).
_DEVICE_HANDLE_RE = re.compile(
    r"^Unable to (?:determine|detect) the device handle for (?:GPU|gpu) ?"
    r"([0-9A-Fa-f]{3,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?): (.*)$"
)
_ATTACHED_RE = re.compile(r"^Attached GPUs +: (\d+)$")
_NVSMI_BANNER_RE = re.compile(r"^=+NVSMI LOG=+$")
_INT_RE = re.compile(r"^(-?\d+)(?: *[A-Za-z%()]+)? *$")
_LEADING_INT_RE = re.compile(r"^(-?\d+)\b")
_FLOAT_RE = re.compile(r"^(-?\d+(?:\.\d+)?)")
# The key of the record standing for the GPUs an output counts but does not list.
MISSING_KEY = "missing"


def normalize_bus_id(value: str | None) -> str | None:
    """``0000:91:00.0`` / ``00000000:91:00.0`` -> ``00000000:91:00.0`` (nvidia-smi's form:
    8-digit domain, upper-case hex); None for anything that is not a PCI address."""
    if value is None:
        return None
    match = _BUS_ID_RE.match(value.strip())
    if match is None:
        return None
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):08X}:{bus.upper()}:{device.upper()}.{function or '0'}"


def same_gpu(bus_id: str, pci: str) -> bool:
    """Whether an nvidia-smi bus id (``00000000:91:00.0``) and a kernel log address
    (``0000:91:00``, no function) name the same GPU; case and domain width ignored."""

    def parts(value: str) -> tuple[int, int, int] | None:
        match = _BUS_ID_RE.match(value.strip())
        if match is None:
            return None
        return int(match.group(1), 16), int(match.group(2), 16), int(match.group(3), 16)

    left, right = parts(bus_id), parts(pci)
    return left is not None and left == right


def empty_record() -> dict[str, Any]:
    """The per-GPU record with every leaf unknown."""
    return {
        "bus_id": None,
        "index": None,
        "name": None,
        "ecc_mode": None,
        "ecc": {
            "volatile": {"correctable": None, "uncorrectable": None},
            "aggregate": {"correctable": None, "uncorrectable": None},
            "pending": None,
        },
        "remapped_rows": {"correctable": None, "uncorrectable": None, "pending": None,
                          "failure": None},
        "retired_pages": {"single_bit": None, "double_bit": None, "pending": None},
        "clocks_event_reasons": {"active": None, "counters_us": None},
        "pcie": {"gen_current": None, "gen_max": None, "width_current": None,
                 "width_max": None, "replays": None},
        "temperature_c": None,
        "memory_temperature_c": None,
        "power_draw_w": None,
        "power_limit_w": None,
        "pstate": None,
        "utilization_gpu": None,
    }


def merge_records(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with every None leaf filled from ``extra`` (known values are kept)."""
    merged = dict(base)
    for key, value in extra.items():
        mine = merged.get(key)
        if isinstance(mine, dict) and isinstance(value, dict):
            merged[key] = merge_records(mine, value)
        elif mine is None:
            merged[key] = value
    return merged


# --- cell values --------------------------------------------------------------------


def _value(text: str | None) -> str | None:
    """A cell with nvidia-smi's "no value" spellings (N/A, [N/A], [Not Supported],
    Not Found, Unknown Error, Requested functionality has been deprecated) as None."""
    if text is None:
        return None
    text = text.strip()
    if text in EMPTY_CELLS or (text.startswith("[") and text.endswith("]")):
        return None
    if text in ("Not Found", "Not Supported", "Unknown Error", "Unknown") or text.startswith(
        "Requested functionality"
    ):
        return None
    return text


def _int(text: str | None) -> int | None:
    value = _value(text)
    if value is None:
        return None
    match = _INT_RE.match(value) or _LEADING_INT_RE.match(value)
    return int(match.group(1)) if match is not None else None


def _float(text: str | None) -> float | None:
    value = _value(text)
    if value is None:
        return None
    match = _FLOAT_RE.match(value)
    return float(match.group(1)) if match is not None else None


def _yes_no(text: str | None) -> bool | None:
    value = _value(text)
    if value is None:
        return None
    lowered = value.lower()
    if lowered in ("yes", "true", "1"):
        return True
    if lowered in ("no", "false", "0"):
        return False
    return None


def _active(text: str | None) -> bool | None:
    value = _value(text)
    if value == "Active":
        return True
    if value == "Not Active":
        return False
    return None


def _enabled(text: str | None) -> str | None:
    value = _value(text)
    return value if value in ("Enabled", "Disabled") else None


def _sum(values: Iterable[int | None]) -> int | None:
    known = [value for value in values if value is not None]
    return sum(known) if known else None


def _any_true(values: Iterable[bool | None]) -> bool | None:
    known = [value for value in values if value is not None]
    return any(known) if known else None


def reasons_from_mask(mask: str | int | None) -> list[str] | None:
    """NVML's hex reason mask (``0x0000000000000004``) -> ``["sw_power_cap"]``."""
    if mask is None:
        return None
    if isinstance(mask, str):
        value = _value(mask)
        if value is None:
            return None
        try:
            mask = int(value, 16)
        except ValueError:
            return None
    return [name for name, bit in REASON_BITS.items() if mask & bit]


def _gen_max(device_max: int | None, host_max: int | None, link_max: int | None) -> int | None:
    """The highest PCIe generation the link can train to: the GPU's own maximum, capped
    by the host's where the driver prints it; the link's "Max" where neither is given."""
    if device_max is not None:
        return min(device_max, host_max) if host_max is not None else device_max
    return link_max


# --- nvidia-smi -q text -------------------------------------------------------------


def _key_value(line: str, indent: int) -> tuple[str, str] | None:
    """``(key, value)`` of a ``Key      : value`` line, the key ending at the first colon
    with a space before it (nvidia-smi pads every key so); None for a section's name.
    String search, not a pattern: linear in the line whatever it holds."""
    colon = line.find(":", indent + 1)
    while colon >= 0 and line[colon - 1] != " ":
        colon = line.find(":", colon + 1)
    if colon < 0:
        return None
    return line[indent:colon].strip().lower(), line[colon + 1:].strip()


# One entry of -q text: (bus id as printed or None, the block as nested dicts or None,
# nvidia-smi's device-handle error for the GPU or None).
_TextEntry = tuple[str | None, dict[str, Any] | None, str | None]


def _text_tree(lines: list[str]) -> list[_TextEntry]:
    """The GPU blocks of -q text as nested dicts with lower-case keys, and the GPUs
    nvidia-smi could not get a handle for, in output order; a block with no ``GPU <bus
    id>`` header (an excerpt) has None as its id."""
    entries: list[_TextEntry] = []
    stack: list[tuple[int, dict[str, Any]]] = []
    for raw in lines:
        line = raw.rstrip().replace("\t", "    ")
        if not line.strip() or line.strip() == "[...]":
            continue
        lost = _DEVICE_HANDLE_RE.match(line.strip())
        if lost is not None:
            entries.append((lost.group(1), None, lost.group(0)))
            stack = []
            continue
        header = _GPU_HEADER_RE.match(line)
        indent = len(line) - len(line.lstrip(" "))
        if header is None and not stack and indent == 0:
            continue  # the log's own lines: Timestamp, Driver Version...
        if header is not None or not stack:
            block: dict[str, Any] = {}
            entries.append((header.group(1) if header else None, block, None))
            stack = [(-1, block)]
            if header is not None:
                continue
        while len(stack) > 1 and stack[-1][0] >= indent:
            stack.pop()
        pair = _key_value(line, indent)
        parent = stack[-1][1]
        if pair is not None:
            parent.setdefault(*pair)
        else:
            child: dict[str, Any] = {}
            parent.setdefault(line.strip().lower(), child)
            stack.append((indent, child))
    return entries


def _section(tree: dict[str, Any], *names: str) -> dict[str, Any]:
    for name in names:
        value = tree.get(name)
        if isinstance(value, dict):
            return value
    return {}


def _leaf(tree: dict[str, Any], *names: str) -> str | None:
    for name in names:
        value = tree.get(name)
        if isinstance(value, str):
            return value
    return None


def _text_ecc_counts(block: dict[str, Any]) -> dict[str, int | None]:
    """One of -q's Volatile/Aggregate blocks -> correctable/uncorrectable totals."""
    single, double = _section(block, "single bit"), _section(block, "double bit")
    if single or double:
        return {"correctable": _int(_leaf(single, "total")),
                "uncorrectable": _int(_leaf(double, "total"))}
    uncorrectable_sram = _int(_leaf(block, "sram uncorrectable"))
    if uncorrectable_sram is None:
        uncorrectable_sram = _sum(
            [_int(_leaf(block, "sram uncorrectable parity")),
             _int(_leaf(block, "sram uncorrectable sec-ded"))]
        )
    return {
        "correctable": _sum([_int(_leaf(block, "sram correctable")),
                             _int(_leaf(block, "dram correctable")),
                             _int(_leaf(block, "correctable"))]),
        "uncorrectable": _sum([uncorrectable_sram, _int(_leaf(block, "dram uncorrectable")),
                               _int(_leaf(block, "uncorrectable"))]),
    }


def _text_ecc(tree: dict[str, Any], record: dict[str, Any]) -> None:
    record["ecc_mode"] = _enabled(_leaf(_section(tree, "ecc mode"), "current"))
    errors = _section(tree, "ecc errors")
    if not errors:
        return
    record["ecc"] = {
        "volatile": _text_ecc_counts(_section(errors, "volatile")),
        "aggregate": _text_ecc_counts(_section(errors, "aggregate")),
        "pending": _any_true(_yes_no(_leaf(errors, key)) for key in _REPAIR_KEYS),
    }


def _text_memory(tree: dict[str, Any], record: dict[str, Any]) -> None:
    rows = _section(tree, "remapped rows")
    record["remapped_rows"] = {
        "correctable": _int(_leaf(rows, "correctable error")),
        "uncorrectable": _int(_leaf(rows, "uncorrectable error")),
        "pending": _yes_no(_leaf(rows, "pending")),
        "failure": _yes_no(_leaf(rows, "remapping failure occurred")),
    }
    pages = _section(tree, "retired pages")
    pending = next((value for key, value in pages.items()
                    if key.startswith("pending") and isinstance(value, str)), None)
    record["retired_pages"] = {
        "single_bit": _retired_count(pages.get("single bit ecc")),
        "double_bit": _retired_count(pages.get("double bit ecc")),
        "pending": _yes_no(pending),
    }


def _retired_count(value: Any) -> int | None:
    if isinstance(value, dict):
        return _int(_leaf(value, "count", "retired count"))
    return _int(value)


def _text_clocks(tree: dict[str, Any], record: dict[str, Any]) -> None:
    reasons = _section(tree, "clocks event reasons", "clocks throttle reasons")
    states = {name: _active(_leaf(reasons, label)) for label, name in _TEXT_REASONS.items()}
    active = None
    if any(state is not None for state in states.values()):
        active = [name for name in REASON_NAMES if states.get(name)]
    counters_block = _section(tree, "clocks event reasons counters")
    counters = {
        name: value
        for label, name in _TEXT_COUNTERS.items()
        if (value := _int(_leaf(counters_block, label))) is not None
    }
    record["clocks_event_reasons"] = {"active": active, "counters_us": counters or None}


def _text_pcie(tree: dict[str, Any], record: dict[str, Any]) -> None:
    pci = _section(tree, "pci")
    link = _section(pci, "gpu link info")
    gen, width = _section(link, "pcie generation"), _section(link, "link width")
    record["pcie"] = {
        "gen_current": _int(_leaf(gen, "current")),
        "gen_max": _gen_max(_int(_leaf(gen, "device max")), _int(_leaf(gen, "host max")),
                            _int(_leaf(gen, "max"))),
        "width_current": _int(_leaf(width, "current")),
        "width_max": _int(_leaf(width, "max")),
        "replays": _int(_leaf(pci, "replays since reset")),
    }
    if record["bus_id"] is None:
        record["bus_id"] = normalize_bus_id(_leaf(pci, "bus id"))


def _text_sensors(tree: dict[str, Any], record: dict[str, Any]) -> None:
    temperature = _section(tree, "temperature")
    power = _section(tree, "gpu power readings", "power readings")
    record.update(
        {
            "temperature_c": _int(_leaf(temperature, "gpu current temp")),
            "memory_temperature_c": _int(_leaf(temperature, "memory current temp")),
            "power_draw_w": _float(
                _leaf(power, "power draw", "average power draw", "instantaneous power draw")
            ),
            "power_limit_w": _float(
                _leaf(power, "current power limit", "enforced power limit", "power limit")
            ),
            "pstate": _value(_leaf(tree, "performance state")),
            "utilization_gpu": _int(_leaf(_section(tree, "utilization"), "gpu")),
        }
    )


def _text_record(bus_id: str | None, index: int, tree: dict[str, Any]) -> dict[str, Any]:
    record = empty_record()
    record["bus_id"] = normalize_bus_id(bus_id)
    record["index"] = index
    record["name"] = _value(_leaf(tree, "product name"))
    _text_ecc(tree, record)
    _text_memory(tree, record)
    _text_clocks(tree, record)
    _text_pcie(tree, record)
    _text_sensors(tree, record)
    return record


def _unreadable(code: str, detail: str, **extra: Any) -> dict[str, Any]:
    return {"code": code, "detail": detail, **extra}


def _device_unreadable(error: str) -> dict[str, Any]:
    """A GPU nvidia-smi could not get a handle for: lost where its error says so."""
    code = "gpu_lost" if "gpu is lost" in error.lower() else "gpu_unreadable"
    return _unreadable(code, f"nvidia-smi: {error}")


def _put(result: dict[str, dict[str, Any]], key: str, record: dict[str, Any]) -> None:
    """``record`` under ``key``, merged into one already there."""
    result[key] = merge_records(result[key], record) if key in result else record


def unreadable_gpus(lines: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{bus id: record}`` for each GPU an nvidia-smi output says it could not get a
    handle for ("Unable to determine the device handle for GPU ..."), each leaf None
    and ``unreadable`` saying why; ``{}`` when there is none."""
    lost: dict[str, dict[str, Any]] = {}
    for line in lines:
        match = _DEVICE_HANDLE_RE.match(line.strip())
        if match is not None:
            record = empty_record()
            record["bus_id"] = normalize_bus_id(match.group(1))
            record["unreadable"] = _device_unreadable(match.group(0))
            _put(lost, record["bus_id"] or match.group(1), record)
    return lost


def _add_missing(result: dict[str, dict[str, Any]], attached: int | None, listed: int) -> None:
    """The GPUs an output counts as attached but does not list, as one record."""
    if attached is None or attached <= listed:
        return
    record = empty_record()
    record["unreadable"] = _unreadable(
        "gpu_missing", f"nvidia-smi counts {attached} attached GPU(s); its output lists "
        f"{listed}", attached=attached, listed=listed)
    result[MISSING_KEY] = record


def _attached(lines: list[str]) -> int | None:
    """``Attached GPUs : N`` of -q text, None where it is not printed."""
    for line in lines:
        match = _ATTACHED_RE.match(line.strip())
        if match is not None:
            return int(match.group(1))
    return None


def parse_query_text(lines: Iterable[str]) -> dict[str, dict[str, Any]] | None:
    """Parse ``nvidia-smi -q`` (whole, or ``-d`` sections, or an excerpt).

    Returns ``{bus_id: record}`` (see the module docstring for the record), keyed by
    the bus id printed after ``GPU `` (normalised, ``00000000:17:00.0``), or by the
    block's position (``"0"``) for an excerpt without that header. ``index`` is the
    block's position: nvidia-smi lists GPUs in index order. A GPU nvidia-smi could not
    get a handle for, a block with nothing in it and the GPUs ``Attached GPUs`` counts
    but the output does not list are records with ``unreadable``. None on an NVML error
    or when there is no GPU at all. Raises UnreadableOutput for a line over the bound.
    """
    kept, _status = split_smi_output(bounded_lines(lines, "nvidia-smi -q"))
    if nvml_failure(kept) is not None:
        return None
    entries = _text_tree(kept)
    attached = _attached(kept)
    if not entries and not attached:
        return None
    result: dict[str, dict[str, Any]] = {}
    for position, (bus_id, tree, error) in enumerate(entries):
        record = _text_record(bus_id, position, tree or {})
        if error is not None:
            record["unreadable"] = _device_unreadable(error)
        elif not tree:
            record["unreadable"] = _unreadable(
                "gpu_no_data", f"GPU {bus_id or position}: its block in nvidia-smi -q "
                "holds nothing")
        _put(result, record["bus_id"] or bus_id or str(position), record)
    _add_missing(result, attached, len(entries))
    return result


# --- nvidia-smi -q -x ---------------------------------------------------------------

_XML_REASON_PREFIX_RE = re.compile(r"^clocks_(?:event|throttle)_reason_")


def _xml_text(node: ElementTree.Element | None, path: str) -> str | None:
    if node is None:
        return None
    found = node.find(path)
    return found.text if found is not None and found.text is not None else None


def _xml_ecc_counts(block: ElementTree.Element | None) -> dict[str, int | None]:
    if block is None:
        return {"correctable": None, "uncorrectable": None}
    if block.find("single_bit") is not None or block.find("double_bit") is not None:
        return {"correctable": _int(_xml_text(block, "single_bit/total")),
                "uncorrectable": _int(_xml_text(block, "double_bit/total"))}
    sram = _int(_xml_text(block, "sram_uncorrectable"))
    if sram is None:
        sram = _sum([_int(_xml_text(block, "sram_uncorrectable_parity")),
                     _int(_xml_text(block, "sram_uncorrectable_secded"))])
    return {
        "correctable": _sum([_int(_xml_text(block, "sram_correctable")),
                             _int(_xml_text(block, "dram_correctable"))]),
        "uncorrectable": _sum([sram, _int(_xml_text(block, "dram_uncorrectable"))]),
    }


def _xml_memory(gpu: ElementTree.Element, record: dict[str, Any]) -> None:
    record["ecc_mode"] = _enabled(_xml_text(gpu, "ecc_mode/current_ecc"))
    errors = gpu.find("ecc_errors")
    if errors is not None:
        record["ecc"] = {
            "volatile": _xml_ecc_counts(errors.find("volatile")),
            "aggregate": _xml_ecc_counts(errors.find("aggregate")),
            "pending": _any_true(
                _yes_no(_xml_text(errors, key.replace(" ", "_"))) for key in _REPAIR_KEYS
            ),
        }
    record["remapped_rows"] = {
        "correctable": _int(_xml_text(gpu, "remapped_rows/remapped_row_corr")),
        "uncorrectable": _int(_xml_text(gpu, "remapped_rows/remapped_row_unc")),
        "pending": _yes_no(_xml_text(gpu, "remapped_rows/remapped_row_pending")),
        "failure": _yes_no(_xml_text(gpu, "remapped_rows/remapped_row_failure")),
    }
    pending = _yes_no(_xml_text(gpu, "retired_pages/pending_retirement"))
    if pending is None:  # drivers before 450 name it pending_blacklist
        pending = _yes_no(_xml_text(gpu, "retired_pages/pending_blacklist"))
    record["retired_pages"] = {
        "single_bit": _int(
            _xml_text(gpu, "retired_pages/multiple_single_bit_retirement/retired_count")
        ),
        "double_bit": _int(_xml_text(gpu, "retired_pages/double_bit_retirement/retired_count")),
        "pending": pending,
    }


def _xml_clocks(gpu: ElementTree.Element, record: dict[str, Any]) -> None:
    active = None
    for tag in ("clocks_event_reasons", "clocks_throttle_reasons"):
        block = gpu.find(tag)
        if block is None:
            continue
        states: dict[str, bool | None] = {}
        for child in block:
            suffix = _XML_REASON_PREFIX_RE.sub("", child.tag)
            states[_REASON_ALIASES.get(suffix, suffix)] = _active(child.text)
        if any(state is not None for state in states.values()):
            active = [name for name in REASON_NAMES if states.get(name)]
        break
    counters: dict[str, int] = {}
    block = gpu.find("clocks_event_reasons_counters")
    for child in block if block is not None else []:
        suffix = child.tag.replace("clocks_event_reasons_counters_", "")
        value = _int(child.text)
        if value is not None:
            counters[_REASON_ALIASES.get(suffix, suffix)] = value
    record["clocks_event_reasons"] = {"active": active, "counters_us": counters or None}


def _xml_pcie_and_sensors(gpu: ElementTree.Element, record: dict[str, Any]) -> None:
    gen = gpu.find("pci/pci_gpu_link_info/pcie_gen")
    record["pcie"] = {
        "gen_current": _int(_xml_text(gen, "current_link_gen")),
        "gen_max": _gen_max(_int(_xml_text(gen, "max_device_link_gen")),
                            _int(_xml_text(gen, "max_host_link_gen")),
                            _int(_xml_text(gen, "max_link_gen"))),
        "width_current": _int(_xml_text(gpu, "pci/pci_gpu_link_info/link_widths/current_link_width")),
        "width_max": _int(_xml_text(gpu, "pci/pci_gpu_link_info/link_widths/max_link_width")),
        "replays": _int(_xml_text(gpu, "pci/replay_counter")),
    }
    power = gpu.find("gpu_power_readings")
    if power is None:
        power = gpu.find("power_readings")
    draw = next((v for tag in ("power_draw", "average_power_draw", "instant_power_draw")
                 if (v := _float(_xml_text(power, tag))) is not None), None)
    limit = next((v for tag in ("current_power_limit", "enforced_power_limit", "power_limit")
                  if (v := _float(_xml_text(power, tag))) is not None), None)
    record.update(
        {
            "temperature_c": _int(_xml_text(gpu, "temperature/gpu_temp")),
            "memory_temperature_c": _int(_xml_text(gpu, "temperature/memory_temp")),
            "power_draw_w": draw,
            "power_limit_w": limit,
            "pstate": _value(_xml_text(gpu, "performance_state")),
            "utilization_gpu": _int(_xml_text(gpu, "utilization/gpu_util")),
        }
    )


# nvidia-smi's own DOCTYPE line (an external DTD, never loaded); any other DTD, and any
# entity declaration, is refused: an entity can expand into anything (the "billion
# laughs") and hide or invent the values judged.
_NVSMI_DOCTYPE_RE = re.compile(r'^<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v\d+\.dtd">$')


def _xml_root(lines: list[str]) -> ElementTree.Element:
    """The ``<nvidia_smi_log>`` element of -q -x lines; UnreadableOutput for XML with a
    DTD or entity of its own, not well-formed (cut short, a character XML does not
    allow) or with another root."""
    body: list[str] = []
    for number, line in enumerate(lines, 1):
        if _NVSMI_DOCTYPE_RE.match(line.strip()):
            continue
        if "<!DOCTYPE" in line or "<!ENTITY" in line:
            raise UnreadableOutput(
                f"nvidia-smi -q -x: line {number} declares a DTD or an entity of its own, "
                "which nvidia-smi never writes: the XML is not read")
        body.append(line)
    try:
        root = ElementTree.fromstring("\n".join(body))
    except ElementTree.ParseError as error:
        raise UnreadableOutput(
            f"nvidia-smi -q -x: not well-formed XML ({error}): cut short, or holding a "
            "character XML does not allow") from error
    if root.tag != "nvidia_smi_log":
        raise UnreadableOutput(f"nvidia-smi -q -x: the root element is <{root.tag[:40]}>, "
                               "not nvidia-smi's <nvidia_smi_log>")
    return root


def _xml_record(gpu: ElementTree.Element, position: int) -> dict[str, Any]:
    record = empty_record()
    record["bus_id"] = normalize_bus_id(gpu.get("id")) or normalize_bus_id(
        _xml_text(gpu, "pci/pci_bus_id")
    )
    record["index"] = position
    record["name"] = _value(_xml_text(gpu, "product_name"))
    _xml_memory(gpu, record)
    _xml_clocks(gpu, record)
    _xml_pcie_and_sensors(gpu, record)
    if len(gpu) == 0:
        record["unreadable"] = _unreadable(
            "gpu_no_data", f"GPU {gpu.get('id') or position}: its <gpu> element in "
            "nvidia-smi -q -x holds nothing")
    return record


def parse_query_xml(text: str) -> dict[str, dict[str, Any]] | None:
    """Parse ``nvidia-smi -q -x``: ``{bus_id: record}`` from each ``<gpu id=...>``
    element actually present, the GPUs nvidia-smi could not get a handle for, and the
    GPUs ``<attached_gpus>`` counts but the file does not hold (a cut file says 16 and
    holds 1: MISSING_KEY). ``index`` is the element's position (nvidia-smi writes them
    in index order). None on an NVML error or without any GPU. Raises UnreadableOutput
    for XML it cannot read (_xml_root) and for a line over the bound."""
    kept, _status = split_smi_output(bounded_lines(text.splitlines(), "nvidia-smi -q -x"))
    if nvml_failure(kept) is not None:
        return None
    lost = unreadable_gpus(kept)
    root = _xml_root([line for line in kept if _DEVICE_HANDLE_RE.match(line.strip()) is None])
    result: dict[str, dict[str, Any]] = {}
    gpus = root.findall("gpu")
    for position, gpu in enumerate(gpus):
        record = _xml_record(gpu, position)
        _put(result, record["bus_id"] or str(position), record)
    for key, record in lost.items():
        _put(result, key, record)
    _add_missing(result, _int(root.findtext("attached_gpus")), len(gpus) + len(lost))
    return result or None


# --- --query-gpu CSV ----------------------------------------------------------------

# The health query this suite recommends (and the order a headerless CSV of it has).
HEALTH_QUERY_FIELDS = [
    "index", "pci.bus_id", "ecc.mode.current", "ecc.errors.uncorrected.volatile.total",
    "ecc.errors.corrected.volatile.total", "ecc.errors.uncorrected.aggregate.total",
    "retired_pages.pending", "remapped_rows.correctable", "remapped_rows.uncorrectable",
    "remapped_rows.pending", "remapped_rows.failure", "pcie.link.gen.current",
    "pcie.link.gen.max", "pcie.link.width.current", "pcie.link.width.max",
    "clocks_event_reasons.active", "clocks_event_reasons.hw_slowdown",
    "clocks_event_reasons.hw_thermal_slowdown", "clocks_event_reasons.sw_thermal_slowdown",
    "clocks_event_reasons.hw_power_brake_slowdown", "temperature.gpu", "temperature.memory",
    "power.draw", "power.limit", "clocks.current.sm", "clocks.max.sm", "fan.speed", "pstate",
]


def _csv_rows(
    lines: Iterable[str], fields: list[str] | None
) -> list[dict[str, str | None]] | None:
    """parse_query_csv with the old ``clocks_throttle_reasons`` names renamed and every
    "no value" spelling as None; nvidia-smi's device-handle errors left out (see
    unreadable_gpus). Raises UnreadableOutput for a line over the bound."""
    kept = [line for line in bounded_lines(lines, "nvidia-smi --query CSV")
            if _DEVICE_HANDLE_RE.match(line.strip()) is None]
    rows = parse_query_csv(kept, fields)
    if rows is None:
        return None
    return [
        {name.replace("clocks_throttle_reasons", "clocks_event_reasons"): _value(value)
         for name, value in row.items()}
        for row in rows
    ]


def _csv_clocks(row: dict[str, str | None]) -> dict[str, Any]:
    prefix = "clocks_event_reasons."
    active = set(reasons_from_mask(row.get(prefix + "active")) or [])
    known = row.get(prefix + "active") is not None
    counters: dict[str, int] = {}
    for field, value in row.items():
        if field.startswith("clocks_event_reasons_counters."):
            name = field.split(".", 1)[1]
            count = _int(value)
            if count is not None:
                counters[_REASON_ALIASES.get(name, name)] = count
        elif field.startswith(prefix) and field not in (prefix + "active",
                                                         prefix + "supported"):
            name = field[len(prefix):]
            state = _active(value)
            known = known or state is not None
            if state:
                active.add(_REASON_ALIASES.get(name, name))
    return {"active": [name for name in REASON_NAMES if name in active] if known else None,
            "counters_us": counters or None}


def _csv_record(row: dict[str, str | None]) -> dict[str, Any]:
    record = empty_record()
    record["bus_id"] = normalize_bus_id(row.get("pci.bus_id") or row.get("gpu_bus_id"))
    record["index"] = _int(row.get("index"))
    record["name"] = row.get("name") or row.get("gpu_name")
    record["ecc_mode"] = _enabled(row.get("ecc.mode.current"))
    record["ecc"] = {
        kind: {"correctable": _int(row.get(f"ecc.errors.corrected.{kind}.total")),
               "uncorrectable": _int(row.get(f"ecc.errors.uncorrected.{kind}.total"))}
        for kind in ("volatile", "aggregate")
    } | {"pending": None}
    record["remapped_rows"] = {
        "correctable": _int(row.get("remapped_rows.correctable")),
        "uncorrectable": _int(row.get("remapped_rows.uncorrectable")),
        "pending": _yes_no(row.get("remapped_rows.pending")),
        "failure": _yes_no(row.get("remapped_rows.failure")),
    }
    record["retired_pages"] = {
        "single_bit": _int(row.get("retired_pages.single_bit_ecc.count")
                           or row.get("retired_pages.sbe")),
        "double_bit": _int(row.get("retired_pages.double_bit.count")
                           or row.get("retired_pages.dbe")),
        "pending": _yes_no(row.get("retired_pages.pending")),
    }
    record["clocks_event_reasons"] = _csv_clocks(row)
    _csv_pcie_and_sensors(row, record)
    return record


def _csv_pcie_and_sensors(row: dict[str, str | None], record: dict[str, Any]) -> None:
    record["pcie"] = {
        "gen_current": _int(row.get("pcie.link.gen.current")),
        "gen_max": _gen_max(_int(row.get("pcie.link.gen.gpumax")),
                            _int(row.get("pcie.link.gen.hostmax")),
                            _int(row.get("pcie.link.gen.max"))),
        "width_current": _int(row.get("pcie.link.width.current")),
        "width_max": _int(row.get("pcie.link.width.max")),
        "replays": None,
    }
    record.update(
        {
            "temperature_c": _int(row.get("temperature.gpu")),
            "memory_temperature_c": _int(row.get("temperature.memory")),
            "power_draw_w": _float(row.get("power.draw")),
            "power_limit_w": _float(row.get("power.limit") or row.get("enforced.power.limit")),
            "pstate": row.get("pstate"),
            "utilization_gpu": _int(row.get("utilization.gpu")),
        }
    )


def parse_health_csv(
    lines: Iterable[str], fields: list[str] | None = None
) -> dict[str, dict[str, Any]] | None:
    """Parse a ``--query-gpu=... --format=csv`` output (any fields, any order, units in
    the header or not; ``fields`` for a ``noheader`` one) into ``{key: record}``, keyed
    by ``pci.bus_id`` where the query has it, else by ``index``, else by row number;
    a GPU nvidia-smi could not get a handle for is a record with ``unreadable``. None on
    an NVML error. Raises UnreadableOutput for a line over the bound."""
    lines = list(lines)
    rows = _csv_rows(lines, fields)
    if rows is None:
        return None
    result: dict[str, dict[str, Any]] = {}
    for number, row in enumerate(rows):
        record = _csv_record(row)
        index = record["index"]
        result[record["bus_id"] or (str(index) if index is not None else str(number))] = record
    for key, record in unreadable_gpus(lines).items():
        _put(result, key, record)
    return result


def health_csv_fields(lines: list[str]) -> list[str] | None:
    """HEALTH_QUERY_FIELDS for a health CSV saved without its header (its first row, past
    nvidia-smi's device-handle errors, starts with a number), None for one with it."""
    first = next((line for line in lines
                  if line.strip() and _DEVICE_HANDLE_RE.match(line.strip()) is None), "")
    return HEALTH_QUERY_FIELDS if not any(c.isalpha() for c in first[:6]) else None


def _row_key(row: dict[str, str | None], number: int) -> str:
    return (normalize_bus_id(row.get("gpu_bus_id") or row.get("pci.bus_id"))
            or row.get("gpu_uuid") or str(number))


def parse_remapped_rows_csv(lines: Iterable[str]) -> dict[str, dict[str, Any]] | None:
    """Parse ``--query-remapped-rows=gpu_bus_id,...,remapped_rows.* --format=csv``:
    ``{bus_id (else uuid): {"correctable", "uncorrectable", "pending", "failure"}}``."""
    rows = _csv_rows(lines, None)
    if rows is None:
        return None
    return {
        _row_key(row, number): {
            "correctable": _int(row.get("remapped_rows.correctable")),
            "uncorrectable": _int(row.get("remapped_rows.uncorrectable")),
            "pending": _yes_no(row.get("remapped_rows.pending")),
            "failure": _yes_no(row.get("remapped_rows.failure")),
        }
        for number, row in enumerate(rows)
    }


def parse_retired_pages_csv(lines: Iterable[str]) -> dict[str, dict[str, Any]] | None:
    """Parse ``--query-retired-pages=...,retired_pages.address,retired_pages.cause``.

    Returns ``{bus_id (else uuid): {"single_bit": int, "double_bit": int, "pages":
    [{"address", "cause", "timestamp"}], "applicable": bool}}``. A GPU that remaps rows
    instead prints one row per cause with ``[N/A]`` as the address: those rows are
    placeholders, counted as 0 pages, and ``applicable`` is False."""
    rows = _csv_rows(lines, None)
    if rows is None:
        return None
    result: dict[str, dict[str, Any]] = {}
    for number, row in enumerate(rows):
        entry = result.setdefault(
            _row_key(row, number),
            {"single_bit": 0, "double_bit": 0, "pages": [], "applicable": False},
        )
        address = row.get("retired_pages.address")
        if address is None:
            continue
        cause = row.get("retired_pages.cause") or ""
        entry["applicable"] = True
        entry["pages"].append({"address": address, "cause": cause or None,
                               "timestamp": row.get("retired_pages.timestamp")})
        if "single" in cause.lower():
            entry["single_bit"] += 1
        elif "double" in cause.lower():
            entry["double_bit"] += 1
    return result


# --- nvidia-smi nvlink -e / -s --------------------------------------------------------

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
        value = _value(counter.group(3))
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


# --- which output is this? --------------------------------------------------------------

# A header field that makes a --query-gpu CSV a health one (an inventory CSV of names,
# memory and driver versions says nothing of health: it is not read as such).
_CSV_HEALTH_HINTS = ("ecc.", "remapped_rows.", "retired_pages.", "pcie.link",
                     "clocks_event_reasons", "clocks_throttle_reasons", "temperature.gpu",
                     "power.draw")


def _detect_csv(lines: list[str]) -> str | None:
    header = [name.strip() for name in lines[0].split(",")]
    if "retired_pages.address" in header or "retired_pages.cause" in header:
        return "retired_pages_csv"
    if any(name.startswith("remapped_rows.") for name in header) and (
        "gpu_bus_id" in header or "gpu_uuid" in header
    ):
        return "remapped_rows_csv"
    if any(name.startswith(hint) for name in header for hint in _CSV_HEALTH_HINTS):
        return "health_csv"
    cells = [cell.strip() for cell in lines[0].split(", ")]
    if len(cells) == len(HEALTH_QUERY_FIELDS) and normalize_bus_id(cells[1]) is not None:
        return "health_csv"  # the headerless form of HEALTH_QUERY_FIELDS
    return None


def _nvlink_message(line: str) -> bool:
    lowered = line.lower()
    return "all links are inactive" in lowered or any(
        phrase in lowered for phrase in _NVLINK_NOT_APPLICABLE + _NVLINK_UNKNOWN
    )


def _detect_smi(lines: list[str]) -> str | None:
    """The kind of an nvidia-smi or dcgmi output among ``lines`` (no device-handle
    errors among them), None for none."""
    if lines[0].lstrip().startswith("<") and any("nvidia_smi_log" in line for line in lines):
        return "query_xml"
    if nvml_failure(lines[:2]) is not None:
        return "nvml_error"
    if any(_NVSMI_BANNER_RE.match(line.strip()) or _GPU_HEADER_RE.match(line)
           for line in lines) or (
        lines[0].strip() in ("ECC Errors", "Remapped Rows", "Retired Pages")
    ):
        return "query_text"
    if any(diag_heading(line) or DIAG_ROW_RE.match(line) for line in lines):
        return "dcgmi_diag"
    if NVLINK_GPU_RE.match(lines[0].strip()):
        if any(_NVLINK_COUNTER_RE.match(line.strip()) for line in lines):
            return "nvlink_errors"
        if any(_NVLINK_LINK_RE.match(line.strip()) or _nvlink_message(line)
               for line in lines):
            return "nvlink_status"
        # nvidia-smi -L prints the same GPU lines and nothing else: not health.
    return None


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
    others = [line for line in lines if _DEVICE_HANDLE_RE.match(line.strip()) is None]
    if not lines:
        return None
    kind = _detect_smi(others) if others else None
    if kind is None and any(is_kernel_log_line(line) for line in others):
        kind = "kernel_log"
    if kind is None and others and "," in others[0]:
        kind = _detect_csv(others)
    if kind is None and len(others) < len(lines):
        kind = "device_error"
    return kind


# --- the facts ----------------------------------------------------------------------------


class GpuHealth(NvidiaSmiFact[dict[str, dict[str, Any]] | None]):
    """
    Returns every GPU's health record from the whole ``nvidia-smi -q`` (ECC, remapped
    rows, retired pages, clocks event reasons, PCIe link and replays, temperature,
    power), keyed by PCI bus id; None without nvidia-smi or on an NVML error. See the
    module docstring for the record:

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
