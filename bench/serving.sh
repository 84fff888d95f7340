#!/usr/bin/env bash
# The sandbox engine's serving figures through its gateway (bench/serving.md has them):
# python -m tools.bench RUNS times on a converged sandbox host, then the median of each
# figure over the runs (vLLM's own client; tokens/s and latencies are its measurements,
# not this script's wall time).
#
#   make demo                                  # one host, TLS, serving
#   bash bench/serving.sh [RUNS] [TOOLS.BENCH OPTION ...]
#
# Root, from the repository root. Each run's report goes to a directory of its own.
set -euo pipefail
PY=.venv/bin/python
RUNS=${1:-5}
shift || true
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
for run in $(seq "$RUNS"); do
    $PY -m tools.bench .sandbox/inventory.py --report-dir "$OUT/$run" "$@" 2>/dev/null
done
$PY - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
from pyinfra_vllm.plans.bench import COLUMNS
runs = [json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*/latest-bench.json"))]
for host in sorted(runs[0]["hosts"]):
    records = [run["hosts"][host] for run in runs]
    print(f"{host}: {len(records)} runs, shape {records[0]['shape']}, {records[0]['stack']}")
    for words, get in COLUMNS:
        values = sorted(get(r) for r in records)
        print(f"  {words}: median {statistics.median(values):g} (min {values[0]:g}, "
              f"max {values[-1]:g})")
PY
