#!/usr/bin/env bash
# A fresh host's whole run with warm package caches: uv hard-linking the environment
# from its wheel cache (python_env_link_mode hardlink, `sandbox up --own-caches`) against
# copying it (the sandbox's shared cache is a bind mount, where uv copies). bench/fresh_host.md
# has the figures.
#
#   bash bench/fresh_host.sh [RUNS]          # default 2 runs of each, in turn
#
# Variables: MODES (default "hardlink copy": which of the two, in that order each run);
# MODEL_S=N holds the model's download to about N seconds (the sandbox mirror's `slow`
# fault on every file, each paced so the largest takes N s), as a real model's
# download of minutes would, to see what runs beside it; REV=COMMIT runs that commit's
# deploys/full.py (a temporary git worktree) against the same hosts, for a before/after.
#
# Root, from the repository root, with the sandbox's uv cache already holding the stack's
# wheels (any earlier run of it, e.g. the e2e tests). The stack is a CUDA build with the
# engine not started: the example fleet's (group_data/a100_nvlink.py) on a seed580 host
# unless VLLM_VERSION, DRIVER_BRANCH and SCENARIO say otherwise (bench/bench_host.sh
# cuda_stack; the design's 0.6.3, about 6.4 GB installed, as in bench/whole_run.md:
# VLLM_VERSION=0.6.3 DRIVER_BRANCH=535-server SCENARIO=seed). Each run boots a new host;
# the sandbox is torn down at the end.
set -euo pipefail
PY=.venv/bin/python
PYINFRA=.venv/bin/pyinfra
INV=.sandbox/inventory.py
RUNS=${1:-2}
. bench/bench_host.sh
cuda_stack
DATA=("${CUDA_DATA[@]}")
read -r -a MODES <<<"${MODES:-hardlink copy}"
HERE=$PWD
CHECKOUT=$HERE
if [ -n "${REV:-}" ]; then
    CHECKOUT=$(mktemp -d /tmp/fresh-host-rev.XXXXXX)
    git worktree add -q --detach "$CHECKOUT" "$REV"
    trap 'git -C "$HERE" worktree remove --force "$CHECKOUT"' EXIT
fi

fresh() {  # $1: hardlink or copy; prints the whole run's wall time and totals
    local up_args=() start end
    [ "$1" = hardlink ] && up_args=(--own-caches)
    $PY -m sandbox up --hosts 1 --scenario "$SCENARIO" "${up_args[@]}" >/dev/null
    [ -n "${MODEL_S:-}" ] && slow_model "$MODEL_S"
    start=$(date +%s.%N)
    (cd "$CHECKOUT" && "$HERE/$PYINFRA" -y --json "$HERE/$INV" deploys/full.py "${DATA[@]}") \
        2> >(stamped >/tmp/fresh_host.err) \
        | $PY -c 'import json,sys; t=json.load(sys.stdin)["results"]["totals"]; sys.exit(t["error"] != 0)'
    end=$(date +%s.%N)
    sleep 0.5  # the stamped stderr's last lines
    echo "$1: whole run $($PY -c "print(round($end - $start, 1))") s; the environment's job" \
        "(first to last journal line): $(on_host "journalctl -q -o short-unix" \
        "-u 'pyinfra-vllm-env-*' | awk 'NR==1{a=\$1} END{printf \"%.1f\", \$1-a}'") s; slowest:"
    slowest 6
}

slow_model() {  # $1: seconds the largest model file takes (each file paced alone)
    $PY - "$1" <<'PYEOF'
import json, sys, urllib.request
text = open(".sandbox/inventory.py").read()
mirror = text.split('"model_base_url": "', 1)[1].split('"', 1)[0]
lock = json.load(open(text.split('"model_lock": "', 1)[1].split('"', 1)[0]))
rate = -(-max(f["size"] for f in lock["files"]) // int(sys.argv[1]))
for method, body in (("DELETE", None), ("POST", {"mode": "slow", "rate": rate, "times": -1})):
    data = None if body is None else json.dumps(body).encode()
    urllib.request.urlopen(urllib.request.Request(
        mirror + "/_faults", data=data, method=method,
        headers={"Content-Type": "application/json"}), timeout=10).read()
PYEOF
}

stamped() {  # each line of stdin behind its time since the start
    $PY -u -c 'import sys, time
t0 = time.monotonic()
for line in sys.stdin:
    sys.stdout.write(f"{time.monotonic() - t0:7.2f} {line}")'
}

slowest() {  # the longest operations of the last run, from its stamped stderr
    awk '/--> Starting operation:/ {t = $1; sub(/.*Starting operation: /, ""); name = $0; next}
         /\] (Success|No changes|Error)/ && name != "" {printf "  %6.2f s  %s\n", $1 - t, name; name = ""}' \
        /tmp/fresh_host.err | sort -rn | head -"${1:-6}"
}

on_host() {  # a command line on the sandbox's first host, as root
    $PY - "$*" <<'PYEOF'
import json, subprocess, sys
from sandbox import hosts
address = json.load(open(".sandbox/state.json"))["hosts"][0]["address"]
argv = [*hosts.ssh_argv(address), "--", "sudo -n sh -c " + __import__("shlex").quote(sys.argv[1])]
print(subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip())
PYEOF
}

for _ in $(seq "$RUNS"); do
    for mode in "${MODES[@]}"; do
        fresh "$mode"
    done
done
$PY -m sandbox down >/dev/null
