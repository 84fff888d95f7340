"""The bad-input catalogue, as Markdown: every input the suite refuses before any change.

    python -m tests.catalogue          # prints what docs/security.md carries

Two sources, both tests: the settings cases of tests/unit/test_settings_rejected.py (each
validated alone: exit 1 before any host is touched) and the pyinfra-testing fixtures of
tests/operations/ whose operation refuses a host (the host stops, unchanged; the others
go on). tests/unit/test_docs.py keeps docs/security.md equal to this output.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_rows() -> list[str]:
    from tests.unit.test_settings_rejected import CASES

    rows = ["| case | key | the message says |", "|---|---|---|"]
    for case in CASES:
        rows.append(f"| `{case.id}` | `{case.key}` | {_cell(' ... '.join(case.fragments))} |")
    return rows


def host_rows() -> list[str]:
    rows = ["| operation | fixture | the host state, and the refusal |", "|---|---|---|"]
    for path in sorted((ROOT / "tests" / "operations").glob("*/*.json")):
        data = json.loads(path.read_text())
        refusals = [c for c in data.get("commands", []) if isinstance(c, list) and c
                    and c[0] == "_refuse"]
        if not refusals:
            continue
        reason = refusals[0][1][0][0]
        rows.append(f"| `{path.parent.name}` | `{path.stem}` | {_cell(data.get('_note', ''))}: "
                    f"\"{_cell(reason)}\" |")
    return rows


def markdown() -> str:
    return "\n".join([
        "### Settings (the whole run stops, exit 1, before any host is touched)", "",
        *settings_rows(), "",
        "### Host states (that host stops, untouched; the others go on)", "",
        *host_rows(),
    ]) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
