"""The one record of a GPU's health that every GPU-health parser returns, and what
reads its values.

The parsers are facts/gpu_health_smi.py and facts/gpu_health_csv.py; the facts are in
facts/gpu_health.py. Why one shape: the same question ("does this GPU need a reset, a reboot or an RMA?")
is answered by ``nvidia-smi -q`` text, its XML (``-q -x``) and ``--query-gpu`` CSV,
each in several driver-dependent layouts. Every parser returns, per GPU::

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
never 0 by default: "no page retirement on this GPU" is not "0 retired pages". The
clocks event reason bits are NVML's ``nvmlClocksEventReasons`` (nvml.h,
https://docs.nvidia.com/deploy/nvml-api/group__nvmlClocksEventReasons.html).

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
from collections.abc import Iterable
from typing import Any

from facts.nvidia_smi import EMPTY_CELLS

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

# XML element suffixes, and query-field suffixes, that differ from REASON_NAMES.
REASON_ALIASES = {
    "gpu_idle": "idle",
    "sw_therm_slowdown": "sw_thermal_slowdown",
    "hw_therm_slowdown": "hw_thermal_slowdown",
    "hw_power_brake": "hw_power_brake_slowdown",
}

_BUS_ID_RE = re.compile(r"^([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})(?:\.([0-7]))?$")

# nvidia-smi, for a GPU whose NVML handle it cannot get (one fallen off the bus), in
# place of its block or row: "Unable to determine the device handle for GPU
# 0000:0B:00.0: Unknown Error" (also "for gpu", "GPU0000:...", "GPU is lost. Reboot the
# system to recover this GPU"; NVIDIA/open-gpu-kernel-modules#387, NVIDIA/nvidia-docker#1553).
DEVICE_HANDLE_RE = re.compile(
    r"^Unable to (?:determine|detect) the device handle for (?:GPU|gpu) ?"
    r"([0-9A-Fa-f]{3,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?): (.*)$"
)

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


# --- cell values ----------------------------------------------------------------------


def cell_value(text: str | None) -> str | None:
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


def cell_int(text: str | None) -> int | None:
    value = cell_value(text)
    if value is None:
        return None
    match = _INT_RE.match(value) or _LEADING_INT_RE.match(value)
    return int(match.group(1)) if match is not None else None


def cell_float(text: str | None) -> float | None:
    value = cell_value(text)
    if value is None:
        return None
    match = _FLOAT_RE.match(value)
    return float(match.group(1)) if match is not None else None


def cell_yes_no(text: str | None) -> bool | None:
    value = cell_value(text)
    if value is None:
        return None
    lowered = value.lower()
    if lowered in ("yes", "true", "1"):
        return True
    if lowered in ("no", "false", "0"):
        return False
    return None


def cell_active(text: str | None) -> bool | None:
    value = cell_value(text)
    if value == "Active":
        return True
    if value == "Not Active":
        return False
    return None


def cell_enabled(text: str | None) -> str | None:
    value = cell_value(text)
    return value if value in ("Enabled", "Disabled") else None


def known_sum(values: Iterable[int | None]) -> int | None:
    known = [value for value in values if value is not None]
    return sum(known) if known else None


def known_any(values: Iterable[bool | None]) -> bool | None:
    known = [value for value in values if value is not None]
    return any(known) if known else None


def reasons_from_mask(mask: str | int | None) -> list[str] | None:
    """NVML's hex reason mask (``0x0000000000000004``) -> ``["sw_power_cap"]``."""
    if mask is None:
        return None
    if isinstance(mask, str):
        value = cell_value(mask)
        if value is None:
            return None
        try:
            mask = int(value, 16)
        except ValueError:
            return None
    return [name for name, bit in REASON_BITS.items() if mask & bit]


def pcie_gen_max(device_max: int | None, host_max: int | None, link_max: int | None) -> int | None:
    """The highest PCIe generation the link can train to: the GPU's own maximum, capped
    by the host's where the driver prints it; the link's "Max" where neither is given."""
    if device_max is not None:
        return min(device_max, host_max) if host_max is not None else device_max
    return link_max


# --- GPUs that cannot be read --------------------------------------------------------


def unreadable(code: str, detail: str, **extra: Any) -> dict[str, Any]:
    return {"code": code, "detail": detail, **extra}


def device_unreadable(error: str) -> dict[str, Any]:
    """A GPU nvidia-smi could not get a handle for: lost where its error says so."""
    code = "gpu_lost" if "gpu is lost" in error.lower() else "gpu_unreadable"
    return unreadable(code, f"nvidia-smi: {error}")


def put_record(result: dict[str, dict[str, Any]], key: str, record: dict[str, Any]) -> None:
    """``record`` under ``key``, merged into one already there."""
    result[key] = merge_records(result[key], record) if key in result else record


def unreadable_gpus(lines: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{bus id: record}`` for each GPU an nvidia-smi output says it could not get a
    handle for ("Unable to determine the device handle for GPU ..."), each leaf None
    and ``unreadable`` saying why; ``{}`` when there is none."""
    lost: dict[str, dict[str, Any]] = {}
    for line in lines:
        match = DEVICE_HANDLE_RE.match(line.strip())
        if match is not None:
            record = empty_record()
            record["bus_id"] = normalize_bus_id(match.group(1))
            record["unreadable"] = device_unreadable(match.group(0))
            put_record(lost, record["bus_id"] or match.group(1), record)
    return lost


def add_missing(result: dict[str, dict[str, Any]], attached: int | None, listed: int) -> None:
    """The GPUs an output counts as attached but does not list, as one record."""
    if attached is None or attached <= listed:
        return
    record = empty_record()
    record["unreadable"] = unreadable(
        "gpu_missing", f"nvidia-smi counts {attached} attached GPU(s); its output lists "
        f"{listed}", attached=attached, listed=listed)
    result[MISSING_KEY] = record
