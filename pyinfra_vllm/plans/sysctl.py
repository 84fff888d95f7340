"""Where the suite's sysctl drop-in goes, and which kernel parameters need writing (pure
functions of facts.sysctl; pyinfra_vllm/operations/sysctl.py writes and applies them)."""

from __future__ import annotations

from typing import Any

from facts.sysctl import normalize

TEMPLATE = "sysctl-vllm.conf.j2"  # in the suite's templates/


def drop_in_path(priority: int, name: str = "vllm") -> str:
    """``/etc/sysctl.d/<priority>-<name>.conf``."""
    return f"/etc/sysctl.d/{priority:02d}-{name}.conf"


def plan_sysctl(
    params: dict[str, Any], current: dict[str, dict[str, Any] | None]
) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """Split the wanted keys into ``sysctl -w`` work and keys that cannot be applied.

    Returns ``([(key, value) to write], {key: why not applied})``; keys already at
    their value are in neither.
    """
    to_write: list[tuple[str, str]] = []
    not_applied: dict[str, str] = {}
    for key, value in params.items():
        wanted = normalize(value)
        found = current.get(key)
        if found is None:
            not_applied[key] = "unknown to this kernel"
        elif found.get("value") == wanted:
            continue
        elif not found.get("writable"):
            not_applied[key] = f"/proc/sys is read-only here; running value {found.get('value')}"
        else:
            to_write.append((key, wanted))
    return to_write, not_applied
