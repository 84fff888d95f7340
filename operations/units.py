"""A systemd unit enabled at boot and running, read with one fact.

pyinfra's ``systemd.service`` reads two facts (SystemdStatus, SystemdEnabled), a remote
round trip each, on every run; facts.units.UnitActivation reads both states in one
``systemctl show``.
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation

from facts.units import UnitActivation


@operation()
def enabled_and_running(unit: str):
    """
    Keep ``unit`` enabled at boot and running.

    + unit: the unit's full name, e.g. ``nginx.service``

    Enabled and active: no command. A unit systemd does not know yet (its package is
    installed earlier in the same run) gets both commands; ``systemctl`` then names the
    problem if it still does not exist.
    """
    found = host.get_fact(UnitActivation, unit=unit)
    quoted = QuoteString(unit)
    changed = False
    if found is None or found["enabled"] != "enabled":
        yield StringCommand("systemctl enable", quoted)
        changed = True
    if found is None or found["active"] != "active":
        yield StringCommand("systemctl start", quoted)
        changed = True
    if not changed:
        host.noop(f"{unit} is enabled and active")
