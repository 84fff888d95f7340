#!/bin/bash
# The engine trial on a lent GPU machine (bench/gpu_engine.md), run there from the
# repository root, as root, read-only towards the GPU (no setting changed, no reset).
# That machine has Python 3.12 with torch 2.11.0 and its CUDA 13 libraries, and no
# network: the rest of the vLLM 0.22.0 stack's lock is carried to it as one tar of wheels
# in parts (.device-parts/pN, 54 MiB each: with the repository, what one call carries),
# kept under /tmp between calls.
#
#   bash bench/gpu_trial/device.sh stage .device-parts/pN   # one part into /tmp/gpu-trial
#   bash bench/gpu_trial/device.sh setup    # wheels checked, environment, probe, models
#   bash bench/gpu_trial/device.sh trial NAME   # bench/gpu_trial/plans/NAME.json
set -euo pipefail
W=/tmp/gpu-trial
OUT=${OUT:-$W/out}
LOCK=locks/stacks/vllm-0.22.0.txt

# Each wheel's sha256 must be one the stack's lock lists for that package and version.
check_wheels() {
    python3 - "$LOCK" "$W/wheels" <<'PY'
import hashlib, os, re, sys
lock, folder = sys.argv[1], sys.argv[2]
hashes, name = {}, None
for line in open(lock, encoding="utf-8"):
    pin = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)", line)
    if pin:
        name = (re.sub(r"[-_.]+", "-", pin[1]).lower(), pin[2])
    for digest in re.findall(r"--hash=sha256:([0-9a-f]{64})", line):
        hashes.setdefault(name, set()).add(digest)
bad = []
for wheel in sorted(os.listdir(folder)):
    dist, version = wheel.split("-")[:2]
    key = (re.sub(r"[-_.]+", "-", dist).lower(), version)
    digest = hashlib.sha256(open(os.path.join(folder, wheel), "rb").read()).hexdigest()
    if digest not in hashes.get(key, ()):
        bad.append(wheel)
print(f"{len(os.listdir(folder)) - len(bad)} wheels match {lock}; not matching: {bad}")
sys.exit(1 if bad else 0)
PY
}

case "$1" in
stage)
    mkdir -p "$W/parts"
    cp "$2"/* "$W/parts/"
    ls -l "$W/parts"
    ;;
setup)
    mkdir -p "$W/wheels" "$OUT"
    (cd "$W/parts" && cat wheels.tar.part-* | sha256sum | sed 's/-$/wheels.tar/' \
        | diff - wheels.tar.sha256 && cat wheels.tar.part-* | tar -x -C "$W/wheels")
    check_wheels
    # The machine's torch is in a virtual environment of its own (python3 is its
    # interpreter), which --system-site-packages would not reach: its site directory goes
    # after the new environment's own, so the lock's wheels come first.
    python3 -m venv "$W/v22"
    python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
        > "$("$W/v22/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/machine-torch.pth"
    time "$W/v22/bin/pip" install -q --no-index --no-deps "$W"/wheels/*.whl
    "$W/v22/bin/pip" list --format=freeze > "$OUT/environment.txt"
    sha=$(sha256sum "$LOCK" | cut -d' ' -f1)
    time "$W/v22/bin/python" files/vllm_probe.py --expect-vllm 0.22.0 --stack 0.22.0 \
        --marker "$W/v22/pyinfra-vllm-env.json" --requirements-sha256 "$sha" --manager pip
    python3 -m json.tool --sort-keys "$W/v22/pyinfra-vllm-env.json" > "$OUT/probe.json"
    python3 -m bench.gpu_trial.model_dir "$W/qwen36"
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv \
        > "$OUT/gpu.csv"
    ;;
trial)
    timeout 570 python3 files/engine_trial.py --plan "bench/gpu_trial/plans/$2.json" \
        --record "$OUT/$2.json" 2> "$OUT/$2.log" >/dev/null || { tail -40 "$OUT/$2.log"; exit 1; }
    tail -5 "$OUT/$2.log"
    # What the engine compiled, kept for the next trial with the same --state-dir.
    state=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["state_dir"] or "")' \
        "bench/gpu_trial/plans/$2.json")
    if [ -n "$state" ] && [ -d "$state/compile-cache" ]; then
        du -s --block-size=1M "$state/compile-cache"/*/ "$state/compile-cache"/vllm/*/*/ \
            | tee "$OUT/$2.du"
    fi
    ;;
esac
