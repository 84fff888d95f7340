"""What the project's facts and audit printed on the real H200 host (the device tool,
2026-11-29), checked against the raw outputs captured in the same run.

tests/fixtures/nvidia/h200-device-20261129/ was written by
``tools/capture_gpu_host.sh`` (raw command outputs, ``pyinfra @local fact ... --json``
and ``pyinfra @local deploys/audit.py``), read-only: no GPU setting was changed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from facts.cuda import parse_nvcc_version
from facts.driver import (
    parse_dpkg_packages,
    parse_driver_info,
    parse_held_dpkg,
    parse_kernel_module,
    parse_nvml_error,
)
from facts.gpus import parse_gpu_inventory, parse_gpu_processes, parse_query_csv
from facts.topology import parse_nvlink_status, parse_p2p, parse_topology

# The capture names facts as they were named when it was recorded (facts.nvidia.*,
# facts.services.*); the module that reads each now is in the import above.
CAPTURE = Path(__file__).parent.parent / "fixtures" / "nvidia" / "h200-device-20261129"
FACTS = json.loads((CAPTURE / "pyinfra-facts.json").read_text())

PARSERS = {
    "facts.nvidia.GpuTopology": (parse_topology, "topo-m.txt"),
    "facts.nvidia.P2pRead": (parse_p2p, "topo-p2p-r.txt"),
    "facts.nvidia.NvlinkStatus": (parse_nvlink_status, "nvlink-s.txt"),
    "facts.nvidia.KernelModule": (parse_kernel_module, "proc-driver-nvidia-version.txt"),
    "facts.cuda.CudaToolkit": (parse_nvcc_version, "nvcc-version.txt"),
    "facts.nvidia.GpuInventory": (parse_gpu_inventory, "query-gpu-csv-noheader-nounits.txt"),
    "facts.nvidia.DriverInfo": (parse_driver_info, "smi.txt"),
    "facts.nvidia.GpuProcesses": (parse_gpu_processes, "query-compute-apps.txt"),
    "facts.nvidia.DriverPackages": (parse_dpkg_packages, "dpkg-nvidia.txt"),
    "facts.nvidia.HeldPackages": (parse_held_dpkg, "dpkg-nvidia.txt"),
    "facts.nvidia.NvmlError": (parse_nvml_error, "L.txt"),
}


def raw(name: str) -> list[str]:
    return (CAPTURE / name).read_text(encoding="utf-8").splitlines()


def fact(name: str):
    return FACTS[name]["@local"]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_recorded_fact_equals_the_parser_on_the_raw_output(name):
    parser, filename = PARSERS[name]
    parsed = json.loads(json.dumps(parser(raw(filename))))
    assert parsed == fact(name)


def test_every_recorded_fact_is_checked():
    assert set(FACTS) == set(PARSERS) | {"facts.nvidia.P2pRead"}


def test_one_h200_mig_disabled_persistence_enabled():
    (gpu,) = fact("facts.nvidia.GpuInventory")
    assert gpu == {
        "index": 0,
        "name": "NVIDIA H200",
        "uuid": "GPU-ab6a0263-0ae2-1846-2f4f-455ff8b12167",
        "pci_bus_id": "00000000:00:06.0",
        "memory_total_mib": 143771,
        "mig_current": "Disabled",
        "mig_pending": "Disabled",
        "persistence_mode": "Enabled",
        "driver_version": "580.159.04",
    }
    assert fact("facts.nvidia.DriverInfo") == {"driver_version": "580.159.04", "cuda_version": "13.0"}
    assert fact("facts.nvidia.KernelModule") == {"version": "580.159.04", "open": True}


def test_no_nvlink_exposed():
    assert raw("nvlink-s.txt") == []
    assert fact("facts.nvidia.NvlinkStatus") == {}
    assert fact("facts.nvidia.GpuTopology")["links"] == {"GPU0": {}}
    assert fact("facts.nvidia.GpuTopology")["cpu_affinity"] == {"GPU0": "0-15"}
    assert fact("facts.nvidia.GpuTopology")["gpu_numa_id"] == {"GPU0": None}
    assert "gpu0.nvlink0.state: NVMLError 3: Not Supported" in raw("nvml-probe.txt")


def test_driver_not_from_dpkg_so_no_mismatch_is_claimed():
    # The host's driver is not a Debian package (its module was built by nix), while
    # CUDA 13.0 libraries are: cuda-compat's 580.95.05 must not be read as the driver.
    packages = fact("facts.nvidia.DriverPackages")
    assert packages["cuda-compat-13-0"] == "580.95.05-0ubuntu1"
    assert not any(name.startswith(("nvidia-utils", "libnvidia-compute")) for name in packages)
    assert fact("facts.nvidia.NvmlError") is None
    assert fact("facts.nvidia.HeldPackages") == []


def test_query_gpu_with_header_and_units():
    (row,) = parse_query_csv(raw("query-gpu-csv.txt"))
    assert row["memory.total"] == "143771"
    assert row["mig.mode.current"] == "Disabled"
    assert row["persistence_mode"] == "Enabled"


def test_audit_report_of_the_real_host():
    report = json.loads((CAPTURE / "audit-report.json").read_text())
    summary = report["hosts"]["@local"]["summary"]
    assert summary["os"] == "Ubuntu 24.04.3 LTS"
    assert (summary["gpu_count"], summary["gpu_names"]) == (1, ["NVIDIA H200"])
    assert (summary["driver_version"], summary["cuda_version"]) == ("580.159.04", "13.0")
    assert summary["mig"] == [{"index": 0, "current": "Disabled", "pending": "Disabled"}]
    assert summary["persistence"] == [{"index": 0, "mode": "Enabled"}]
    assert summary["nvlink_active_links"] == {}
    assert summary["module_mismatch"] is None
    log = (CAPTURE / "audit-log.txt").read_text()
    assert "1x NVIDIA H200  580.159.04  13.0  disabled  enabled" in log


def test_every_command_exited_as_recorded():
    codes = dict(line.split() for line in raw("exit-codes.txt"))
    # dpkg-query exits 1 because no libnvidia-* package is installed; the fact accepts it.
    assert codes.pop("dpkg-nvidia") == "1"
    assert set(codes.values()) == {"0"}


def test_second_real_host_with_the_final_audit():
    # A second H200 lent later the same day (another GPU: its UUID differs), with the
    # audit's final table, a preflight at TP=1 and a bad setting.
    facts = json.loads((CAPTURE / "pyinfra-facts-second-host.json").read_text())
    (gpu,) = facts["facts.nvidia.GpuInventory"]["@local"]
    assert (gpu["name"], gpu["driver_version"], gpu["mig_current"], gpu["persistence_mode"]) == (
        "NVIDIA H200", "580.159.04", "Disabled", "Enabled"
    )
    assert facts["facts.nvidia.NvlinkStatus"]["@local"] == {}
    log = (CAPTURE / "audit-log-second-host.txt").read_text()
    assert (
        "@local  Ubuntu 24.04.3 LTS  1x NVIDIA H200  580.159.04  13.0  disabled  enabled      "
        "no NVLink exposed  fewer than 2 GPUs" in log
    )
    preflight = (CAPTURE / "preflight-dry-tp1-second-host.txt").read_text()
    assert "Preflight: host refused" not in preflight
    bad = (CAPTURE / "full-dry-bad-setting-second-host.txt").read_text()
    assert "block_size = 24: Input should be 8, 16 or 32 (allowed: 8, 16, 32)" in bad


# --- the engine stages' facts, the GPU guard and the drift audit on the same kind of host
# (device tool, read-only: pyinfra --dry, facts, NVML queries), recorded in runtime/.
RUNTIME = CAPTURE / "runtime"


def _fact_json(log: str, name: str):
    section = log.split(f"--> Fact data for: {name}", 1)[1]
    body = section[section.index("{"):]
    return json.loads(body[: body.index("\n}\n") + 2])["@local"]


def test_runtime_facts_return_absent_values_on_a_host_without_the_runtime():
    log = (RUNTIME / "device-runtime.log").read_text()
    assert _fact_json(log, "facts.python_env.HostPython") == "3.12.3"
    assert _fact_json(log, "facts.python_env.VllmEnvironments (root=/opt/vllm)") == {
        "current": None, "envs": {}, "uv": None, "conda": False}
    assert _fact_json(log, "facts.services.UnitActivation (unit=vllm.service)") is None
    assert _fact_json(log, "facts.storage.FilesystemSize (path=/dev/shm)") == 137438953472
    assert _fact_json(log, "facts.model.ModelFiles (path=/srv/models/Qwen/Qwen3.6-27B)") is None


def test_gpu_guard_with_real_nvml():
    log = (RUNTIME / "device-runtime.log").read_text()
    # /usr/bin/python3 there has no pynvml: the guard says so in its one line.
    assert ("gpu-guard: NVML unavailable: pynvml is not installed in /usr/bin/python3's "
            "environment") in log


def test_drift_audit_of_the_real_host():
    refused = json.loads((RUNTIME / "audit-tp2.json").read_text())["hosts"]["@local"]
    assert refused["refused"] == [
        "preflight gpu_count: 1 GPU(s); tensor_parallel_size is 2; set "
        "tensor_parallel_size to at most 1"]
    planned = json.loads((RUNTIME / "audit-tp1.json").read_text())["hosts"]["@local"]
    assert planned["refused"] == [] and len(planned["drift"]) == 19
    stages = {item["stage"] for item in planned["drift"]}
    assert stages == {"driver", "persistence", "sysctl", "model_volume", "python_env",
                      "vllm_service", "gateway", "metrics"}


# The GPU-health run on the same host (tools/capture_gpu_host.sh, 2026-12-02, read-only):
# the health facts, the audit with tensor_parallel_size 1 and gateway_open, and
# tools.gpu_health on the saved outputs.
HEALTH_CAPTURE = CAPTURE.with_name("h200-device-20261202")
H200_BUS = "00000000:00:06.0"


def test_the_h200_health_facts_are_the_parsers_on_its_raw_outputs():
    from facts.gpu_health_nvlink import parse_nvlink_errors
    from facts.gpu_health_smi import parse_query_text

    facts = json.loads((HEALTH_CAPTURE / "pyinfra-facts.json").read_text())
    recorded = facts["facts.gpu_health.GpuHealth"]["@local"]
    raw = (HEALTH_CAPTURE / "q.txt").read_text().splitlines()
    parsed = json.loads(json.dumps(parse_query_text(raw)))
    # The fact ran nvidia-smi -q a moment after the raw capture: the sensors moved.
    live = ("temperature_c", "memory_temperature_c", "power_draw_w", "utilization_gpu",
            "pstate", "clocks_event_reasons")
    assert ({k: v for k, v in recorded[H200_BUS].items() if k not in live}
            == {k: v for k, v in parsed[H200_BUS].items() if k not in live})
    gpu = recorded[H200_BUS]
    assert gpu["ecc"]["volatile"] == {"correctable": 0, "uncorrectable": 0}
    assert gpu["remapped_rows"] == {"correctable": 0, "uncorrectable": 0, "pending": False,
                                    "failure": False}
    assert gpu["pcie"]["width_current"] == gpu["pcie"]["width_max"] == 16
    # NVLink is not exposed in this VM: nvlink -e prints nothing, the fact is {}.
    assert (HEALTH_CAPTURE / "nvlink-e.txt").read_text() == ""
    assert facts["facts.gpu_health.NvlinkErrors"]["@local"] == parse_nvlink_errors([]) == {}
    # No systemd and no journal there: the kernel log came from dmesg, with no Xid.
    assert facts["facts.gpu_health.XidEvents"]["@local"] == {"source": "dmesg", "events": []}


def test_the_h200_audit_and_the_health_tool_say_ok():
    entry = json.loads((HEALTH_CAPTURE / "audit-report.json").read_text())["hosts"]["@local"]
    assert entry["summary"]["health"] == "ok"
    assert entry["gpu_health"][H200_BUS]["verdict"] == "ok"
    assert entry["gpu_health"][H200_BUS]["counters"]["xid_events"] == 0
    table = (HEALTH_CAPTURE / "audit-log.txt").read_text().splitlines()
    header = next(line for line in table if line.startswith("host "))
    row = next(line for line in table if line.startswith("@local "))
    assert row[header.index("health"):].split()[0] == "ok"
    tool = json.loads((HEALTH_CAPTURE / "gpu-health.json").read_text())
    assert tool["gpus"] == {H200_BUS: {"verdict": "ok", "reasons": []}}
    exits = dict(line.split() for line in (HEALTH_CAPTURE / "exit-codes.txt").read_text()
                 .splitlines())
    assert (exits["facts"], exits["audit"], exits["gpu_health"]) == ("0", "0", "0")
