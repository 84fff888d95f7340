"""The post's tuning as a command: benchmark one host on every combination of engine
settings, put it back as it was, and say which combination serves best.

    python -m tools.tune INVENTORY --limit HOST --grid KEY=V1,V2 [--grid KEY=V1,V2 ...]
        [--max-ttft-p95-ms MS] [--concurrency N] [--input-len N] [--output-len N]
        [--requests N] [--report-dir DIR] [PYINFRA OPTION ...]

For one host (``--limit``, exactly one: a group or a glob that matches several hosts of
the inventory, or none, is refused before anything runs), from the repository root:

1. every combination is checked first, by a ``--dry`` run of deploys/full.py with its
   settings: a value the settings refuse stops the tuning before the host is touched;
2. the host is taken out of the load balancers' rotation (its gateway answers 503 on
   /health; /v1 still serves, for the benchmark and for the requests in flight);
3. for each combination: deploys/full.py with its settings (the engine restarts, rolling,
   without the canary: a tuning compares combinations, not against the host's record),
   then ``python -m tools.bench`` on the host (its record kept as each run's);
4. deploys/full.py with the inventory's own settings puts the host back as it was, a
   last benchmark makes its record the one of its own settings again (the next
   rollout's canary compares with it; none when the last combination was the
   inventory's own settings, whose record it is already), and the host goes back into
   rotation, whatever happened in between.

Prints one row per combination and the best one: the highest goodput (with bench_slo_*
set, every combination measured under the same latency targets) or else output tokens/s,
among those whose TTFT p95 is within ``--max-ttft-p95-ms`` (all of them without it), with the
``--data`` line that applies it; writes the table to ``reports/tune-<UTC>.json`` and
``.md``. Exit status: 0 a best combination was found; 1 none met the target, or a
combination failed (named); 2 bad usage, a combination the settings refuse, or the host
could not be put back (named: run deploys/full.py for it).

Grid keys are the engine's settings (``TUNABLE``); docs/bench.md shows the post's steps.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import subprocess
import sys
import tempfile
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from pyinfra_vllm.core.host_text import markdown_text
from pyinfra_vllm.plans import bench as bench_plan
from pyinfra_vllm.plans.gateway import DRAIN_DIR, ROTATION_FLAG
from tools import repository_env

ROOT = Path(__file__).resolve().parents[1]
REPORT_DIR = ROOT / "reports"
USAGE = ("usage: python -m tools.tune INVENTORY --limit HOST --grid KEY=V1,V2 [--grid ...] "
         "[--max-ttft-p95-ms MS] [--concurrency N] [--input-len N] [--output-len N] "
         "[--requests N] [--report-dir DIR] [PYINFRA OPTION ...]")
# The engine's settings a grid may vary: what the post tunes and what vLLM's docs name
# for throughput (scheduler limits, memory, KV cache pages, compilation).
TUNABLE = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
           "gpu_memory_utilization", "block_size", "enforce_eager", "max_model_len")
BENCH_OPTIONS = ("--concurrency", "--input-len", "--output-len", "--requests")


class UsageError(Exception):
    pass


def parse_args(argv: list[str]) -> dict[str, Any]:
    """The command line as ``{"inventory", "host", "grid": {key: [values]}, "target",
    "bench": [tools.bench options], "report_dir", "pyinfra": [options]}``."""
    if not argv or argv[0] in ("-h", "--help"):
        raise UsageError(USAGE)
    if argv[0].startswith("-"):
        raise UsageError(f"the inventory comes first\n{USAGE}")
    args: dict[str, Any] = {"inventory": argv[0], "host": None, "grid": {}, "target": None,
                            "bench": [], "report_dir": REPORT_DIR, "pyinfra": []}
    rest = list(argv[1:])
    while rest:
        arg = rest.pop(0)
        value = rest.pop(0) if arg in ("--limit", "--grid", "--max-ttft-p95-ms",
                                       "--report-dir", *BENCH_OPTIONS) and rest else None
        if arg == "--limit" and value:
            if args["host"] is not None or "," in value:
                raise UsageError("--limit: one host only: a tuning restarts its engine once "
                                 "per combination")
            args["host"] = value
        elif arg == "--grid" and value:
            key, _, values = value.partition("=")
            if key not in TUNABLE:
                raise UsageError(f"--grid {value}: {key!r} is not one of the engine's settings "
                                 f"a tuning varies: {', '.join(TUNABLE)}")
            if key in args["grid"] or not values or "" in values.split(","):
                raise UsageError(f"--grid {value}: one --grid per key, KEY=V1,V2,...")
            args["grid"][key] = values.split(",")
        elif arg == "--max-ttft-p95-ms" and value:
            try:
                args["target"] = float(value)
            except ValueError:
                raise UsageError(f"--max-ttft-p95-ms {value}: a number of ms") from None
        elif arg == "--report-dir" and value:
            args["report_dir"] = Path(value).resolve()
        elif arg in BENCH_OPTIONS and value:
            args["bench"] += [arg, value]
        elif arg in ("--limit", "--grid", "--max-ttft-p95-ms", "--report-dir", *BENCH_OPTIONS):
            raise UsageError(f"{arg} needs a value\n{USAGE}")
        elif arg in ("-y", "--yes", "--dry", "--json"):
            raise UsageError(f"{arg}: the tuning runs pyinfra itself")
        elif arg.startswith(("--limit=", "--exclude")):
            # pyinfra would add these to the tuning's own --limit.
            raise UsageError(f"{arg}: the tuning's one host is given as --limit HOST")
        else:
            args["pyinfra"].append(arg)
    if args["host"] is None or not args["grid"]:
        raise UsageError(f"--limit HOST and at least one --grid are needed\n{USAGE}")
    return args


def inventory_matches(inventory: Any, limit: str) -> list[str]:
    """The names of the hosts pyinfra's ``--limit LIMIT`` runs on: a group's hosts when
    LIMIT names a group, else every host whose name matches it as a glob (pyinfra_cli's
    ``_get_inventory_pattern_matches``, pyinfra 3)."""
    from pyinfra.api.exceptions import NoGroupError

    try:
        return sorted(found.name for found in inventory.get_group(limit))
    except NoGroupError:
        return sorted(found.name for found in inventory if fnmatch(found.name, limit))


def resolve_host(inventory: str, limit: str,
                 why: str = "a tuning restarts its engine once per combination") -> str:
    """The one host of ``inventory`` that ``--limit`` names, as pyinfra reads the
    inventory (group_data/ from the repository root) and the limit; UsageError, naming
    what matched and ``why`` one host only, unless that is exactly one host, which its own
    name names alone."""
    from pyinfra.api import State
    from pyinfra.context import ctx_state
    from pyinfra_cli.inventory import make_inventory

    # pyinfra's CLI reads inventory and group_data files with a state in context.
    with ctx_state.use(State()):
        made = make_inventory(inventory, cwd=str(ROOT))
    found = inventory_matches(made, limit)
    if len(found) != 1:
        matched = (f"the hosts {', '.join(found)}" if found else "no host")
        raise UsageError(f"--limit {limit}: matches {matched} of {inventory}, as pyinfra "
                         f"reads it (a group's name, else a glob on host names); {why}: "
                         "name exactly one host")
    if inventory_matches(made, found[0]) != found:
        raise UsageError(f"--limit {limit}: its host {found[0]!r} is not named by its own "
                         "name alone (a group of that name, or a glob in it): rename it")
    return found[0]


def combinations(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    keys = sorted(grid)
    return [dict(zip(keys, values, strict=True))
            for values in itertools.product(*(grid[key] for key in keys))]


def data_args(combination: dict[str, str]) -> list[str]:
    return [arg for key, value in combination.items() for arg in ("--data", f"{key}={value}")]


def basis(rows: list[dict[str, Any]]) -> tuple[str, str | None]:
    """What the combinations are compared by: "goodput" where every measured one has a
    goodput under the same latency targets (bench_slo_*), else "throughput" (output
    tokens/s); with why not goodput where some has one (None otherwise)."""
    records = [row["record"] for row in rows if row.get("record")]
    goods = [bench_plan.record_goodput(record) for record in records]
    if not any(goods):
        return "throughput", None
    targets = {json.dumps(good["slo_ms"], sort_keys=True) if good else None for good in goods}
    if len(targets) == 1 and all(bench_plan.goodput_rate(record) is not None
                                 for record in records):
        return "goodput", None
    return "throughput", ("goodput not compared: the combinations were not all measured "
                          "under the same latency targets with a known goodput; output "
                          "tokens/s compared instead")


def best(rows: list[dict[str, Any]], target: float | None) -> dict[str, Any] | None:
    """The row with the highest goodput (``basis``; output tokens/s without it) among
    the measured ones within the TTFT p95 target (every measured row without one)."""
    fit = [row for row in rows if row.get("record") and not row["record"]["failed"]
           and (target is None or row["record"]["ttft_ms"]["p95"] <= target)]
    if basis(rows)[0] == "goodput":
        return max(fit, key=lambda row: (bench_plan.goodput_rate(row["record"]),
                                         row["record"]["output_tokens_per_s"]), default=None)
    return max(fit, key=lambda row: row["record"]["output_tokens_per_s"], default=None)


def table(rows: list[dict[str, Any]], target: float | None) -> str:
    """The Markdown table of the tuning, the best row marked, and the line to apply it."""
    keys = sorted({key for row in rows for key in row["settings"]})
    # A goodput column where a combination was measured under latency targets.
    good = any(row.get("record") and bench_plan.record_goodput(row["record"]) for row in rows)
    figures_head = ["output tok/s", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms",
                    *(["goodput req/s"] if good else []), "failed"]
    lines = ["| " + " | ".join([*keys, *figures_head, ""]) + " |",
             "|---" * (len(keys) + len(figures_head) + 1) + "|"]
    winner = best(rows, target)
    for row in rows:
        mark = "best" if row is winner else (row.get("error") or "")
        lines.append("| " + " | ".join([*(row["settings"][key] for key in keys),
                                         *_figures(row.get("record"), good), mark]) + " |")
    lines += _verdict(rows, target, winner)
    return "\n".join(lines) + "\n"


def _figures(record: dict[str, Any] | None, good: bool) -> list[str]:
    """A row's figures; the record is the host's: markdown_text, for the terminal and the
    .md alike."""
    if record is None:
        return ["-"] * (6 if good else 5)
    rate = bench_plan.goodput_rate(record)
    return [f"{record['output_tokens_per_s']:g}",
            *(markdown_text(value) for value in (
                record["ttft_ms"]["p50"], record["ttft_ms"]["p95"], record["itl_ms"]["p50"])),
            *([("-" if rate is None else f"{rate:g}")] if good else []),
            markdown_text(record["failed"])]


def _verdict(rows: list[dict[str, Any]], target: float | None,
             winner: dict[str, Any] | None) -> list[str]:
    """The lines under the table: the best combination and what it was chosen by."""
    by, note = basis(rows)
    lines = [f"\n{note}."] if note else []
    if winner is None:
        return [*lines, "\nNo combination met the target"
                + (f" (TTFT p95 <= {target:g} ms)." if target is not None else ".")]
    chosen = ""
    if by == "goodput":
        good = bench_plan.record_goodput(winner["record"]) or {}
        targets = markdown_text(bench_plan.slo_words(good.get("slo_ms")))  # the host's words
        chosen = f" by goodput within {targets}"
    return [*lines, "\nBest" + chosen
            + (f" with TTFT p95 <= {target:g} ms" if target else "") + ": "
            + " ".join(data_args(winner["settings"]))]


def _inventory_path(inventory: str) -> str:
    """An inventory file named relative to the caller's directory, as the runs from the
    repository root find it."""
    return os.path.abspath(inventory) if os.path.exists(inventory) else inventory


class Tuning:
    """One host's tuning: pyinfra and tools.bench run from the repository root."""

    def __init__(self, args: dict[str, Any], out: Path) -> None:
        self.args = args
        self.out = out
        self.env = repository_env()
        self.inventory = _inventory_path(args["inventory"])

    def deploy(self, *extra: str, dry: bool = False, report: bool = False
               ) -> subprocess.CompletedProcess:
        """deploys/full.py for the host (its progress on stderr, as it comes); with
        ``report``, pyinfra's JSON results on stdout (``changed_nothing``)."""
        mode = ["--dry"] if dry else ["-y"]
        return subprocess.run(
            [sys.executable, "-m", "pyinfra", *mode, *(["--json"] if report else []),
             *self.args["pyinfra"], *extra, "--data", "rollout_canary=false",
             "--limit", self.args["host"], self.inventory, "deploys/full.py"],
            cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if report else subprocess.DEVNULL, text=True)

    def rotation(self, out: bool) -> bool:
        """The host out of the load balancers' rotation (True) or back in it. The flag
        holds "tune": one the sentinel placed (holding "sentinel") becomes tune's, so the
        sentinel leaves it to tune until tune removes it (files/sentinel.py)."""
        command = (f"install -d -m 755 {DRAIN_DIR} && echo tune > {ROTATION_FLAG}" if out
                   else f"rm -f {ROTATION_FLAG}")
        proc = subprocess.run(
            [sys.executable, "-m", "pyinfra", "-y", *self.args["pyinfra"], "--sudo",
             "--limit", self.args["host"], self.inventory, "exec", "--", command],
            cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            text=True)
        return proc.returncode == 0

    def bench(self, combination: dict[str, str]) -> dict[str, Any] | None:
        report = self.out / "bench"
        proc = subprocess.run(
            [sys.executable, "-m", "tools.bench", self.inventory, "--limit", self.args["host"],
             *self.args["bench"], *self.args["pyinfra"], *data_args(combination),
             "--report-dir", str(report)],
            cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            text=True)
        latest = report / "latest-bench.json"
        if proc.returncode not in (0, 1) or not latest.exists():
            return None
        return json.loads(latest.read_text())["hosts"].get(self.args["host"])


def changed_nothing(proc: subprocess.CompletedProcess) -> bool:
    """Did a deploy run with ``report`` succeed without changing anything (pyinfra's JSON
    totals: no operation succeeded with a change)?"""
    if proc.returncode != 0:
        return False
    try:
        totals = json.loads(proc.stdout)["results"]["totals"]
    except (ValueError, KeyError, TypeError):
        return False
    return totals.get("success") == 0 and totals.get("error") == 0


def _say(line: str) -> None:
    print(f"tune: {line}", file=sys.stderr, flush=True)


def measure(tuning: Tuning, combos: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Each combination deployed and benchmarked; a failure named in its row."""
    rows = []
    for number, combination in enumerate(combos, start=1):
        words = " ".join(f"{key}={value}" for key, value in combination.items())
        _say(f"{number}/{len(combos)}: {words}: deploying")
        row: dict[str, Any] = {"settings": combination, "record": None}
        if tuning.deploy(*data_args(combination)).returncode != 0:
            row["error"] = "the deploy failed (its lines above say why)"
        else:
            _say(f"{number}/{len(combos)}: {words}: benchmarking")
            row["record"] = tuning.bench(combination)
            if row["record"] is None:
                row["error"] = "the benchmark failed (its lines above say why)"
        rows.append(row)
    return rows


def run(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        # Before anything runs: pyinfra would take every host a group or a glob matches.
        args["host"] = resolve_host(_inventory_path(args["inventory"]), args["host"])
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    combos = combinations(args["grid"])
    at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    with tempfile.TemporaryDirectory(prefix="pyinfra-vllm-tune-") as tmp:
        tuning = Tuning(args, Path(tmp))
        for combination in combos:
            if tuning.deploy(*data_args(combination), dry=True).returncode != 0:
                _say(f"{' '.join(data_args(combination))}: refused by a dry run (its lines "
                     "above say why); the host was not touched")
                return 2
        if not tuning.rotation(out=True):
            _say(f"could not take {args['host']} out of rotation; nothing changed")
            return 2
        rows: list[dict[str, Any]] = []
        try:
            rows = measure(tuning, combos)
        finally:
            _say(f"putting {args['host']} back as the inventory says")
            deployed = tuning.deploy(report=True)
            back = deployed.returncode == 0
            # Its record measured again on its own settings: the next rollout's canary
            # compares with it, not with the last combination's; unless that combination
            # is its own settings (the way back changed nothing), whose benchmark is the
            # host's record already.
            if changed_nothing(deployed) and rows and rows[-1]["record"] is not None:
                again = rows[-1]["record"]
            else:
                again = tuning.bench({}) if back else None
            back = tuning.rotation(out=False) and back
    text = table(rows, args["target"])
    if again is not None:
        text += (f"\nBack on the inventory's settings: {again['output_tokens_per_s']:g} output "
                 f"tokens/s, TTFT p95 {markdown_text(again['ttft_ms']['p95'])} ms"
                 f"{markdown_text(bench_plan.goodput_words(again))} (the host's record).\n")
    print(text)
    report_dir: Path = args["report_dir"]
    report_dir.mkdir(parents=True, exist_ok=True)
    stamp = at.replace(":", "").replace("-", "")
    (report_dir / f"tune-{stamp}.json").write_text(json.dumps(
        {"at": at, "host": args["host"], "target_ttft_p95_ms": args["target"],
         "compared": basis(rows)[0], "rows": rows},
        indent=1, sort_keys=True) + "\n")
    (report_dir / f"tune-{stamp}.md").write_text(f"# Tuning of {args['host']}, {at}\n\n{text}")
    if not back:
        _say(f"{args['host']} could not be put back: run deploys/full.py for it")
        return 2
    return 0 if best(rows, args["target"]) and not any(row.get("error") for row in rows) else 1


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
