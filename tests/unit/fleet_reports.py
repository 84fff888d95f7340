"""Audit reports of a small fleet built from recorded outputs of real machines, for the
report tests: the real H200 host's audited state (tests/fixtures/nvidia/h200-device-20261129),
and the same state with the topology matrix of a real 8-GPU DGX A100 (NV12 between GPUs,
PXB/PIX/SYS to ten NICs) or of a real 6-GPU PCIe server (PIX, NODE, SYS), parsed by
facts/topology.py as the GpuTopology fact parses them."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from pyinfra.api import Config, Inventory, State

from facts.topology import parse_topology
from pyinfra_vllm.core.settings import validate
from pyinfra_vllm.report.verdicts import model_plans, summarize

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
NVIDIA = FIXTURES / "nvidia"
H200_REPORT = NVIDIA / "h200-device-20261129" / "audit-report.json"
QWEN36_CONFIG = FIXTURES / "hf" / "qwen3.6-27b" / "config.json"
SETTINGS = validate({"gateway_open": True})

SYSCTL = {"operation": "Sysctl: kernel parameters persisted and applied", "stage": "sysctl"}
GATEWAY = {"operation": "Gateway: nginx enabled and running", "stage": "gateway"}
REBOOT = "driver 535-server installed; reboot required to load its kernel module"
TORCH = ("python_env: /opt/vllm/envs/0.6.3-cu121-a1b2c3 changed by hand since it was "
         "proven: torch 2.4.0 -> 2.4.1")


def h200_state() -> dict[str, Any]:
    report = json.loads(H200_REPORT.read_text())
    return copy.deepcopy(report["hosts"]["@local"]["state"])


def topology(name: str) -> dict[str, Any]:
    parsed = parse_topology((NVIDIA / name).read_text(encoding="utf-8").splitlines())
    if parsed is None:
        raise ValueError(f"{name}: no matrix")
    return parsed


def state_with(topology_file: str, gpu_name: str, memory_mib: int) -> dict[str, Any]:
    """The H200 host's state with another recorded matrix and as many GPUs as it has."""
    state = h200_state()
    state["topology"] = topology(topology_file)
    gpu = state["gpus"][0]
    state["gpus"] = [dict(gpu, index=i, name=gpu_name, memory_total_mib=memory_mib,
                          uuid=f"GPU-{i:08d}") for i in range(len(state["topology"]["gpus"]))]
    state["nvlink"] = None
    return state


def qwen36_lock() -> dict[str, Any]:
    return {"model_id": "Qwen/Qwen3.6-27B", "config": json.loads(QWEN36_CONFIG.read_text()),
            "files": [{"path": "model-00001-of-00002.safetensors", "size": 30_000_000_000},
                      {"path": "model-00002-of-00002.safetensors", "size": 25_600_000_000},
                      {"path": "config.json", "size": 1234}]}


def host_entry(name: str, state: dict[str, Any], drift: list | None, refused: list | None,
               findings: list | None = None, lock: dict | None = None) -> dict[str, Any]:
    entry = summarize(name, state, SETTINGS)
    plans = model_plans(SETTINGS, lock, state)
    entry.update(drift=drift, conditional=[] if drift is not None else None, refused=refused,
                 drift_note=None if drift is not None else "not checked: deploys/audit.py ran alone",
                 findings=list(findings or []), compatibility=plans["compatibility"],
                 capacity=plans["capacity"], model_note=plans["why"],
                 integrity={"drop_ins": {"vllm.service": []}, "nginx": [], "engine": None,
                            "engine_note": "no engine running"})
    return entry


def fleet() -> dict[str, Any]:
    """Three hosts: a drifted DGX with a hand-changed environment, the converged H200, and
    a 6-GPU PCIe server the driver stage refused."""
    return {
        "generated_at": "2026-12-01T10:00:00+00:00",
        "hosts": {
            "gpu-dgx-01": host_entry(
                "gpu-dgx-01",
                state_with("topo-8xA100-sxm4-40gb-dgx-10nic-nps4-01.txt",
                           "NVIDIA A100-SXM4-40GB", 40960),
                [SYSCTL], [], [TORCH], lock=qwen36_lock()),
            "gpu-h200-01": host_entry("gpu-h200-01", h200_state(), [], []),
            "gpu-pcie-01": host_entry(
                "gpu-pcie-01",
                state_with("topo-6gpu-2mlx5-olddriver-cpuaffinity-only-01.txt",
                           "Tesla V100-PCIE-16GB", 16384),
                [], [REBOOT]),
        },
    }


def previous_of(report: dict[str, Any]) -> dict[str, Any]:
    """The same fleet as an earlier audit saw it."""
    before = json.loads(json.dumps(report))
    before["generated_at"] = "2026-11-30T10:00:00+00:00"
    dgx = before["hosts"]["gpu-dgx-01"]
    dgx["drift"] = [GATEWAY]
    dgx["findings"] = []
    dgx["summary"]["driver_version"] = "570.172.08"
    dgx["summary"]["gpu_count"] = 7
    pcie = before["hosts"]["gpu-pcie-01"]
    pcie["refused"] = []
    pcie["summary"]["verdict"] = "ok"
    before["hosts"]["gpu-old-01"] = before["hosts"].pop("gpu-h200-01")
    return before


def connected_state(names: list[str]) -> State:
    """A pyinfra run's State whose hosts ``names`` are all connected (active), as the CLI
    has it when it prepares the deploy files."""
    state = State(Inventory((names, {})), Config())
    for host in state.inventory:
        state.activate_host(host)
    return state
