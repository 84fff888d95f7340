"""The engine's compile cache on a real GPU, recorded (tests/fixtures/vllm-cuda-0.22.0/h100/,
its README says how; bench/gpu_engine.md has the figures): CUDA graphs engines on one H100
started twice from one kept state directory, once under a new key and once under the
same one, as a restarted unit starts."""

from __future__ import annotations

import json

import pytest

from pyinfra_vllm.plans.capacity import GIB, plan
from tests.unit.test_gpu_trial_recorded import FOLDER, PLAN_ARGS, ROOT, SHAPE, report_figure
from tools import engine_trial

H100 = FOLDER / "h100"
# The trials in the order they ran: (record, benchmark runs). graphs and graphs-new-key
# ran before the trial kept its engine's key with --state-dir, graphs-cold and
# graphs-warm after, on the machine lent again.
TRIALS = {"graphs": 4, "graphs-new-key": 2, "graphs-cold": 1, "graphs-warm": 1}
COMPILED = r"\(compilation: ([\d.]+) s\)"
LOADED = "Directly load the compiled graph(s) for compile range (1, 4096) from the cache"


def record(name: str) -> dict:
    return json.loads((H100 / f"trial-{name}.json").read_text())


def cache_mib(name: str) -> dict[str, int]:
    """What the state directory's compile cache held after the trial ``name``, MiB."""
    sizes = {}
    for line in (H100 / "compile-cache.tsv").read_text().splitlines():
        trial, mib, path = line.split("\t")
        if trial == name:
            sizes[path.rstrip("/").rsplit("/", 1)[1]] = int(mib)
    return sizes


def report(name: str) -> str:
    return "\n".join(record(name)["engine_report"])


def test_the_h100_and_its_probe_read_as_the_h200_s():
    assert (H100 / "gpu.csv").read_text().splitlines()[1] == (
        "NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04, 9.0")
    assert (json.loads((H100 / "probe.json").read_text())
            == json.loads((FOLDER / "h200" / "probe.json").read_text()))


@pytest.mark.parametrize("name", sorted(TRIALS))
def test_each_trial_served_with_the_unit_s_flags_and_failed_no_request(name):
    found = record(name)
    assert (found["error"], found["vllm"], found["stop"]["left"]) == (
        None, {"dist": "vllm", "version": "0.22.0"}, [])
    assert [(run["completed"], run["failed"], run["shape"]) for run in found["bench_runs"]] == [
        (16, 0, SHAPE)] * TRIALS[name]
    rendered = engine_trial.build(engine_trial.parse_args(
        [*PLAN_ARGS, "--data", "enforce_eager=false"]))
    assert found["argv"] == rendered["argv"] and "--no-enforce-eager" in found["argv"]


def test_a_restart_from_the_kept_cache_loads_what_the_first_start_compiled():
    """The unit's case: the same HOME, compile cache and key as the start before. vLLM
    loads the compiled graphs instead of compiling them, the cache does not grow, and the
    engine is ready in under a third of the time."""
    cold, warm = record("graphs-cold"), record("graphs-warm")
    assert cold["state_dir"] == warm["state_dir"] == "/tmp/gpu-trial/kept"
    assert all("with the engine's key" in " ".join(found["differences"])
               for found in (cold, warm))
    assert (LOADED in report("graphs-cold"), LOADED in report("graphs-warm")) == (False, True)
    assert [report_figure(found["engine_report"], COMPILED) for found in (cold, warm)] == [
        65.95, 11.01]
    assert (cold["ready"]["s"], warm["ready"]["s"]) == (243.7, 66.6)
    assert cache_mib("graphs-cold") == {"triton": 74, "vllm": 284}
    assert cache_mib("graphs-warm") == {"triton": 75, "vllm": 284}
    doc = (ROOT / "bench" / "gpu_engine.md").read_text()
    assert "243.7 s" in doc and "66.6 s" in doc


def test_a_restart_under_a_new_key_compiles_again_beside_the_first():
    """Why the trial keeps its key with the state directory, and what a unit whose key
    changed pays once: VLLM_API_KEY is among vLLM's compile factors, so the second engine
    compiled its graphs again under a new cache key (Triton's kernels were reused)."""
    first, second = record("graphs"), record("graphs-new-key")
    assert first["state_dir"] == second["state_dir"] == "/tmp/gpu-trial/state"
    assert not any("engine's key" in line for line in first["differences"])
    assert LOADED not in report("graphs-new-key")
    assert [report_figure(found["engine_report"], r"compile range \(1, 4096\) takes "
                          r"([\d.]+) s") for found in (first, second)] == [55.91, 40.74]
    assert (cache_mib("graphs"), cache_mib("graphs-new-key")) == (
        {"triton": 74, "vllm": 284}, {"triton": 74, "vllm": 568})
    assert (first["ready"]["s"], second["ready"]["s"]) == (315.2, 137.4)


def test_the_capacity_planner_against_what_vllm_allocated_on_the_h100():
    """The planner's KV tokens for the H100 (81,559 MiB x 0.92) against vLLM's: 7.1% more
    than a start that compiled left (its compile's memory counted in the profile), 0.6%
    fewer than the restart from the cache; the same whole 131,072-token sequences (2)."""
    config = json.loads((ROOT / "tests" / "fixtures" / "hf" / "qwen3.6-27b" /
                         "config.json").read_text())
    estimate = plan(config, tensor_parallel_size=1, gpu_memory_mib=81559,
                    gpu_memory_utilization=0.92, max_model_len=131072, block_size=32,
                    weights_bytes=int(report_figure(record("graphs-cold")["engine_report"],
                                                    r"Model loading took ([\d.]+) GiB") * GIB))
    planned = estimate["kv_budget_bytes_per_gpu"] // estimate["kv_bytes_per_token_per_gpu"]
    tokens = [report_figure(record(name)["engine_report"], r"GPU KV cache size: ([\d,]+) tokens")
              for name in ("graphs-cold", "graphs-warm")]
    assert (planned, tokens) == (328592, [306881, 330427])
    assert [round(planned / found - 1, 3) for found in tokens] == [0.071, -0.006]
    assert estimate["sequences"] == 2 == min(
        int(report_figure(record(name)["engine_report"], r"per request: ([\d.]+)x"))
        for name in ("graphs-cold", "graphs-warm"))
