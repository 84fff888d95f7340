"""pyinfra_vllm.plans.capacity against the Qwen3.6-27B-like fixture and the mirror's tiny Qwen2."""

from __future__ import annotations

import json
from pathlib import Path

from pyinfra_vllm.plans.capacity import GIB, estimate_parameters, layer_types, plan
from sandbox.mirror import model

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures/hf/qwen3.6-27b/config.json"
WEIGHTS = 55_600_000_000  # research: 55.6 GB in 15 shards


def qwen36() -> dict:
    return json.loads(FIXTURE.read_text())


def test_qwen36_27b_numbers_at_tp2_on_80gb():
    p = plan(qwen36(), dtype="bfloat16", tensor_parallel_size=2, gpu_memory_mib=81920,
             gpu_memory_utilization=0.92, max_model_len=131072, block_size=32,
             weights_bytes=WEIGHTS)
    assert p["full_attention_layers"] == 16 and p["linear_attention_layers"] == 48
    assert p["kv_bytes_per_token"] == 65536  # 2 * 16 * 4 * 256 * 2
    assert p["kv_bytes_per_sequence"] == 8 * GIB
    assert p["kv_bytes_per_sequence_per_gpu"] == 4 * GIB
    assert p["weights_bytes_per_gpu"] == 27_800_000_000
    # 48 layers x (conv 3 x 5120 x 2 B + recurrent 24 x 128 x 128 x 4 B (float32))
    assert p["linear_state_bytes_per_sequence_per_gpu"] == 48 * (3 * 5120 * 2 + 24 * 128 * 128 * 4)
    assert p["sequences"] == 10 and p["check"]["ok"] is True


def test_too_long_max_model_len_is_refused_with_the_numbers():
    p = plan(qwen36(), tensor_parallel_size=2, gpu_memory_mib=81920,
             gpu_memory_utilization=0.92, max_model_len=2_097_152, block_size=32,
             weights_bytes=WEIGHTS)
    check = p["check"]
    assert check["ok"] is False and check["severity"] == "error"
    assert "max_model_len 2097152 does not fit" in check["detail"]
    assert "64.00 GiB KV" in check["detail"] and "25.89 GiB" in check["detail"]
    assert "44.71 GiB for the KV cache" in check["detail"]
    fit = p["max_model_len_that_fits"]
    assert f"lower max_model_len to {fit}" in check["fix"] and fit % 32 == 0
    assert plan(qwen36(), max_model_len=fit, block_size=32, weights_bytes=WEIGHTS)["sequences"] == 1


def test_weights_alone_too_big_says_so():
    p = plan(qwen36(), tensor_parallel_size=1, gpu_memory_mib=40960, weights_bytes=WEIGHTS)
    assert p["check"]["ok"] is False and "weights alone" in p["check"]["fix"]


def test_interval_without_layer_types_and_estimate():
    config = qwen36()
    del config["text_config"]["layer_types"]
    assert layer_types(config).count("full_attention") == 16
    assert layer_types(config)[3] == "full_attention" and layer_types(config)[0] != "full_attention"
    # ~26.9 B text parameters (the 55.6 GB on the Hub also holds the vision tower and MTP).
    assert 26.5e9 < estimate_parameters(config) < 27.5e9
    assert plan(config, weights_bytes=None)["weights_source"] == "estimate"


def test_tiny_qwen2_from_the_mirror(tmp_path):
    manifest = model.generate(tmp_path / "r")
    config = json.loads((tmp_path / "r/config.json").read_text())
    p = plan(config, tensor_parallel_size=2, max_model_len=131072, block_size=16,
             weights_bytes=None)
    assert p["full_attention_layers"] == 4 and p["linear_attention_layers"] == 0
    assert p["kv_bytes_per_token"] == 2 * 4 * 2 * 64 * 2
    assert p["kv_bytes_per_token_per_gpu"] == 2 * 4 * 1 * 64 * 2
    assert p["linear_state_bytes_per_sequence_per_gpu"] == 0
    # The estimate ignores biases and norms only.
    params = manifest["weights"]["parameters"]
    assert 0.99 * params < estimate_parameters(config) <= params


def test_kv_heads_replicate_when_fewer_than_ranks(tmp_path):
    model.generate(tmp_path / "r")
    config = json.loads((tmp_path / "r/config.json").read_text())
    p = plan(config, tensor_parallel_size=4, weights_bytes=0)
    assert p["kv_bytes_per_token_per_gpu"] == 2 * 4 * 1 * 64 * 2  # 2 KV heads, 4 ranks
