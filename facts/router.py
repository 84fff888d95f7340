"""Facts about the fleet's front door (a router host's HAProxy): its pool as HAProxy's
runtime API says it, ``show stat`` read from its stats socket, with its parser."""

from __future__ import annotations

import csv
from typing import Any

from pyinfra.api import QuoteString, StringCommand
from typing_extensions import override

from facts.base import FactBase

# The backend of the serving hosts' gateways (templates/haproxy-vllm-router.cfg.j2).
POOL_BACKEND = "vllm_gateways"
_ABSENT = "--- absent ---"
_UNREADABLE = "--- unreadable ---"
# python3's socket module (no socat or nc on a minimal host): ``show stat`` on the runtime
# API, its answer as it comes; a socket that refuses or times out is named, exit 0.
_ASK = """import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(5)
try:
    s.connect(sys.argv[1])
    s.sendall(b"show stat\\n")
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        sys.stdout.buffer.write(chunk)
except OSError as error:
    print()
    print("--- unreadable ---")
    print(error)
"""

# HAProxy's ``show stat`` CSV: the columns the pool's view reads.
_STAT_FIELDS = ("pxname", "svname", "status", "check_status", "check_code", "last_chk")


def pool_view(show_stat: str, backend: str = POOL_BACKEND) -> list[dict[str, Any]]:
    """The router's view of its pool from ``show stat``'s CSV (its runtime API): each
    server of ``backend`` with ``in_pool`` (HAProxy's status UP, or going down but still
    taking requests: "UP 1/2"), the status as HAProxy says it, and why (the last check's
    status and code). A text that is not that CSV raises ValueError: never read as an
    empty, healthy pool."""
    lines = show_stat.lstrip().splitlines()
    if not lines or not lines[0].startswith("# pxname,svname,"):
        raise ValueError("not HAProxy's show stat output (no '# pxname,svname,' header)")
    rows = csv.DictReader([lines[0][2:], *lines[1:]])
    missing = [field for field in _STAT_FIELDS if field not in (rows.fieldnames or [])]
    if missing:
        raise ValueError(f"show stat output without the column(s) {', '.join(missing)}")
    view = []
    for row in rows:
        if row["pxname"] != backend or row["svname"] in ("FRONTEND", "BACKEND"):
            continue
        status = row["status"]
        view.append({"host": row["svname"], "in_pool": status.startswith("UP"),
                     "status": status, "why": _last_check(row)})
    return view


def _last_check(row: dict[str, str]) -> str:
    """Why a server is in or out, from its last finished check: its status (HAProxy
    marks it "* " while the next check runs), its HTTP code (0 while one runs), and the
    check's words (its answer's reason, else HAProxy's description of the status)."""
    code = row["check_code"] if row["check_code"] not in ("", "0") else ""
    words = row["last_chk"] or row.get("check_desc") or ""
    return " ".join(part for part in (row["check_status"].removeprefix("* "), code, words)
                    if part)


def parse_pool(output: list[str]) -> dict[str, Any] | None:
    """RouterPool's output read: None where the socket is absent (no HAProxy of the
    front door); ``{"error"}`` where it cannot be asked or its answer is not ``show
    stat`` (never an empty, healthy pool then); else ``{"servers": pool_view's}``."""
    lines = [line.strip() for line in output if line.strip()]
    if lines == [_ABSENT]:
        return None
    if _UNREADABLE in lines:
        why = " ".join(lines[lines.index(_UNREADABLE) + 1:]) or "no reason given"
        return {"error": f"HAProxy's runtime API cannot be asked: {why}"}
    try:
        return {"servers": pool_view("\n".join(output))}
    except ValueError as error:
        return {"error": f"HAProxy's runtime API gave no pool: {error}"}


class RouterPool(FactBase[dict[str, Any] | None]):
    """
    Returns the front door's pool as HAProxy's runtime API says it (``show stat`` on its
    stats socket, root only, at level user): each serving host's gateway, in the pool or
    not, and why (its last health check); None when the socket is absent (HAProxy is not
    installed or not running the front door's configuration); ``{"error": ...}`` where the
    socket cannot be asked or the answer is not ``show stat``:

    .. code:: python

        {"servers": [{"host": "gpu-1", "in_pool": True, "status": "UP", "why": "L7OK 200"},
                     {"host": "gpu-2", "in_pool": False, "status": "DOWN",
                      "why": "L7STS 503"}]}
    """

    @override
    def command(self, socket: str) -> StringCommand:
        quoted = QuoteString(socket)
        return StringCommand("if [ -e", quoted, "]; then python3 -c", QuoteString(_ASK),
                             quoted, "|| { echo; echo", QuoteString(_UNREADABLE),
                             "; echo python3 failed; }; else echo", QuoteString(_ABSENT),
                             "; fi")

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        return parse_pool(output)
