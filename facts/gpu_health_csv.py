"""``nvidia-smi --query-gpu``, ``--query-remapped-rows`` and ``--query-retired-pages``
CSV as GPU health sources, each GPU as the record of facts/gpu_health_record.py. The
query fields are those of ``nvidia-smi --help-query-gpu``
(https://docs.nvidia.com/deploy/nvidia-smi/index.html); the older drivers'
``clocks_throttle_reasons`` fields are read as ``clocks_event_reasons``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from facts.gpu_health_input import bounded_lines
from facts.gpu_health_record import (
    DEVICE_HANDLE_RE,
    REASON_ALIASES,
    REASON_NAMES,
    cell_active,
    cell_enabled,
    cell_float,
    cell_int,
    cell_value,
    cell_yes_no,
    empty_record,
    normalize_bus_id,
    pcie_gen_max,
    put_record,
    reasons_from_mask,
    unreadable_gpus,
)
from facts.gpus import parse_query_csv

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
            if DEVICE_HANDLE_RE.match(line.strip()) is None]
    rows = parse_query_csv(kept, fields)
    if rows is None:
        return None
    return [
        {name.replace("clocks_throttle_reasons", "clocks_event_reasons"): cell_value(value)
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
            count = cell_int(value)
            if count is not None:
                counters[REASON_ALIASES.get(name, name)] = count
        elif field.startswith(prefix) and field not in (prefix + "active",
                                                         prefix + "supported"):
            name = field[len(prefix):]
            state = cell_active(value)
            known = known or state is not None
            if state:
                active.add(REASON_ALIASES.get(name, name))
    return {"active": [name for name in REASON_NAMES if name in active] if known else None,
            "counters_us": counters or None}


def _csv_record(row: dict[str, str | None]) -> dict[str, Any]:
    record = empty_record()
    record["bus_id"] = normalize_bus_id(row.get("pci.bus_id") or row.get("gpu_bus_id"))
    record["index"] = cell_int(row.get("index"))
    record["name"] = row.get("name") or row.get("gpu_name")
    record["ecc_mode"] = cell_enabled(row.get("ecc.mode.current"))
    record["ecc"] = {
        kind: {"correctable": cell_int(row.get(f"ecc.errors.corrected.{kind}.total")),
               "uncorrectable": cell_int(row.get(f"ecc.errors.uncorrected.{kind}.total"))}
        for kind in ("volatile", "aggregate")
    } | {"pending": None}
    record["remapped_rows"] = {
        "correctable": cell_int(row.get("remapped_rows.correctable")),
        "uncorrectable": cell_int(row.get("remapped_rows.uncorrectable")),
        "pending": cell_yes_no(row.get("remapped_rows.pending")),
        "failure": cell_yes_no(row.get("remapped_rows.failure")),
    }
    record["retired_pages"] = {
        "single_bit": cell_int(row.get("retired_pages.single_bit_ecc.count")
                           or row.get("retired_pages.sbe")),
        "double_bit": cell_int(row.get("retired_pages.double_bit.count")
                           or row.get("retired_pages.dbe")),
        "pending": cell_yes_no(row.get("retired_pages.pending")),
    }
    record["clocks_event_reasons"] = _csv_clocks(row)
    _csv_pcie_and_sensors(row, record)
    return record


def _csv_pcie_and_sensors(row: dict[str, str | None], record: dict[str, Any]) -> None:
    record["pcie"] = {
        "gen_current": cell_int(row.get("pcie.link.gen.current")),
        "gen_max": pcie_gen_max(cell_int(row.get("pcie.link.gen.gpumax")),
                            cell_int(row.get("pcie.link.gen.hostmax")),
                            cell_int(row.get("pcie.link.gen.max"))),
        "width_current": cell_int(row.get("pcie.link.width.current")),
        "width_max": cell_int(row.get("pcie.link.width.max")),
        "replays": None,
    }
    record.update(
        {
            "temperature_c": cell_int(row.get("temperature.gpu")),
            "memory_temperature_c": cell_int(row.get("temperature.memory")),
            "power_draw_w": cell_float(row.get("power.draw")),
            "power_limit_w": cell_float(row.get("power.limit") or row.get("enforced.power.limit")),
            "pstate": row.get("pstate"),
            "utilization_gpu": cell_int(row.get("utilization.gpu")),
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
        put_record(result, key, record)
    return result


def health_csv_fields(lines: list[str]) -> list[str] | None:
    """HEALTH_QUERY_FIELDS for a health CSV saved without its header (its first row, past
    nvidia-smi's device-handle errors, starts with a number), None for one with it."""
    first = next((line for line in lines
                  if line.strip() and DEVICE_HANDLE_RE.match(line.strip()) is None), "")
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
            "correctable": cell_int(row.get("remapped_rows.correctable")),
            "uncorrectable": cell_int(row.get("remapped_rows.uncorrectable")),
            "pending": cell_yes_no(row.get("remapped_rows.pending")),
            "failure": cell_yes_no(row.get("remapped_rows.failure")),
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


# A header field that makes a --query-gpu CSV a health one (an inventory CSV of names,
# memory and driver versions says nothing of health: it is not read as such).
_CSV_HEALTH_HINTS = ("ecc.", "remapped_rows.", "retired_pages.", "pcie.link",
                     "clocks_event_reasons", "clocks_throttle_reasons", "temperature.gpu",
                     "power.draw")


def csv_kind(lines: list[str]) -> str | None:
    """``"health_csv"``, ``"remapped_rows_csv"`` or ``"retired_pages_csv"`` for such a
    CSV among ``lines`` (not blank, its header or first row first), None for any other
    (an inventory CSV says nothing of health)."""
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
