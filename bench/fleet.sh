#!/usr/bin/env bash
# The no-op re-run of deploys/full.py on 1, 8, 16 and 32 converged sandbox hosts
# (bench/fleet.md has the figures). Every host converges the host layer, the gateway and
# the metrics stage; the Python environment, the model and the engine are skipped, since
# 32 environments do not fit this machine's disk (the one-host run with every stage is
# bench/latency.md). Each count: its sandbox booted, converged once, then bench/timing.py runs
# the no-op run RUNS times (medians of the wall and of pyinfra's own CPU, user + sys); one
# more no-op run's CPU is taken with /usr/bin/time beside the whole machine's.
#
#   bash bench/fleet.sh [RUNS] [COUNTS...]       # default: 3 runs; 1 8 16 32 hosts
#
# Root, from the repository root; tears the sandbox down at the end. 32 hosts need more
# inotify instances than the default 128 (each host's systemd takes several):
# sysctl fs.inotify.max_user_instances=1024 first.
set -euo pipefail
PY=.venv/bin/python
PYINFRA=.venv/bin/pyinfra
INV=.sandbox/inventory.py
RUNS=${1:-3}
shift || true
COUNTS=("${@:-1 8 16 32}")
# shellcheck disable=SC2206
COUNTS=(${COUNTS[*]})
SKIP='skip_stages=["python_env","model","vllm_service"]'

for hosts in "${COUNTS[@]}"; do
    $PY -m sandbox down >/dev/null
    $PY -m sandbox up --hosts "$hosts" --scenario seed >/dev/null
    $PYINFRA -y --json $INV deploys/full.py --data "$SKIP" \
        | $PY -c 'import json,sys; print("converge:", json.load(sys.stdin)["results"]["totals"])'
    noop="$PYINFRA -y $INV deploys/full.py --data $SKIP"
    $noop --json | $PY -c 'import json,sys; t=json.load(sys.stdin)["results"]["totals"]; print("no-op totals:", t); sys.exit(t["success"] != 0)'
    echo "== $hosts host(s)"
    python3 bench/timing.py -n "$RUNS" --timeout 1800 -- $noop
    # The whole machine's busy CPU over one no-op run (/proc/stat, 100 ticks a second),
    # beside pyinfra's own: the rest is the hosts' side (sshd, sudo, the one read), which
    # runs on these same 2 cores here and on each host's own CPUs in a real fleet.
    before=$(awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat)
    /usr/bin/time -f "pyinfra's own CPU, $hosts host(s): %U s user + %S s sys, %e s wall" \
        $noop >/dev/null
    after=$(awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat)
    echo "the machine's busy CPU in that run: $(( (after - before) / 100 )).$(( (after - before) % 100 )) s"
    echo "remote commands of gpu-sbx-1: $($noop -vvv 2>&1 | grep -cE '\[gpu-sbx-1\] *>>> ')"
done
$PY -m sandbox down >/dev/null
