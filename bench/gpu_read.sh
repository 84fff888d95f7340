#!/usr/bin/env bash
# The GPU host's read (facts.gpu_host.GpuHostState: the driver, the GPUs, their
# processes, topology and NVLink, six of them nvidia-smi calls) with its sections run
# side by side, against one after another (bench/fleet.md has the figures from a real
# H200 host).
#
#   bash bench/gpu_read.sh write DIR [REV]     # here: DIR/new.sh from this tree,
#                                              # DIR/old.sh from commit REV (default HEAD~)
#   bash bench/gpu_read.sh time DIR [RUNS]     # on the GPU host, root: each RUNS times
#                                              # in turn (default 5), outputs compared
#
# `write` needs the repository's .venv; `time` only sh, on the host (its outputs land in
# DIR/out/). Only the live cells of nvidia-smi's table (the clock, power, temperature)
# may differ between the two; the facts parsed from them must not (where REV printed
# other section markers, parse old.*.txt with REV's GpuHostState instead):
#   .venv/bin/python -c 'import sys; from facts.gpu_host import GpuHostState; \
#     p = GpuHostState().process; \
#     print(p(open(sys.argv[1]).read().splitlines()) == p(open(sys.argv[2]).read().splitlines()))' \
#     DIR/out/old.1.txt DIR/out/new.1.txt
set -euo pipefail
mode=$1 dir=$2
case $mode in
write)
    mkdir -p "$dir"
    rev=${3:-HEAD~}
    .venv/bin/python - "$dir" "$rev" <<'PYEOF'
import importlib.util, subprocess, sys, tempfile
from facts.gpu_host import GpuHostState
directory, rev = sys.argv[1], sys.argv[2]
open(f"{directory}/new.sh", "w").write(GpuHostState().command() + "\n")
with tempfile.TemporaryDirectory() as tmp:
    source = subprocess.run(["git", "show", f"{rev}:facts/gpu_host.py"], check=True,
                            capture_output=True, text=True).stdout
    open(f"{tmp}/gpu_host_old.py", "w").write(source)
    spec = importlib.util.spec_from_file_location("gpu_host_old", f"{tmp}/gpu_host_old.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    open(f"{directory}/old.sh", "w").write(module.GpuHostState().command() + "\n")
PYEOF
    ;;
time)
    runs=${3:-5}
    mkdir -p "$dir/out"
    ms() { echo $(( $(date +%s%N) / 1000000 )); }
    for run in $(seq "$runs"); do
        for version in old new; do
            start=$(ms)
            sh "$dir/$version.sh" >"$dir/out/$version.$run.txt" 2>/dev/null
            echo "$version, run $run: $(( $(ms) - start )) ms"
        done
        cmp -s "$dir/out/old.$run.txt" "$dir/out/new.$run.txt" \
            && echo "run $run: the same output" \
            || echo "run $run: outputs differ (nvidia-smi's live cells?): diff them"
    done
    ;;
*)
    echo "usage: $0 write DIR [REV] | time DIR [RUNS]" >&2
    exit 2
    ;;
esac
