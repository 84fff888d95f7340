#!/usr/bin/env bash
# What the environment's proof costs on a fresh host (bench/fresh_host.md has the
# figures): files/vllm_probe.py inside a CUDA environment (the example fleet's stack;
# VLLM_VERSION, DRIVER_BRANCH and SCENARIO pick another: bench/bench_host.sh cuda_stack), with Python's
# bytecode caches (__pycache__) removed first, as on a fresh host, and then present.
# PROBE=FILE times another version of the probe beside it, in turn (e.g. an older one:
# `git show REV:files/vllm_probe.py > /tmp/probe.py`). Each timing is bash's `time` on
# the host.
#
#   bash bench/probe.sh [RUNS]          # default 2 runs of each
#   PROBE=/tmp/probe.py bash bench/probe.sh 2
#
# Root, from the repository root, with the sandbox's uv cache holding the stack's wheels
# (any earlier run of bench/fresh_host.sh or the e2e tests). Boots one host of SCENARIO
# (--own-caches), builds the environment with deploys/full.py (the engine not started),
# times on the host, and tears the sandbox down.
set -euo pipefail
PY=.venv/bin/python
PYINFRA=.venv/bin/pyinfra
RUNS=${1:-2}
. bench/bench_host.sh

cuda_stack
bench_host_up "${CUDA_DATA[@]}"
{
    echo "RUNS=$RUNS VERSION=$VLLM_VERSION"
    if [ -n "${PROBE:-}" ]; then
        # The other version, written on the host by the script itself.
        echo "cat > /tmp/probe-other.py <<'EOF_PROBE'"; cat "$PROBE"; echo "EOF_PROBE"
        echo "OTHER='PROBE ($PROBE)'"
    fi
    cat <<'EOF_HOST'
E=$(readlink -f /opt/vllm/current)
clean() { find "$E" -name __pycache__ -type d -prune -exec rm -rf {} + ; }
timed() {  # words, probe: one line with the probe's wall and CPU seconds
    local line
    line=$( { TIMEFORMAT='%R s wall, %U s user + %S s sys'; time "$E/bin/python" "$2" \
        --expect-vllm "$VERSION" --marker /tmp/m.json --stack bench --requirements-sha256 bench \
        --manager uv >/dev/null 2>&1; } 2>&1 )
    echo "$1: $line"
}
cd /tmp
for run in $(seq "$RUNS"); do
    clean; timed "run $run, the probe, no bytecode cache (a fresh host)" "$E/pyinfra-vllm-probe.py"
    timed "run $run, the probe, bytecode cached" "$E/pyinfra-vllm-probe.py"
    if [ -n "${OTHER:-}" ]; then
        clean; timed "run $run, $OTHER, no bytecode cache (a fresh host)" /tmp/probe-other.py
        timed "run $run, $OTHER, bytecode cached" /tmp/probe-other.py
    fi
done
echo "bytecode files after the imports: $(find "$E" -name '*.pyc' | wc -l)"
EOF_HOST
} | bench_host_script
$PY -m sandbox down >/dev/null
