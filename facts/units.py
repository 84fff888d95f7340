"""Facts about systemd services beyond pyinfra's SystemdStatus: the processes of a unit."""

from __future__ import annotations

import re
from typing import Any

from pyinfra.api import QuoteString, StringCommand
from typing_extensions import override

from facts.base import FactBase


class UnitPids(FactBase[list[int]]):
    """
    Returns the PIDs in a systemd unit's control group (cgroup v2), ``[]`` when the unit
    does not exist, is not running, or systemd is absent:

    .. code:: python

        [4242, 4250, 4251]
    """

    @override
    def requires_command(self, unit: str) -> str:
        return "systemctl"

    @override
    def command(self, unit: str) -> StringCommand:
        # ControlGroup is empty for a unit that is not running; /sys/fs/cgroup is the
        # unified hierarchy on Ubuntu 22.04+ and Debian 12.
        return StringCommand(
            "cg=$(systemctl show --property=ControlGroup --value --",
            QuoteString(unit),
            "2>/dev/null);",
            '! test -n "$cg" -a -r "/sys/fs/cgroup$cg/cgroup.procs"',
            '|| cat "/sys/fs/cgroup$cg/cgroup.procs"',
        )

    @override
    @staticmethod
    def default() -> list[int]:
        return []

    @override
    def process(self, output: list[str]) -> list[int]:
        return sorted(int(line) for line in (line.strip() for line in output) if line.isdigit())


class UnitActivation(FactBase[dict[str, Any] | None]):
    """
    Returns a systemd unit's state and how long its last start took to become active,
    or None when systemd does not know the unit:

    .. code:: python

        {"active": "active", "enabled": "enabled", "start_to_active_s": 412.7}

    ``start_to_active_s`` is None until the unit has become active after a start.
    """

    @override
    def requires_command(self, unit: str) -> str:
        return "systemctl"

    @override
    def command(self, unit: str) -> StringCommand:
        return StringCommand(
            "systemctl show --property=LoadState,ActiveState,UnitFileState,"
            "InactiveExitTimestampMonotonic,ActiveEnterTimestampMonotonic --",
            QuoteString(unit),
        )

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        values = dict(line.strip().partition("=")[::2] for line in output if "=" in line)
        if values.get("LoadState") in (None, "not-found"):
            return None
        started = int(values.get("InactiveExitTimestampMonotonic") or 0)
        active = int(values.get("ActiveEnterTimestampMonotonic") or 0)
        return {
            "active": values.get("ActiveState"),
            "enabled": values.get("UnitFileState"),
            "start_to_active_s": round((active - started) / 1e6, 1)
            if started and active >= started else None,
        }


# Where an administrator's drop-ins for a unit live (systemd.unit(5), "Description":
# /etc and /run, and the .control directories `systemctl set-property` writes). The
# package's own drop-ins under /usr/lib and /lib are not listed.
ADMIN_UNIT_DIRS = (
    "/etc/systemd/system.control",
    "/run/systemd/system.control",
    "/etc/systemd/system",
    "/run/systemd/system",
)


class UnitDropIns(FactBase[list[dict[str, Any]]]):
    """
    Returns the drop-ins of a unit in the directories an administrator writes
    (``ADMIN_UNIT_DIRS``: ``/etc/systemd/system/<unit>.d/*.conf`` and the like): those
    systemd loaded (``DropInPaths``) and those on disk, loaded or not yet; ``[]`` when
    there are none or systemd is absent:

    .. code:: python

        [{"path": "/etc/systemd/system/vllm.service.d/override.conf",
          "loaded": False, "on_disk": True}]

    ``loaded`` without ``on_disk``: deleted since the last ``systemctl daemon-reload``.
    """

    @override
    def requires_command(self, unit: str) -> str:
        return "systemctl"

    @override
    def command(self, unit: str) -> StringCommand:
        dirs = [StringCommand(base, "/", QuoteString(unit), ".d", _separator="")
                for base in ADMIN_UNIT_DIRS]
        return StringCommand(
            "for d in", *dirs, "; do echo \"dir $d\"; done;",
            # DropInPaths is space-separated; systemd names no drop-in with a space.
            "for p in $(systemctl show --property=DropInPaths --value --",
            QuoteString(unit), "2>/dev/null); do echo \"loaded $p\"; done;",
            "for f in", *(StringCommand(d, "/*.conf", _separator="") for d in dirs),
            '; do [ ! -e "$f" ] || echo "file $f"; done',
        )

    @override
    @staticmethod
    def default() -> list[dict[str, Any]]:
        return []

    @override
    def process(self, output: list[str]) -> list[dict[str, Any]]:
        return parse_drop_ins(output)


def parse_drop_ins(output: list[str]) -> list[dict[str, Any]]:
    """UnitDropIns' lines (``dir``, ``loaded``, ``file``) as its list: only drop-ins in
    the unit's own directories of ``dir`` lines."""
    dirs: set[str] = set()
    loaded: set[str] = set()
    on_disk: set[str] = set()
    for line in output:
        kind, _, path = line.strip().partition(" ")
        {"dir": dirs, "loaded": loaded, "file": on_disk}.get(kind, set()).add(path)
    paths = {path for path in loaded | on_disk if path.rpartition("/")[0] in dirs}
    return [{"path": path, "loaded": path in loaded, "on_disk": path in on_disk}
            for path in sorted(paths)]


class SystemdBooted(FactBase[bool]):
    """
    Returns True when systemd is the host's init (PID 1), False otherwise (a container
    started without it, another init):

    .. code:: python

        True

    The test is sd_booted(3)'s: ``/run/systemd/system/`` exists only when systemd booted
    the system. Long jobs run as transient units only where this is True.
    """

    @override
    def command(self) -> str:
        return "test -d /run/systemd/system && echo yes || echo no"

    @override
    @staticmethod
    def default() -> bool:
        return False

    @override
    def process(self, output: list[str]) -> bool:
        return [line.strip() for line in output] == ["yes"]


# Read by UnitState and by the watch of a long job (pyinfra_vllm/operations/util/jobs.py), which
# polls them.
UNIT_STATE_PROPERTIES = "LoadState,ActiveState,SubState,Result,ExecMainStatus"


def parse_unit_state(output: list[str]) -> dict[str, Any] | None:
    """``systemctl show`` lines of ``UNIT_STATE_PROPERTIES`` as UnitState's value."""
    values = dict(line.strip().partition("=")[::2] for line in output if "=" in line)
    if values.get("LoadState") in (None, "", "not-found"):
        return None
    status = values.get("ExecMainStatus") or ""
    return {
        "active": values.get("ActiveState"),
        "sub": values.get("SubState"),
        "result": values.get("Result"),
        "status": int(status) if status.isdigit() else None,
    }


class UnitState(FactBase[dict[str, Any] | None]):
    """
    Returns a systemd unit's state, or None when systemd does not know it (never
    started, a transient unit collected after it ended, or systemd absent):

    .. code:: python

        {"active": "active", "sub": "running", "result": "success", "status": 0}

    ``status`` is the main process's exit status (``ExecMainStatus``).
    """

    @override
    def requires_command(self, unit: str) -> str:
        return "systemctl"

    @override
    def command(self, unit: str) -> StringCommand:
        return StringCommand(f"systemctl show --property={UNIT_STATE_PROPERTIES} --",
                             QuoteString(unit))

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        return parse_unit_state(output)


# pyinfra_vllm/operations/util/jobs.py unit_name: pyinfra-vllm-<what>-<12 hex>, a transient service.
_JOB_UNIT = re.compile(r"^pyinfra-vllm-[a-z_]+-[0-9a-f]{12}\.service$")


class JobUnits(FactBase[dict[str, str]]):
    """
    Returns the suite's long jobs systemd has loaded now (pyinfra_vllm/operations/util/jobs.py: the
    model's download, an environment's build, each a transient service), with their ActiveState;
    ``{}`` when there is none or systemd is absent:

    .. code:: python

        {"pyinfra-vllm-model-647366b5208f.service": "active"}
    """

    @override
    def requires_command(self) -> str:
        return "systemctl"

    @override
    def command(self) -> str:
        return ("systemctl list-units --all --plain --no-legend --no-pager --type=service "
                "-- 'pyinfra-vllm-*' 2>/dev/null; true")

    @override
    @staticmethod
    def default() -> dict[str, str]:
        return {}

    @override
    def process(self, output: list[str]) -> dict[str, str]:
        # UNIT LOAD ACTIVE SUB DESCRIPTION (systemctl(1), list-units)
        found = {}
        for line in output:
            fields = line.split()
            if len(fields) >= 4 and _JOB_UNIT.match(fields[0]):
                found[fields[0]] = fields[2]
        return found
