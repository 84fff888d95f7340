"""Facts about the engine's sentinel (files/sentinel.py): the state it last wrote, and
who holds the rotation flag."""

from __future__ import annotations

import json
from typing import Any

from pyinfra.api import QuoteString, StringCommand
from typing_extensions import override

from facts.base import FactBase

# The sentinel's states (files/sentinel.py STATES).
STATES = ("ok", "failing", "out-of-rotation", "restarting", "paused")
_ROTATION = "--- rotation flag ---"
_ABSENT = "--- absent ---"
_UNREADABLE = "--- unreadable ---"


def parse_state(output: list[str]) -> dict[str, Any] | None:
    """SentinelState's output read: None where the state file is absent; ``{"error"}``
    where it cannot be read or is not the sentinel's (never a state then); else the
    state with ``rotation`` (None: no flag; "sentinel"; "other")."""
    output = [line for line in output if line.strip()]
    if _ROTATION not in output:
        return {"error": "the sentinel's state was not read (no answer from the host)"}
    at = output.index(_ROTATION)
    state_lines, flag_lines = output[:at], output[at + 1:]
    rotation = (None if flag_lines == [_ABSENT] else
                "sentinel" if [line.strip() for line in flag_lines] == ["sentinel"]
                else "other")
    if state_lines == [_ABSENT]:
        return None
    if state_lines == [_UNREADABLE]:
        return {"error": "the sentinel's state file cannot be read", "rotation": rotation}
    try:
        record = json.loads("\n".join(state_lines))
    except ValueError as exc:
        return {"error": f"the sentinel's state file is not JSON ({exc})", "rotation": rotation}
    if not isinstance(record, dict) or record.get("state") not in STATES:
        return {"error": "the sentinel's state file holds no known state", "rotation": rotation}
    events = record.get("events")
    return {"state": record["state"], "reason": str(record.get("reason", "")),
            "failures": record.get("failures"), "restarts": record.get("restarts"),
            "last_latency_s": record.get("last_latency_s"), "updated": record.get("updated"),
            "events": events if isinstance(events, list) else [], "rotation": rotation}


class SentinelState(FactBase[dict[str, Any] | None]):
    """
    Returns the state the sentinel last wrote and who holds the rotation flag; None when
    it wrote none (absent); ``{"error": ...}`` where it cannot be read:

    .. code:: python

        {"state": "out-of-rotation", "reason": "3 failure(s) in a row: ...",
         "failures": 3, "restarts": 1, "last_latency_s": 0.08, "updated": 1796648531.2,
         "events": [{"time": ..., "from": "ok", "to": "failing", "reason": "..."}],
         "rotation": "sentinel"}
    """

    @override
    def command(self, state_path: str, rotation_flag: str) -> StringCommand:
        def shown(path: str) -> list[Any]:
            quoted = QuoteString(path)
            # echo after cat: a file without a last newline still ends its line.
            return ["if [ -e", quoted, "]; then { cat", quoted, "&& echo; } 2>/dev/null ||",
                    "echo", QuoteString(_UNREADABLE), "; else echo", QuoteString(_ABSENT),
                    "; fi"]

        return StringCommand(*shown(state_path), "; echo", QuoteString(_ROTATION), ";",
                             *shown(rotation_flag))

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        return parse_state(output)
