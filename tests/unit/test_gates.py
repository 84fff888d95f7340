"""The model gates preflight, the audit and the metrics share: architecture, context length and capacity."""

from __future__ import annotations

import json
from pathlib import Path

from pyinfra_vllm.core.locks import safetensors_bytes
from pyinfra_vllm.core.settings import validate
from pyinfra_vllm.plans.gates import (
    check_context_length,
    gpu_memory_mib,
    installed_registry,
    model_gates,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


QWEN36_CONFIG = FIXTURES / "hf/qwen3.6-27b/config.json"


MODEL_ID = "Qwen/Qwen3.6-27B"


COMMIT = "5f1e0c3a9b7d2e4f6a8c0b1d3e5f7a9c2b4d6e8f"


def _lock(*files: tuple[str, int, str]) -> dict:
    return {"model_id": MODEL_ID, "commit": COMMIT,
            "files": [{"path": p, "size": s, "algo": "sha256", "digest": d} for p, s, d in files]}


# --- the model gates ---------------------------------------------------------------------
def qwen36_lock() -> dict:
    """A lock built for the test, NOT a real one: the reconstructed Qwen3.6-27B config.json
    (tests/fixtures/hf) and 15 safetensors shards totalling 55.6 GB (14 x 3.71 GB +
    3.66 GB), plus the small files that do not count as weights."""
    shards = [(f"model-{i:05d}-of-00015.safetensors", 3_710_000_000, "a" * 64)
              for i in range(1, 15)]
    shards.append(("model-00015-of-00015.safetensors", 3_660_000_000, "a" * 64))
    lock = _lock(("config.json", 3000, "c" * 64), *shards,
                 ("model.safetensors.index.json", 90_000, "d" * 64))
    lock["config"] = json.loads(QWEN36_CONFIG.read_text())
    return lock


TWO_A100 = {"gpus": [{"index": 0, "memory_total_mib": 81920},
                     {"index": 1, "memory_total_mib": 81920}]}


def _gate_settings(**extra):
    data = {"model_id": MODEL_ID, "gateway_open": True, **extra}
    if data.get("vllm_version") == "0.17.0":
        data.setdefault("nvidia_driver_branch", "570-server")  # the stack needs >= 570.124
    return validate(data)


def _by_name(gates: dict) -> dict:
    return {check["name"]: check for check in gates["checks"]}


def test_the_constructed_lock_weighs_55_6_gb():
    assert safetensors_bytes(qwen36_lock()) == 55_600_000_000


def test_gates_on_063_refuse_the_architecture():
    checks = _by_name(model_gates(_gate_settings(vllm_version="0.6.3"), qwen36_lock(), TWO_A100))
    arch = checks["model_architecture"]
    assert arch["ok"] is False and arch["severity"] == "error"
    assert "Qwen3_5ForConditionalGeneration" in arch["detail"] and "0.17.0" in arch["detail"]
    assert "vllm_version" in arch["fix"]


def test_gates_on_017_pass():
    gates = model_gates(_gate_settings(vllm_version="0.17.0"), qwen36_lock(), TWO_A100)
    checks = _by_name(gates)
    assert [c["name"] for c in gates["checks"]] == ["model_architecture", "context_length",
                                                     "capacity"]
    assert all(c["ok"] is True for c in gates["checks"])
    assert checks["context_length"]["detail"] == (
        "max_model_len 131072; the model's max_position_embeddings is 262144")
    assert gates["capacity"]["weights_source"] == "lock"
    assert gates["capacity"]["weights_bytes_per_gpu"] == 27_800_000_000
    assert gates["capacity"]["sequences"] == 10
    assert checks["capacity"]["detail"].startswith("10 sequence(s) of 131072 tokens fit")


def test_gates_use_the_installed_registry_when_given():
    settings = _gate_settings(vllm_version="0.17.0")
    arch = _by_name(model_gates(settings, qwen36_lock(), TWO_A100,
                                registry=["Qwen3_5ForConditionalGeneration"]))
    assert "its installed registry" in arch["model_architecture"]["detail"]
    missing = _by_name(model_gates(settings, qwen36_lock(), TWO_A100, registry=["Qwen2X"]))
    assert missing["model_architecture"]["ok"] is False


def test_gates_1m_context_exceeds_the_model_but_fits_the_gpus():
    checks = _by_name(model_gates(_gate_settings(vllm_version="0.17.0", max_model_len=1048576),
                                  qwen36_lock(), TWO_A100))
    context = checks["context_length"]
    assert context["ok"] is False and "262144" in context["detail"]
    assert context["fix"] == "lower max_model_len to 262144 or less"
    # 32 GiB of KV per GPU for one 1M-token sequence still fits in the 44.71 GiB left
    # after the weights and the reserve: only the model's own limit refuses it.
    assert checks["capacity"]["ok"] is True
    assert checks["capacity"]["detail"].startswith("1 sequence(s) of 1048576 tokens fit")


def test_gates_2m_context_does_not_fit():
    checks = _by_name(model_gates(_gate_settings(vllm_version="0.17.0", max_model_len=2097152),
                                  qwen36_lock(), TWO_A100))
    assert checks["context_length"]["ok"] is False
    capacity = checks["capacity"]
    assert capacity["ok"] is False
    assert "max_model_len 2097152 does not fit" in capacity["detail"]
    for number in ("budget 73.60 GiB (81920 MiB x 0.92)", "weights 25.89 GiB (lock)",
                   "= 44.71 GiB for the KV cache", "64.00 GiB KV"):
        assert number in capacity["detail"]
    assert capacity["fix"].startswith("lower max_model_len to 1462656 or less")


def test_gates_at_lower_utilization_refuse_1m():
    settings = _gate_settings(vllm_version="0.17.0", max_model_len=1048576,
                              gpu_memory_utilization=0.5)
    capacity = _by_name(model_gates(settings, qwen36_lock(), TWO_A100))["capacity"]
    assert capacity["ok"] is False
    assert "budget 40.00 GiB (81920 MiB x 0.5)" in capacity["detail"]
    assert "32.00 GiB KV" in capacity["detail"]


def test_gpu_memory_mib():
    settings = _gate_settings(tensor_parallel_size=2, min_gpu_memory_mib=40960)
    assert gpu_memory_mib({}, settings) == 40960
    assert gpu_memory_mib({"gpus": None}, settings) == 40960
    assert gpu_memory_mib(TWO_A100, settings) == 81920
    # Only the GPUs the server uses count: the first tensor_parallel_size of them.
    mixed = {"gpus": [{"memory_total_mib": 81920}, {"memory_total_mib": 81559},
                      {"memory_total_mib": 40960}]}
    assert gpu_memory_mib(mixed, settings) == 81559
    assert gpu_memory_mib({"gpus": [{"memory_total_mib": None}]}, settings) == 40960


def test_check_context_length_without_a_limit():
    check = check_context_length({"architectures": ["X"]}, _gate_settings())
    assert check["ok"] is None and check["severity"] == "warning"
    top = check_context_length({"max_position_embeddings": 4096}, _gate_settings())
    assert top["ok"] is False and "4096" in top["detail"]


def test_installed_registry():
    path = "/opt/vllm/envs/vllm-0.17.0-ec565792"
    environments = {"current": path, "uv": None, "conda": True, "envs": {path: {
        "marker": {"runtime": {"architectures": ["Qwen3_5ForConditionalGeneration"]}},
        "installed": {"vllm": "0.17.0"}}}}
    assert installed_registry(environments, path) == ["Qwen3_5ForConditionalGeneration"]
    assert installed_registry(environments, "/opt/vllm/envs/other") is None
    assert installed_registry({"envs": {path: {"marker": {"stack": "0.17.0"}}}}, path) is None
    assert installed_registry({"envs": {path: {"marker": None}}}, path) is None
    assert installed_registry({"current": None, "envs": {}, "uv": None, "conda": False},
                              path) is None
