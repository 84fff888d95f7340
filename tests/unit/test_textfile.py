"""pyinfra_vllm.plans.textfile: the node_exporter textfile, byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

from pyinfra_vllm.core.settings import validate
from pyinfra_vllm.plans.gates import model_gates
from pyinfra_vllm.plans.textfile import gpu_health_text, metrics_text

QWEN = Path(__file__).resolve().parents[1] / "fixtures/hf/qwen3.6-27b/config.json"


def test_checks_info_and_capacity_as_gauges():
    checks = [{"name": "os", "ok": True, "severity": "error"},
              {"name": "tp_nvlink", "ok": False, "severity": "error"},
              {"name": "driver_present", "ok": None, "severity": "error"}]
    text = metrics_text('gpu-"1"', checks, {"vllm": "0.6.3", "driver": "535.129.03"},
                        {"sequences": 10, "kv_bytes_per_token": 65536,
                         "weights_bytes_per_gpu": 27_800_000_000,
                         "kv_budget_bytes_per_gpu": 48_000_000_000})
    lines = text.splitlines()
    assert 'pyinfra_vllm_check_ok{check="os",severity="error"} 1' in lines
    assert 'pyinfra_vllm_check_ok{check="tp_nvlink",severity="error"} 0' in lines
    assert 'pyinfra_vllm_check_ok{check="driver_present",severity="error"} -1' in lines
    # Label values escape quotes; labels in a stable order.
    assert 'pyinfra_vllm_info{host="gpu-\\"1\\"",driver="535.129.03",vllm="0.6.3"} 1' in lines
    assert "pyinfra_vllm_capacity_sequences 10" in lines
    assert "pyinfra_vllm_capacity_weights_bytes_per_gpu 27800000000" in lines
    assert text.endswith("\n") and "timestamp" not in text
    # Every sample has its HELP and TYPE before it.
    names = {line.split("{")[0].split()[0] for line in lines if not line.startswith("#")}
    for name in names:
        assert f"# TYPE {name} gauge" in lines


def test_same_input_same_bytes_and_no_capacity_without_a_plan():
    checks = [{"name": "os", "ok": True, "severity": "error"}]
    first = metrics_text("h", checks, {"vllm": "0.6.3"}, None)
    assert first == metrics_text("h", checks, {"vllm": "0.6.3"}, None)
    assert "capacity" not in first
    assert "capacity" not in metrics_text("h", checks, {}, {"error": "cannot be planned"})


def test_qwen36_plan_on_two_a100():
    lock = {"config": json.loads(QWEN.read_text()),
            "files": [{"path": f"m-{n}.safetensors", "size": 55_600_000_000 // 15}
                      for n in range(15)]}
    settings = validate({"vllm_version": "0.17.0", "nvidia_driver_branch": "570-server", "gateway_open": True})
    gates = model_gates(settings, lock, {"gpus": [{"memory_total_mib": 81920}] * 2})
    text = metrics_text("h", gates["checks"], {}, gates["capacity"])
    assert 'pyinfra_vllm_check_ok{check="model_architecture",severity="error"} 1' in text
    assert "pyinfra_vllm_capacity_sequences 10\n" in text
    assert "pyinfra_vllm_capacity_kv_bytes_per_token 65536\n" in text


HEALTH = {
    "00000000:17:00.0": {"index": 0, "name": "NVIDIA A100 80GB PCIe", "verdict": "failing",
                         "reasons": [{"code": "xid_79", "severity": "failing",
                                      "detail": "Xid 79", "action": "reboot the host"}],
                         "counters": {"xid_events": 1, "pcie_gen_current": 1,
                                      "pcie_width_current": 16}},
    "00000000:65:00.0": {"index": 1, "name": "NVIDIA A100 80GB PCIe", "verdict": "ok",
                         "reasons": [], "counters": {"xid_events": 0}},
}


def test_gpu_health_verdicts_reasons_and_counters_as_gauges():
    lines = gpu_health_text("gpu-1", HEALTH).splitlines()
    gpu0 = 'host="gpu-1",gpu="0",bus_id="00000000:17:00.0"'
    gpu1 = 'host="gpu-1",gpu="1",bus_id="00000000:65:00.0"'
    assert f"pyinfra_vllm_gpu_health{{{gpu0}}} 2" in lines
    assert f"pyinfra_vllm_gpu_health{{{gpu1}}} 0" in lines
    assert (f'pyinfra_vllm_gpu_health_reason{{{gpu0},reason="xid_79",severity="failing"}} 1'
            in lines)
    assert [line for line in lines if line.startswith("pyinfra_vllm_gpu_health_reason")] == [
        f'pyinfra_vllm_gpu_health_reason{{{gpu0},reason="xid_79",severity="failing"}} 1']
    assert f"pyinfra_vllm_gpu_xid_events{{{gpu1}}} 0" in lines
    assert f"pyinfra_vllm_gpu_pcie_width_current{{{gpu0}}} 16" in lines
    # The PCIe generation follows the load (an idle GPU drops to Gen 1): left out.
    assert not [line for line in lines if "pcie_gen_current" in line]
    names = {line.split("{")[0] for line in lines if not line.startswith("#")}
    for name in names:
        assert f"# TYPE {name} gauge" in lines


def test_an_xid_of_a_gpu_no_longer_listed_has_no_index():
    lost = {"0000:9b:00": {"index": None, "verdict": "failing", "counters": {},
                           "reasons": [{"code": "xid_79", "severity": "failing",
                                        "detail": "d", "action": "a"}]}}
    assert 'pyinfra_vllm_gpu_health{host="h",gpu="",bus_id="0000:9b:00"} 2' in \
        gpu_health_text("h", lost).splitlines()
