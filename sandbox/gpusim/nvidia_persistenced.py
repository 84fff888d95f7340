#!/usr/bin/env python3
"""Simulated nvidia-persistenced (installed as /usr/bin/nvidia-persistenced).

Like the real daemon (docs.nvidia.com/deploy/driver-persistence): it forks, writes
/var/run/nvidia-persistenced/nvidia-persistenced.pid, and while it runs the GPUs are in
persistence mode, unless it was started with --no-persistence-mode (which Ubuntu's packaged
unit does). On SIGTERM it leaves persistence mode and exits, so persistence is off after a stop.

Simplifications: --user/--group are accepted but the process stays root, because it has to
write the simulator's state file; messages go to stderr (the journal), not syslog.
Simulation-only flags: --gpusim-foreground (do not fork; for tests) and
--gpusim-pid-dir DIR (instead of /var/run/nvidia-persistenced).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

DEFAULT_STATE = "/var/lib/gpusim/state.json"
PID_DIR = "/var/run/nvidia-persistenced"
FAILED = "nvidia-persistenced failed to initialize. Check syslog for more details."


# -------------------------------------------- state file (same few lines as in nvidia_smi.py)


def state_path() -> Path:
    return Path(os.environ.get("GPUSIM_STATE", DEFAULT_STATE))


@contextlib.contextmanager
def locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def load_state(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def save_state(state: dict, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".state-", dir=path.parent)
    with os.fdopen(fd, "w") as handle:
        json.dump(state, handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
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



# ------------------------------------------------------------------------------------ daemon


def log(verbose: bool, message: str) -> None:
    if verbose:
        print(f"nvidia-persistenced: {message}", file=sys.stderr, flush=True)


def driver_usable(state: dict | None) -> bool:
    drv = (state or {}).get("driver") or {}
    return bool(drv.get("module_loaded") and drv.get("installed_version")
                and drv.get("module_version") == drv.get("installed_version"))


def register(path: Path, pid: int, persistence: bool, verbose: bool) -> bool:
    """Record the daemon and switch persistence mode on; False if it cannot start."""
    with locked(path):
        state = load_state(path)
        if not driver_usable(state):
            print(FAILED, file=sys.stderr, flush=True)
            return False
        running = state.get("persistenced") or {}
        if daemon_alive(running) and running.get("pid") != pid:
            log(True, f"already running as pid {running['pid']}")
            print(FAILED, file=sys.stderr, flush=True)
            return False
        state["persistenced"] = {"pid": pid, "persistence_mode": persistence}
        for gpu in state["gpus"]:
            gpu["persistence_daemon"] = persistence
            log(verbose, f"device {gpu['pci_bus_id']} - persistence mode "
                         f"{'enabled' if persistence else 'disabled'}.")
        save_state(state, path)
    return True


def unregister(path: Path, pid: int, verbose: bool) -> None:
    with locked(path):
        state = load_state(path)
        if state is None or (state.get("persistenced") or {}).get("pid") != pid:
            return
        state["persistenced"] = None
        for gpu in state["gpus"]:
            gpu["persistence_daemon"] = False
            log(verbose, f"device {gpu['pci_bus_id']} - persistence mode disabled.")
        save_state(state, path)


def write_pidfile(pid_dir: Path, pid: int) -> Path:
    pid_dir.mkdir(parents=True, exist_ok=True)
    pidfile = pid_dir / "nvidia-persistenced.pid"
    pidfile.write_text(f"{pid}\n")
    return pidfile


def daemonize() -> bool:
    """Classic double fork; True in the daemon, the parent exits once the pid file exists."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child > 0:
        os.close(write_end)
        ok = os.read(read_end, 1) == b"1"
        # Reap the intermediate child before exiting: systemd (Type=forking, no PIDFile)
        # guesses the main PID from what is left in the cgroup, and must find only the
        # daemon there, or stop and restart go to the wrong process.
        os.waitpid(child, 0)
        os._exit(0 if ok else 1)
    os.close(read_end)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    os.chdir("/")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.environ["_GPUSIM_READY_FD"] = str(write_end)
    return True


def signal_ready(ok: bool) -> None:
    fd = os.environ.pop("_GPUSIM_READY_FD", None)
    if fd is not None:
        os.write(int(fd), b"1" if ok else b"0")
        os.close(int(fd))


def run(args: argparse.Namespace) -> int:
    path = state_path()
    if not args.gpusim_foreground:
        daemonize()
    pid = os.getpid()

    def stop(signum, frame):  # noqa: ARG001 - signal handler signature
        raise SystemExit(0)

    # Handlers first: a SIGTERM during start-up (systemd stops a unit it just started
    # when StopWhenUnneeded) must still leave persistence mode and unregister.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log(args.verbose, f"Started ({pid})")
    pidfile = None
    try:
        if not register(path, pid, args.persistence_mode, args.verbose):
            signal_ready(False)
            return 1
        pidfile = write_pidfile(Path(args.gpusim_pid_dir), pid)
        signal_ready(True)
        while True:
            signal.pause()
    finally:
        # A no-op unless this process is the registered daemon.
        unregister(path, pid, args.verbose)
        if pidfile is not None:
            with contextlib.suppress(FileNotFoundError):
                pidfile.unlink()
        log(args.verbose, f"Shutdown ({pid})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nvidia-persistenced")
    parser.add_argument("-u", "--user")
    parser.add_argument("-g", "--group")
    parser.add_argument("-V", "--verbose", action="store_true")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--persistence-mode", dest="persistence_mode", action="store_true",
                      default=True)
    mode.add_argument("--no-persistence-mode", dest="persistence_mode", action="store_false")
    parser.add_argument("--nvidia-cfg-path")
    parser.add_argument("-v", "--version", action="version",
                        version="nvidia-persistenced (gpusim simulation)")
    parser.add_argument("--gpusim-foreground", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gpusim-pid-dir", default=PID_DIR, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
