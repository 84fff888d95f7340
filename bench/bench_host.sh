# Sourced by bench/probe.sh and bench/engine_bytecode.sh, from the repository root.
# Needs PY and PYINFRA.
#   bench_host_up DATA...      one fresh sandbox host (SCENARIO, default seed) with its own caches
#                              (--own-caches), converged by deploys/full.py with DATA
#                              (--data ... words); fails when the run had an error
#   bench_host_script < FILE   FILE run by bash as root on that host; its stdout and
#                              stderr come back as they are
#   cuda_stack                 sets VLLM_VERSION, DRIVER_BRANCH, SCENARIO and CUDA_DATA
#                              (--data words): the example fleet's CUDA stack and driver
#                              branch (group_data/a100_nvlink.py) on the scenario whose
#                              driver carries it, unless the variables are set already
#                              (the design's stack: VLLM_VERSION=0.6.3
#                              DRIVER_BRANCH=535-server SCENARIO=seed)
cuda_stack() {
    local fleet
    fleet=$("$PY" -c 'import runpy; g = runpy.run_path("group_data/a100_nvlink.py")
print(g["vllm_version"], g["nvidia_driver_branch"])')
    VLLM_VERSION=${VLLM_VERSION:-${fleet% *}}
    DRIVER_BRANCH=${DRIVER_BRANCH:-${fleet#* }}
    # sandbox/hosts.py SCENARIOS: seed carries the 535 branch, seed580 the 580 one.
    SCENARIO=${SCENARIO:-$([ "${DRIVER_BRANCH%%-*}" = 535 ] && echo seed || echo seed580)}
    CUDA_DATA=(--data vllm_device=cuda --data "vllm_version=$VLLM_VERSION"
               --data "nvidia_driver_branch=$DRIVER_BRANCH" --data vllm_start=false)
}

bench_host_up() {
    "$PY" -m sandbox down >/dev/null
    "$PY" -m sandbox up --hosts 1 --scenario "${SCENARIO:-seed}" --own-caches >/dev/null
    "$PYINFRA" -y --json .sandbox/inventory.py deploys/full.py "$@" 2>/dev/null \
        | "$PY" -c 'import json,sys; t=json.load(sys.stdin)["results"]["totals"]; sys.exit(t["error"] != 0)'
}

bench_host_script() {
    "$PY" -c 'import json, subprocess, sys
from sandbox import hosts
address = json.load(open(".sandbox/state.json"))["hosts"][0]["address"]
sys.exit(subprocess.run([*hosts.ssh_argv(address), "--", "sudo -n bash -s"]).returncode)'
}
