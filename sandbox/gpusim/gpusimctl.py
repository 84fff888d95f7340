#!/usr/bin/env python3
"""gpusimctl: the admin side of the simulated NVIDIA stack (installed as /usr/sbin/gpusimctl).

Single file, Python 3.11 stdlib only (it ships in the simulated nvidia-dkms package).
Commands:
  init --scenario seed|seed580|pcie|mig|mismatch|h200|bare  write a fresh state file
  attach-process --gpu N [--pid P] [--name NAME] [--used-mib M]
  detach-process --pid P | --all
  boot                what a reboot does to the GPUs; run by gpusim-boot.service
  install-driver --version V / remove-driver   what the package scripts call
  configure --mig-auto-reset on|off            bare-metal (on) or passthrough-like (off)
  show                print the state as JSON
  fault GPU FAULT [N] / fault clear           GPU-health faults (README.md lists them)

The state file is /var/lib/gpusim/state.json unless GPUSIM_STATE says otherwise. The
helpers below repeat the few lines of nvidia_smi.py that read and write it, because each
program is one file shipped in its own package.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

DEFAULT_STATE = "/var/lib/gpusim/state.json"
PROC_DRIVER = Path("/proc/driver")
FALLBACK_PROC = Path("/run/gpusim/proc-driver")
SCHEMA = 1

# How each simulated module version reports itself in /proc/driver/nvidia/version.
# 535.104.05: a real dmesg line ("Sat Aug 19 01:15:15 UTC 2023"). 535.129.03: the date is
# not verified. 580.159.04: the captured H200 host (open module, nix build).
MODULE_BUILDS = {
    "535.129.03": {"flavor": "proprietary", "date": "Thu Oct 19 18:56:32 UTC 2023",
                   "gcc": "gcc version 11.4.0 (Ubuntu 11.4.0-1ubuntu1~22.04)"},
    "535.104.05": {"flavor": "proprietary", "date": "Sat Aug 19 01:15:15 UTC 2023",
                   "gcc": "gcc version 11.4.0 (Ubuntu 11.4.0-1ubuntu1~22.04)"},
    "580.159.04": {"flavor": "open", "date": "", "builder": "nixbld@",
                   "gcc": "gcc version 15.3.0 (GCC) "},
}
CUDA_OF_BRANCH = {"535": "12.2", "550": "12.4", "555": "12.5", "570": "12.8", "580": "13.0"}


# ------------------------------------------------------------------ state file (see module doc)


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
    state["processes"] = [p for p in state.get("processes", []) if pid_alive(p.get("pid"))]
    daemon = state.get("persistenced")
    if daemon and not daemon_alive(daemon):
        state["persistenced"] = None
        for gpu in state.get("gpus", []):
            gpu["persistence_daemon"] = False
    return state


def load_state(path: Path) -> dict | None:
    try:
        return prune(json.loads(path.read_text()))
    except FileNotFoundError:
        return None


def save_state(state: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".state-", dir=path.parent)
    with os.fdopen(fd, "w") as handle:
        json.dump(state, handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


@contextlib.contextmanager
def locked(path: Path):
    """Exclusive lock for a read-modify-write; the caller saves."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# ----------------------------------------------------------------------------------- scenarios


def gpu_uuid(bus_id: str) -> str:
    # Stable per bus id, so re-running init gives the same UUIDs (facts compare them).
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_OID, f"gpusim:{bus_id}"))


def a100_pcie(index: int, bus_id: str, temp: int, draw: float, nvlink: dict) -> dict:
    """NVIDIA A100 80GB PCIe as R535 reports it (real capture of this card at these bus ids:
    4MiB used, 300W cap). Serial/VBIOS are illustrative, not from a capture."""
    return {
        "index": index, "name": "NVIDIA A100 80GB PCIe", "uuid": gpu_uuid(bus_id),
        "pci_bus_id": bus_id, "pci_device_id": "0x20B510DE", "pci_subsystem_id": "0x153310DE",
        "serial": f"13240210{index:05d}", "vbios": "92.00.90.00.04", "board_id": "0x" + bus_id[9:11],
        "brand": "NVIDIA", "architecture": "Ampere", "compute_cap": "8.0",
        "memory_total_mib": 81920, "memory_reserved_mib": 0, "memory_base_used_mib": 4,
        "power_limit_w": 300.0, "power_draw_w": draw, "temperature_c": temp, "pstate": "P0",
        "temperature_memory_c": temp - 3, "pcie_gen_max": 4, "pcie_width_max": 16,
        "clocks_max_sm_mhz": 1410, "ecc_mode": "Enabled", "compute_mode": "Default",
        "mig_capable": True, "mig_current": "Disabled", "mig_pending": "Disabled",
        "persistence_legacy": False, "persistence_daemon": False,
        "cpu_affinity": "0-31,64-95", "numa_affinity": "0", "gpu_numa_id": "N/A",
        "nvlink": nvlink,
    }


def driver(version: str | None, loaded_version: str | None) -> dict:
    branch = (version or loaded_version or "535").split(".")[0]
    return {"installed_version": version, "module_loaded": loaded_version is not None,
            "module_version": loaded_version, "cuda_version": CUDA_OF_BRANCH.get(branch, "12.2")}


def scenario_state(name: str, pcie_link: str = "PHB") -> dict:
    if name == "h200":
        return h200_state()
    bridged = name in ("seed", "seed580", "mig", "mismatch", "bare")
    nvl = ({"state": "active", "links": 12, "speed": "25 GB/s"} if bridged
           else {"state": "inactive"})
    gpus = [a100_pcie(0, "00000000:17:00.0", 46, 63.0, dict(nvl)),
            a100_pcie(1, "00000000:65:00.0", 50, 76.0, dict(nvl))]
    if name == "mig":
        gpus[0]["mig_current"] = gpus[0]["mig_pending"] = "Enabled"
    # seed580: the seed's hardware on the 580 branch (the H200 capture's driver), which the
    # CUDA 13 stacks need; its A100s print the R580 layouts.
    versions = {"bare": (None, None), "mismatch": ("535.129.03", "535.104.05"),
                "seed580": ("580.159.04", "580.159.04")}
    installed, loaded = versions.get(name, ("535.129.03", "535.129.03"))
    return {
        "schema": SCHEMA, "scenario": name, "driver": driver(installed, loaded),
        "topology": {"pairs": {"0,1": "NV12"} if bridged else {}, "pcie_link": pcie_link,
                     "p2p": "OK"},
        # Bare-metal Ampere resets an idle GPU itself when MIG mode changes (MIG user guide).
        "mig_auto_reset": True,
        "gpus": gpus, "processes": [], "persistenced": None,
        # `init` describes the machine as it runs now: the container's next boot continues it.
        "boot": {"skip_next": True, "count": 0},
    }


def h200_state() -> dict:
    """The captured H200 host (fixtures/nvidia/h200-ubuntu2404-driver580), value for value."""
    gpu = {
        "index": 0, "name": "NVIDIA H200", "uuid": "GPU-f70fc72c-8ec5-a53a-cda1-f039fcfe7fab",
        "pci_bus_id": "00000000:00:06.0", "pci_device_id": "0x233510DE",
        "pci_subsystem_id": "0x18BF10DE", "serial": "1653824141930", "vbios": "96.00.A5.00.1A",
        "board_id": "0x6", "brand": "NVIDIA", "architecture": "Hopper", "compute_cap": "9.0",
        "memory_total_mib": 143771, "memory_reserved_mib": 616, "memory_base_used_mib": 0,
        "memory_free_bias_mib": 1, "power_limit_w": 700.0, "power_draw_w": 133.46,
        "temperature_c": 43, "pstate": "P0", "clocks_max_sm_mhz": 1980, "ecc_mode": "Enabled",
        "compute_mode": "Default", "mig_capable": True, "mig_current": "Disabled",
        "mig_pending": "Disabled", "persistence_legacy": True, "persistence_daemon": False,
        "cpu_affinity": "0-15", "numa_affinity": "0", "gpu_numa_id": "N/A",
        "nvlink": {"state": "hidden"},
        # -q health details of the capture (q.txt): healthy, every error counter 0.
        "pcie_gen_max": 5, "pcie_width_max": 16, "pcie_replays": 1, "remap_banks": 3072,
        "temperature_tlimit_c": 44, "temperature_memory_c": 42, "power_instant_w": 133.77,
        "power_memory_w": 37.63, "power_min_limit_w": 200.0,
    }
    return {
        "schema": SCHEMA, "scenario": "h200", "driver": driver("580.159.04", "580.159.04"),
        "topology": {"pairs": {}, "pcie_link": "PHB", "p2p": "OK"}, "mig_auto_reset": False,
        "gpus": [gpu], "processes": [], "persistenced": None,
        "boot": {"skip_next": True, "count": 0},
    }


# --------------------------------------------------------------------------- /proc exposure


def version_text(version: str) -> str:
    build = MODULE_BUILDS.get(version, {"flavor": "proprietary", "date": "",
                                        "gcc": "gcc version 11.4.0 (Ubuntu 11.4.0-1ubuntu1~22.04)"})
    if build["flavor"] == "open":
        first = (f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {version}  "
                 f"Release Build  ({build.get('builder', 'buildd@lcy02-amd64-001')})  "
                 f"{build['date']}")
    else:
        first = f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  {build['date']}"
    return f"{first}\nGCC version:  {build['gcc']}\n"


def _mountpoint_fs(path: Path) -> str | None:
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            if left.split()[4] == str(path):
                fs = right.split()
                return f"{fs[0]}:{fs[1]}"
    except OSError:
        return None
    return None


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


def expose_proc(state: dict, proc_driver: Path, use_mount: bool) -> Path | None:
    """Make <proc_driver>/nvidia/version match the loaded module (or vanish without one).

    Inside systemd-nspawn /proc is a real procfs where nothing can be created, but the
    container has CAP_SYS_ADMIN, so a small tmpfs is mounted over /proc/driver (the way
    container runtimes mask /proc/acpi). Returns the directory written, or None.
    """
    ours = _mountpoint_fs(proc_driver) == "tmpfs:gpusim"
    if use_mount and not ours:
        if (proc_driver / "nvidia").exists():
            print("gpusimctl: a real NVIDIA driver is loaded here; not simulating /proc",
                  file=sys.stderr)
            return None
        if not (proc_driver.is_dir() and
                _mount("-t", "tmpfs", "-o", "mode=0555,size=64k", "gpusim", str(proc_driver))):
            return _fallback(state)
        ours = True
    if ours:
        _mount("-o", "remount,rw", str(proc_driver))
    try:
        _write_version(state, proc_driver)
    finally:
        if ours:
            _mount("-o", "remount,ro", str(proc_driver))
    return proc_driver


def _fallback(state: dict) -> Path:
    print(f"gpusimctl: cannot mount over {PROC_DRIVER}; wrote {FALLBACK_PROC}/nvidia/version "
          "instead (facts reading /proc/driver/nvidia/version will see no driver)",
          file=sys.stderr)
    _write_version(state, FALLBACK_PROC)
    return FALLBACK_PROC


def _write_version(state: dict, proc_driver: Path) -> None:
    nvdir = proc_driver / "nvidia"
    drv = state["driver"]
    if not drv.get("module_loaded"):
        shutil.rmtree(nvdir, ignore_errors=True)
        return
    nvdir.mkdir(parents=True, exist_ok=True)
    target = nvdir / "version"
    if target.exists():
        target.chmod(0o644)
    target.write_text(version_text(drv["module_version"]))
    target.chmod(0o444)
    nvdir.chmod(0o555)


# ------------------------------------------------------------------------------- commands


def cmd_init(args: argparse.Namespace, path: Path) -> int:
    with locked(path):
        save_state(scenario_state(args.scenario, args.pcie_link), path)
    print(f"gpusim: scenario {args.scenario} written to {path}")
    return 0


def _need_state(path: Path) -> dict:
    state = load_state(path)
    if state is None:
        raise SystemExit(f"gpusimctl: no state at {path}; run `gpusimctl init` first")
    return state


def cmd_attach(args: argparse.Namespace, path: Path) -> int:
    with locked(path):
        state = _need_state(path)
        if not any(g["index"] == args.gpu for g in state["gpus"]):
            raise SystemExit(f"gpusimctl: no GPU {args.gpu}")
        spawned = args.pid is None
        pid = args.pid
        if spawned:
            # A real process, so `ps`, `fuser`-style checks and kill work on it.
            proc = subprocess.Popen(["sleep", "infinity"], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
            pid = proc.pid
        elif not pid_alive(pid):
            raise SystemExit(f"gpusimctl: pid {pid} is not running")
        state["processes"].append({"gpu": args.gpu, "pid": pid, "name": args.name,
                                   "used_mib": args.used_mib, "type": "C", "spawned": spawned})
        save_state(state, path)
    print(pid)
    return 0


def _stop_spawned(procs: list[dict]) -> None:
    """Only the `sleep` processes gpusimctl itself started are ended."""
    for proc in procs:
        if proc.get("spawned") and pid_alive(proc["pid"]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc["pid"], signal.SIGTERM)


def cmd_detach(args: argparse.Namespace, path: Path) -> int:
    with locked(path):
        state = _need_state(path)
        gone = [p for p in state["processes"] if args.all or p["pid"] == args.pid]
        if not gone and not args.all:
            raise SystemExit(f"gpusimctl: pid {args.pid} is not attached")
        state["processes"] = [p for p in state["processes"] if p not in gone]
        _stop_spawned(gone)
        save_state(state, path)
    return 0


def apply_reboot(state: dict) -> None:
    """What a reboot does: pending MIG becomes current (Ampere keeps MIG mode in the InfoROM),
    persistence mode is off until the daemon starts again, processes are gone, and the
    module that loads is the installed one."""
    for gpu in state["gpus"]:
        if gpu.get("mig_capable", True):
            gpu["mig_current"] = gpu.get("mig_pending", gpu.get("mig_current"))
        gpu["persistence_legacy"] = False
        gpu["persistence_daemon"] = False
        reset_health(gpu)
    _stop_spawned(state["processes"])
    state["processes"] = []
    state["persistenced"] = None
    drv = state["driver"]
    drv["module_version"] = drv.get("installed_version")
    drv["module_loaded"] = drv["module_version"] is not None
    if drv["module_version"]:
        branch = drv["module_version"].split(".")[0]
        drv["cuda_version"] = CUDA_OF_BRANCH.get(branch, drv.get("cuda_version", "12.2"))


def _start_persistenced() -> None:
    """Ubuntu's udev rule (71-nvidia.rules) starts the daemon when the module loads."""
    unit = Path("/lib/systemd/system/nvidia-persistenced.service")
    if Path("/run/systemd/system").is_dir() and unit.is_file():
        subprocess.run(["systemctl", "start", "--no-block", "nvidia-persistenced.service"],
                       capture_output=True)


def cmd_boot(args: argparse.Namespace, path: Path) -> int:
    with locked(path):
        state = load_state(path)
        if state is None:
            print("gpusimctl boot: no simulated GPUs here (no state file)")
            return 0
        boot = state.setdefault("boot", {"skip_next": False, "count": 0})
        if boot.get("skip_next"):
            boot["skip_next"] = False
        else:
            apply_reboot(state)
        new_kernel_log(state)  # every boot, the first included, starts a new kernel log
        boot["count"] = boot.get("count", 0) + 1
        save_state(state, path)
    proc_driver = Path(args.proc_root) if args.proc_root else PROC_DRIVER
    expose_proc(state, proc_driver, use_mount=args.proc_root is None)
    if state["driver"].get("module_loaded") and not args.no_udev:
        _start_persistenced()
    return 0


def cmd_install_driver(args: argparse.Namespace, path: Path) -> int:
    """Called by the package's postinst: new files on disk, the loaded module is unchanged."""
    with locked(path):
        state = load_state(path)
        if state is None:
            state = scenario_state("bare")
            state["boot"]["skip_next"] = False
        state["driver"]["installed_version"] = args.version
        save_state(state, path)
    return 0


def cmd_remove_driver(args: argparse.Namespace, path: Path) -> int:
    with locked(path):
        state = load_state(path)
        if state is not None:
            state["driver"]["installed_version"] = None
            save_state(state, path)
    return 0


def cmd_configure(args: argparse.Namespace, path: Path) -> int:
    with locked(path):
        state = _need_state(path)
        if args.mig_auto_reset:
            state["mig_auto_reset"] = args.mig_auto_reset == "on"
        if args.pcie_link:
            state["topology"]["pcie_link"] = args.pcie_link
        save_state(state, path)
    return 0


def cmd_show(args: argparse.Namespace, path: Path) -> int:
    state = load_state(path)
    if state is None:
        raise SystemExit(f"gpusimctl: no state at {path}")
    print(json.dumps(state, indent=2, sort_keys=True))
    return 0


# ------------------------------------------------------------------------ faults, kernel log
# NVIDIA's Xid line: `NVRM: Xid (PCI:0000:17:00): 79, pid='<unknown>', name=<unknown>, TEXT`.
# Texts from real kernel-log lines (fixtures/nvidia/health/xid-*.txt unless noted); {link}
# and {gpu} are filled in. Codes not listed get a short text from NVIDIA's Xid catalogue.
XID_TEXT = {
    13: "Graphics SM Warp Exception on (GPC 8, TPC 5, SM 0): Out Of Range Address",
    31: ("Ch 0000003b, intr 00000000. MMU Fault: ENGINE GRAPHICS HUBCLIENT_SCC faulted @ "
         "0x1_8c710000. Fault is of type FAULT_PTE ACCESS_TYPE_VIRT_READ"),
    43: "Ch 00000008",
    48: ("An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer "
         "at physAddr 0x12bac1c3e0 partition 2, subpartition 1."),
    63: "Row Remapper: New row (0x00000012bac1c3e0) marked for remapping, reset gpu to activate.",
    # 64: a field report quoted in a public parser's doctest.
    64: "Row Remapper Error: (0x00000002eebc4100) - All reserved rows for bank are remapped",
    # 74: NVIDIA's Xid catalogue example and field reports.
    74: "NVLink: fatal error detected on link {link}(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
    79: "GPU has fallen off the bus.",
    94: "Contained: SM (0x1). RST: No, D-RST: No",
    # 95: field reports (and the example in NVIDIA's open kernel module source).
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
    119: ("Timeout after 6s of waiting for RPC response from GPU{gpu} GSP! Expected function "
          "103 (GSP_RM_ALLOC) (0x2081 0x4)."),
}
XID_CATALOGUE = {
    8: "GPU stopped processing", 32: "Invalid or corrupted push buffer stream",
    45: "Preemptive cleanup, due to previous errors", 61: "Internal micro-controller breakpoint/warning",
    62: "Internal micro-controller halt", 92: "High single-bit ECC error rate",
    120: "GSP Error", 154: "GPU recovery action changed",
}
CLOCK_FAULTS = {  # fault -> clocks event reasons it makes Active (8xH100 535 captures)
    "hw-slowdown": ["hw_slowdown"],
    "power-brake": ["hw_slowdown", "hw_power_brake_slowdown"],
    "thermal-slowdown": ["hw_slowdown", "hw_thermal_slowdown"],
    "sw-power-cap": ["sw_power_cap"],
    "sw-thermal-slowdown": ["sw_thermal_slowdown"],
}
# R580 also counts the time spent in a reason ("Clocks Event Reasons Counters", in us).
COUNTED = {"hw_power_brake_slowdown", "hw_thermal_slowdown", "sw_power_cap",
           "sw_thermal_slowdown"}


def now() -> float:
    fixed = os.environ.get("GPUSIM_TIME")  # tests pin the clock
    return float(fixed) if fixed else time.time()


def xid_line(gpu: dict, code: int, link: int = 0) -> str:
    bus = gpu["pci_bus_id"]
    pci = f"{bus[4:8]}:{bus[9:11]}:{bus[12:14]}".lower()  # 00000000:17:00.0 -> 0000:17:00
    text = XID_TEXT.get(code, XID_CATALOGUE.get(code, "Unknown Error"))
    text = text.format(link=link, gpu=gpu["index"])
    return f"NVRM: Xid (PCI:{pci}): {code}, pid='<unknown>', name=<unknown>, {text}"


def log_kernel(state: dict, lines: list[str]) -> None:
    """Append to the simulated kernel log (never /dev/kmsg: the containers share this
    machine's kernel). Lines of one event are a few microseconds apart."""
    log = state.setdefault("kernel_log", [])
    start = max([now()] + [e["t"] + 0.000001 for e in log[-1:]])
    for n, line in enumerate(lines):
        log.append({"t": round(start + n * 0.000028, 6), "level": "warn", "msg": line})


def pid1_start() -> float | None:
    """When this PID namespace's init started: the container's boot time."""
    try:
        stat = Path("/proc/1/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def new_kernel_log(state: dict) -> None:
    """A new boot: an empty kernel log, and the boot time its timestamps count from."""
    state["kernel_log"] = []
    boot = state.setdefault("boot", {"skip_next": False, "count": 0})
    fixed = os.environ.get("GPUSIM_TIME")
    boot["wall"] = float(fixed) if fixed else (pid1_start() or now())


def reset_health(gpu: dict) -> None:
    """A GPU reset or reboot: volatile ECC counts start again at 0 and a pending row remap
    takes effect (Pending: No; the remapped row stays counted). Other faults stay."""
    h = gpu.get("health")
    if not h:
        return
    if "ecc" in h:
        h["ecc"].pop("volatile", None)
    if "remapped_rows" in h:
        h["remapped_rows"]["pending"] = False


def nvlink_peers(state: dict, gpu: dict) -> list[dict]:
    pairs = state.get("topology", {}).get("pairs", {})
    peers = []
    for other in state["gpus"]:
        key = f"{min(gpu['index'], other['index'])},{max(gpu['index'], other['index'])}"
        if other is not gpu and pairs.get(key, "").startswith("NV"):
            peers.append(other)
    return peers


def _set_ecc(gpu: dict, key: str, count: int) -> None:
    ecc = gpu.setdefault("health", {}).setdefault("ecc", {})
    for scope in ("volatile", "aggregate"):
        ecc.setdefault(scope, {})[key] = count


def apply_fault(state: dict, gpu: dict, kind: str, value: int | None) -> str:
    h = gpu.setdefault("health", {})
    if kind == "clear":
        for link in h.get("nvlink_down", []):  # the other end of each link comes back too
            for peer in nvlink_peers(state, gpu):
                down = peer.get("health", {}).get("nvlink_down", [])
                if link in down:
                    down.remove(link)
        gpu.pop("health", None)
        return f"GPU {gpu['index']}: healthy"
    if kind == "ecc-correctable":
        _set_ecc(gpu, "dram_correctable", value)
    elif kind == "ecc-uncorrectable":
        # A DBE in HBM: the row is marked for remapping (A100/H100 row remapper).
        _set_ecc(gpu, "dram_uncorrectable", value)
        rows = h.setdefault("remapped_rows", {})
        rows["uncorrectable"] = rows.get("uncorrectable", 0) + 1
        rows["pending"] = True
        log_kernel(state, [xid_line(gpu, 48), xid_line(gpu, 63)])
    elif kind == "remap-failure":
        h.setdefault("remapped_rows", {})["failure"] = True
        log_kernel(state, [xid_line(gpu, 64)])
    elif kind == "xid":
        log_kernel(state, [xid_line(gpu, value)])
    elif kind == "nvlink-down":
        nvl = gpu.get("nvlink") or {}
        if nvl.get("state") != "active" or not 0 <= value < nvl.get("links", 0):
            raise SystemExit(f"gpusimctl: GPU {gpu['index']} has no active NVLink {value}")
        for target in [gpu] + nvlink_peers(state, gpu):
            down = target.setdefault("health", {}).setdefault("nvlink_down", [])
            if value not in down:
                down.append(value)
                down.sort()
        log_kernel(state, [xid_line(gpu, 74, link=value)])
    elif kind == "nvlink-crc":
        # Each CRC error makes the link replay the packet: both counters of link 0.
        errs = h.setdefault("nvlink_errors", {}).setdefault("0", {})
        errs["crc"] = errs["replay"] = value
    elif kind == "pcie-width":
        h.setdefault("pcie", {})["width_current"] = value
    elif kind == "nvlink-garbled":
        nvl = gpu.get("nvlink") or {}
        if nvl.get("state") != "active":
            raise SystemExit(f"gpusimctl: GPU {gpu['index']} has no active NVLink to garble")
        h["nvlink_garbled"] = True
    else:
        reasons = h.setdefault("clocks_event_reasons", [])
        counters = h.setdefault("clocks_event_counters_us", {})
        for reason in CLOCK_FAULTS[kind]:
            if reason not in reasons:
                reasons.append(reason)
            if reason in COUNTED:
                counters[reason] = counters.get(reason, 0) + 1000000
    return f"GPU {gpu['index']}: {kind}" + ("" if value is None else f" {value}")


FAULTS_WITH_VALUE = {"ecc-correctable", "ecc-uncorrectable", "xid", "nvlink-down",
                     "nvlink-crc", "pcie-width"}
FAULTS = sorted(FAULTS_WITH_VALUE | set(CLOCK_FAULTS)
                | {"remap-failure", "nvlink-garbled", "clear"})


def cmd_fault(args: argparse.Namespace, path: Path) -> int:
    if os.geteuid() != 0 and os.environ.get("GPUSIM_ASSUME_ROOT") != "1":
        raise SystemExit("gpusimctl fault: must be root")
    words = args.words
    with locked(path):
        state = _need_state(path)
        if words == ["clear"]:
            # Healthy again everywhere, and the kernel log is empty as after a reboot.
            for gpu in state["gpus"]:
                gpu.pop("health", None)
            state["kernel_log"] = []
            save_state(state, path)
            print("gpusim: every GPU healthy, kernel log empty")
            return 0
        if len(words) < 2 or words[1] not in FAULTS:
            raise SystemExit("usage: gpusimctl fault clear | gpusimctl fault GPU "
                             f"{{{','.join(FAULTS)}}} [N]")
        target, kind = words[0], words[1]
        gpu = next((g for g in state["gpus"] if str(g["index"]) == target), None)
        if gpu is None:
            raise SystemExit(f"gpusimctl: no GPU {target}")
        needs = kind in FAULTS_WITH_VALUE
        if len(words) != 2 + needs or (needs and not words[2].isdigit()):
            what = "a number" if needs else "no value"
            raise SystemExit(f"gpusimctl fault: {kind} takes {what}")
        value = int(words[2]) if needs else None
        if kind == "pcie-width" and value not in (1, 2, 4, 8, 16):
            raise SystemExit("gpusimctl fault: pcie-width is 1, 2, 4, 8 or 16")
        message = apply_fault(state, gpu, kind, value)
        save_state(state, path)
    print(f"gpusim: {message}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpusimctl", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="write a fresh state for a scenario")
    init.add_argument("--scenario", required=True,
                      choices=["seed", "seed580", "pcie", "mig", "mismatch", "h200", "bare"])
    init.add_argument("--pcie-link", default="PHB", choices=["PHB", "NODE", "SYS", "PXB", "PIX"],
                      help="topo -m cell between GPUs without a bridge (pcie scenario)")
    init.set_defaults(func=cmd_init)
    attach = sub.add_parser("attach-process", help="a process that holds a GPU")
    attach.add_argument("--gpu", type=int, required=True)
    attach.add_argument("--pid", type=int)
    attach.add_argument("--name", default="python3")
    attach.add_argument("--used-mib", type=int, default=1024)
    attach.set_defaults(func=cmd_attach)
    detach = sub.add_parser("detach-process")
    group = detach.add_mutually_exclusive_group(required=True)
    group.add_argument("--pid", type=int)
    group.add_argument("--all", action="store_true")
    detach.set_defaults(func=cmd_detach)
    boot = sub.add_parser("boot", help="apply what a reboot does (run at every boot)")
    boot.add_argument("--proc-root", help="write DIR/nvidia/version instead of mounting "
                      "over /proc/driver (tests)")
    boot.add_argument("--no-udev", action="store_true",
                      help="do not start nvidia-persistenced like Ubuntu's udev rule does")
    boot.set_defaults(func=cmd_boot)
    inst = sub.add_parser("install-driver", help="package postinst: installed version")
    inst.add_argument("--version", required=True)
    inst.set_defaults(func=cmd_install_driver)
    sub.add_parser("remove-driver", help="package prerm").set_defaults(func=cmd_remove_driver)
    conf = sub.add_parser("configure")
    conf.add_argument("--mig-auto-reset", choices=["on", "off"])
    conf.add_argument("--pcie-link", choices=["PHB", "NODE", "SYS", "PXB", "PIX"])
    conf.set_defaults(func=cmd_configure)
    sub.add_parser("show").set_defaults(func=cmd_show)
    fault = sub.add_parser(
        "fault", help="put a fault on a GPU (README.md: what each one changes)",
        usage="gpusimctl fault clear | gpusimctl fault GPU FAULT [N]")
    fault.add_argument("words", nargs="+", metavar="GPU FAULT [N]",
                       help=f"FAULT: {', '.join(FAULTS)}")
    fault.set_defaults(func=cmd_fault)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args, state_path())


if __name__ == "__main__":
    sys.exit(main())
