"""The front door's view of each serving host, beside the host's own verdict: in the pool of
each router host of the audit or out of it, and why (HAProxy's status and last check).

A router host's entry carries its pool as its HAProxy said it (``router``,
pyinfra_vllm/plans/router.py ``verdict``); every other host's entry gets ``front_door``
from it when the report is made (``with_front_door``), so that the JSON, Markdown and HTML
files and the terminal table all carry the same words. A report without a router host is
left as it is.
"""

from __future__ import annotations

from typing import Any

from pyinfra_vllm.plans.router import server_words


def is_router_entry(entry: dict[str, Any]) -> bool:
    return entry.get("role") == "router"


def with_front_door(hosts: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``hosts`` (name: entry), each serving host's entry with ``front_door``: one view per
    router host, ``{"router", "in_pool", "status", "why"}``; ``in_pool`` None where that
    router's pool could not be read. Unchanged without a router host."""
    routers = {name: entry["router"] for name, entry in sorted(hosts.items())
               if is_router_entry(entry)}
    if not routers:
        return hosts
    return {name: entry if is_router_entry(entry) else
            dict(entry, front_door=[_view(router, judged, name)
                                    for router, judged in routers.items()])
            for name, entry in hosts.items()}


def _view(router: str, judged: dict[str, Any], name: str) -> dict[str, Any]:
    """Router ``router``'s view of the serving host ``name`` (``judged``: its verdict)."""
    if judged["state"] == "unknown":
        return {"router": router, "in_pool": None, "status": "unknown",
                "why": f"the front door's pool was not read: {judged['reason']}"}
    server = next((server for server in judged["servers"] if server["host"] == name), None)
    if server is None:
        return {"router": router, "in_pool": False, "status": "absent",
                "why": "from the front door's running configuration"}
    return {"router": router, "in_pool": server["in_pool"], "status": server["status"],
            "why": server["why"]}


def front_door_words(entry: dict[str, Any]) -> str:
    """The report's "front door" cell: a router host's pool in a few words, a serving
    host's place in each router's pool (``in pool: UP L7OK 200``, the router named where
    there are several), "-" without a router in the report."""
    if is_router_entry(entry):
        judged = entry["router"]
        return f"{judged['state']}: {judged['reason']}"
    views = entry.get("front_door") or []
    words = [("in pool" if view["in_pool"] else "unknown" if view["in_pool"] is None
              else "out") + f": {server_words(view)}" for view in views]
    if len(views) > 1:
        words = [f"{view['router']} {word}" for view, word in zip(views, words, strict=True)]
    return "; ".join(words) or "-"
