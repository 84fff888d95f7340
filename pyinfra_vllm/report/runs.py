"""The reports of each pyinfra run: gathered per run, written once, and the terminal
table printed when the process exits.

pyinfra runs a deploy file once per host, in parallel greenlets; this module outlives
those runs, so it gathers every host's entry, per run (pyinfra's State), and writes the
reports (JSON, Markdown, HTML) once, when the last of the run's hosts is recorded (a run
cut short writes what it read when the process exits). The terminal table is printed
once, when the process exits, after pyinfra's own output.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from weakref import WeakKeyDictionary

from pyinfra_vllm.report import store
from pyinfra_vllm.report.changes import changes
from pyinfra_vllm.report.front_door import with_front_door
from pyinfra_vllm.report.html_page import render_html
from pyinfra_vllm.report.markdown import render_markdown
from pyinfra_vllm.report.summary import summary_rows, summary_table

# When set (python -m tools.audit sets it), the paths of the reports are written to
# this file as JSON, so the wrapper reads the report this run wrote.
INDEX_ENV = "PYINFRA_VLLM_AUDIT_INDEX"


def _paths(report_dir: str) -> tuple[Path, Path]:
    """The new set's JSON and Markdown paths, stamped to the second. A set of that second
    already there (a second audit within the same second) is never overwritten: the stamp
    waits for the next second, at most one."""
    directory = Path(report_dir)
    while True:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        if not any((directory / f"audit-{stamp}{suffix}").exists()
                   for suffix in (".json", ".md", ".html")):
            return directory / f"audit-{stamp}.json", directory / f"audit-{stamp}.md"
        time.sleep(0.05)


@dataclass
class AuditRun:
    """One pyinfra run's reports: where they go, the previous report they are compared
    with (read before this run writes or prunes anything), and the hosts' entries."""

    json_path: Path
    md_path: Path
    previous: tuple[Path, dict[str, Any]] | None
    # The report sets kept in the reports' directory (None: all).
    keep: int | None
    generated_at: str
    hosts: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The files of older report sets this run removed (audit_report_keep).
    removed: list[Path] = field(default_factory=list)
    written: bool = False

    def report(self) -> dict[str, Any]:
        # Each serving host with the front door's view of it, where a router host was read.
        return {"generated_at": self.generated_at, "hosts": with_front_door(self.hosts)}


# Keyed by pyinfra's State, as the run context is keyed by its Host objects: a second
# run in the same process (pyinfra's API, a test) writes reports of its own.
_RUNS: WeakKeyDictionary[Any, AuditRun] = WeakKeyDictionary()


def audit_run(pyinfra_state: Any, report_dir: str, keep: int | None = None) -> AuditRun:
    """The reports of the run ``pyinfra_state`` (pyinfra's State), begun on its first use:
    their paths in ``report_dir`` and the previous report there; the terminal table is
    printed when the process exits."""
    run = _RUNS.get(pyinfra_state)
    if run is None:
        json_path, md_path = _paths(report_dir)
        run = AuditRun(json_path, md_path, store.previous_report(json_path), keep,
                       datetime.now(timezone.utc).isoformat(timespec="seconds"))
        _RUNS[pyinfra_state] = run
        atexit.register(_finish, run)
    return run


def _write(run: AuditRun) -> None:
    json_path, md_path = run.json_path, run.md_path
    json_path.parent.mkdir(parents=True, exist_ok=True)
    previous_path, previous = run.previous or (None, None)
    report = dict(run.report(), changes=changes(previous, run.report(),
                                                previous_path.name if previous_path else None))
    json_path.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    md_path.write_text(render_markdown(report) + "\n")
    json_path.with_suffix(".html").write_text(render_html(report, summary_rows(report)))
    store.publish_latest(json_path)
    if run.keep is not None:
        run.removed += store.prune(json_path.parent, run.keep,
                                          store.stamp_of(json_path) or "")
    index = os.environ.get(INDEX_ENV)
    if index:
        paths = {"json": str(json_path.resolve()), "markdown": str(md_path.resolve()),
                 "html": str(json_path.with_suffix(".html").resolve())}
        Path(index).write_text(json.dumps(paths) + "\n")
    run.written = True


def _finish(run: AuditRun) -> None:
    """At the process's exit: the reports of a run cut short before its last host was
    recorded (what it read), then the terminal table."""
    if run.hosts and not run.written:
        _write(run)
    _print_summary(run)


def _print_summary(run: AuditRun) -> None:
    if not run.hosts:
        return
    json_path, md_path = run.json_path, run.md_path
    print("\n" + summary_table(run.report()), file=sys.stderr)
    print(f"\nAudit reports written to {json_path} and {md_path}", file=sys.stderr)
    removed = {store.stamp_of(path) for path in run.removed}
    print(f"HTML report: {json_path.with_suffix('.html')}; "
          f"{json_path.parent / (store.LATEST + '.{json,md,html}')} point at this audit"
          + (f"; {len(removed)} older report set(s) removed (audit_report_keep)"
             if removed else ""), file=sys.stderr)


def previous_entry(pyinfra_state: Any, name: str, report_dir: str,
                   keep: int | None = None) -> dict[str, Any] | None:
    """The host's entry in the audit report in ``report_dir`` before the run
    ``pyinfra_state``'s (None: none)."""
    _path, previous = audit_run(pyinfra_state, report_dir, keep).previous or (None, None)
    return ((previous or {}).get("hosts") or {}).get(name)


def record(pyinfra_state: Any, name: str, entry: dict[str, Any], report_dir: str,
           keep: int | None = None) -> None:
    """Add one host's entry to the reports of the run ``pyinfra_state``, and write them
    once every host of the run is recorded; ``keep``: the report sets kept in
    ``report_dir`` (None: all)."""
    run = audit_run(pyinfra_state, report_dir, keep)
    run.hosts[name] = entry
    # pyinfra prepares a deploy file for each of the run's active hosts
    # (pyinfra_cli/util.py _parallel_load_hosts): with the last one recorded, the audit
    # of the run is whole.
    if {host.name for host in pyinfra_state.active_hosts} <= set(run.hosts):
        _write(run)
