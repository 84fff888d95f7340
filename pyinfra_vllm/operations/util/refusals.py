"""Refusal reasons logged once: those a stage logged while the run was planned
(HostContext.refuse) are not logged again when the refusing operation runs
(pyinfra_vllm/operations/gate.py)."""

from __future__ import annotations

import logging
from typing import Any
from weakref import WeakKeyDictionary

logger = logging.getLogger("pyinfra")

# Per pyinfra Host: a later run (pyinfra's API, a test) has new Host objects.
_LOGGED: WeakKeyDictionary[Any, set[str]] = WeakKeyDictionary()


def log_reasons(host: Any, reasons: list[str]) -> None:
    """Log ``reasons`` for ``host`` now, in red, and not again when its refusal runs."""
    for reason in reasons:
        host.log_styled(reason, fg="red", log_func=logger.error)
    _LOGGED.setdefault(host, set()).update(reasons)


def logged_reasons(host: Any) -> set[str]:
    """The reasons already logged for ``host``."""
    return _LOGGED.get(host, set())
