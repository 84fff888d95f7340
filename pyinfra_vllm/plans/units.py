"""Which drop-ins of a unit are not the suite's, and where they are set aside."""

from __future__ import annotations

from typing import Any

# Where foreign drop-ins are kept, at their own path below it: moved, never deleted.
DISABLED_DROP_IN_DIR = "/var/lib/pyinfra-vllm/disabled-drop-ins"


def foreign_drop_ins(found: list[dict[str, Any]], own: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The drop-ins of facts.units.UnitDropIns the suite did not write (not in ``own``)."""
    return [drop_in for drop_in in found if drop_in["path"] not in own]
