#!/usr/bin/env bash
# The no-op re-run's own cost on the operator's side (bench/noop.md has the figures).
#
#   make demo                  # one sandbox host, every stage, the engine serving
#   bash bench/noop.sh [RUNS]  # default 7
#
# Root, from the repository root, against the host `make demo` left up. The re-run must
# change nothing (-y --json totals success 0); bench/timing.py then times RUNS no-op runs
# after a warm-up: wall and pyinfra's own CPU (user + sys, wait4's figure for the process),
# medians. Last, one more run under bench/noop_profile.py: where that CPU goes.
set -euo pipefail
PY=.venv/bin/python
PYINFRA=.venv/bin/pyinfra
INV=.sandbox/inventory.py
RUNS=${1:-7}

$PYINFRA -y --json $INV deploys/full.py | $PY -c 'import json,sys
totals = json.load(sys.stdin)["results"]["totals"]
print("no-op totals:", totals)
sys.exit(totals["success"] != 0)'
python3 bench/timing.py -n "$RUNS" -- $PYINFRA -y $INV deploys/full.py
echo "remote commands of gpu-sbx-1: $($PYINFRA -y -vvv $INV deploys/full.py 2>&1 \
    | grep -cE '\[gpu-sbx-1\] *>>> ')"
$PY bench/noop_profile.py $INV deploys/full.py 2>/dev/null | sed -n '/^pyinfra.s CPU under/,$p'
