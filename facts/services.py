"""Facts about systemd services beyond pyinfra's SystemdStatus: the processes of a unit."""

from __future__ import annotations

from typing_extensions import override

from pyinfra.api import FactBase, QuoteString, StringCommand


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
