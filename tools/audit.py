"""The fleet audit with drift, for people, cron and CI: exit 0 converged, 1 drift, 2 failed.

    python -m tools.audit INVENTORY [--deploy deploys/full.py] [--deep] [PYINFRA OPTION ...]

Runs, from the repository root, one read-only pyinfra run:

    pyinfra --dry --json [PYINFRA OPTION ...] INVENTORY deploys/full.py deploys/audit.py

pyinfra prepares every stage of deploys/full.py for every host (facts are read, nothing
is executed: ``--dry``), then deploys/audit.py reads, per host, which of those
operations would change and which stage refused the host, and writes the JSON and
Markdown reports (pyinfra_vllm/report/). The options after INVENTORY go to pyinfra
as they are (``--data KEY=VALUE``, ``--limit HOST``, ``--ssh-user``...); ``-y`` is
refused, since it turns pyinfra's change detection off. ``--deep`` is
``--data model_verify=deep --data python_env_verify=deep``: every model file is re-hashed
on its host, and a file whose content no longer matches the lock refuses the host, named
(exit 1); so is every file the vLLM environment's wheels installed, against their RECORD.

Exit status:

* 0: every host audited, converged (nothing would change) and not refused;
* 1: some host drifted or was refused; one ``drift: host ...`` line each on stderr;
* 2: this pyinfra is not one the audit was tested with (pyinfra_vllm/core/versions.py), or
  pyinfra failed (bad settings, a host it cannot connect to, an error in a deploy
  file), with its message, or the audit is incomplete: no trustworthy verdict.

Why this shape: pyinfra 3.10's ``--dry --json`` plan lists, per operation, the hosts it
would change, but not why a stage refused a host, and it counts the refusal itself
(pyinfra_vllm/operations/gate.py) as a change. The audit, running in the same process after the
stages, has both: pyinfra's per-host change flag and the stages' refusal reasons. The
wrapper still reads the ``--json`` plan and checks it names exactly the hosts the
audit found drifted or refused, so a change in pyinfra's internals shows as exit 2,
never as a false "converged".
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from pyinfra_vllm.report.text import printable, printable_keeping_colours
from tools import repository_env

ROOT = Path(__file__).resolve().parents[1]
AUDIT_FILE = "deploys/audit.py"
DEFAULT_DEPLOY = "deploys/full.py"
INDEX_ENV = "PYINFRA_VLLM_AUDIT_INDEX"  # pyinfra_vllm/report/runs.py writes the report paths there
USAGE = "usage: python -m tools.audit INVENTORY [--deploy FILE] [--deep] [PYINFRA OPTION ...]"
# --deep: the model stage re-hashes every model file, and the run every file of the
# vLLM environment's wheels (settings.py, model_verify and python_env_verify).
DEEP_DATA = ["--data", "model_verify=deep", "--data", "python_env_verify=deep"]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class UsageError(Exception):
    pass


def parse_args(argv: list[str]) -> tuple[str, str, list[str]]:
    """(inventory, deploy file, options for pyinfra) from the command line."""
    if not argv or argv[0] in ("-h", "--help"):
        raise UsageError(USAGE)
    inventory, rest = argv[0], list(argv[1:])
    if inventory.startswith("-"):
        raise UsageError(f"the inventory comes first\n{USAGE}")
    deploy = DEFAULT_DEPLOY
    if "--deploy" in rest:
        at = rest.index("--deploy")
        if at + 1 >= len(rest):
            raise UsageError(f"--deploy needs a file\n{USAGE}")
        deploy = rest[at + 1]
        del rest[at : at + 2]
    if "--deep" in rest:
        rest = [*DEEP_DATA, *(arg for arg in rest if arg != "--deep")]
    for refused in ("-y", "--yes", "--dry", "--json"):
        if refused in rest:
            raise UsageError(
                f"{refused}: the audit always runs pyinfra with --dry --json and never "
                "with -y (which turns change detection off)"
            )
    return inventory, deploy, rest


def pyinfra_command(inventory: str, deploy: str, options: list[str]) -> list[str]:
    # An inventory file named relative to the caller's directory still works from ROOT.
    if os.path.exists(inventory):
        inventory = os.path.abspath(inventory)
    return [sys.executable, "-m", "pyinfra", "--dry", "--json", *options, inventory, deploy,
            AUDIT_FILE]


def plan_hosts(plan: Any) -> set[str]:
    """Hosts pyinfra's --dry --json plan says would change (conditional changes aside)."""
    if not isinstance(plan, dict) or not isinstance(plan.get("plan"), list):
        raise ValueError("pyinfra printed no --json plan")
    return {name for op in plan["plan"] for name in op.get("hosts_with_change", [])}


def verdict(report: dict[str, Any], plan: Any) -> tuple[int, list[str]]:
    """Exit status (0 or 1, or 2 when the audit cannot be trusted) and the stderr lines,
    each ``printable``: the operations, refusals and findings in them come from hosts."""
    from pyinfra_vllm.report.drift import host_problems

    lines: list[str] = []
    hosts = report.get("hosts") or {}
    if not hosts:
        return 2, ["audit: no host was audited"]
    flagged = set()
    for name, entry in sorted(hosts.items()):
        host = f"host {printable(name)}"
        if entry.get("drift") is None:
            lines.append(f"audit: {host}: "
                         f"{printable(entry.get('drift_note') or 'drift not checked')}")
            continue
        drift, refused = host_problems(entry)
        if drift:
            words = "; ".join(f"{d['operation']} [{d['stage'] or '-'}]" for d in drift)
            lines.append(f"drift: {host}: {len(drift)} operation(s) would change: "
                         f"{printable(words)}")
        for reason in refused:
            lines.append(f"drift: {host}: refused: {printable(reason)}")
        for finding in entry.get("findings") or []:
            lines.append(f"drift: {host}: found: {printable(finding)}")
        if drift or refused:
            flagged.add(name)
    if any(entry.get("drift") is None for entry in hosts.values()):
        return 2, lines
    try:
        changing = plan_hosts(plan) & set(hosts)
    except ValueError as exc:
        return 2, [*lines, f"audit: {exc}"]
    if changing != flagged:
        return 2, [
            *lines,
            "audit: pyinfra's plan and the audit disagree: pyinfra would change "
            f"{sorted(changing) or 'no host'}, the audit found {sorted(flagged) or 'no host'} "
            "drifted or refused",
        ]
    if flagged:
        lines.append(f"audit: {len(flagged)} of {len(hosts)} host(s) drifted or refused")
        return 1, lines
    lines.append(f"audit: {len(hosts)} host(s) converged, none refused")
    return 0, lines


def _error_lines(stderr: list[str]) -> list[str]:
    """pyinfra's own words for a failure: the host errors, then its final error message."""
    plain = [printable(_ANSI.sub("", line)).rstrip() for line in stderr]
    start = next((i for i, line in enumerate(plain) if "--> pyinfra error" in line), len(plain))
    hosts = [
        line.strip() for line in plain[:start]
        if re.search(r"error|could not|failed|refused|invalid", line, re.IGNORECASE)
    ]
    found = hosts + [line.strip() for line in plain[start:] if line.strip()]
    return found or [line.strip() for line in plain if line.strip()][-5:]


def pyinfra_refusal() -> str | None:
    """Why this machine's pyinfra cannot be trusted with the drift, or None."""
    from pyinfra_vllm.core.versions import pyinfra_problem

    try:
        version = importlib.metadata.version("pyinfra")
    except importlib.metadata.PackageNotFoundError:
        return "pyinfra is not installed in this Python: pip install -r requirements.lock"
    return pyinfra_problem(version)


def run(argv: list[str]) -> int:
    try:
        inventory, deploy, options = parse_args(argv)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    # Before anything runs: another pyinfra could keep its change flags elsewhere, and a
    # drift read there would be a false "converged".
    refusal = pyinfra_refusal()
    if refusal is not None:
        print(f"audit: {refusal}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pyinfra-vllm-audit-") as tmp:
        index = Path(tmp) / "index.json"
        env = repository_env()
        env[INDEX_ENV] = str(index)
        command = pyinfra_command(inventory, deploy, options)
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.stdout is None or proc.stderr is None:  # both are PIPE: never None
            raise RuntimeError("pyinfra was started without its output pipes")
        stdout_pipe, stderr_pipe = proc.stdout, proc.stderr
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(stdout_pipe.read()))
        reader.start()
        stderr = []
        for line in stderr_pipe:  # pyinfra's progress and the audit's table, as they come
            # pyinfra prints what hosts said (a refusal, a command's output) as it is.
            text, end = (line[:-1], "\n") if line.endswith("\n") else (line, "")
            sys.stderr.write(printable_keeping_colours(text) + end)
            stderr.append(line)
        proc.wait()
        reader.join()
        report = None
        if index.exists():
            paths = json.loads(index.read_text())
            report = json.loads(Path(paths["json"]).read_text())
    try:
        plan = json.loads("".join(out)) if "".join(out).strip() else None
    except ValueError:
        plan = None
    code, lines = verdict(report, plan) if report is not None else (2, [])
    for line in lines:
        print(line, file=sys.stderr)
    if proc.returncode != 0:
        print(f"audit: pyinfra failed (exit {proc.returncode}):", file=sys.stderr)
        for line in _error_lines(stderr):
            print(f"  {line}", file=sys.stderr)
        return 2
    if report is None:
        print("audit: pyinfra wrote no audit report (no host audited)", file=sys.stderr)
        return 2
    return code


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
