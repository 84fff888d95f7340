"""``nvidia-smi -q`` as a GPU health source: its text and its XML (``-q -x``), each GPU
as the record of facts/gpu_health_record.py.

Layouts handled, from the real outputs the tests carry: ``Clocks Throttle Reasons``
(older drivers) and ``Clocks Event Reasons`` (535 and later); the ECC counters as
``Single Bit``/``Double Bit`` tables with a ``Total`` row (Kepler to Volta) or as
``SRAM``/``DRAM`` lines (Ampere and later; 535+ splits ``SRAM Uncorrectable`` into
``Parity`` and ``SEC-DED``; 580 adds ``Channel Repair Pending``, ``TPC Repair Pending``
and ``Unrepairable Memory``); ``Power Readings`` and ``GPU Power Readings``; -q
excerpts without their GPU header; ``[...]`` elision lines.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterable
from typing import Any

from facts.gpu_health_input import UnreadableOutput, bounded_lines
from facts.gpu_health_record import (
    DEVICE_HANDLE_RE,
    REASON_ALIASES,
    REASON_NAMES,
    add_missing,
    cell_active,
    cell_enabled,
    cell_float,
    cell_int,
    cell_value,
    cell_yes_no,
    device_unreadable,
    empty_record,
    known_any,
    known_sum,
    normalize_bus_id,
    pcie_gen_max,
    put_record,
    unreadable,
    unreadable_gpus,
)
from facts.nvidia_smi import nvml_failure, split_smi_output

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

# 580's ECC lines that say a repair waits for a reset (or cannot be done).
_REPAIR_KEYS = ("channel repair pending", "tpc repair pending", "unrepairable memory")

_GPU_HEADER_RE = re.compile(r"^GPU\s+([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$")

_ATTACHED_RE = re.compile(r"^Attached GPUs +: (\d+)$")

_NVSMI_BANNER_RE = re.compile(r"^=+NVSMI LOG=+$")


# --- nvidia-smi -q text ---------------------------------------------------------------


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
        lost = DEVICE_HANDLE_RE.match(line.strip())
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
        return {"correctable": cell_int(_leaf(single, "total")),
                "uncorrectable": cell_int(_leaf(double, "total"))}
    uncorrectable_sram = cell_int(_leaf(block, "sram uncorrectable"))
    if uncorrectable_sram is None:
        uncorrectable_sram = known_sum(
            [cell_int(_leaf(block, "sram uncorrectable parity")),
             cell_int(_leaf(block, "sram uncorrectable sec-ded"))]
        )
    return {
        "correctable": known_sum([cell_int(_leaf(block, "sram correctable")),
                             cell_int(_leaf(block, "dram correctable")),
                             cell_int(_leaf(block, "correctable"))]),
        "uncorrectable": known_sum([uncorrectable_sram, cell_int(_leaf(block, "dram uncorrectable")),
                               cell_int(_leaf(block, "uncorrectable"))]),
    }


def _text_ecc(tree: dict[str, Any], record: dict[str, Any]) -> None:
    record["ecc_mode"] = cell_enabled(_leaf(_section(tree, "ecc mode"), "current"))
    errors = _section(tree, "ecc errors")
    if not errors:
        return
    record["ecc"] = {
        "volatile": _text_ecc_counts(_section(errors, "volatile")),
        "aggregate": _text_ecc_counts(_section(errors, "aggregate")),
        "pending": known_any(cell_yes_no(_leaf(errors, key)) for key in _REPAIR_KEYS),
    }


def _text_memory(tree: dict[str, Any], record: dict[str, Any]) -> None:
    rows = _section(tree, "remapped rows")
    record["remapped_rows"] = {
        "correctable": cell_int(_leaf(rows, "correctable error")),
        "uncorrectable": cell_int(_leaf(rows, "uncorrectable error")),
        "pending": cell_yes_no(_leaf(rows, "pending")),
        "failure": cell_yes_no(_leaf(rows, "remapping failure occurred")),
    }
    pages = _section(tree, "retired pages")
    pending = next((value for key, value in pages.items()
                    if key.startswith("pending") and isinstance(value, str)), None)
    record["retired_pages"] = {
        "single_bit": _retired_count(pages.get("single bit ecc")),
        "double_bit": _retired_count(pages.get("double bit ecc")),
        "pending": cell_yes_no(pending),
    }


def _retired_count(value: Any) -> int | None:
    if isinstance(value, dict):
        return cell_int(_leaf(value, "count", "retired count"))
    return cell_int(value)


def _text_clocks(tree: dict[str, Any], record: dict[str, Any]) -> None:
    reasons = _section(tree, "clocks event reasons", "clocks throttle reasons")
    states = {name: cell_active(_leaf(reasons, label)) for label, name in _TEXT_REASONS.items()}
    active = None
    if any(state is not None for state in states.values()):
        active = [name for name in REASON_NAMES if states.get(name)]
    counters_block = _section(tree, "clocks event reasons counters")
    counters = {
        name: value
        for label, name in _TEXT_COUNTERS.items()
        if (value := cell_int(_leaf(counters_block, label))) is not None
    }
    record["clocks_event_reasons"] = {"active": active, "counters_us": counters or None}


def _text_pcie(tree: dict[str, Any], record: dict[str, Any]) -> None:
    pci = _section(tree, "pci")
    link = _section(pci, "gpu link info")
    gen, width = _section(link, "pcie generation"), _section(link, "link width")
    record["pcie"] = {
        "gen_current": cell_int(_leaf(gen, "current")),
        "gen_max": pcie_gen_max(cell_int(_leaf(gen, "device max")), cell_int(_leaf(gen, "host max")),
                            cell_int(_leaf(gen, "max"))),
        "width_current": cell_int(_leaf(width, "current")),
        "width_max": cell_int(_leaf(width, "max")),
        "replays": cell_int(_leaf(pci, "replays since reset")),
    }
    if record["bus_id"] is None:
        record["bus_id"] = normalize_bus_id(_leaf(pci, "bus id"))


def _text_sensors(tree: dict[str, Any], record: dict[str, Any]) -> None:
    temperature = _section(tree, "temperature")
    power = _section(tree, "gpu power readings", "power readings")
    record.update(
        {
            "temperature_c": cell_int(_leaf(temperature, "gpu current temp")),
            "memory_temperature_c": cell_int(_leaf(temperature, "memory current temp")),
            "power_draw_w": cell_float(
                _leaf(power, "power draw", "average power draw", "instantaneous power draw")
            ),
            "power_limit_w": cell_float(
                _leaf(power, "current power limit", "enforced power limit", "power limit")
            ),
            "pstate": cell_value(_leaf(tree, "performance state")),
            "utilization_gpu": cell_int(_leaf(_section(tree, "utilization"), "gpu")),
        }
    )


def _text_record(bus_id: str | None, index: int, tree: dict[str, Any]) -> dict[str, Any]:
    record = empty_record()
    record["bus_id"] = normalize_bus_id(bus_id)
    record["index"] = index
    record["name"] = cell_value(_leaf(tree, "product name"))
    _text_ecc(tree, record)
    _text_memory(tree, record)
    _text_clocks(tree, record)
    _text_pcie(tree, record)
    _text_sensors(tree, record)
    return record


def _attached(lines: list[str]) -> int | None:
    """``Attached GPUs : N`` of -q text, None where it is not printed."""
    for line in lines:
        match = _ATTACHED_RE.match(line.strip())
        if match is not None:
            return int(match.group(1))
    return None


def is_query_text(lines: list[str]) -> bool:
    """Is the output of ``lines`` (not blank) ``nvidia-smi -q`` text: its banner, a GPU's
    header, or a ``-d`` section's title first?"""
    return any(_NVSMI_BANNER_RE.match(line.strip()) or _GPU_HEADER_RE.match(line)
               for line in lines) or (
        lines[0].strip() in ("ECC Errors", "Remapped Rows", "Retired Pages")
    )


def parse_query_text(lines: Iterable[str]) -> dict[str, dict[str, Any]] | None:
    """Parse ``nvidia-smi -q`` (whole, or ``-d`` sections, or an excerpt).

    Returns ``{bus_id: record}`` (facts/gpu_health_record.py says what), keyed by
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
            record["unreadable"] = device_unreadable(error)
        elif not tree:
            record["unreadable"] = unreadable(
                "gpu_no_data", f"GPU {bus_id or position}: its block in nvidia-smi -q "
                "holds nothing")
        put_record(result, record["bus_id"] or bus_id or str(position), record)
    add_missing(result, attached, len(entries))
    return result


# --- nvidia-smi -q -x -----------------------------------------------------------------

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
        return {"correctable": cell_int(_xml_text(block, "single_bit/total")),
                "uncorrectable": cell_int(_xml_text(block, "double_bit/total"))}
    sram = cell_int(_xml_text(block, "sram_uncorrectable"))
    if sram is None:
        sram = known_sum([cell_int(_xml_text(block, "sram_uncorrectable_parity")),
                     cell_int(_xml_text(block, "sram_uncorrectable_secded"))])
    return {
        "correctable": known_sum([cell_int(_xml_text(block, "sram_correctable")),
                             cell_int(_xml_text(block, "dram_correctable"))]),
        "uncorrectable": known_sum([sram, cell_int(_xml_text(block, "dram_uncorrectable"))]),
    }


def _xml_memory(gpu: ElementTree.Element, record: dict[str, Any]) -> None:
    record["ecc_mode"] = cell_enabled(_xml_text(gpu, "ecc_mode/current_ecc"))
    errors = gpu.find("ecc_errors")
    if errors is not None:
        record["ecc"] = {
            "volatile": _xml_ecc_counts(errors.find("volatile")),
            "aggregate": _xml_ecc_counts(errors.find("aggregate")),
            "pending": known_any(
                cell_yes_no(_xml_text(errors, key.replace(" ", "_"))) for key in _REPAIR_KEYS
            ),
        }
    record["remapped_rows"] = {
        "correctable": cell_int(_xml_text(gpu, "remapped_rows/remapped_row_corr")),
        "uncorrectable": cell_int(_xml_text(gpu, "remapped_rows/remapped_row_unc")),
        "pending": cell_yes_no(_xml_text(gpu, "remapped_rows/remapped_row_pending")),
        "failure": cell_yes_no(_xml_text(gpu, "remapped_rows/remapped_row_failure")),
    }
    pending = cell_yes_no(_xml_text(gpu, "retired_pages/pending_retirement"))
    if pending is None:  # drivers before 450 name it pending_blacklist
        pending = cell_yes_no(_xml_text(gpu, "retired_pages/pending_blacklist"))
    record["retired_pages"] = {
        "single_bit": cell_int(
            _xml_text(gpu, "retired_pages/multiple_single_bit_retirement/retired_count")
        ),
        "double_bit": cell_int(_xml_text(gpu, "retired_pages/double_bit_retirement/retired_count")),
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
            states[REASON_ALIASES.get(suffix, suffix)] = cell_active(child.text)
        if any(state is not None for state in states.values()):
            active = [name for name in REASON_NAMES if states.get(name)]
        break
    counters: dict[str, int] = {}
    block = gpu.find("clocks_event_reasons_counters")
    for child in block if block is not None else []:
        suffix = child.tag.replace("clocks_event_reasons_counters_", "")
        value = cell_int(child.text)
        if value is not None:
            counters[REASON_ALIASES.get(suffix, suffix)] = value
    record["clocks_event_reasons"] = {"active": active, "counters_us": counters or None}


def _xml_pcie_and_sensors(gpu: ElementTree.Element, record: dict[str, Any]) -> None:
    gen = gpu.find("pci/pci_gpu_link_info/pcie_gen")
    record["pcie"] = {
        "gen_current": cell_int(_xml_text(gen, "current_link_gen")),
        "gen_max": pcie_gen_max(cell_int(_xml_text(gen, "max_device_link_gen")),
                            cell_int(_xml_text(gen, "max_host_link_gen")),
                            cell_int(_xml_text(gen, "max_link_gen"))),
        "width_current": cell_int(_xml_text(gpu, "pci/pci_gpu_link_info/link_widths/current_link_width")),
        "width_max": cell_int(_xml_text(gpu, "pci/pci_gpu_link_info/link_widths/max_link_width")),
        "replays": cell_int(_xml_text(gpu, "pci/replay_counter")),
    }
    power = gpu.find("gpu_power_readings")
    if power is None:
        power = gpu.find("power_readings")
    draw = next((v for tag in ("power_draw", "average_power_draw", "instant_power_draw")
                 if (v := cell_float(_xml_text(power, tag))) is not None), None)
    limit = next((v for tag in ("current_power_limit", "enforced_power_limit", "power_limit")
                  if (v := cell_float(_xml_text(power, tag))) is not None), None)
    record.update(
        {
            "temperature_c": cell_int(_xml_text(gpu, "temperature/gpu_temp")),
            "memory_temperature_c": cell_int(_xml_text(gpu, "temperature/memory_temp")),
            "power_draw_w": draw,
            "power_limit_w": limit,
            "pstate": cell_value(_xml_text(gpu, "performance_state")),
            "utilization_gpu": cell_int(_xml_text(gpu, "utilization/gpu_util")),
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
    record["name"] = cell_value(_xml_text(gpu, "product_name"))
    _xml_memory(gpu, record)
    _xml_clocks(gpu, record)
    _xml_pcie_and_sensors(gpu, record)
    if len(gpu) == 0:
        record["unreadable"] = unreadable(
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
    root = _xml_root([line for line in kept if DEVICE_HANDLE_RE.match(line.strip()) is None])
    result: dict[str, dict[str, Any]] = {}
    gpus = root.findall("gpu")
    for position, gpu in enumerate(gpus):
        record = _xml_record(gpu, position)
        put_record(result, record["bus_id"] or str(position), record)
    for key, record in lost.items():
        put_record(result, key, record)
    add_missing(result, cell_int(root.findtext("attached_gpus")), len(gpus) + len(lost))
    return result or None
