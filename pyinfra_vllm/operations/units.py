"""A systemd unit enabled at boot and running, read with one fact; a unit kept free of
drop-ins the suite did not write.

pyinfra's ``systemd.service`` reads two facts (SystemdStatus, SystemdEnabled), a remote
round trip each, on every run; facts.units.UnitActivation reads both states in one
``systemctl show``.
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation

from facts.units import UnitActivation, UnitDropIns
from pyinfra_vllm.plans.units import (
    DISABLED_DROP_IN_DIR,
    foreign_drop_ins,
)


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


@operation()
def drop_ins_only(unit: str, own: list[str] | None = None,
                  disabled_dir: str = DISABLED_DROP_IN_DIR):
    """
    Keep ``unit`` free of drop-ins the suite did not write: each foreign one (in
    facts.units.ADMIN_UNIT_DIRS) is moved under ``disabled_dir``, then systemd reloads.

    + unit: the unit's full name, e.g. ``vllm.service``
    + own: the suite's own drop-ins of the unit, left in place
    + disabled_dir: where foreign drop-ins are kept, at their own path below it
      (``mv --backup=numbered``: one moved before is kept too)

    No foreign drop-in: no command. One systemd still has loaded but that is gone from
    disk gets only the reload. The caller restarts the unit (``_if`` on this operation):
    a running process keeps the configuration it started with.
    """
    foreign = foreign_drop_ins(host.get_fact(UnitDropIns, unit=unit), tuple(own or ()))
    if not foreign:
        host.noop(f"{unit} has no foreign drop-in")
        return
    for drop_in in foreign:
        if not drop_in["on_disk"]:
            continue
        kept = f"{disabled_dir}{drop_in['path']}"
        yield StringCommand(
            "install -d -m 700", QuoteString(kept.rpartition("/")[0]), "&&",
            "mv --backup=numbered -f", QuoteString(drop_in["path"]), QuoteString(kept),
        )
    yield "systemctl daemon-reload"
