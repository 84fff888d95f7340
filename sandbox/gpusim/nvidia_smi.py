#!/usr/bin/env python3
"""Simulated `nvidia-smi` for sandbox hosts that have no GPU (installed as /usr/bin/nvidia-smi).

Single file, Python 3.11 stdlib only: it ships in the simulated nvidia-utils package and runs on
Debian 12's python3. Its whole world is one JSON state file (default /var/lib/gpusim/state.json,
env GPUSIM_STATE overrides it), written by `gpusimctl` and the simulated nvidia-persistenced.

The output follows real nvidia-smi byte for byte where a real capture exists (see README.md in
this directory for the sources and for what is extrapolated). Three table layouts exist because
NVIDIA changed the default table twice: the 89-column R535 table, the 91-column R550/R555 one
and the R570+/R580 one (wider PID column, `+---` rule under the header).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_STATE = "/var/lib/gpusim/state.json"

# nvidia-smi's documented return values (man nvidia-smi, RETURN VALUE), plus 18 which is what
# it really returns on a driver/library mismatch (it passes NVML_ERROR_LIB_RM_VERSION_MISMATCH
# through; seen in anderskm/gputil#55 and mozilla/translations#1167).
EXIT_OK = 0
EXIT_BAD_ARG = 2
EXIT_NOT_SUPPORTED = 3
EXIT_NO_PERMISSION = 4
EXIT_NOT_FOUND = 6
EXIT_DRIVER_NOT_LOADED = 9
EXIT_LIB_RM_MISMATCH = 18
EXIT_OTHER = 255

NO_DRIVER_MSG = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)
HELP_HINT = "Please run 'nvidia-smi -h' for help."

TOPO_LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""

P2P_LEGEND = """
Legend:

  X    = Self
  OK   = Status Ok
  CNS  = Chipset not supported
  GNS  = GPU not supported
  TNS  = Topology not supported
  NS   = Not supported
  U    = Unknown
"""

UNDERLINE, RESET = "\x1b[4m", "\x1b[0m"


class SmiExit(Exception):
    """Stop with this text on stdout and this exit code (nvidia-smi prints errors on stdout)."""

    def __init__(self, text: str, code: int) -> None:
        super().__init__(text)
        self.text = text
        self.code = code


# ---------------------------------------------------------------------------------- state file


def state_path() -> Path:
    return Path(os.environ.get("GPUSIM_STATE", DEFAULT_STATE))


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it holds no GPU any more.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def daemon_alive(daemon: dict | None) -> bool:
    """Is the recorded persistence daemon still running? Its pid alone is not enough:
    pids are small and reused quickly in a container, above all after a reboot."""
    pid = (daemon or {}).get("pid")
    if not pid_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"nvidia-persistenced" in cmdline or b"nvidia_persistenced" in cmdline



def prune(state: dict) -> dict:
    """Drop what died: processes whose pid is gone, a persistence daemon that is not running."""
    state["processes"] = [p for p in state.get("processes", []) if pid_alive(p.get("pid"))]
    daemon = state.get("persistenced")
    if daemon and not daemon_alive(daemon):
        state["persistenced"] = None
        for gpu in state.get("gpus", []):
            gpu["persistence_daemon"] = False
    return state


def load_state(path: Path | None = None) -> dict | None:
    path = path or state_path()
    try:
        return prune(json.loads(path.read_text()))
    except FileNotFoundError:
        return None


def save_state(state: dict, path: Path | None = None) -> None:
    """Atomic replace, so a concurrent reader never sees half a file."""
    path = path or state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".state-", dir=path.parent)
    with os.fdopen(fd, "w") as handle:
        json.dump(state, handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


@contextlib.contextmanager
def locked_state(path: Path | None = None):
    """Read-modify-write under an exclusive lock; yields the state (None if there is none)."""
    path = path or state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = load_state(path)
        yield state
        if state is not None:
            save_state(state, path)


# ------------------------------------------------------------------------------ small helpers


def major(version: str) -> int:
    return int(version.split(".")[0])


def layout(state: dict) -> str:
    """Which generation of nvidia-smi output to print (see the module docstring)."""
    m = major(state["driver"]["installed_version"])
    if m >= 570:
        return "r580"
    if m >= 545:
        return "r555"
    return "r535"


def persistence_on(state: dict, gpu: dict) -> bool:
    return bool(gpu.get("persistence_legacy")) or bool(
        gpu.get("persistence_daemon") and state.get("persistenced")
    )


def on_off(flag: bool) -> str:
    return "Enabled" if flag else "Disabled"


def used_mib(state: dict, gpu: dict) -> int:
    procs = [p for p in state.get("processes", []) if p["gpu"] == gpu["index"]]
    return gpu.get("memory_base_used_mib", 0) + sum(p.get("used_mib", 0) for p in procs)


def free_mib(state: dict, gpu: dict) -> int:
    # NVML counts bytes and rounds each figure on its own; the bias keeps a captured host exact.
    return (gpu["memory_total_mib"] - gpu.get("memory_reserved_mib", 0) - used_mib(state, gpu)
            + gpu.get("memory_free_bias_mib", 0))


def gpu_processes(state: dict, gpu: dict) -> list[dict]:
    return [p for p in state.get("processes", []) if p["gpu"] == gpu["index"]]


def power(watts: float) -> str:
    return f"{watts:.2f} W"


def timestamp() -> str:
    fixed = os.environ.get("GPUSIM_TIME")  # tests pin the clock
    when = time.localtime(float(fixed)) if fixed else time.localtime()
    return time.strftime("%a %b %e %H:%M:%S %Y", when)


def check_driver(state: dict | None) -> None:
    """What NVML init would say: no module, or a module that is not the library's version."""
    drv = (state or {}).get("driver") or {}
    if not drv.get("installed_version") or not drv.get("module_loaded"):
        raise SmiExit(NO_DRIVER_MSG, EXIT_DRIVER_NOT_LOADED)
    if drv.get("module_version") != drv["installed_version"]:
        lib = ".".join(drv["installed_version"].split(".")[:2])
        raise SmiExit(
            "Failed to initialize NVML: Driver/library version mismatch\n"
            f"NVML library version: {lib}\n",
            EXIT_LIB_RM_MISMATCH,
        )


def select_gpus(state: dict, ids: str | None) -> list[dict]:
    """-i takes indexes, PCI bus ids or UUIDs, comma separated."""
    gpus = state["gpus"]
    if ids is None:
        return gpus
    chosen = []
    for token in ids.split(","):
        token = token.strip()
        match = [g for g in gpus if token in (str(g["index"]), g["uuid"])
                 or token.upper() in (g["pci_bus_id"], g["pci_bus_id"][4:])]
        if not match:
            raise SmiExit("No devices were found\n", EXIT_NOT_FOUND)
        chosen.extend(m for m in match if m not in chosen)
    return chosen


# ------------------------------------------------------------------- GPU health (gpusimctl fault)
# Each GPU's faults live in its "health" dict; a missing key is the healthy default, so state
# files written before faults existed read as healthy GPUs.

ECC_KEYS = ("sram_correctable", "sram_uncorrectable_parity", "sram_uncorrectable_secded",
            "dram_correctable", "dram_uncorrectable")


def health(gpu: dict) -> dict:
    return gpu.get("health") or {}


def ecc_counts(gpu: dict) -> dict:
    ecc = health(gpu).get("ecc", {})
    return {scope: {key: int(ecc.get(scope, {}).get(key, 0)) for key in ECC_KEYS}
            for scope in ("volatile", "aggregate")}


def remap(gpu: dict) -> dict:
    rows = health(gpu).get("remapped_rows", {})
    return {"correctable": int(rows.get("correctable", 0)),
            "uncorrectable": int(rows.get("uncorrectable", 0)),
            "pending": bool(rows.get("pending", False)), "failure": bool(rows.get("failure", False))}


def default_banks(gpu: dict) -> int:
    """Bank Remap Availability Histogram "Max" of a healthy board (H200 capture: 3072; H100
    535 capture: 2560; A100 80GB: 640, from the A100-SXM4-80GB excerpt's 639 + 1)."""
    name = gpu["name"]
    if "H200" in name:
        return 3072
    if "H100" in name:
        return 2560
    return 640


def pcie_link(gpu: dict) -> dict:
    """PCIe generation and width: the board's maximum (A100: Gen4, Hopper: Gen5, x16) and what
    the link trained to (a pcie-width fault lowers the width)."""
    gen_max = int(gpu.get("pcie_gen_max", 5 if gpu.get("architecture") == "Hopper" else 4))
    width_max = int(gpu.get("pcie_width_max", 16))
    pcie = health(gpu).get("pcie", {})
    return {"gen_max": gen_max, "gen_current": int(pcie.get("gen_current", gen_max)),
            "width_max": width_max, "width_current": int(pcie.get("width_current", width_max))}


def nvlink_down(gpu: dict) -> set[int]:
    return {int(n) for n in health(gpu).get("nvlink_down", [])}


def nvlink_errors(gpu: dict, link: int) -> dict:
    errs = health(gpu).get("nvlink_errors", {}).get(str(link), {})
    return {key: int(errs.get(key, 0)) for key in ("replay", "recovery", "crc")}


def reset_health(gpu: dict) -> None:
    """What a GPU reset or reboot does to the counters: volatile ECC counts start again at 0
    and a pending row remap takes effect (Pending: No; the remapped row stays counted)."""
    h = gpu.get("health")
    if not h:
        return
    if "ecc" in h:
        h["ecc"].pop("volatile", None)
    if "remapped_rows" in h:
        h["remapped_rows"]["pending"] = False


def volatile_uncorrectable(gpu: dict) -> int:
    vol = ecc_counts(gpu)["volatile"]
    return (vol["dram_uncorrectable"] + vol["sram_uncorrectable_parity"]
            + vol["sram_uncorrectable_secded"])


# ------------------------------------------------------------------------------ default table


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _table_geometry(kind: str) -> tuple[int, int]:
    """(total width, width of the middle column)."""
    return (89, 22) if kind == "r535" else (91, 24)


def _header_lines(state: dict, kind: str) -> list[str]:
    drv = state["driver"]
    total, mid = _table_geometry(kind)
    rule = "+" + "-" * (total - 2) + "+"
    ver = drv["installed_version"]
    drv_w = 13 if kind == "r535" else 15
    title = (f"| NVIDIA-SMI {ver:<23}Driver Version: {ver:<{drv_w}}"
             f"CUDA Version: {drv['cuda_version']:<9}|")
    sep_char = "+" if kind == "r580" else "|"
    sep = f"{sep_char}{'-' * 41}+{'-' * mid}+{'-' * 22}+"
    col2 = ("Bus-Id        Disp.A", "        Memory-Usage") if kind == "r535" else (
        "Bus-Id          Disp.A", "          Memory-Usage")
    return [
        rule,
        title,
        sep,
        f"| GPU  Name                 Persistence-M | {col2[0]} | Volatile Uncorr. ECC |",
        f"| Fan  Temp   Perf          Pwr:Usage/Cap | {col2[1]} | GPU-Util  Compute M. |",
        f"|                                         | {' ' * (mid - 2)} |               MIG M. |",
        f"|{'=' * 41}+{'=' * mid}+{'=' * 22}|",
    ]


def _gpu_block(state: dict, gpu: dict, kind: str) -> list[str]:
    _, mid = _table_geometry(kind)
    mig_on = gpu.get("mig_current") == "Enabled"
    pm = "On" if persistence_on(state, gpu) else "Off"
    left1 = f"{gpu['index']:>4}  {_fit(gpu['name'], 31):<31}{pm:<4}"
    pad = 1 if kind == "r535" else 3
    mid1 = f"{' ' * pad}{gpu['pci_bus_id']} {gpu.get('display_active', 'Off'):>3} "
    # Real R535 output shows "On" in the ECC cell and N/A utilisation while MIG is current.
    ecc = "On" if mig_on else str(gpu.get("ecc_errors", 0) + volatile_uncorrectable(gpu))
    right1 = f"{ecc:>21} "
    fan = gpu.get("fan", "N/A")
    temp = f"{gpu['temperature_c']}C"
    usage = f"{round(gpu['power_draw_w'])}W"
    cap = f"{round(gpu['power_limit_w'])}W"
    if kind == "r535":
        left2 = f" {fan:>3}   {temp:>3}    {gpu['pstate']:<2}{usage:>17} / {cap:>4} "
        mid2 = f"{used_mib(state, gpu):>7}MiB / {gpu['memory_total_mib']:>5}MiB "
    else:
        left2 = f" {fan:>3}   {temp:>3}    {gpu['pstate']:<2}{usage:>16} / {cap:>5} "
        mid2 = f"{used_mib(state, gpu):>8}MiB / {gpu['memory_total_mib']:>6}MiB "
    util = "N/A" if mig_on else f"{gpu.get('utilization', 0)}%"
    right2 = f"{util:>8}{gpu.get('compute_mode', 'Default'):>13} "
    mig = gpu.get("mig_pending", "N/A") if gpu.get("mig_capable", True) else "N/A"
    # A pending MIG change shows as the pending mode with a star (real R470-era capture).
    if gpu.get("mig_capable", True) and gpu.get("mig_pending") != gpu.get("mig_current"):
        mig += "*"
    right3 = f"{mig:>21} "
    return [
        f"|{left1}|{mid1}|{right1}|",
        f"|{left2}|{mid2}|{right2}|",
        f"|{' ' * 41}|{' ' * mid}|{right3}|",
        f"+{'-' * 41}+{'-' * mid}+{'-' * 22}+",
    ]


def _mig_section(state: dict, kind: str) -> list[str]:
    """R535 layout; no instance is ever created in the simulator, so the body is always empty."""
    total = 89
    return [
        "+" + "-" * (total - 2) + "+",
        f"| {'MIG devices:':<{total - 3}}|",
        "+------------------+--------------------------------+-----------+-----------------------+",
        "| GPU  GI  CI  MIG |                   Memory-Usage |        Vol|      Shared           |",
        "|      ID  ID  Dev |                     BAR1-Usage | SM     Unc| CE ENC DEC OFA JPG    |",
        "|                  |                                |        ECC|                       |",
        "|==================+================================+===========+=======================|",
        f"|  {'No MIG devices found':<{total - 4}}|",
        "+" + "-" * (total - 2) + "+",
    ]


def _process_lines(state: dict, kind: str) -> list[str]:
    total = _table_geometry(kind)[0]
    pid_w = 16 if kind == "r580" else 10
    name_w = total - 51 - (pid_w - 10)
    head = {
        "r535": "|  GPU   GI   CI        PID   Type   Process name                            GPU Memory |",
        "r555": "|  GPU   GI   CI        PID   Type   Process name                              GPU Memory |",
        "r580": "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
    }[kind]
    lines = [
        "+" + "-" * (total - 2) + "+",
        f"| {'Processes:':<{total - 3}}|",
        head,
        f"|        ID   ID{' ' * (total - 28)}Usage      |",
        "|" + "=" * (total - 2) + "|",
    ]
    procs = sorted(state.get("processes", []), key=lambda p: (p["gpu"], p["pid"]))
    if not procs:
        lines.append(f"|  {'No running processes found':<{total - 4}}|")
    for proc in procs:
        name = proc.get("name", "python3")
        if len(name) > name_w:
            name = "..." + name[-(name_w - 3):]
        mem = f"{proc.get('used_mib', 0)}MiB"
        lines.append(f"|{proc['gpu']:>5}{'N/A':>6}{'N/A':>5}{proc['pid']:>{pid_w}}"
                     f"{proc.get('type', 'C'):>7}   {name:<{name_w}}{mem:>12} |")
    lines.append("+" + "-" * (total - 2) + "+")
    return lines


def render_table(state: dict, gpus: list[dict]) -> str:
    kind = layout(state)
    # R535 and R555 print a line of 89 spaces between sections; R580 an empty line.
    blank = "" if kind == "r580" else " " * 89
    lines = [timestamp() + "       "] + _header_lines(state, kind)
    for gpu in gpus:
        lines += _gpu_block(state, gpu, kind)
    if kind == "r535" and any(g.get("mig_current") == "Enabled" for g in gpus):
        lines += [blank] + _mig_section(state, kind)
    lines += [blank] + _process_lines(state, kind)
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- -L and queries


def render_list(state: dict, gpus: list[dict]) -> str:
    return "".join(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})\n" for g in gpus)


# field -> (header name, unit or None, getter). Aliases map to the canonical header.
def _gpu_fields(state: dict) -> dict:
    drv = state["driver"]
    return {
        "index": ("index", None, lambda g: str(g["index"])),
        "count": ("count", None, lambda g: str(len(state["gpus"]))),
        "name": ("name", None, lambda g: g["name"]),
        "uuid": ("uuid", None, lambda g: g["uuid"]),
        "serial": ("serial", None, lambda g: g.get("serial", "[N/A]")),
        "pci.bus_id": ("pci.bus_id", None, lambda g: g["pci_bus_id"]),
        "pci.device_id": ("pci.device_id", None, lambda g: g.get("pci_device_id", "[N/A]")),
        "memory.total": ("memory.total", "MiB", lambda g: str(g["memory_total_mib"])),
        "memory.reserved": ("memory.reserved", "MiB",
                            lambda g: str(g.get("memory_reserved_mib", 0))),
        "memory.used": ("memory.used", "MiB", lambda g: str(used_mib(state, g))),
        "memory.free": ("memory.free", "MiB", lambda g: str(free_mib(state, g))),
        "mig.mode.current": ("mig.mode.current", None,
                             lambda g: g.get("mig_current") or "[N/A]"),
        "mig.mode.pending": ("mig.mode.pending", None,
                             lambda g: g.get("mig_pending") or "[N/A]"),
        "persistence_mode": ("persistence_mode", None,
                             lambda g: on_off(persistence_on(state, g))),
        "driver_version": ("driver_version", None, lambda g: drv["module_version"]),
        "vbios_version": ("vbios_version", None, lambda g: g.get("vbios", "[N/A]")),
        "temperature.gpu": ("temperature.gpu", None, lambda g: str(g["temperature_c"])),
        "power.limit": ("power.limit", "W", lambda g: f"{g['power_limit_w']:.2f}"),
        "power.draw": ("power.draw", "W", lambda g: f"{g['power_draw_w']:.2f}"),
        "pstate": ("pstate", None, lambda g: g["pstate"]),
        "compute_cap": ("compute_cap", None, lambda g: g["compute_cap"]),
        "clocks.max.sm": ("clocks.max.sm", "MHz", lambda g: str(g.get("clocks_max_sm_mhz", 0))),
        "ecc.mode.current": ("ecc.mode.current", None, lambda g: g.get("ecc_mode", "Enabled")),
        "utilization.gpu": ("utilization.gpu", "%", lambda g: str(g.get("utilization", 0))),
        "compute_mode": ("compute_mode", None, lambda g: g.get("compute_mode", "Default")),
    }


GPU_ALIASES = {
    "gpu_name": "name", "gpu_uuid": "uuid", "gpu_bus_id": "pci.bus_id", "gpu_serial": "serial",
    "persistence-mode": "persistence_mode", "pcie.bus_id": "pci.bus_id",
    "temperature": "temperature.gpu", "enforced.power.limit": "power.limit",
    "compute_capability": "compute_cap",
}


def parse_format(fmt: str | None) -> tuple[bool, bool]:
    """--format=csv[,noheader][,nounits] -> (header, units)."""
    if fmt is None:
        raise SmiExit(f'"--format=" switch is missing. {HELP_HINT}\n', EXIT_BAD_ARG)
    parts = [p.strip() for p in fmt.split(",") if p.strip()]
    if "csv" not in parts or any(p not in ("csv", "noheader", "nounits") for p in parts):
        raise SmiExit(f'"{fmt}" is not a valid format. {HELP_HINT}\n', EXIT_BAD_ARG)
    return "noheader" not in parts, "nounits" not in parts


def _csv(rows: list[list[str]]) -> str:
    return "".join(", ".join(row) + "\n" for row in rows)


def render_query_gpu(state: dict, gpus: list[dict], fields: str, fmt: str | None) -> str:
    table = _gpu_fields(state)
    names = [f.strip() for f in fields.split(",") if f.strip()]
    specs = []
    for name in names:
        spec = table.get(GPU_ALIASES.get(name, name))
        if spec is None:
            raise SmiExit(f'Field "{name}" is not a valid field to query.\n', EXIT_BAD_ARG)
        specs.append(spec)
    header, units = parse_format(fmt)
    rows = []
    if header:
        rows.append([f"{h} [{u}]" if (u and units) else h for h, u, _ in specs])
    for gpu in gpus:
        rows.append([get(gpu) + (f" {u}" if (u and units) else "") for _, u, get in specs])
    return _csv(rows)


def render_query_apps(state: dict, gpus: list[dict], fields: str, fmt: str | None) -> str:
    by_index = {g["index"]: g for g in state["gpus"]}
    table = {
        "pid": ("pid", None, lambda p: str(p["pid"])),
        "process_name": ("process_name", None, lambda p: p.get("name", "")),
        "name": ("process_name", None, lambda p: p.get("name", "")),
        "gpu_uuid": ("gpu_uuid", None, lambda p: by_index[p["gpu"]]["uuid"]),
        "gpu_name": ("gpu_name", None, lambda p: by_index[p["gpu"]]["name"]),
        "gpu_bus_id": ("gpu_bus_id", None, lambda p: by_index[p["gpu"]]["pci_bus_id"]),
        "gpu_serial": ("gpu_serial", None, lambda p: by_index[p["gpu"]].get("serial", "[N/A]")),
        # Real nvidia-smi heads `used_memory` as "used_gpu_memory [MiB]".
        "used_memory": ("used_gpu_memory", "MiB", lambda p: str(p.get("used_mib", 0))),
        "used_gpu_memory": ("used_gpu_memory", "MiB", lambda p: str(p.get("used_mib", 0))),
    }
    specs = []
    for name in [f.strip() for f in fields.split(",") if f.strip()]:
        if name not in table:
            raise SmiExit(f'Field "{name}" is not a valid field to query.\n', EXIT_BAD_ARG)
        specs.append(table[name])
    header, units = parse_format(fmt)
    wanted = {g["index"] for g in gpus}
    procs = sorted((p for p in state.get("processes", []) if p["gpu"] in wanted),
                   key=lambda p: (p["gpu"], p["pid"]))
    rows = [[f"{h} [{u}]" if (u and units) else h for h, u, _ in specs]] if header else []
    rows += [[get(p) + (f" {u}" if (u and units) else "") for _, u, get in specs] for p in procs]
    return _csv(rows)


# -------------------------------------------------------------------------------------- -q


def _q_width(state: dict) -> int:
    """Column of the ':' in -q output: 42 in the R535 capture, 55 in the R580 capture."""
    return 55 if layout(state) == "r580" else 42


# -d names and the blocks they select, in the order real -q prints the blocks.
Q_DISPLAY = {"MEMORY", "ECC", "PAGE_RETIREMENT", "ROW_REMAPPER", "PERFORMANCE", "TEMPERATURE",
             "POWER"}


def render_q(state: dict, gpus: list[dict], display: str | None) -> str:
    width = _q_width(state)
    drv = state["driver"]
    kind = layout(state)

    def kv(depth: int, key: str, value: str) -> str:
        return f"{' ' * (4 * depth)}{key}".ljust(width) + f": {value}"

    def title(depth: int, key: str) -> str:
        return f"{' ' * (4 * depth)}{key}"

    wanted = {d.strip().upper() for d in display.split(",")} if display else None

    def want(block: str) -> bool:
        return wanted is None or block in wanted

    # The whole R580 -q starts with two empty lines, its -d forms with one (H200 captures).
    lead = ["", ""] if kind == "r580" and wanted is None else [""]
    lines = lead + ["==============NVSMI LOG==============", "",
                    kv(0, "Timestamp", timestamp()),
                    kv(0, "Driver Version", drv["module_version"]),
                    kv(0, "CUDA Version", drv["cuda_version"]), "",
                    kv(0, "Attached GPUs", str(len(state["gpus"])))]
    for number, gpu in enumerate(gpus):
        if number:
            lines.append("")  # an empty line between GPUs (multi-GPU captures)
        lines.append(f"GPU {gpu['pci_bus_id']}")
        if wanted is None:
            lines += _q_identity(state, gpu, kv, title)
        if want("PERFORMANCE"):
            lines += _q_performance(state, gpu, kv, title)
        if want("MEMORY"):
            lines += [title(1, "FB Memory Usage"),
                      kv(2, "Total", f"{gpu['memory_total_mib']} MiB"),
                      kv(2, "Reserved", f"{gpu.get('memory_reserved_mib', 0)} MiB"),
                      kv(2, "Used", f"{used_mib(state, gpu)} MiB"),
                      kv(2, "Free", f"{free_mib(state, gpu)} MiB")]
        if wanted is None:
            lines.append(kv(1, "Compute Mode", gpu.get("compute_mode", "Default")))
        if want("ECC"):
            lines += _q_ecc(state, gpu, kv, title)
        if want("PAGE_RETIREMENT"):
            # A100/H100/H200 remap rows instead of retiring pages: N/A (H200, A10, H100 captures).
            lines += [title(1, "Retired Pages"), kv(2, "Single Bit ECC", "N/A"),
                      kv(2, "Double Bit ECC", "N/A"), kv(2, "Pending Page Blacklist", "N/A")]
        if want("ROW_REMAPPER"):
            lines += _q_remapped_rows(state, gpu, kv, title)
        if want("TEMPERATURE"):
            lines += _q_temperature(state, gpu, kv, title)
        if want("POWER"):
            lines += _q_power(state, gpu, kv, title, samples=wanted is not None)
        if wanted is None:
            lines += _q_processes(state, gpu, kv, title)
    return "\n".join(lines) + "\n\n"


def _q_identity(state: dict, gpu: dict, kv, title) -> list[str]:
    bus = gpu["pci_bus_id"]
    return [
        kv(1, "Product Name", gpu["name"]),
        kv(1, "Product Brand", gpu.get("brand", "NVIDIA")),
        kv(1, "Product Architecture", gpu.get("architecture", "Ampere")),
        kv(1, "Persistence Mode", on_off(persistence_on(state, gpu))),
        kv(1, "Addressing Mode", "None"),
        title(1, "MIG Mode"),
        kv(2, "Current", gpu.get("mig_current") or "N/A"),
        kv(2, "Pending", gpu.get("mig_pending") or "N/A"),
        kv(1, "Accounting Mode", "Disabled"),
        kv(1, "Accounting Mode Buffer Size", "4000"),
        kv(1, "Serial Number", gpu.get("serial", "N/A")),
        kv(1, "GPU UUID", gpu["uuid"]),
        kv(1, "Minor Number", str(gpu["index"])),
        kv(1, "VBIOS Version", gpu.get("vbios", "N/A")),
        kv(1, "MultiGPU Board", "No"),
        kv(1, "Board ID", gpu.get("board_id", "0x0")),
        title(1, "PCI"),
        kv(2, "Bus", "0x" + bus[9:11]),
        kv(2, "Device", "0x" + bus[12:14]),
        kv(2, "Domain", "0x" + bus[4:8]),
        kv(2, "Device Id", gpu.get("pci_device_id", "N/A")),
        kv(2, "Bus Id", bus),
        kv(2, "Sub System Id", gpu.get("pci_subsystem_id", "N/A")),
    ] + _q_pci_link(gpu, kv, title)


def _q_pci_link(gpu: dict, kv, title) -> list[str]:
    """GPU Link Info and the replay counter, as the A10/H100 535 and H200 580 captures print."""
    link = pcie_link(gpu)
    return [
        title(2, "GPU Link Info"),
        title(3, "PCIe Generation"),
        kv(4, "Max", str(link["gen_max"])),
        kv(4, "Current", str(link["gen_current"])),
        kv(4, "Device Current", str(link["gen_current"])),
        kv(4, "Device Max", str(link["gen_max"])),
        kv(4, "Host Max", str(gpu.get("pcie_host_max", "N/A"))),
        title(3, "Link Width"),
        kv(4, "Max", f"{link['width_max']}x"),
        kv(4, "Current", f"{link['width_current']}x"),
        kv(2, "Replays Since Reset", str(gpu.get("pcie_replays", 0))),
        kv(2, "Replay Number Rollovers", "0"),
    ]


CLOCK_REASONS = [  # (-q label, depth, health key); the HW ones sit under "HW Slowdown"
    ("Idle", 2, "idle"), ("Applications Clocks Setting", 2, "applications_clocks_setting"),
    ("SW Power Cap", 2, "sw_power_cap"), ("HW Slowdown", 2, "hw_slowdown"),
    ("HW Thermal Slowdown", 3, "hw_thermal_slowdown"),
    ("HW Power Brake Slowdown", 3, "hw_power_brake_slowdown"), ("Sync Boost", 2, "sync_boost"),
    ("SW Thermal Slowdown", 2, "sw_thermal_slowdown"),
    ("Display Clock Setting", 2, "display_clock_setting"),
]
# R580's "Clocks Event Reasons Counters" (H200 capture): label -> reason whose time it counts.
CLOCK_COUNTERS = [("SW Power Capping", "sw_power_cap"), ("Sync Boost", "sync_boost"),
                  ("SW Thermal Slowdown", "sw_thermal_slowdown"),
                  ("HW Thermal Slowdown", "hw_thermal_slowdown"),
                  ("HW Power Braking", "hw_power_brake_slowdown")]


def active_reasons(state: dict, gpu: dict) -> set[str]:
    """Idle when no process holds the GPU; plus the faults gpusimctl set."""
    active = set(health(gpu).get("clocks_event_reasons", []))
    if not gpu_processes(state, gpu):
        active.add("idle")
    return active


def _q_performance(state: dict, gpu: dict, kv, title) -> list[str]:
    active = active_reasons(state, gpu)
    # R535 already says "Clocks Event Reasons" (A10 and H100 535 captures); R470 and older
    # said "Clocks Throttle Reasons" (A100 460 capture).
    lines = [kv(1, "Performance State", gpu["pstate"]), title(1, "Clocks Event Reasons")]
    lines += [kv(depth, label, "Active" if key in active else "Not Active")
              for label, depth, key in CLOCK_REASONS]
    if layout(state) == "r580":
        counters = health(gpu).get("clocks_event_counters_us", {})
        lines.append(title(1, "Clocks Event Reasons Counters"))
        lines += [kv(2, label, f"{counters.get(key, 0)} us") for label, key in CLOCK_COUNTERS]
        lines.append(kv(1, "Sparse Operation Mode", "Disabled"))
    return lines


ECC_SPLIT = [("SRAM Correctable", "sram_correctable"),
             ("SRAM Uncorrectable Parity", "sram_uncorrectable_parity"),
             ("SRAM Uncorrectable SEC-DED", "sram_uncorrectable_secded"),
             ("DRAM Correctable", "dram_correctable"), ("DRAM Uncorrectable", "dram_uncorrectable")]


def ecc_split(gpu: dict) -> bool:
    """GA100/GH100 print SRAM Uncorrectable as Parity + SEC-DED (A100-SXM4 and H100 535
    captures); the A10 (GA102) on 535 prints one `SRAM Uncorrectable` line."""
    return gpu.get("architecture") == "Hopper" or "A100" in gpu["name"]


def _q_ecc(state: dict, gpu: dict, kv, title) -> list[str]:
    mode = gpu.get("ecc_mode", "Enabled")
    counts = ecc_counts(gpu)
    on = mode == "Enabled"

    def val(scope: str, key: str) -> str:
        if not on:
            return "N/A"
        if key == "sram_uncorrectable":
            c = counts[scope]
            return str(c["sram_uncorrectable_parity"] + c["sram_uncorrectable_secded"])
        return str(counts[scope][key])

    lines = [title(1, "ECC Mode"), kv(2, "Current", mode), kv(2, "Pending", mode),
             title(1, "ECC Errors")]
    split = ecc_split(gpu)
    fields = ECC_SPLIT if split else [
        ("SRAM Correctable", "sram_correctable"), ("SRAM Uncorrectable", "sram_uncorrectable"),
        ("DRAM Correctable", "dram_correctable"), ("DRAM Uncorrectable", "dram_uncorrectable")]
    for scope in ("volatile", "aggregate"):
        lines.append(title(2, scope.capitalize()))
        lines += [kv(3, label, val(scope, key)) for label, key in fields]
    if split:
        lines.append(kv(3, "SRAM Threshold Exceeded", "No" if on else "N/A"))
        lines.append(title(2, "Aggregate Uncorrectable SRAM Sources"))
        lines += [kv(3, f"SRAM {src}", "0" if on else "N/A")
                  for src in ("L2", "SM", "Microcontroller", "PCIE", "Other")]
    if layout(state) == "r580":
        lines += [kv(2, "Channel Repair Pending", "No"), kv(2, "TPC Repair Pending", "No"),
                  kv(2, "Unrepairable Memory", "Yes" if remap(gpu)["failure"] else "No")]
    return lines


def _q_remapped_rows(state: dict, gpu: dict, kv, title) -> list[str]:
    rows = remap(gpu)
    banks = gpu.get("remap_banks", default_banks(gpu))
    lines = [title(1, "Remapped Rows"), kv(2, "Correctable Error", str(rows["correctable"]))]
    r580 = layout(state) == "r580"
    if r580:
        lines.append(kv(2, "Inactive Correctable Error", "0"))
    lines.append(kv(2, "Uncorrectable Error", str(rows["uncorrectable"])))
    if r580:
        lines.append(kv(2, "Inactive Uncorrectable Error", "0"))
    lines += [kv(2, "Pending", "Yes" if rows["pending"] else "No"),
              kv(2, "Remapping Failure Occurred", "Yes" if rows["failure"] else "No"),
              title(2, "Bank Remap Availability Histogram"),
              kv(3, "Max", f"{banks} bank(s)")]
    lines += [kv(3, name, "0 bank(s)") for name in ("High", "Partial", "Low", "None")]
    return lines


def _temp(value) -> str:
    return "N/A" if value is None else f"{value} C"


def _q_temperature(state: dict, gpu: dict, kv, title) -> list[str]:
    lines = [title(1, "Temperature"), kv(2, "GPU Current Temp", f"{gpu['temperature_c']} C"),
             kv(2, "GPU T.Limit Temp", _temp(gpu.get("temperature_tlimit_c")))]
    if gpu.get("architecture") == "Hopper":
        # Hopper reports thresholds relative to T.Limit (H100 535 and H200 580 captures).
        lines += [kv(2, "GPU Shutdown T.Limit Temp", "-8 C"),
                  kv(2, "GPU Slowdown T.Limit Temp", "-2 C"),
                  kv(2, "GPU Max Operating T.Limit Temp", "0 C"),
                  kv(2, "GPU Target Temperature", "N/A"),
                  kv(2, "Memory Current Temp", _temp(gpu.get("temperature_memory_c"))),
                  kv(2, "Memory Max Operating T.Limit Temp", "0 C")]
    else:
        # Ampere: absolute thresholds (A10 535 capture's lines; the A100 values illustrative).
        limits = gpu.get("temperature_limits_c", {"shutdown": 92, "slowdown": 89,
                                                   "max_operating": 85, "memory_max": 95})
        lines += [kv(2, "GPU Shutdown Temp", _temp(limits.get("shutdown"))),
                  kv(2, "GPU Slowdown Temp", _temp(limits.get("slowdown"))),
                  kv(2, "GPU Max Operating Temp", _temp(limits.get("max_operating"))),
                  kv(2, "GPU Target Temperature", "N/A"),
                  kv(2, "Memory Current Temp", _temp(gpu.get("temperature_memory_c"))),
                  kv(2, "Memory Max Operating Temp", _temp(limits.get("memory_max")))]
    return lines


def _q_power(state: dict, gpu: dict, kv, title, samples: bool) -> list[str]:
    draw, cap = gpu["power_draw_w"], gpu["power_limit_w"]
    limits = [kv(2, "Current Power Limit", power(cap)), kv(2, "Requested Power Limit", power(cap)),
              kv(2, "Default Power Limit", power(gpu.get("power_default_limit_w", cap))),
              kv(2, "Min Power Limit", power(gpu.get("power_min_limit_w", cap / 2))),
              kv(2, "Max Power Limit", power(gpu.get("power_max_limit_w", cap)))]
    module_limits = ["Current Power Limit", "Requested Power Limit", "Default Power Limit",
                     "Min Power Limit", "Max Power Limit"]
    sample_lines = [title(1, "Power Samples"), kv(2, "Duration", "2.36 sec"),
                    kv(2, "Number of Samples", "119"), kv(2, "Max", power(draw)),
                    kv(2, "Min", power(draw)), kv(2, "Avg", power(draw))] if samples else []
    if layout(state) != "r580":
        # R535: one "Power Draw" line (A10 and H100 535 captures).
        return ([title(1, "GPU Power Readings"), kv(2, "Power Draw", power(draw))] + limits
                + sample_lines + [title(1, "Module Power Readings"), kv(2, "Power Draw", "N/A")]
                + [kv(2, name, "N/A") for name in module_limits])
    memory = gpu.get("power_memory_w")
    return ([title(1, "GPU Power Readings"), kv(2, "Average Power Draw", power(draw)),
             kv(2, "Instantaneous Power Draw", power(gpu.get("power_instant_w", draw)))]
            + limits + sample_lines
            # The capture has a trailing space after "GPU Memory Power Readings".
            + [title(1, "GPU Memory Power Readings "),
               kv(2, "Average Power Draw", "N/A" if memory is None else power(memory)),
               kv(2, "Instantaneous Power Draw", "N/A"),
               title(1, "Module Power Readings"), kv(2, "Average Power Draw", "N/A"),
               kv(2, "Instantaneous Power Draw", "N/A")]
            + [kv(2, name, "N/A") for name in module_limits])


def _q_processes(state: dict, gpu: dict, kv, title) -> list[str]:
    procs = gpu_processes(state, gpu)
    if not procs:
        return [kv(1, "Processes", "None")]
    lines = [title(1, "Processes")]
    for proc in procs:
        lines += [kv(2, "GPU instance ID", "N/A"), kv(2, "Compute instance ID", "N/A"),
                  kv(2, "Process ID", str(proc["pid"])), kv(2, "Type", proc.get("type", "C")),
                  kv(2, "Name", proc.get("name", "")),
                  kv(2, "Used GPU Memory", f"{proc.get('used_mib', 0)} MiB")]
    return lines


# -------------------------------------------------------------------------------- topology


def link_between(state: dict, a: int, b: int) -> str:
    """NV<links that are up>: a bridge link that is down on either GPU leaves the bond (NV12
    with one link down is NV11); with none left the pair talks over PCIe."""
    topo = state.get("topology", {})
    key = f"{min(a, b)},{max(a, b)}"
    pcie = topo.get("pcie_link", "PHB")
    cell = topo.get("pairs", {}).get(key, pcie)
    if not cell.startswith("NV"):
        return cell
    by_index = {g["index"]: g for g in state.get("gpus", [])}
    down = set()
    for index in (a, b):
        if index in by_index:
            down |= {n for n in nvlink_down(by_index[index]) if n < int(cell[2:])}
    up = int(cell[2:]) - len(down)
    return f"NV{up}" if up > 0 else pcie


def render_topo_m(state: dict) -> str:
    gpus = state["gpus"]
    names = [f"GPU{g['index']}" for g in gpus]
    head = "\t".join(names + ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"])
    lines = [f"\t{UNDERLINE}{head}{RESET}"]
    for gpu in gpus:
        cells = [" X " if other is gpu else link_between(state, gpu["index"], other["index"])
                 for other in gpus]
        # Real output has an empty cell between NUMA Affinity and GPU NUMA ID (see fixtures).
        cells += [gpu.get("cpu_affinity", "N/A"), gpu.get("numa_affinity", "N/A"), "",
                  gpu.get("gpu_numa_id", "N/A")]
        lines.append("\t".join([f"GPU{gpu['index']}"] + cells))
    return "\n".join(lines) + "\n" + TOPO_LEGEND


def render_topo_p2p(state: dict, cap: str) -> str:
    gpus = state["gpus"]
    head = "".join(f"GPU{g['index']}\t" for g in gpus)
    lines = [f" \t{UNDERLINE}{head}{RESET}"]
    for gpu in gpus:
        cells = []
        for other in gpus:
            if other is gpu:
                cells.append("X")
            elif cap == "n":
                nv = link_between(state, gpu["index"], other["index"]).startswith("NV")
                cells.append("OK" if nv else "NS")
            else:
                cells.append(state.get("topology", {}).get("p2p", "OK"))
        lines.append(f" GPU{gpu['index']}\t" + "".join(c + "\t" for c in cells))
    return "\n".join(lines) + "\n" + P2P_LEGEND


def render_nvlink_status(state: dict, gpus: list[dict]) -> str:
    out = []
    for gpu in gpus:
        nvl = gpu.get("nvlink") or {"state": "inactive"}
        if nvl["state"] == "hidden":
            continue  # a passthrough VM without NVLink prints nothing (H200 capture)
        if nvl["state"] == "inactive":
            out.append(f"GPU {gpu['index']}: {gpu['name']}")
            out.append("NVML: Unable to retrieve NVLink information as all links are inActive")
            continue
        out.append(f"GPU {gpu['index']}: {gpu['name']} (UUID: {gpu['uuid']})")
        down = nvlink_down(gpu)
        speed = garbled_speed(nvl["speed"]) if health(gpu).get("nvlink_garbled") else nvl["speed"]
        # An inactive link: `<inactive>` (V100 captures).
        out += [f"\t Link {n}: {'<inactive>' if n in down else speed}"
                for n in range(nvl["links"])]
    return "".join(line + "\n" for line in out)


def garbled_speed(speed: str) -> str:
    """The nvlink-garbled fault's link speed: ``25 GB/s`` as ``25.25.25 GB/s``, as if
    writes ran together. No real capture: output no parser can read, for the tests of a
    fact whose parser fails (facts.topology's NVLink speed)."""
    number, _, unit = speed.partition(" ")
    return f"{'.'.join([number] * 3)} {unit}"


def render_nvlink_errors(state: dict, gpus: list[dict]) -> str:
    """`nvlink -e`: per link Replay, Recovery and CRC errors, an empty line after each link
    (a public 8x A100-SXM4-40GB 535.161.08 capture; stas00/ml-engineering's H100 example)."""
    out = []
    for gpu in gpus:
        nvl = gpu.get("nvlink") or {"state": "inactive"}
        if nvl["state"] == "hidden":
            continue  # H200 VM: `nvlink -e` printed nothing, exit 0
        if nvl["state"] == "inactive":
            out.append(f"GPU {gpu['index']}: {gpu['name']}")
            out.append("NVML: Unable to retrieve NVLink information as all links are inActive")
            continue
        out.append(f"GPU {gpu['index']}: {gpu['name']} (UUID: {gpu['uuid']})")
        for n in range(nvl["links"]):
            errs = nvlink_errors(gpu, n)
            out += [f"\t Link {n}: Replay Errors: {errs['replay']}",
                    f"\t Link {n}: Recovery Errors: {errs['recovery']}",
                    f"\t Link {n}: CRC Errors: {errs['crc']}", ""]
    return "".join(line + "\n" for line in out)


def render_mig_lgi(state: dict, gpus: list[dict]) -> tuple[str, int]:
    if not any(g.get("mig_current") == "Enabled" for g in gpus):
        return "No MIG-enabled devices found.\n", EXIT_NOT_FOUND
    # The simulator never creates GPU instances.
    return "No GPU instances found: Not Found\n", EXIT_NOT_FOUND


# -------------------------------------------------------------------------- state changers


def require_root() -> None:
    if os.geteuid() != 0 and os.environ.get("GPUSIM_ASSUME_ROOT") != "1":
        raise SmiExit("Insufficient Permissions\nTerminating early due to previous errors.\n",
                      EXIT_NO_PERMISSION)


def set_persistence(ids: str | None, value: str) -> str:
    require_root()
    if value not in ("0", "1", "ENABLED", "DISABLED"):
        raise SmiExit(f"Invalid value for -pm. {HELP_HINT}\n", EXIT_BAD_ARG)
    enable = value in ("1", "ENABLED")
    out = []
    with locked_state() as state:
        check_driver(state)
        for gpu in select_gpus(state, ids):
            if state.get("persistenced"):
                # With the daemon running nvidia-smi asks it over RPC: not the legacy mode.
                gpu["persistence_daemon"] = enable
                word = "persistence mode"
            else:
                gpu["persistence_legacy"] = enable
                # R580-era drivers call the daemon-less mode "Legacy" in this message.
                word = ("Legacy persistence mode" if enable and layout(state) == "r580"
                        else "persistence mode")
                if not enable:
                    gpu["persistence_daemon"] = False
            out.append(f"{'Enabled' if enable else 'Disabled'} {word} for GPU "
                       f"{gpu['pci_bus_id']}.")
    return "\n".join(out) + "\nAll done.\n"


def set_mig(ids: str | None, value: str) -> str:
    require_root()
    if value not in ("0", "1", "ENABLED", "DISABLED"):
        raise SmiExit(f"Invalid value for -mig. {HELP_HINT}\n", EXIT_BAD_ARG)
    mode = "Enabled" if value in ("1", "ENABLED") else "Disabled"
    verb = "enable" if mode == "Enabled" else "disable"
    out = []
    with locked_state() as state:
        check_driver(state)
        for gpu in select_gpus(state, ids):
            bus = gpu["pci_bus_id"]
            if not gpu.get("mig_capable", True):
                out.append(f"Unable to {verb} MIG Mode for GPU {bus}: Not Supported")
                continue
            gpu["mig_pending"] = mode
            if gpu_processes(state, gpu):
                out.append(f"Warning: MIG mode is in pending {verb} state for GPU {bus}:"
                           "In use by another client")
                out.append(f"{bus} is currently being used by one or more other processes "
                           "(e.g. CUDA application or a monitoring application such as another "
                           "instance of nvidia-smi). Please first kill all processes using the "
                           "device and retry the command or reboot the system to make MIG mode "
                           "effective.")
            elif not state.get("mig_auto_reset", True):
                # Passthrough VMs: the driver may not reset the GPU itself (MIG user guide).
                out.append(f"Warning: MIG mode is in pending {verb} state for GPU {bus}:"
                           "Not Supported")
                out.append("Reboot the system or try nvidia-smi --gpu-reset to make MIG mode "
                           f"effective on GPU {bus}")
            else:
                # Bare-metal Ampere: the driver resets an idle GPU at once (MIG user guide).
                gpu["mig_current"] = mode
                out.append(f"{'Enabled' if mode == 'Enabled' else 'Disabled'} MIG Mode for GPU "
                           f"{bus}")
    return "\n".join(out) + "\nAll done.\n"


def gpu_reset(ids: str | None) -> str:
    require_root()
    with locked_state() as state:
        check_driver(state)
        targets = select_gpus(state, ids)
        busy = [g for g in targets if gpu_processes(state, g)]
        if busy:
            raise SmiExit(_reset_refusal(state, busy), EXIT_OTHER)
        out = []
        for gpu in targets:
            gpu["mig_current"] = gpu.get("mig_pending", gpu.get("mig_current"))
            reset_health(gpu)
            out.append(f"GPU {gpu['pci_bus_id']} was successfully reset.")
    return "\n".join(out) + "\nAll done.\n"


def _reset_refusal(state: dict, busy: list[dict]) -> str:
    count = len(busy)
    noun = "1 device is" if count == 1 else f"{count} devices are"
    these = "this device" if count == 1 else "these devices"
    tail = (f"{noun} currently being used by one or more other processes (e.g., Fabric Manager, "
            "CUDA application, graphics application such as an X server, or a monitoring "
            "application such as another instance of nvidia-smi). Please first kill all "
            f"processes using {these} and all compute applications running in the system.\n")
    if layout(state) == "r535":
        # The form in NVIDIA/gpu-operator#118.
        head = "".join(f"GPU {g['pci_bus_id']} is currently in use by another process.\n"
                       for g in busy)
        return head + "\n" + tail
    # The form newer drivers print (NVIDIA/mig-parted#181, 2025).
    head = "The following GPUs could not be reset:\n" + "".join(
        f"  GPU {g['pci_bus_id']}: In use by another client\n" for g in busy)
    return head + "\n" + tail


# ------------------------------------------------------------------------------ arguments

VALUE_OPTS = {
    "-i": "id", "--id": "id", "-pm": "pm", "--persistence-mode": "pm",
    "-mig": "mig", "--multi-instance-gpu": "mig", "--query-gpu": "query_gpu",
    "--query-compute-apps": "query_apps", "--format": "format", "-d": "display",
    "--display": "display", "-f": "filename", "--filename": "filename",
}
FLAG_OPTS = {
    "-L": "list", "--list-gpus": "list", "-q": "query", "--query": "query",
    "-r": "reset", "--gpu-reset": "reset", "-h": "help", "--help": "help",
}


def parse_args(argv: list[str]) -> dict:
    opts: dict = {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        name, eq, inline = tok.partition("=")
        if name in VALUE_OPTS:
            if eq:
                value = inline
            elif i + 1 < len(argv):
                i += 1
                value = argv[i]
            else:
                raise SmiExit(f"ERROR: Option {name} is missing its value. {HELP_HINT}\n",
                              EXIT_BAD_ARG)
            opts[VALUE_OPTS[name]] = value
        elif tok in FLAG_OPTS:
            opts[FLAG_OPTS[tok]] = True
        else:
            raise SmiExit(f"ERROR: Option {tok} is not recognized. {HELP_HINT}\n", EXIT_BAD_ARG)
        i += 1
    return opts


def _loaded_state() -> dict:
    state = load_state()
    check_driver(state)
    return state


def cmd_topo(argv: list[str]) -> tuple[str, int]:
    if argv in (["-m"], ["--matrix"]):
        return render_topo_m(_loaded_state()), EXIT_OK
    if len(argv) == 2 and argv[0] in ("-p2p", "--p2p") and argv[1] in ("r", "w", "n", "a", "p"):
        return render_topo_p2p(_loaded_state(), argv[1]), EXIT_OK
    raise SmiExit(f"Invalid combination of input arguments. {HELP_HINT}\n", EXIT_BAD_ARG)


def cmd_nvlink(argv: list[str]) -> tuple[str, int]:
    ids = None
    rest = []
    i = 0
    while i < len(argv):
        if argv[i] in ("-i", "--id") and i + 1 < len(argv):
            ids = argv[i + 1]
            i += 2
            continue
        rest.append(argv[i])
        i += 1
    if rest in (["-s"], ["--status"]):
        render = render_nvlink_status
    elif rest in (["-e"], ["--errorcounters"]):
        render = render_nvlink_errors
    else:
        raise SmiExit(f"Invalid combination of input arguments. {HELP_HINT}\n", EXIT_BAD_ARG)
    state = _loaded_state()
    return render(state, select_gpus(state, ids)), EXIT_OK


def cmd_mig(argv: list[str]) -> tuple[str, int]:
    if argv not in (["-lgi"], ["--list-gpu-instances"]):
        raise SmiExit(f"Invalid combination of input arguments. {HELP_HINT}\n", EXIT_BAD_ARG)
    state = _loaded_state()
    return render_mig_lgi(state, state["gpus"])


def cmd_main(argv: list[str]) -> tuple[str, int]:
    opts = parse_args(argv)
    if opts.get("help"):
        return "NVIDIA System Management Interface -- (simulated by gpusim)\n", EXIT_OK
    ids = opts.get("id")
    if "pm" in opts:
        return set_persistence(ids, opts["pm"].upper()), EXIT_OK
    if "mig" in opts:
        return set_mig(ids, opts["mig"].upper()), EXIT_OK
    if opts.get("reset"):
        return gpu_reset(ids), EXIT_OK
    state = _loaded_state()
    gpus = select_gpus(state, ids)
    if "query_gpu" in opts:
        return render_query_gpu(state, gpus, opts["query_gpu"], opts.get("format")), EXIT_OK
    if "query_apps" in opts:
        return render_query_apps(state, gpus, opts["query_apps"], opts.get("format")), EXIT_OK
    if opts.get("list"):
        return render_list(state, gpus), EXIT_OK
    if opts.get("query"):
        return render_q(state, gpus, opts.get("display")), EXIT_OK
    if "format" in opts or "display" in opts:
        raise SmiExit(f"Invalid combination of input arguments. {HELP_HINT}\n", EXIT_BAD_ARG)
    return render_table(state, gpus), EXIT_OK


SUBCOMMANDS = {"topo": cmd_topo, "nvlink": cmd_nvlink, "mig": cmd_mig}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in SUBCOMMANDS:
            text, code = SUBCOMMANDS[argv[0]](argv[1:])
        else:
            text, code = cmd_main(argv)
    except SmiExit as stop:
        text, code = stop.text, stop.code
    sys.stdout.write(text)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
