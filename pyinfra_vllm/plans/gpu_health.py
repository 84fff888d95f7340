"""Per-GPU health verdicts from the facts of facts/gpu_health.py: ok, degraded, unknown or
failing, with stable reason codes (Prometheus label values) and the action each one asks
for.

Pure functions over parsed data: no host access, so the audit, the monitoring exporter
and tools/gpu_health.py judge a GPU the same way.

Severities: "failing" means the GPU should not take work until acted on (an
uncorrectable error waiting for a reset to be remapped or retired, a remap that failed,
a fallen-off-the-bus or firmware fault, a tensor-parallel NVLink down); "degraded"
means it works but below spec or trending bad (a correctable remap pending, counters
rising, a hardware slowdown). "unknown" means what was to be read of it could not be:
it is never "ok", and ranks above degraded (it may hide anything) and below failing.
Informational states (SW power cap, idle PCIe link power saving, application-caused
Xids, NVLink not applicable or not queryable) give no reason at all.

The Xid table follows NVIDIA's Xid catalogue
(https://docs.nvidia.com/deploy/xid-errors/index.html and its catalogue for Ampere
and later, https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html) and
the memory error management guide for Ampere and later
(https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/index.html: Xid 48 is an
uncorrectable ECC error, 94 a contained one, 95 an uncontained one, 63 a row remap
recorded, 64 a remap that could not be recorded).
"""

from __future__ import annotations

import re
from typing import Any

from facts.gpu_health_record import MISSING_KEY, normalize_bus_id, same_gpu

RESET = "reset the GPU when no process uses it (nvidia-smi -r -i N), or reboot"
REBOOT = "reboot the host"
RMA = "replace the GPU (RMA)"
NVLINK_BRIDGE = "reseat/replace the NVLink bridge"
RESEAT = "reseat the GPU / check the riser"
COOLING = "check cooling and power"
APPLICATION = "check the application (its own fault); nothing to do on the GPU"

# code -> (NVIDIA's meaning, action, severity).
XID_CODES: dict[int, tuple[str, str, str]] = {
    8: ("GPU stopped processing (channel idle timeout)", APPLICATION, "info"),
    13: ("Graphics Engine Exception", APPLICATION, "info"),
    31: ("GPU memory page fault", APPLICATION, "info"),
    32: ("Invalid or corrupted push buffer stream", f"{RESEAT}; {RESET}", "degraded"),
    43: ("GPU stopped processing", APPLICATION, "info"),
    45: ("Preemptive cleanup, due to previous errors", APPLICATION, "info"),
    48: ("Double Bit ECC Error (uncorrectable)", f"{RESET}; {RMA} if it recurs", "failing"),
    61: ("Internal micro-controller breakpoint/warning", RESET, "failing"),
    62: ("Internal micro-controller halt", RESET, "failing"),
    63: ("ECC page retirement or row remapping recording event",
         f"{RESET} to activate the remap", "degraded"),
    64: ("ECC page retirement or row remapper recording failure", f"{RESET}; {RMA}",
         "failing"),
    74: ("NVLink error", f"{RESET}; {NVLINK_BRIDGE} if it recurs", "failing"),
    79: ("GPU has fallen off the bus", f"{REBOOT}; {RESEAT}", "failing"),
    92: ("High single-bit ECC error rate", f"{RMA} if it persists", "degraded"),
    94: ("Contained ECC error (the application using the memory was stopped)",
         f"{RESET} to remap the row", "degraded"),
    95: ("Uncontained ECC error", RESET, "failing"),
    119: ("GSP RPC timeout", RESET, "failing"),
    120: ("GSP error", RESET, "failing"),
    140: ("Unrecovered ECC error (the driver could not offline or remap the memory)",
          RESET, "failing"),
    154: ("GPU recovery action changed", f"{RESET} (the action the Xid text names)",
          "failing"),
}
UNKNOWN_XID = ("not in this suite's table: see NVIDIA's Xid catalogue", RESET, "degraded")

READ_AGAIN = ("read the GPU again (nvidia-smi -q, the kernel log); if it still cannot be "
              "read, check the driver, then the GPU")
# A record's "unreadable" code (facts/gpu_health.py) -> (severity, action).
UNREADABLE_CODES: dict[str, tuple[str, str]] = {
    "gpu_unreadable": ("unknown", f"{READ_AGAIN}: {REBOOT}; {RESEAT}"),
    "gpu_lost": ("failing", f"{REBOOT}; {RESEAT}"),
    "gpu_no_data": ("unknown", READ_AGAIN),
    "gpu_missing": ("unknown", READ_AGAIN),
}
# A kernel notice naming a failing GPU without an Xid (facts/gpu_health_logs.py) ->
# (what it says, action); its reason is "gpu_<notice>", failing.
NOTICES: dict[str, tuple[str, str]] = {
    "fallen_off_bus": ("GPU has fallen off the bus", f"{REBOOT}; {RESEAT}"),
    "init_failed": ("the driver could not initialise the GPU (RmInitAdapter failed)",
                    f"{REBOOT}; {RESEAT}; check that the driver supports this GPU"),
    "lost": ("GPU is lost", f"{REBOOT}; {RESEAT}"),
}
# Read on the host, but nothing of this GPU (pyinfra_vllm/plans/gpu_health.py
# host_gpu_health): reason code -> (detail, action).
NOT_READ: dict[str, tuple[str, str]] = {
    "health_not_read": ("nvidia-smi -q gave no health record of this GPU: its ECC, row "
                        "remapping, clocks and PCIe link are unknown", READ_AGAIN),
    "kernel_log_not_read": ("the kernel log could not be read (neither the journal nor "
                            "dmesg answered): its Xids are unknown",
                            "read it as root (sudo dmesg); check journald"),
}

_HW_SLOWDOWN = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
_SEVERITY_RANK = {"degraded": 1, "unknown": 2, "failing": 3}
VERDICTS = ("ok", "degraded", "unknown", "failing")


def reason(code: str, severity: str, detail: str, action: str) -> dict[str, str]:
    """One reason of a verdict: its stable code, severity, detail and what to do."""
    return {"code": code, "severity": severity, "detail": detail, "action": action}


def _get(record: dict[str, Any] | None, *path: str) -> Any:
    value: Any = record
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _positive(value: Any) -> bool:
    return isinstance(value, int) and value > 0


def _memory_reasons(health: dict[str, Any]) -> list[dict[str, str]]:
    """ECC, row remapping and page retirement."""
    reasons = []
    rows, pages = health.get("remapped_rows") or {}, health.get("retired_pages") or {}
    volatile_unc = _get(health, "ecc", "volatile", "uncorrectable")
    uncorrectable_pending = (
        _get(health, "ecc", "pending") is True
        or (rows.get("pending") is True and _positive(rows.get("uncorrectable")))
        or (pages.get("pending") is True
            and (_positive(pages.get("double_bit")) or _positive(volatile_unc)))
    )
    if uncorrectable_pending:
        reasons.append(reason("ecc_uncorrectable_pending", "failing",
                               "uncorrectable memory errors with a repair (row remap, page "
                               "retirement, channel/TPC repair) pending a reset", RESET))
    elif rows.get("pending") is True:
        reasons.append(reason("row_remap_pending", "degraded",
                               f"{rows.get('correctable') or 0} correctable row remap(s) "
                               "pending a reset", RESET))
    elif pages.get("pending") is True:
        reasons.append(reason("retired_pages_pending", "degraded",
                               "page retirement pending a reset", RESET))
    if rows.get("failure") is True:
        reasons.append(reason("row_remap_failure", "failing",
                               "a row remapping failed: the memory cannot be repaired", RMA))
    # Degraded, not failing: since the last reset the GPU had an uncorrectable error,
    # but that error was handled (contained and the page offlined on Ampere and later;
    # the context killed on older GPUs). What still needs the reset is the pending
    # remap or retirement, judged above as failing; without one, the GPU serves.
    if _positive(volatile_unc):
        reasons.append(reason("ecc_volatile_uncorrectable", "degraded",
                               f"{volatile_unc} uncorrectable ECC error(s) since the last "
                               "reset", f"{RESET}; {RMA} if it recurs"))
    return reasons


def _is_idle(health: dict[str, Any], busy: bool) -> bool:
    """A GPU in a power-saving state, whose PCIe link may train down on purpose: the
    Idle clocks event reason, P8 or deeper, or no utilization and no process. Without
    any of those signals, a GPU no process uses counts as idle."""
    active = _get(health, "clocks_event_reasons", "active") or []
    match = re.match(r"^P(\d+)$", health.get("pstate") or "")
    utilization = health.get("utilization_gpu")
    if "idle" in active or (match is not None and int(match.group(1)) >= 8):
        return True
    if busy:
        return False
    return utilization == 0 or (utilization is None and match is None and not active)


def _link_reasons(health: dict[str, Any], busy: bool) -> list[dict[str, str]]:
    """PCIe width/generation and the clocks event reasons."""
    reasons = []
    pcie = health.get("pcie") or {}
    width, width_max = pcie.get("width_current"), pcie.get("width_max")
    gen, gen_max = pcie.get("gen_current"), pcie.get("gen_max")
    if isinstance(width, int) and isinstance(width_max, int) and width < width_max:
        reasons.append(reason("pcie_degraded", "degraded",
                               f"PCIe link x{width} of x{width_max}", RESEAT))
    elif (isinstance(gen, int) and isinstance(gen_max, int) and gen < gen_max
          and not _is_idle(health, busy)):
        reasons.append(reason("pcie_degraded", "degraded",
                               f"PCIe link gen {gen} of {gen_max} while not idle", RESEAT))
    active = _get(health, "clocks_event_reasons", "active") or []
    hardware = [name for name in _HW_SLOWDOWN if name in active]
    if hardware:
        reasons.append(reason("hw_slowdown", "degraded",
                               "hardware clock slowdown active: " + ", ".join(hardware),
                               COOLING))
    if "sw_thermal_slowdown" in active and busy:
        reasons.append(reason("thermal_slowdown", "degraded",
                               "SW thermal slowdown active under load", COOLING))
    return reasons


def _xid_reasons(xids: list[dict[str, Any]]) -> list[dict[str, str]]:
    by_code: dict[int, list[dict[str, Any]]] = {}
    for event in xids:
        by_code.setdefault(int(event["code"]), []).append(event)
    reasons = []
    for code in sorted(by_code):
        meaning, action, severity = XID_CODES.get(code, UNKNOWN_XID)
        if severity == "info":
            continue
        events = by_code[code]
        times = [event.get("time") for event in events if event.get("time")]
        when = f", first {times[0]}, last {times[-1]}" if times else ""
        reasons.append(reason(f"xid_{code}", severity,
                               f"Xid {code} ({meaning}): {len(events)} event(s){when}", action))
    return reasons


def _unreadable_reasons(health: dict[str, Any]) -> list[dict[str, str]]:
    """What a record that could not be read says (facts/gpu_health.py ``unreadable``)."""
    unreadable = health.get("unreadable")
    if not isinstance(unreadable, dict):
        return []
    code = str(unreadable.get("code") or "gpu_unreadable")
    severity, action = UNREADABLE_CODES.get(code, ("unknown", READ_AGAIN))
    return [reason(code, severity, str(unreadable.get("detail") or code), action)]


def _notice_reasons(notices: list[dict[str, Any]]) -> list[dict[str, str]]:
    by_notice: dict[str, list[dict[str, Any]]] = {}
    for notice in notices:
        by_notice.setdefault(str(notice["notice"]), []).append(notice)
    reasons = []
    for name, found in by_notice.items():
        meaning, action = NOTICES.get(name, (name.replace("_", " "), f"{REBOOT}; {RESEAT}"))
        times = [notice.get("time") for notice in found if notice.get("time")]
        when = f", first {times[0]}, last {times[-1]}" if times else ""
        reasons.append(reason(f"gpu_{name}", "failing",
                               f"kernel log: {meaning}: {len(found)} notice(s){when}", action))
    return reasons


def not_read_reason(code: str) -> dict[str, str]:
    """The unknown reason of something read on the host that says nothing of a GPU."""
    detail, action = NOT_READ[code]
    return reason(code, "unknown", detail, action)


def judged(reasons: list[dict[str, str]]) -> dict[str, Any]:
    """``{"verdict", "reasons"}``: the verdict is the worst reason's severity."""
    worst = max((_SEVERITY_RANK[found["severity"]] for found in reasons), default=0)
    return {"verdict": VERDICTS[worst], "reasons": reasons}


def _nvlink_reasons(links: list[dict[str, Any]] | None, had_nvlink: bool) -> list[dict[str, str]]:
    if links is None:
        return []
    inactive = [link["link"] for link in links if not link.get("active")]
    if inactive:
        detail = "NVLink link(s) inactive: " + ", ".join(str(link) for link in inactive)
    elif not links and had_nvlink:
        detail = "all NVLink links inactive"
    else:
        return []
    return [reason("nvlink_down", "failing", detail, f"{NVLINK_BRIDGE}; {RESET}")]


def gpu_counters(
    health: dict[str, Any] | None,
    nvlink_errors: dict[int, dict[str, int | None]] | None = None,
    xids: list[dict[str, Any]] | None = None,
) -> dict[str, int]:
    """The flat integer counters of one GPU (only those with a known value)."""
    booleans = {"remapped_rows_pending": ("remapped_rows", "pending"),
                "remapped_rows_failure": ("remapped_rows", "failure")}
    paths = {
        "ecc_volatile_correctable": ("ecc", "volatile", "correctable"),
        "ecc_volatile_uncorrectable": ("ecc", "volatile", "uncorrectable"),
        "ecc_aggregate_correctable": ("ecc", "aggregate", "correctable"),
        "ecc_aggregate_uncorrectable": ("ecc", "aggregate", "uncorrectable"),
        "remapped_rows_correctable": ("remapped_rows", "correctable"),
        "remapped_rows_uncorrectable": ("remapped_rows", "uncorrectable"),
        "retired_pages_single_bit": ("retired_pages", "single_bit"),
        "retired_pages_double_bit": ("retired_pages", "double_bit"),
        "pcie_replays": ("pcie", "replays"),
        "pcie_width_current": ("pcie", "width_current"),
        "pcie_width_max": ("pcie", "width_max"),
        "pcie_gen_current": ("pcie", "gen_current"),
        "pcie_gen_max": ("pcie", "gen_max"),
    }
    counters: dict[str, int] = {}
    for name, path in paths.items():
        value = _get(health, *path)
        if isinstance(value, int) and not isinstance(value, bool):
            counters[name] = value
    for name, path in booleans.items():
        flag = _get(health, *path)
        if isinstance(flag, bool):
            counters[name] = int(flag)
    if nvlink_errors:
        values = [value for link in nvlink_errors.values() for value in link.values()
                  if isinstance(value, int)]
        if values:
            counters["nvlink_errors"] = sum(values)
    if xids is not None:
        counters["xid_events"] = len(xids)
    return counters


_RISING = (
    ("ecc_correctable_rising", ("ecc_aggregate_correctable", "ecc_volatile_correctable"),
     "correctable ECC errors rising", f"{RMA} if it keeps rising"),
    ("nvlink_errors_rising", ("nvlink_errors",), "NVLink error counters rising",
     f"{NVLINK_BRIDGE} if it keeps rising"),
    ("pcie_replays_rising", ("pcie_replays",), "PCIe replays rising", RESEAT),
)


def _rising_reasons(now: dict[str, int], before: dict[str, int]) -> list[dict[str, str]]:
    reasons = []
    for code, names, detail, action in _RISING:
        for name in names:
            if name in now and name in before and now[name] > before[name]:
                reasons.append(reason(code, "degraded",
                                       f"{detail}: {before[name]} -> {now[name]} ({name})",
                                       action))
                break
    return reasons


def _previous_counters(previous: dict[str, Any] | None) -> dict[str, int] | None:
    if previous is None:
        return None
    if isinstance(previous.get("counters"), dict):
        return previous["counters"]
    return gpu_counters(previous.get("health"), previous.get("nvlink_errors"))


def gpu_verdict(
    health: dict[str, Any] | None,
    *,
    xids: list[dict[str, Any]] | tuple[dict[str, Any], ...] = (),
    notices: list[dict[str, Any]] | tuple[dict[str, Any], ...] = (),
    nvlink_links: list[dict[str, Any]] | None = None,
    nvlink_errors: dict[int, dict[str, int | None]] | None = None,
    tp_member: bool = False,
    previous: dict[str, Any] | None = None,
    busy: bool = False,
) -> dict[str, Any]:
    """One GPU's verdict: ``{"verdict": "ok"|"degraded"|"unknown"|"failing", "reasons":
    [{"code", "severity", "detail", "action"}]}``, the verdict being the worst reason's
    severity.

    ``health`` is a facts/gpu_health record (None: only the other inputs are judged;
    one with ``unreadable`` is unknown, or failing where nvidia-smi said the GPU is
    lost); ``xids`` this GPU's kernel log events and ``notices`` its kernel notices
    (facts/gpu_health_logs.py: failing); ``nvlink_links`` its facts.topology
    NvlinkStatus links (None: not judged; ``[]`` is "down" only where the GPU has
    NVLink: error counters, or links in ``previous``); NVLink is judged for a
    ``tp_member`` only. ``previous`` is an earlier input of the same GPU
    (``{"health", "nvlink_errors", "nvlink_links"}``) or an earlier host_gpu_health
    entry (``{"counters"}``): counters higher now are "rising"; without it nothing is.
    ``busy``: a process runs on the GPU.
    """
    reasons: list[dict[str, str]] = []
    if health is not None:
        reasons += _unreadable_reasons(health)
        reasons += _memory_reasons(health)
        reasons += _link_reasons(health, busy)
    reasons += _xid_reasons(list(xids))
    reasons += _notice_reasons(list(notices))
    if tp_member:
        had = bool(nvlink_errors) or bool((previous or {}).get("nvlink_links"))
        reasons += _nvlink_reasons(nvlink_links, had)
    before = _previous_counters(previous)
    if before is not None:
        reasons += _rising_reasons(gpu_counters(health, nvlink_errors), before)
    return judged(reasons)


def _by_index(mapping: dict[Any, Any] | None, index: int | None) -> Any:
    if not mapping or index is None:
        return None
    return mapping.get(index, mapping.get(str(index)))


def _host_gpus(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """bus id -> {"index", "name", "uuid", "health"} from GpuHealth and GpuInventory.
    GpuHealth's record of the GPUs its output counts but does not list (MISSING_KEY)
    stands on its own only without an inventory: with one, each GPU of it that has no
    record is judged on its own (health_not_read)."""
    gpus: dict[str, dict[str, Any]] = {}
    inventory = state.get("gpus") or []
    for key, record in (state.get("gpu_health") or {}).items():
        if key == MISSING_KEY and inventory:
            continue
        bus_id = normalize_bus_id(record.get("bus_id")) or key
        gpus[bus_id] = {"index": record.get("index"), "name": record.get("name"),
                        "uuid": None, "health": record}
    for row in inventory:
        bus_id = normalize_bus_id(row.get("pci_bus_id"))
        if bus_id is None:
            continue
        entry = gpus.setdefault(bus_id, {"index": None, "name": None, "uuid": None,
                                         "health": None})
        # The inventory's index is nvidia-smi's own: it wins over a -q block position.
        entry["index"] = row.get("index", entry["index"])
        entry["name"] = entry["name"] or row.get("name")
        entry["uuid"] = row.get("uuid")
    return gpus


def _not_read(state: dict[str, Any], gpu: dict[str, Any]) -> list[dict[str, str]]:
    """The unknown reasons of a GPU whose health, or whose host's kernel log, was read
    and says nothing of it. A state without the key was not read: nothing is said."""
    reasons = []
    if "gpu_health" in state and gpu["health"] is None:
        reasons.append(not_read_reason("health_not_read"))
    if "xid" in state and state["xid"] is None:
        reasons.append(not_read_reason("kernel_log_not_read"))
    return reasons


def host_gpu_health(
    state: dict[str, Any], tp_indices: list[int], previous: dict[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    """Every GPU of a host judged: ``{bus_id: {"index", "name", "verdict", "reasons",
    "counters"}}``.

    ``state`` holds the facts: ``"gpu_health"`` (GpuHealth), ``"nvlink"``
    (NvlinkStatus), ``"nvlink_errors"`` (NvlinkErrors), ``"xid"`` (XidEvents),
    ``"processes"`` (GpuProcesses) and ``"gpus"`` (GpuInventory), any of them None or
    missing. A GPU is unknown where ``gpu_health`` was read (the key is there) and has
    no record of it, or where ``xid`` was read and is None (the kernel log could not
    be). ``tp_indices``: the GPUs of the tensor-parallel group. ``previous``: an
    earlier result of this function (its counters). An Xid or a kernel notice whose
    PCI address matches no GPU (one that fell off the bus is no longer listed) is
    reported under that address with index None. ``{}`` when the state has no GPU
    data at all.
    """
    gpus = _host_gpus(state)
    xid_state = state.get("xid")
    log = xid_state if isinstance(xid_state, dict) else {}
    events = list(log.get("events") or []) if isinstance(xid_state, dict) else None
    notices = list(log.get("notices") or [])
    busy_uuids = {row.get("gpu_uuid") for row in state.get("processes") or []}
    result: dict[str, dict[str, Any]] = {}
    for bus_id, gpu in gpus.items():
        index = gpu["index"]
        mine = [event for event in events or [] if same_gpu(bus_id, event["pci"])]
        errors = _by_index(state.get("nvlink_errors"), index)
        verdict = gpu_verdict(
            gpu["health"], xids=mine,
            notices=[notice for notice in notices if same_gpu(bus_id, notice["pci"])],
            nvlink_links=_by_index(state.get("nvlink"), index),
            nvlink_errors=errors, tp_member=index in tp_indices,
            previous=(previous or {}).get(bus_id),
            busy=gpu["uuid"] is not None and gpu["uuid"] in busy_uuids,
        )
        verdict = judged(_not_read(state, gpu) + verdict["reasons"])
        counters = gpu_counters(gpu["health"], errors, mine if events is not None else None)
        result[bus_id] = {"index": index, "name": gpu["name"], **verdict, "counters": counters}
    _orphan_xids(result, events or [], notices, previous)
    return result


def _orphan_xids(
    result: dict[str, dict[str, Any]], events: list[dict[str, Any]],
    notices: list[dict[str, Any]], previous: dict[str, Any] | None,
) -> None:
    """The Xids and notices of GPUs ``result`` does not hold, under their PCI address."""
    known = [bus_id for bus_id in result if ":" in bus_id]
    orphans: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
    for position, found in enumerate((events, notices)):
        for item in found:
            if not any(same_gpu(bus_id, item["pci"]) for bus_id in known):
                orphans.setdefault(item["pci"], ([], []))[position].append(item)
    for pci, (mine, told) in orphans.items():
        verdict = gpu_verdict(None, xids=mine, notices=told, previous=(previous or {}).get(pci))
        result[pci] = {"index": None, "name": None, **verdict,
                       "counters": gpu_counters(None, None, mine)}
