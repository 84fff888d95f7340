#!/usr/bin/env python3
"""Simulated `dmesg` for sandbox hosts (installed as /usr/local/bin/dmesg, ahead of /usr/bin in
root's PATH and sudo's secure_path): prints the simulated kernel log, never the real one.

Single file, Python 3.11 stdlib only (it ships in the simulated nvidia-dkms package). The
sandbox containers share this machine's kernel, so the real ring buffer is the host's: this
program never reads it and never runs /usr/bin/dmesg. Its lines are the `kernel_log` list of
the gpusim state file (/var/lib/gpusim/state.json, env GPUSIM_STATE overrides it), written
by `gpusimctl fault` and emptied by `gpusimctl boot` (a new boot) and `gpusimctl fault clear`.

Time formats as util-linux prints them:
  (default, --time-format raw|reltime)  [  123.456789] NVRM: ...   seconds since boot
  -T, --ctime, --time-format ctime      [Wed Dec  2 02:42:57 2026] NVRM: ...
  --time-format iso                     2026-12-02T02:42:57,123456+00:00 NVRM: ...
  -t, --notime, --time-format notime    NVRM: ...
  -x, --decode                          kern  :warn  : before the time (as `dmesg -x`)
  -C, --clear / -c, --read-clear        empty the simulated log (root), -c after printing
Other options are accepted and ignored (those that take a value skip it).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_STATE = "/var/lib/gpusim/state.json"
# util-linux options that take a value (skipped with it, not printed as an error).
VALUE_OPTS = {"-l", "--level", "-f", "--facility", "-s", "--buffer-size", "-n",
              "--console-level", "-F", "--file", "-K", "--kmsg-file", "--since", "--until",
              "--color"}


def state_path() -> Path:
    return Path(os.environ.get("GPUSIM_STATE", DEFAULT_STATE))


def is_root() -> bool:
    return os.geteuid() == 0 or os.environ.get("GPUSIM_ASSUME_ROOT") == "1"


def restricted() -> bool:
    """kernel.dmesg_restrict (1 on Debian 12): only root may read the log."""
    try:
        return Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() == "1"
    except OSError:
        return False


def parse(argv: list[str]) -> dict:
    opts = {"time": "raw", "decode": False, "clear": None}
    i = 0
    while i < len(argv):
        tok = argv[i]
        name, eq, inline = tok.partition("=")
        if name == "--time-format":
            if eq:
                value = inline
            elif i + 1 < len(argv):
                i += 1
                value = argv[i]
            else:
                raise SystemExit("dmesg: option '--time-format' requires an argument")
            if value not in ("iso", "ctime", "notime", "raw", "reltime", "delta"):
                raise SystemExit(f"dmesg: unknown time format: {value}")
            opts["time"] = {"reltime": "raw", "delta": "raw"}.get(value, value)
        elif tok in ("-T", "--ctime"):
            opts["time"] = "ctime"
        elif tok in ("-t", "--notime"):
            opts["time"] = "notime"
        elif tok in ("-x", "--decode"):
            opts["decode"] = True
        elif tok in ("-C", "--clear"):
            opts["clear"] = "only"
        elif tok in ("-c", "--read-clear"):
            opts["clear"] = "after"
        elif name in VALUE_OPTS and not eq:
            i += 1  # skip its value
        elif tok.startswith("-") and not tok.startswith("--") and len(tok) > 2:
            # bundled short flags such as -Tx
            sub = parse([f"-{c}" for c in tok[1:]])
            opts.update({k: v for k, v in sub.items() if v not in (None, False, "raw")})
        i += 1
    return opts


def load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def boot_time(state: dict, entries: list[dict]) -> float:
    wall = (state.get("boot") or {}).get("wall")
    if wall is not None:
        return float(wall)
    return min((e["t"] for e in entries), default=time.time())


def iso(t: float) -> str:
    when = datetime.datetime.fromtimestamp(t).astimezone()
    offset = when.strftime("%z")
    return f"{when:%Y-%m-%dT%H:%M:%S},{when.microsecond:06d}{offset[:3]}:{offset[3:]}"


def render(state: dict, opts: dict) -> str:
    entries = state.get("kernel_log") or []
    boot = boot_time(state, entries)
    out = []
    for entry in entries:
        t, msg = float(entry["t"]), entry["msg"]
        if opts["time"] == "iso":
            line = f"{iso(t)} {msg}"
        elif opts["time"] == "ctime":
            line = f"[{time.strftime('%a %b %e %H:%M:%S %Y', time.localtime(t))}] {msg}"
        elif opts["time"] == "notime":
            line = msg
        else:
            rel = max(t - boot, 0.0)
            sec, usec = int(rel), int(round((rel - int(rel)) * 1e6))
            if usec == 1000000:
                sec, usec = sec + 1, 0
            line = f"[{sec:5d}.{usec:06d}] {msg}"
        if opts["decode"]:
            line = f"kern  :{entry.get('level', 'warn'):<6}: {line}"
        out.append(line + "\n")
    return "".join(out)


def clear(path: Path) -> None:
    """Empty the simulated log under the state lock (as gpusimctl does)."""
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = load(path)
        if not state:
            return
        state["kernel_log"] = []
        fd, tmp = tempfile.mkstemp(prefix=".state-", dir=path.parent)
        with os.fdopen(fd, "w") as handle:
            json.dump(state, handle, indent=2, sort_keys=True)
            handle.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        opts = parse(argv)
    except SystemExit as stop:
        print(stop, file=sys.stderr)
        return 1
    if not is_root() and (opts["clear"] or restricted()):
        print("dmesg: read kernel buffer failed: Operation not permitted", file=sys.stderr)
        return 1
    path = state_path()
    state = load(path)
    if opts["clear"] != "only":
        sys.stdout.write(render(state, opts))
        sys.stdout.flush()
    if opts["clear"] and state:
        with contextlib.suppress(OSError):
            clear(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
