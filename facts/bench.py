"""Facts about the acceptance benchmark: the last record on the host."""

from __future__ import annotations

import json
from typing import Any

from pyinfra.api import QuoteString, StringCommand
from typing_extensions import override

from facts.base import FactBase


def parse_record(text: str | None) -> dict[str, Any] | None:
    """A benchmark record (pyinfra_vllm/plans/bench.py) from its text; None when there
    is none or the text is not one."""
    if not text:
        return None
    try:
        entry = json.loads(text)
    except ValueError:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("output_tokens_per_s"),
                                                       (int, float)):
        return None
    return entry


class BenchRecord(FactBase[dict[str, Any] | None]):
    """
    Returns the host's last benchmark record (``python -m tools.bench`` or a rolling
    restart's canary; pyinfra_vllm/plans/bench.py), or None when there is none or the
    file is not a record:

    .. code:: python

        {"output_tokens_per_s": 812.4, "failed": 0, "ttft_ms": {"p95": 2040.3, ...},
         "shape": {...}, "stack": "vllm 0.17.0 (torch 2.10.0, CUDA 12.8)",
         "at": "2026-12-03T14:02:11Z", ...}
    """

    @override
    def command(self, path: str) -> StringCommand:
        return StringCommand("cat", QuoteString(path), "2>/dev/null; true")

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        return parse_record("\n".join(output))
