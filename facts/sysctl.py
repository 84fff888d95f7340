"""Kernel parameters read from /proc/sys, with whether they can be written here."""

from __future__ import annotations

from typing import Any

from pyinfra.api import QuoteString, StringCommand
from typing_extensions import override

from facts.base import FactBase


def proc_sys_path(key: str) -> str:
    """``vm.swappiness`` -> ``/proc/sys/vm/swappiness``."""
    return "/proc/sys/" + key.replace(".", "/")


def normalize(value: Any) -> str:
    """A sysctl value as the kernel prints it, whitespace collapsed (``1024\\t65000``)."""
    return " ".join(str(value).split())


class KernelParam(FactBase[dict[str, Any] | None]):
    """
    Returns a kernel parameter's value and whether this host can change it now, or None
    when the kernel has no such parameter:

    .. code:: python

        {"value": "60", "writable": False}

    ``writable`` is False where /proc/sys is mounted read-only (a container: vm.* keys
    in systemd-nspawn) or the key belongs to another namespace; such a key can only be
    persisted, not applied.
    """

    @override
    def command(self, key: str) -> StringCommand:
        path = QuoteString(proc_sys_path(key))
        return StringCommand(
            "! test -e", path, "|| {",
            "if test -w", path, "; then echo writable; else echo read-only; fi;",
            "! test -r", path, "|| cat", path, "; }",
        )

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        if not output:
            return None
        return {
            "value": normalize(" ".join(output[1:])) if len(output) > 1 else None,
            "writable": output[0].strip() == "writable",
        }
