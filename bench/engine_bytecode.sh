#!/usr/bin/env bash
# Does compiling the whole environment's bytecode at install speed up the engine's
# starts? (bench/fresh_host.md has the figures.) The engine's user cannot write
# bytecode into the root-owned environment (the unit's ProtectSystem=strict): each start
# compiles in memory what the probe, run as root at build time, did not import.
#
#   bash bench/engine_bytecode.sh [RESTARTS]       # default 2 restarts each way
#
# Root, from the repository root. Boots one `seed` host, converges it with
# deploys/full.py (vLLM's CPU build, the engine serving), then on the host: the
# environment's bytecode caches removed and the probe run as at build time; RESTARTS
# restarts of the engine timed to /health; `python -m compileall -j 0` over the
# environment, timed; RESTARTS restarts again. Tears the sandbox down.
set -euo pipefail
PY=.venv/bin/python
PYINFRA=.venv/bin/pyinfra
. bench/bench_host.sh

bench_host_up
{ echo "RESTARTS=${1:-2}"; cat <<'EOF_HOST'; } | bench_host_script
E=$(readlink -f /opt/vllm/current)
version=$("$E/bin/python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["runtime"]["vllm"])' "$E/pyinfra-vllm-env.json")
ms() { echo $(( $(date +%s%N) / 1000000 )); }
restart() {
    # The unit's start limit counts these restarts too: cleared before each.
    systemctl reset-failed vllm 2>/dev/null; s=$(ms); systemctl restart vllm; n=0
    until curl -sf -o /dev/null http://127.0.0.1:8000/health || [ $n -gt 1500 ]; do
        sleep 0.2; n=$((n+1)); done
    echo "restart to /health: $(( $(ms) - s )) ms ($(systemctl is-active vllm))"
}
find "$E" -name __pycache__ -type d -prune -exec rm -rf {} +
s=$(ms); "$E/bin/python" "$E/pyinfra-vllm-probe.py" --expect-vllm "$version" --marker /tmp/m.json \
    --stack bench --requirements-sha256 bench --manager uv >/dev/null 2>&1
echo "the probe, no bytecode cache: $(( $(ms) - s )) ms"
echo "files: $(find "$E" -name '*.py' | wc -l) .py, $(find "$E" -name '*.pyc' | wc -l) .pyc as built"
for _ in $(seq "$RESTARTS"); do restart; done
s=$(ms); "$E/bin/python" -m compileall -q -j 0 "$E"/lib/python3*/site-packages >/dev/null 2>&1
echo "compileall -j 0: $(( $(ms) - s )) ms; $(find "$E" -name '*.pyc' | wc -l) .pyc"
for _ in $(seq "$RESTARTS"); do restart; done
EOF_HOST
$PY -m sandbox down >/dev/null
