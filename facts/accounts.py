"""Facts about local accounts, read with getent (so NSS sources count too)."""

from __future__ import annotations

from typing import Any

from pyinfra.api import QuoteString, StringCommand
from typing_extensions import override

from facts.base import FactBase


class Account(FactBase[dict[str, Any]]):
    """
    Returns a user and the group of the same name, each None when absent:

    .. code:: python

        {"user": {"uid": 999, "gid": 999, "home": "/var/lib/vllm",
                  "shell": "/usr/sbin/nologin"},
         "group": {"gid": 999}}
    """

    @override
    def command(self, account: str) -> StringCommand:
        quoted = QuoteString(account)
        return StringCommand(
            "echo '== user'; getent passwd", quoted, "; echo '== group'; getent group", quoted,
            "; true",
        )

    @override
    def process(self, output: list[str]) -> dict[str, Any]:
        found: dict[str, Any] = {"user": None, "group": None}
        section = None
        for line in output:
            if line.strip() in ("== user", "== group"):
                section = line.strip()[3:]
                continue
            fields = line.strip().split(":")
            if section == "user" and len(fields) >= 7:
                found["user"] = {"uid": int(fields[2]), "gid": int(fields[3]),
                                 "home": fields[5], "shell": fields[6]}
            elif section == "group" and len(fields) >= 3:
                found["group"] = {"gid": int(fields[2])}
        return found
