"""The engine on a real GPU, recorded (tests/fixtures/vllm-cuda-0.22.0/h200/, its README
says how; bench/gpu_engine.md has the figures): the 0.22.0 row's probe with its GPU path,
and four engine trials (files/engine_trial.py) with the flags the unit gives the engine,
checked against the row, the unit as the suite renders it now, the capacity planner and
the figures the docs quote."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from files import vllm_probe
from pyinfra_vllm.core.stack_locks import read_lock
from pyinfra_vllm.core.stacks import STACKS
from pyinfra_vllm.plans.capacity import GIB, plan
from tools import engine_trial

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "tests" / "fixtures" / "vllm-cuda-0.22.0"
H200 = FOLDER / "h200"
ROW = STACKS["0.22.0"]
# The trials in the order they ran on one machine: (record, runs, CUDA graphs).
TRIALS = {"eager-1": (4, False), "graphs-1": (4, True), "graphs-2": (2, True),
          "eager-2": (4, False)}
SHAPE = {"concurrency": 16, "input_len": 8192, "output_len": 256, "requests": 16}
# What bench/gpu_trial/plans.sh gives python -m tools.engine_trial besides --plan-only.
PLAN_ARGS = [str(ROOT / "bench" / "gpu_trial" / "inventory.py"), "--limit", "gpu-trial", "--python",
             "/tmp/gpu-trial/v22/bin/python", "--model-dir", "/tmp/gpu-trial/qwen36",
             "--devices", "0", "--port", "8011", "--marker", str(FOLDER / "probe.json"),
             "--requests", "16", "--load-format", "dummy", "--engine-env",
             "VLLM_USE_FLASHINFER_SAMPLER=0",
             '--engine-arg=--additional-config={"gdn_prefill_backend":"triton"}',
             "--ready-timeout", "480", "--engine-arg=--language-model-only"]


def record(name: str) -> dict:
    return json.loads((H200 / f"trial-{name}.json").read_text())


def report_figure(lines: list[str], pattern: str) -> float:
    """A number of the engine's own report (its log), commas dropped."""
    [found] = [match for line in lines if (match := re.search(pattern, line))]
    return float(found[1].replace(",", ""))


def test_the_probe_ran_its_gpu_path_on_the_h200():
    marker = json.loads((H200 / "probe.json").read_text())
    runtime = marker["runtime"]
    assert (marker["stack"], marker["manager"]) == ("0.22.0", "pip")
    assert marker["requirements_sha256"] == read_lock(ROW).sha256
    assert (runtime["vllm"], runtime["torch"], runtime["torch_cuda"]) == ("0.22.0", "2.11.0",
                                                                         "13.0")
    # vLLM's CUDA kernels loaded (vllm._C) and the GPU's compute capability read: nothing
    # left unchecked, the GPU's sm_90 among the row's architectures.
    assert (runtime["gpus"], runtime["unchecked"]) == (["9.0"], [])
    assert tuple(runtime["cuda_archs"]) == ROW.cuda_archs and "sm_90" in ROW.cuda_archs
    # The same server and registry as the wheel probed without a GPU.
    without = json.loads((FOLDER / "probe.json").read_text())["runtime"]
    assert (runtime["flags"], runtime["architectures"]) == (without["flags"],
                                                            without["architectures"])
    assert without["unchecked"][:2] == [vllm_probe.UNCHECKED_KERNELS, vllm_probe.UNCHECKED_GPUS]


def test_the_machine_and_its_environment():
    assert (H200 / "gpu.csv").read_text().splitlines()[1] == (
        "NVIDIA H200, 143771 MiB, 580.159.04, 9.0")
    installed = dict(line.split("==") for line in (H200 / "environment.txt").read_text().split())
    pins = {"vllm": ROW.vllm, **ROW.pins}
    # The lock's own: what was carried (vLLM, transformers) and what the machine had
    # (torch and its companions); flashinfer was not carried (bench/gpu_engine.md).
    assert {name: installed.get(name) for name in pins} == {**pins, "flashinfer-python": None,
                                                            "numba": "0.68.0"}


@pytest.mark.parametrize("name", sorted(TRIALS))
def test_each_trial_served_with_the_unit_s_flags_and_failed_no_request(name):
    runs, graphs = TRIALS[name]
    found = record(name)
    assert (found["error"], found["vllm"], found["device"]["gpus"]) == (
        None, {"dist": "vllm", "version": "0.22.0"}, [0])
    assert (found["stop"]["signal"], found["stop"]["left"]) == ("SIGTERM", [])
    assert re.fullmatch(r"wait-ready: http://127\.0\.0\.1:8011/health answered 200 after "
                        r"\d+ s", found["ready"]["lines"][0])
    assert found["completion"]["completion_tokens"] == 16
    assert [(run["completed"], run["failed"], run["shape"]) for run in found["bench_runs"]] == [
        (16, 0, SHAPE)] * runs
    # The engine's command line is the one the suite renders now for the trial's host.
    eager = ["--data", f"enforce_eager={str(not graphs).lower()}"]
    rendered = engine_trial.build(engine_trial.parse_args([*PLAN_ARGS, *eager]))
    assert found["argv"] == rendered["argv"]
    assert ("--no-enforce-eager" if graphs else "--enforce-eager") in found["argv"]


def measured(mode_graphs: bool, figure: str) -> list[float]:
    """A figure of every run but each engine's first (its warm-up), in order."""
    return [run[figure] for name, (_, graphs) in TRIALS.items() if graphs == mode_graphs
            for run in record(name)["bench_runs"][1:]]


def test_cuda_graphs_serve_twice_the_tokens_of_eager_as_bench_gpu_engine_md_says():
    eager, graphs = measured(False, "output_tokens_per_s"), measured(True, "output_tokens_per_s")
    assert (len(eager), len(graphs)) == (6, 4)
    assert round(statistics.median(eager), 1) == 122.7
    assert round(statistics.median(graphs), 1) == 244.8
    assert min(graphs) > 1.8 * max(eager)
    doc = (ROOT / "bench" / "gpu_engine.md").read_text()
    assert "122.7" in doc and "244.8" in doc and "2.0x" in doc


@pytest.mark.parametrize("name", ["eager-1", "graphs-1"])
def test_the_capacity_planner_is_within_4_percent_of_what_vllm_allocated(name):
    """The planner's KV tokens for the same GPU, settings and weights against vLLM's own
    "GPU KV cache size": the same whole 131,072-token sequences (9), 0.4% more tokens than
    eager got and 3.4% more than CUDA graphs left (their pools and compile take ~2 GiB
    more than eager's, the planner holds back 3 GiB for either)."""
    report = record(name)["engine_report"]
    weights = report_figure(report, r"Model loading took ([\d.]+) GiB")
    tokens = report_figure(report, r"GPU KV cache size: ([\d,]+) tokens")
    concurrency = report_figure(report, r"per request: ([\d.]+)x")
    config = json.loads((ROOT / "tests" / "fixtures" / "hf" / "qwen3.6-27b" /
                         "config.json").read_text())
    estimate = plan(config, tensor_parallel_size=1, gpu_memory_mib=143771,
                    gpu_memory_utilization=0.92, max_model_len=131072, block_size=32,
                    weights_bytes=int(weights * GIB))
    planned = estimate["kv_budget_bytes_per_gpu"] // estimate["kv_bytes_per_token_per_gpu"]
    assert planned == 1244352
    assert 0 < planned / tokens - 1 < 0.04
    assert estimate["sequences"] == int(concurrency) == 9


def test_the_second_graphs_start_compiled_again_under_another_home():
    """Why the trial keeps HOME with its caches (--state-dir): both graphs engines had
    VLLM_CACHE_ROOT in one kept directory but each its own HOME, and vLLM's compile cache
    key follows HOME (VLLM_CONFIG_ROOT): the second compiled as long as the first."""
    first, second = record("graphs-1"), record("graphs-2")
    cache = "/tmp/gpu-trial/compile-cache"
    assert (first["cache_dir"], second["cache_dir"]) == (cache, cache)
    assert first["environment"]["VLLM_CACHE_ROOT"] == second["environment"]["VLLM_CACHE_ROOT"]
    assert first["environment"]["HOME"] != second["environment"]["HOME"]
    compiled = [report_figure(found["engine_report"], r"\(compilation: ([\d.]+) s\)")
                for found in (first, second)]
    assert compiled == [54.72, 59.01]
