#!/usr/bin/env python3
"""Refuse to start vLLM on GPUs that are not fit for it: the unit's ``ExecStartPre``.

Uploaded by the deploy and run by systemd, as the service user, with the vLLM
environment's Python (its ``nvidia-ml-py`` package provides ``pynvml``):

    python gpu_guard.py --expect-gpus 2 --devices 0,1 [--require-nvlink] [--json]
    python gpu_guard.py --expect-gpus 2 --devices 0,1 --snapshot FILE   # test/replay input

It reads one snapshot of the GPUs from NVML and checks, for the GPUs the server will use
(``--devices``, NVML indexes; the unit sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA's
indexes are the same):

- NVML initialises (a missing library or a "Driver/library version mismatch" after an
  unattended driver upgrade is the reason given, not a CUDA error minutes later);
- NVML sees at least ``--expect-gpus`` GPUs and every listed index exists;
- MIG mode (current) is disabled on each: vLLM tensor parallel needs whole GPUs;
- no compute process runs on any of them (a leftover worker of an earlier server, or
  someone else's job): it would hold memory vLLM sizes its KV cache from;
- with ``--require-nvlink``: every pair is joined by at least one active NVLink (a link
  whose remote PCI bus id is the peer, or both GPUs on an NVSwitch).

Output: success is one line on stdout, ``gpu-guard: ok: N GPU(s) ...``, exit 0. Failure is
exactly one line on stderr, ``gpu-guard: `` and every problem joined by ``; ``, exit 1, so
``journalctl -u vllm`` shows why the unit did not start. Bad arguments: one line, exit 2.
``--json`` prints ``{"ok", "problems", "snapshot"}`` on stdout instead of the ok line (the
failure line still goes to stderr). ``--snapshot FILE`` judges a snapshot saved with
``--json`` (its ``snapshot`` member) or written by hand, without NVML: the test and replay
input.

Standard library only, apart from ``pynvml``, imported lazily so a missing package is a
reason like any other.
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import combinations
from typing import Any

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
PREFIX = "gpu-guard: "
MIB = 1024 * 1024
# NVML_NVLINK_MAX_LINKS in nvml.h: 12 on Ampere's headers, 18 since Hopper.
MAX_LINKS = 18
# nvmlDeviceGetNvLinkRemoteDeviceType's values (nvml.h, NVML_NVLINK_DEVICE_TYPE_*).
REMOTE_TYPES = {0: "gpu", 1: "ibmnpu", 2: "switch"}


class UsageError(Exception):
    """Bad arguments or an unreadable snapshot (exit 2)."""


# --- judging (pure) ------------------------------------------------------------------
def bus_key(bus_id: str | None) -> str | None:
    """A PCI bus id in one spelling: NVML writes ``00000000:3B:00.0``, sysfs ``0000:3b:00.0``."""
    if not bus_id:
        return None
    try:
        rest, function = bus_id.strip().rsplit(".", 1)
        domain, bus, device = rest.split(":")[-3:]
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{int(function, 16):x}"
    except ValueError:
        return bus_id.strip().lower()


def _process_words(process: dict) -> str:
    details = [str(process["name"]) if process.get("name") else "name unknown"]
    if process.get("used_mib") is not None:
        details.append(f"{process['used_mib']} MiB")
    return f"pid {process.get('pid')} ({', '.join(details)})"


def _active_links(gpu: dict) -> list[dict]:
    return [link for link in gpu.get("nvlinks") or [] if link.get("active")]


def nvlink_count(a: dict, b: dict) -> int:
    """Active NVLinks joining two GPUs of a snapshot (either end's view, or a shared switch)."""
    bus_a, bus_b = bus_key(a.get("bus_id")), bus_key(b.get("bus_id"))
    a_to_b = [link for link in _active_links(a) if bus_key(link.get("remote_bus_id")) == bus_b]
    b_to_a = [link for link in _active_links(b) if bus_key(link.get("remote_bus_id")) == bus_a]
    direct = max(len(a_to_b), len(b_to_a))
    if direct:
        return direct
    # HGX boards: every GPU's links end on NVSwitches, which join all of them.
    a_sw = [link for link in _active_links(a) if link.get("remote_type") == "switch"]
    b_sw = [link for link in _active_links(b) if link.get("remote_type") == "switch"]
    return min(len(a_sw), len(b_sw))


def judge(
    snapshot: dict, expect_gpus: int, devices: list[int], require_nvlink: bool
) -> list[str]:
    """The problems of a snapshot for a server on ``devices``; empty means fit to start.

    ``snapshot`` is the plain dict ``read_snapshot`` returns: ``{"nvml_error": str|None,
    "driver_version", "gpus": [{"index", "name", "bus_id", "mig_current" (1 on, 0 off,
    None unsupported), "processes": [{"pid", "name", "used_mib"}] (None: NVML would not
    list them), "nvlinks": [{"link", "active", "remote_bus_id", "remote_type"}] (None:
    no NVLink on this GPU)}]}``.
    """
    if snapshot.get("nvml_error"):
        return [f"NVML unavailable: {snapshot['nvml_error']}"]
    gpus = {gpu["index"]: gpu for gpu in snapshot.get("gpus") or []}
    problems = []
    if len(gpus) < expect_gpus:
        problems.append(f"expected at least {expect_gpus} GPU(s), NVML sees {len(gpus)}")
    present = []
    for index in devices:
        if index not in gpus:
            seen = ", ".join(str(i) for i in sorted(gpus)) or "none"
            problems.append(f"GPU {index} not found (NVML indexes: {seen})")
        else:
            present.append(gpus[index])
    for gpu in present:
        if gpu.get("mig_current") == 1:
            problems.append(
                f"GPU {gpu['index']} has MIG mode enabled (vLLM needs whole GPUs; "
                "the deploy's mig stage turns it off)"
            )
    for gpu in present:
        processes = gpu.get("processes") or []
        if processes:
            listed = ", ".join(_process_words(p) for p in processes)
            problems.append(f"GPU {gpu['index']} is in use by {listed}")
    if require_nvlink:
        for a, b in combinations(present, 2):
            if not nvlink_count(a, b):
                why = ""
                unsupported = [str(g["index"]) for g in (a, b) if g.get("nvlinks") is None]
                if unsupported:
                    why = f" (NVLink not supported on GPU {', '.join(unsupported)})"
                problems.append(
                    f"no active NVLink between GPU {a['index']} and GPU {b['index']}{why}"
                )
    return problems


def summary(snapshot: dict, devices: list[int], require_nvlink: bool) -> str:
    """The ok line's words (after ``gpu-guard: ok: ``) for a snapshot ``judge`` accepted."""
    gpus = {gpu["index"]: gpu for gpu in snapshot.get("gpus") or []}
    names = sorted({str(gpus[i].get("name") or "GPU") for i in devices})
    words = [
        f"{len(devices)} GPU(s) [{','.join(str(i) for i in devices)}] {' / '.join(names)}",
        "MIG off",
        "no compute process"
        if all(gpus[i].get("processes") is not None for i in devices)
        else "compute processes not readable",
    ]
    if require_nvlink:
        pairs = [
            f"GPU{a}-GPU{b} {nvlink_count(gpus[a], gpus[b])} link(s)"
            for a, b in combinations(devices, 2)
        ]
        words.append("NVLink " + ", ".join(pairs) if pairs else "NVLink not needed (1 GPU)")
    if snapshot.get("driver_version"):
        words.append(f"driver {snapshot['driver_version']}")
    return ", ".join(words)


# --- reading NVML --------------------------------------------------------------------
def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_snapshot() -> dict:
    """One snapshot of every GPU from NVML, as a plain dict (see ``judge``).

    A field NVML does not support on a GPU (``NVMLError_NotSupported``) is None; an NVML
    that does not initialise, or a missing ``pynvml``, is ``nvml_error`` and nothing else.
    """
    try:
        import pynvml  # nvidia-ml-py, installed with vLLM
    except ImportError:
        return {
            "nvml_error": f"pynvml is not installed in {sys.executable}'s environment",
            "gpus": [],
        }
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return {"nvml_error": str(exc) or type(exc).__name__, "gpus": []}
    try:
        return _read_gpus(pynvml)
    except pynvml.NVMLError as exc:
        return {"nvml_error": f"reading the GPUs failed: {exc}", "gpus": []}
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _read_gpus(pynvml: Any) -> dict:
    def optional(call, *args):
        try:
            return call(*args)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_NoPermission):
            return None

    snapshot: dict[str, Any] = {
        "nvml_error": None,
        "driver_version": _text(pynvml.nvmlSystemGetDriverVersion()),
        "gpus": [],
    }
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        mig = optional(pynvml.nvmlDeviceGetMigMode, handle)
        gpu: dict[str, Any] = {
            "index": index,
            "name": _text(pynvml.nvmlDeviceGetName(handle)),
            "bus_id": _text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
            "mig_current": None if mig is None else int(mig[0]),
            "processes": [],
            "nvlinks": None,
        }
        processes = optional(pynvml.nvmlDeviceGetComputeRunningProcesses, handle)
        if processes is None:
            gpu["processes"] = None  # not readable here: reported as unknown, not as busy
        for process in processes or []:
            used = getattr(process, "usedGpuMemory", None)
            try:
                name = _text(pynvml.nvmlSystemGetProcessName(process.pid))
            except pynvml.NVMLError:
                name = None  # another user's process: hidden by ProtectProc=invisible
            gpu["processes"].append({
                "pid": int(process.pid),
                "name": name,
                # NVML_VALUE_NOT_AVAILABLE (or None) without the permission to see it.
                "used_mib": used // MIB if isinstance(used, int) and 0 <= used < 2**63 else None,
            })
        gpu["nvlinks"] = _read_links(pynvml, handle, optional)
        snapshot["gpus"].append(gpu)
    return snapshot


def _read_links(pynvml: Any, handle: Any, optional) -> list[dict] | None:
    links: list[dict] = []
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", MAX_LINKS)):
        try:
            state = pynvml.nvmlDeviceGetNvLinkState(handle, link)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            # NotSupported on link 0: no NVLink at all; past the GPU's last link: done.
            return links if link else None
        entry: dict[str, Any] = {
            "link": link, "active": bool(state), "remote_bus_id": None, "remote_type": None,
        }
        if state:
            remote = optional(pynvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
            entry["remote_bus_id"] = _text(remote.busId) if remote is not None else None
            get_type = getattr(pynvml, "nvmlDeviceGetNvLinkRemoteDeviceType", None)
            if get_type is not None:
                kind = optional(get_type, handle, link)
                entry["remote_type"] = REMOTE_TYPES.get(kind) if kind is not None else None
        links.append(entry)
    return links


# --- command line --------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, instead of usage text
        raise UsageError(message)


def parse_devices(text: str) -> list[int]:
    try:
        devices = [int(part) for part in text.split(",") if part.strip() != ""]
    except ValueError:
        raise UsageError(f"--devices {text!r} is not a comma-separated list of indexes") from None
    if not devices or any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise UsageError(f"--devices {text!r} must list distinct indexes >= 0")
    return devices


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="gpu_guard.py", description=__doc__.splitlines()[0])
    parser.add_argument("--expect-gpus", type=int, required=True,
                        help="GPUs the server needs (the tensor parallel size)")
    parser.add_argument("--devices", help="NVML indexes of those GPUs, e.g. 0,1 "
                        "(default: 0 .. expect-gpus - 1)")
    parser.add_argument("--require-nvlink", action="store_true",
                        help="every pair of the GPUs must share an active NVLink")
    parser.add_argument("--json", action="store_true",
                        help='print {"ok", "problems", "snapshot"} instead of the ok line')
    parser.add_argument("--snapshot", metavar="FILE",
                        help="judge this JSON snapshot instead of reading NVML (tests, replay)")
    args = parser.parse_args(argv)
    if args.expect_gpus < 1:
        raise UsageError(f"--expect-gpus {args.expect_gpus} must be >= 1")
    if args.devices is None:
        args.devices = list(range(args.expect_gpus))
    else:
        args.devices = parse_devices(args.devices)
    if len(args.devices) != args.expect_gpus:
        raise UsageError(
            f"--devices lists {len(args.devices)} GPU(s) but --expect-gpus is {args.expect_gpus}"
        )
    return args


def load_snapshot(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read snapshot {path}: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("snapshot"), dict):
        data = data["snapshot"]  # a saved --json output
    if not isinstance(data, dict) or not isinstance(data.get("gpus", []), list):
        raise UsageError(f"snapshot {path} is not an object with a list of gpus")
    return data


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        snapshot = load_snapshot(args.snapshot) if args.snapshot else read_snapshot()
    except UsageError as exc:
        print(f"{PREFIX}bad arguments: {exc}", file=sys.stderr)
        return EXIT_USAGE
    problems = judge(snapshot, args.expect_gpus, args.devices, args.require_nvlink)
    if args.json:
        print(json.dumps({"ok": not problems, "problems": problems, "snapshot": snapshot},
                         indent=1, sort_keys=True))
    if problems:
        print(PREFIX + "; ".join(problems), file=sys.stderr)
        return EXIT_PROBLEMS
    if not args.json:
        print(f"{PREFIX}ok: {summary(snapshot, args.devices, args.require_nvlink)}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
