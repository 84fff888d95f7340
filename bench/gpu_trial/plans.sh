#!/bin/bash
# The engine trial's plans for the lent GPU machine (bench/gpu_engine.md), rendered here by
# python -m tools.engine_trial --plan-only from bench/gpu_trial/inventory.py: that machine
# has none of the suite's Python packages, and runs them with files/engine_trial.py alone
# (bench/gpu_trial/device.sh). Writes bench/gpu_trial/plans/*.json.
#
#   bash bench/gpu_trial/plans.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
W=/tmp/gpu-trial
out=bench/gpu_trial/plans
mkdir -p "$out"
plan() {  # NAME MODEL_DIR ARGS...
    local name=$1 model=$2
    shift 2
    .venv/bin/python -m tools.engine_trial bench/gpu_trial/inventory.py --limit gpu-trial \
        --python "$W/v22/bin/python" --model-dir "$model" --devices 0 --port 8011 \
        --marker tests/fixtures/vllm-cuda-0.22.0/probe.json --requests 16 \
        --load-format dummy --engine-env VLLM_USE_FLASHINFER_SAMPLER=0 \
        '--engine-arg=--additional-config={"gdn_prefill_backend":"triton"}' \
        --ready-timeout 480 "$@" --plan-only > "$out/$name.json"
}
# The model's own config, its vision tower left out by vLLM's --language-model-only.
plan eager "$W/qwen36" --engine-arg=--language-model-only --data enforce_eager=true \
    --bench-runs 4
# CUDA graphs, then the same engine again from the first one's state directory (its
# compile cache), as a restarted unit starts.
plan graphs "$W/qwen36" --engine-arg=--language-model-only --data enforce_eager=false \
    --bench-runs 4 --state-dir "$W/state"
plan graphs-restarted "$W/qwen36" --engine-arg=--language-model-only \
    --data enforce_eager=false --bench-runs 2 --state-dir "$W/state"
# The same pair from a state directory of its own with one benchmark each: the start
# with an empty compile cache, then the restart from it.
plan graphs-cold "$W/qwen36" --engine-arg=--language-model-only \
    --data enforce_eager=false --bench-runs 1 --state-dir "$W/kept"
plan graphs-warm "$W/qwen36" --engine-arg=--language-model-only \
    --data enforce_eager=false --bench-runs 1 --state-dir "$W/kept"
ls "$out"
