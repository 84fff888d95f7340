"""Version strings compared as numbers, for drivers, vLLM and Python alike."""

from __future__ import annotations


def version_tuple(version: str | None) -> tuple[int, ...]:
    """``"535.129.03"`` -> ``(535, 129, 3)``; stops at the first non-numeric part
    (``"0.6.3.post1"`` -> ``(0, 6, 3)``), so versions compare as numbers."""
    parts: list[int] = []
    for piece in (version or "").strip().split("."):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)
