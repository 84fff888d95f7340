"""The audit's report sets on the operator's machine: the previous one, ``latest``, and
retention.

A report set is ``audit-<UTC stamp>.json``, ``.md`` and ``.html`` in ``audit_report_dir``
(pyinfra_vllm/report/runs.py writes them). This module only reads and removes files named
that way, and writes ``latest.json``, ``latest.md`` and ``latest.html`` beside them;
every other file in the directory is left alone.

``latest.*`` are relative symbolic links to the newest set: replacing a link is atomic
(``os.replace`` of a new link over the old one), costs no copy, and ``ls -l`` shows which
report it is. Where the file system refuses symbolic links (some network and FAT mounts
raise ``OSError`` from ``os.symlink``) they are copies instead, rewritten with the set.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

SET_NAME = re.compile(r"^audit-(\d{8}T\d{6}Z)\.(json|md|html)$")
SUFFIXES = (".json", ".md", ".html")
LATEST = "latest"


def stamp_of(path: Path) -> str | None:
    """The UTC stamp of a report set's file name, or None for any other file."""
    match = SET_NAME.match(path.name)
    return match.group(1) if match else None


def report_sets(directory: Path) -> dict[str, list[Path]]:
    """{stamp: [files of that set]} in ``directory`` ({} when it does not exist)."""
    sets: dict[str, list[Path]] = {}
    if not directory.is_dir():
        return sets
    for path in sorted(directory.iterdir()):
        stamp = stamp_of(path)
        if stamp is not None and not path.is_symlink() and path.is_file():
            sets.setdefault(stamp, []).append(path)
    return sets


def previous_report(json_path: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest readable JSON report older than ``json_path``'s set, as (path, report).

    Read before the new set is written and before any pruning. A JSON file that does
    not parse (a run cut short while writing it) is passed over for the one before it.
    """
    current = stamp_of(json_path)
    sets = report_sets(json_path.parent)
    for stamp in sorted(sets, reverse=True):
        if current is not None and stamp >= current:
            continue
        path = json_path.parent / f"audit-{stamp}.json"
        if path not in sets[stamp]:
            continue
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(report, dict) and isinstance(report.get("hosts"), dict):
            return path, report
    return None


def publish_latest(json_path: Path) -> list[Path]:
    """Point ``latest.json``, ``latest.md`` and ``latest.html`` at ``json_path``'s set
    (those of its files that exist); returns the ``latest`` paths written."""
    written = []
    for suffix in SUFFIXES:
        target = json_path.with_suffix(suffix)
        if not target.is_file():
            continue
        latest = target.parent / f"{LATEST}{suffix}"
        temporary = target.parent / f".{LATEST}{suffix}.{os.getpid()}"
        temporary.unlink(missing_ok=True)
        try:
            os.symlink(target.name, temporary)
        except OSError:
            shutil.copyfile(target, temporary)
        os.replace(temporary, latest)
        written.append(latest)
    return written


def prune(directory: Path, keep: int, current: str) -> list[Path]:
    """Remove the report sets older than the newest ``keep`` ones; the set stamped
    ``current`` (the one just written) is always kept. Returns the files removed."""
    sets = report_sets(directory)
    kept = set(sorted(sets, reverse=True)[: max(keep, 1)]) | {current}
    removed = []
    for stamp in sorted(sets):
        if stamp in kept or stamp > current:
            continue
        for path in sets[stamp]:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
