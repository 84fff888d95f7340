"""The acceptance benchmark of a fleet: exit 0 every host measured, no request failed.

    python -m tools.bench INVENTORY [--limit HOST] [--concurrency N] [--input-len N]
        [--output-len N] [--requests N] [--report-dir DIR] [PYINFRA OPTION ...]

Runs, from the repository root, one pyinfra run of deploys/bench.py: on each host, vLLM's
own benchmark client as a transient job through the host's gateway (TLS and the first API
key), in the settings' shape (bench_input_len, bench_output_len, bench_concurrency,
bench_requests, times bench_scale; the options above replace the first four, before the
scale). Progress at normal verbosity; a dropped SSH connection leaves the job running on
its host, and the same command run again follows it.

Writes, on this machine, ``reports/bench-<UTC>.json``, ``.md`` and ``.html`` and
``reports/latest-bench.json`` (``--report-dir`` for another directory than
``reports``)::

    {"at": "...", "hosts": {"<name>": {"output_tokens_per_s": ..., "total_tokens_per_s":
     ..., "requests_per_s": ..., "failed": ..., "ttft_ms": {"p50", "p95", "p99"},
     "itl_ms": {"p50", "p95"}, "tpot_ms": {"mean"}, "shape": {...}, "stack": "...",
     "at": "...", "goodput": {"requests_per_s", "met", "share", "slo_ms"}}},
     "failed_hosts": {"<name>": "<why>"}}

(``goodput`` only with a bench_slo_* set: vLLM's ``--goodput``, docs/bench.md.)

and, on each host, the record (``/var/lib/pyinfra-vllm/bench/latest.json``, which the
audit reads) and node_exporter's textfile (``pyinfra_vllm_bench_*`` gauges).

Exit status: 0 every host measured with no failed request; 1 a host failed or had
failed requests (named on stderr); 2 bad usage, or pyinfra failed before any host ran.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pyinfra_vllm.core.host_text import printable
from pyinfra_vllm.plans import bench as bench_plan
from tools import repository_env

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = "deploys/bench.py"
REPORT_DIR = ROOT / "reports"
USAGE = ("usage: python -m tools.bench INVENTORY [--limit HOST] [--concurrency N] "
         "[--input-len N] [--output-len N] [--requests N] [--report-dir DIR] "
         "[PYINFRA OPTION ...]")
# The options that replace a shape setting, and the setting each replaces.
SHAPE_OPTIONS = {"--concurrency": "bench_concurrency", "--input-len": "bench_input_len",
                 "--output-len": "bench_output_len", "--requests": "bench_requests"}


class UsageError(Exception):
    pass


def parse_args(argv: list[str]) -> tuple[str, list[str], Path]:
    """(inventory, options for pyinfra, report directory) from the command line."""
    if not argv or argv[0] in ("-h", "--help"):
        raise UsageError(USAGE)
    inventory, rest = argv[0], list(argv[1:])
    if inventory.startswith("-"):
        raise UsageError(f"the inventory comes first\n{USAGE}")
    options = []
    report_dir = REPORT_DIR
    while rest:
        arg = rest.pop(0)
        if arg == "--report-dir":
            if not rest:
                raise UsageError(f"--report-dir needs a directory\n{USAGE}")
            report_dir = Path(rest.pop(0)).resolve()
        elif arg in SHAPE_OPTIONS:
            if not rest or not rest[0].isdigit() or int(rest[0]) < 1:
                raise UsageError(f"{arg} needs a whole number of at least 1\n{USAGE}")
            options += ["--data", f"{SHAPE_OPTIONS[arg]}={rest.pop(0)}"]
        elif arg in ("--dry", "--json"):
            raise UsageError(f"{arg}: the benchmark always runs pyinfra with -y --json")
        else:
            options.append(arg)
    return inventory, options, report_dir


def pyinfra_command(inventory: str, options: list[str]) -> list[str]:
    if os.path.exists(inventory):
        inventory = os.path.abspath(inventory)
    extra = [arg for arg in options if arg not in ("-y", "--yes")]
    return [sys.executable, "-m", "pyinfra", "-y", "--json", *extra, inventory, DEPLOY]


def collect(out_dir: Path, results: dict[str, Any] | None, at: str) -> dict[str, Any]:
    """The run's report: each host's record, and why each failed host has none."""
    hosts = {path.stem: json.loads(path.read_text()) for path in sorted(out_dir.glob("*.json"))}
    failed = {name: "the run failed on this host (its lines above say why)"
              for name in (results or {}).get("failed_hosts", []) if name not in hosts}
    for name, entry in hosts.items():
        if entry.get("failed"):
            failed[name] = f"{entry['failed']} of {entry['failed'] + entry['completed']} " \
                           "requests failed"
    return {"at": at, "hosts": hosts, "failed_hosts": failed}


def write_reports(report: dict[str, Any], report_dir: Path) -> dict[str, Path]:
    """The report's three files and latest-bench.json, each written whole."""
    report_dir.mkdir(parents=True, exist_ok=True)
    stamp = report["at"].replace(":", "").replace("-", "")
    text = json.dumps(report, indent=1, sort_keys=True) + "\n"
    paths = {
        "json": report_dir / f"bench-{stamp}.json",
        "md": report_dir / f"bench-{stamp}.md",
        "html": report_dir / f"bench-{stamp}.html",
        "latest": report_dir / "latest-bench.json",
    }
    for kind, content in (("json", text), ("md", bench_plan.markdown(report)),
                          ("html", bench_plan.html(report)), ("latest", text)):
        new = paths[kind].with_name(paths[kind].name + ".new")
        new.write_text(content)
        new.replace(paths[kind])
    return paths


def terminal_lines(report: dict[str, Any]) -> list[str]:
    """Each host's result in one line for the terminal: ``printable``, since the records
    are the hosts' words (no escape sequence of theirs reaches the terminal)."""
    lines = [printable(f"bench: {name}: {entry['output_tokens_per_s']:g} output tokens/s, "
                       f"TTFT p95 {entry['ttft_ms']['p95']} ms"
                       f"{bench_plan.goodput_words(entry)}, {entry['failed']} failed")
             for name, entry in sorted(report["hosts"].items())]
    return lines + [printable(f"bench: {name}: {reason}")
                    for name, reason in sorted(report["failed_hosts"].items())]


def run(argv: list[str]) -> int:
    try:
        inventory, options, report_dir = parse_args(argv)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    with tempfile.TemporaryDirectory(prefix="pyinfra-vllm-bench-") as tmp:
        env = repository_env()
        env[bench_plan.OUT_ENV] = tmp
        # pyinfra's progress and the hosts' lines on stderr, as they come.
        proc = subprocess.run(pyinfra_command(inventory, options), cwd=ROOT, env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        try:
            results = json.loads(proc.stdout).get("results") if proc.stdout.strip() else None
        except ValueError:
            results = None
        report = collect(Path(tmp), results, at)
    if not report["hosts"] and not report["failed_hosts"]:
        print(f"bench: pyinfra failed (exit {proc.returncode}) before any host was measured",
              file=sys.stderr)
        return 2
    paths = write_reports(report, report_dir)
    for line in terminal_lines(report):
        print(line, file=sys.stderr)
    print(f"bench: reports {paths['md']} and {paths['latest']}", file=sys.stderr)
    return 1 if report["failed_hosts"] else 0


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
