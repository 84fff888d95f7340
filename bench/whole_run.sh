#!/usr/bin/env bash
# The whole run's speed on sandbox hosts (bench/whole_run.md has the figures).
#
#   bash bench/whole_run.sh fresh        # one fresh host, cold then warm package caches
#   bash bench/whole_run.sh noop N       # no-op re-runs on N converged seed hosts
#
# Root, from the repository root. "fresh" empties the sandbox's shared uv/pip caches
# (sandbox/hosts.py PACKAGE_CACHES) for its first run; they refill as they would on a
# new machine. Each host's vLLM environment takes about 6.4 GB of disk.
set -euo pipefail
PY=.venv/bin/python
PYINFRA=.venv/bin/pyinfra
CACHE=${SANDBOX_CACHE_DIR:-/var/cache/pyinfra-vllm-sandbox}
INV=.sandbox/inventory.py

totals() { $PY -c 'import json,sys; t=json.load(sys.stdin)["results"]["totals"]; print(t)'; }
# Wall seconds of a pyinfra run that must succeed, with its totals.
timed() {
    local start end
    start=$(date +%s.%N)
    "$@" --json | totals
    end=$(date +%s.%N)
    $PY -c "print(round($end - $start, 1))"
}

case "${1:-}" in
fresh)
    # 1. Cold: no wheel in the caches, nothing on the host.
    # Emptied before `up`: the hosts bind the cache directories when they boot.
    $PY -m sandbox down >/dev/null
    rm -rf "$CACHE/uv-cache" "$CACHE/pip-cache"
    $PY -m sandbox up --hosts 1 --scenario seed >/dev/null
    echo "cold caches, whole run: $(timed $PYINFRA -y $INV deploys/full.py) s"
    # 2. Warm: the same fresh host again, every wheel already in the shared cache.
    $PY -m sandbox up --hosts 1 --scenario seed >/dev/null
    echo "warm caches, whole run: $(timed $PYINFRA -y $INV deploys/full.py) s"
    # 3. Warm, without the Python environment: the rest of the suite.
    $PY -m sandbox up --hosts 1 --scenario seed >/dev/null
    echo "warm, python_env skipped: $(timed $PYINFRA -y $INV deploys/full.py \
        --data 'skip_stages=["python_env","vllm_service"]') s"
    $PY -m sandbox down >/dev/null
    ;;
noop)
    hosts=${2:-1}
    $PY -m sandbox up --hosts "$hosts" --scenario seed >/dev/null
    $PYINFRA -y --json $INV deploys/full.py | totals          # converge
    for _ in 1 2 3; do
        # %e wall, %U+%S the pyinfra process's own CPU (the hosts' sshd and shells run
        # on this machine's cores too, which a real fleet does not).
        /usr/bin/time -f "no-op, $hosts host(s): %e s wall, %U s user + %S s sys in pyinfra" \
            $PYINFRA -y --json $INV deploys/full.py 2>/tmp/whole_run.err | totals
        tail -1 /tmp/whole_run.err
    done
    echo "remote commands per host: $($PYINFRA -y -vvv $INV deploys/full.py --limit gpu-sbx-1 \
        2>&1 | grep -c '>>>')"
    $PY -m sandbox down >/dev/null
    ;;
*)
    echo "usage: $0 fresh | noop N" >&2
    exit 2
    ;;
esac
