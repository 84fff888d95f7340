"""The mirror's run-time fault switch and request counters.

Tests flip faults over HTTP (``POST /_faults``) while a download is in flight elsewhere, so
both tables are shared between server threads and guarded by one lock each.

A fault is consumed only when it actually changes a response: a ``drop`` needs a body longer
than ``after_bytes``; a ``corrupt`` needs the served range to cover ``offset``; a ``slow`` needs
a body at all (a GET of at least one byte). So a resumed request that starts past the corrupt
byte does not silently use up the fault.

A response takes a copy of its fault as it starts: clearing the table (``DELETE /_faults``)
does not speed up a ``slow`` body already on its way, it only leaves the next ones alone.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field

MODES = ("drop", "corrupt", "status", "slow")


class FaultError(ValueError):
    """A fault specification that cannot be honoured."""


@dataclass
class Fault:
    """One armed fault. ``times`` is how many responses it affects; -1 means every one."""

    mode: str
    path: str | None = None  # file name in the repo ("rfilename"); None: any file
    repo_id: str | None = None  # None: any repo
    after_bytes: int = 0  # drop: body bytes sent before the connection is closed
    offset: int = 0  # corrupt: byte offset in the *file* (equals the body offset for a full GET)
    status: int = 503  # status: the HTTP status answered instead of the file
    rate: int = 0  # slow: body bytes per second, per response (each connection paced alone)
    times: int = 1
    id: int = 0
    fired: int = 0

    def matches(self, repo_id: str, path: str) -> bool:
        return (self.path in (None, path)) and (self.repo_id in (None, repo_id))


def parse_fault(spec: object) -> Fault:
    """Validate a JSON fault specification from ``POST /_faults``."""
    if not isinstance(spec, dict):
        raise FaultError("a fault is a JSON object")
    unknown = set(spec) - {"mode", "path", "repo_id", "after_bytes", "offset", "status", "rate",
                           "times"}
    if unknown:
        raise FaultError(f"unknown fault fields: {sorted(unknown)}")
    if spec.get("mode") not in MODES:
        raise FaultError(f"mode must be one of {MODES}")
    fault = Fault(**spec)
    for name in ("after_bytes", "offset", "status", "rate", "times"):
        value = getattr(fault, name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise FaultError(f"{name} must be an integer, got {value!r}")
    if fault.after_bytes < 0 or fault.offset < 0:
        raise FaultError("after_bytes and offset must be >= 0")
    if fault.times == 0 or fault.times < -1:
        raise FaultError("times must be -1 (always) or a positive count")
    if fault.mode == "status" and not 400 <= fault.status <= 599:
        raise FaultError("status must be an HTTP error status (400-599)")
    if fault.mode == "slow" and fault.rate <= 0:
        raise FaultError(f"rate must be > 0 for mode slow (body bytes per second, e.g. "
                         f"200000), got {fault.rate}")
    if fault.mode != "slow" and fault.rate != 0:
        raise FaultError(f"rate applies to mode slow only, not {fault.mode}")
    return fault


class FaultTable:
    """Armed faults, first armed first applied."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._next_id = 1

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            fault.id = self._next_id
            self._next_id += 1
            self._faults.append(fault)
            return fault

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def snapshot(self) -> list[dict[str, object]]:
        with self._lock:
            return [asdict(f) for f in self._faults]

    def take(self, repo_id: str, path: str, *, method: str, start: int, length: int
             ) -> Fault | None:
        """Claim the first fault that would change this response, spending one of its uses."""
        with self._lock:
            for fault in self._faults:
                if fault.matches(repo_id, path) and _applies(fault, method, start, length):
                    fault.fired += 1
                    if fault.times > 0:
                        fault.times -= 1
                        if fault.times == 0:
                            self._faults.remove(fault)
                    return Fault(**asdict(fault))
        return None


def _applies(fault: Fault, method: str, start: int, length: int) -> bool:
    if fault.mode == "status":
        return True
    if method != "GET":
        return False  # drop, corrupt and slow act on a body; HEAD has none
    if fault.mode == "drop":
        return fault.after_bytes < length
    if fault.mode == "slow":
        return length > 0
    return start <= fault.offset < start + length  # corrupt


@dataclass
class FileStats:
    get: int = 0
    head: int = 0
    ranged: int = 0  # GETs answered 206
    bytes_sent: int = 0  # body bytes actually written (a dropped response counts what went out)


@dataclass
class Stats:
    """Per-file counters plus a few server-wide ones, for "downloaded nothing" assertions."""

    files: dict[str, FileStats] = field(default_factory=dict)
    api: int = 0
    unauthorized: int = 0
    not_found: int = 0
    faults_fired: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def file(self, key: str, **deltas: int) -> None:
        with self._lock:
            entry = self.files.setdefault(key, FileStats())
            for name, delta in deltas.items():
                setattr(entry, name, getattr(entry, name) + delta)

    def bump(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def reset(self) -> None:
        with self._lock:
            self.files.clear()
            self.api = self.unauthorized = self.not_found = self.faults_fired = 0

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            files = {k: asdict(v) for k, v in sorted(self.files.items())}
            return {
                "files": files,
                "totals": {
                    "get": sum(v["get"] for v in files.values()),
                    "head": sum(v["head"] for v in files.values()),
                    "bytes_sent": sum(v["bytes_sent"] for v in files.values()),
                },
                "api": self.api,
                "unauthorized": self.unauthorized,
                "not_found": self.not_found,
                "faults_fired": self.faults_fired,
            }
