"""What every GPU-health parser checks before any pattern runs: the line-length bound,
and the error an output it knows but cannot read raises.

Why a bound: a parser runs inside pyinfra's run (a fact's ``process``) and in
tools/gpu_health.py over whatever a support bundle holds. Each pattern of the parsers
(facts/gpu_health_smi.py, _csv.py, _nvlink.py, _record.py and _logs.py) is linear in its
input (no nested or overlapping quantifiers: tests/unit/test_gpu_health.py checks them),
and the bound caps what one line can cost. A line over the bound is an unreadable output, never a line
skipped: what it held is unknown, so the output is not judged healthy.

The longest line of the real outputs the tests carry is the header of a ``--query-gpu``
CSV of every field (5,901 characters, tests/fixtures/nvidia/health/); a kernel log
record is at most 1,024 bytes (the printk ring buffer's record limit), and nvidia-smi's
``-q`` lines are under 200 characters.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_LINE_CHARS = 16384


class UnreadableOutput(ValueError):
    """An output of a kind a parser knows that it cannot read; the message says which
    output and why (the line, what was found)."""


def bounded_lines(lines: Iterable[str], what: str) -> list[str]:
    """``lines`` as a list, each without its line break; UnreadableOutput naming ``what``
    (the output) and the line when one is longer than MAX_LINE_CHARS."""
    kept: list[str] = []
    for number, line in enumerate(lines, 1):
        line = line.rstrip("\r\n")
        if len(line) > MAX_LINE_CHARS:
            raise UnreadableOutput(
                f"{what}: line {number} is {len(line)} characters long, over the "
                f"{MAX_LINE_CHARS} a line of it may have: the output is not read"
            )
        kept.append(line)
    return kept
