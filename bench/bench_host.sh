# Sourced by bench/probe.sh and bench/engine_bytecode.sh, from the repository root.
# Needs PY and PYINFRA.
#   bench_host_up DATA...      one fresh `seed` sandbox host with its own caches
#                              (--own-caches), converged by deploys/full.py with DATA
#                              (--data ... words); fails when the run had an error
#   bench_host_script < FILE   FILE run by bash as root on that host; its stdout and
#                              stderr come back as they are
bench_host_up() {
    "$PY" -m sandbox down >/dev/null
    "$PY" -m sandbox up --hosts 1 --scenario seed --own-caches >/dev/null
    "$PYINFRA" -y --json .sandbox/inventory.py deploys/full.py "$@" 2>/dev/null \
        | "$PY" -c 'import json,sys; t=json.load(sys.stdin)["results"]["totals"]; sys.exit(t["error"] != 0)'
}

bench_host_script() {
    "$PY" -c 'import json, subprocess, sys
from sandbox import hosts
address = json.load(open(".sandbox/state.json"))["hosts"][0]["address"]
sys.exit(subprocess.run([*hosts.ssh_argv(address), "--", "sudo -n bash -s"]).returncode)'
}
