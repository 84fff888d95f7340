"""Preflight and audit verdicts, one test per branch, on hand-built host states."""

from __future__ import annotations

from pyinfra_vllm.core.settings import validate
from pyinfra_vllm.plans.checks import arch_runs_on, blocking, check_host, version_tuple

UBUNTU_2204 = {"name": "Ubuntu", "major": 22, "minor": 4, "release_meta": {"PRETTY_NAME": "Ubuntu 22.04.4 LTS"}}


def a100(index: int, **extra) -> dict:
    gpu = {
        "index": index,
        "name": "NVIDIA A100 80GB PCIe",
        "uuid": f"GPU-{index:08d}-0000-0000-0000-000000000000",
        "pci_bus_id": f"00000000:{0x17 + index * 0x4E:02X}:00.0",
        "memory_total_mib": 81920,
        "mig_current": "Disabled",
        "mig_pending": "Disabled",
        "persistence_mode": "Enabled",
        "driver_version": "535.129.03",
    }
    gpu.update(extra)
    return gpu


def topology(code: str) -> dict:
    return {
        "gpus": ["GPU0", "GPU1"],
        "links": {"GPU0": {"GPU1": code}, "GPU1": {"GPU0": code}},
        "cpu_affinity": {"GPU0": "0-31", "GPU1": "0-31"},
        "numa_affinity": {"GPU0": "0", "GPU1": "0"},
        "gpu_numa_id": {"GPU0": None, "GPU1": None},
        "nics": [],
        "nic_links": {},
        "nic_legend": {},
    }


def seed_state(**changes) -> dict:
    state = {
        "os": UBUNTU_2204,
        "kernel": "5.15.0-91-generic",
        "kernel_module": {"version": "535.129.03", "open": False},
        "driver": {"driver_version": "535.129.03", "cuda_version": "12.2"},
        "driver_packages": {"nvidia-utils-535-server": "535.129.03-0ubuntu0.22.04.1"},
        "held_packages": [],
        "nvml_error": None,
        "gpus": [a100(0), a100(1)],
        "compute_caps": {"00000000:17:00.0": "8.0", "00000000:65:00.0": "8.0"},
        "processes": [],
        "topology": topology("NV12"),
        "nvlink": {0: [{"link": n, "active": True, "speed_gbps": 25.0} for n in range(12)]},
        "cuda_toolkit": None,
    }
    state.update(changes)
    return state


def names(checks):
    return {c["name"]: c for c in checks}


def test_the_seed_host_passes_every_check():
    checks = check_host(seed_state(), validate({"gateway_open": True}))
    assert [c["name"] for c in checks] == [
        "os", "driver_version", "driver_cuda", "gpu_count", "gpu_memory", "tp_nvlink", "gpu_arch",
        "gpu_health",
    ]
    assert all(c["ok"] is True for c in checks), checks
    assert names(checks)["tp_nvlink"]["detail"] == "GPU0 and GPU1 joined by NVLink (GPU0-GPU1 NV12)"
    assert blocking(checks) == []


def test_pcie_topology_stops_the_host_naming_code_and_setting():
    checks = check_host(seed_state(topology=topology("PHB")), validate({"gateway_open": True}))
    failed = blocking(checks)
    assert [c["name"] for c in failed] == ["tp_nvlink"]
    assert "GPU0-GPU1 PHB" in failed[0]["detail"]
    assert "allow_pcie_tensor_parallel=true" in failed[0]["fix"]


def test_pcie_topology_is_a_warning_when_accepted():
    checks = check_host(seed_state(topology=topology("PHB")), validate({"allow_pcie_tensor_parallel": True, "gateway_open": True}))
    link = names(checks)["tp_nvlink"]
    assert link["ok"] is False and link["severity"] == "warning"
    assert blocking(checks) == []


def test_too_few_gpus_for_tensor_parallel():
    checks = check_host(seed_state(gpus=[a100(0)]), validate({"gateway_open": True}))
    count = names(checks)["gpu_count"]
    assert count["ok"] is False
    assert count["detail"] == "1 GPU(s); tensor_parallel_size is 2"
    assert count["fix"] == "set tensor_parallel_size to at most 1"


def test_small_gpus_are_refused():
    small = [a100(0, name="NVIDIA A100-PCIE-40GB", memory_total_mib=40960), a100(1, memory_total_mib=40960)]
    check = names(check_host(seed_state(gpus=small), validate({"gateway_open": True})))["gpu_memory"]
    assert check["ok"] is False
    assert "smallest 40960 MiB, min_gpu_memory_mib is 80000" in check["detail"]


def test_an_h100_80gb_is_an_80_gb_card():
    """An H100 80GB HBM3 reports 81559 MiB (tests/fixtures/nvidia/q-1xH100-driver535-
    persistence-disabled-passthrough-01.txt, and a lent H100's nvidia-smi), less than an
    A100 80GB's 81920: accepted by default."""
    h100 = [a100(index, name="NVIDIA H100 80GB HBM3", memory_total_mib=81559)
            for index in (0, 1)]
    check = names(check_host(seed_state(gpus=h100), validate({"gateway_open": True})))["gpu_memory"]
    assert check["ok"] is True
    assert check["detail"] == ("NVIDIA H100 80GB HBM3; smallest 81559 MiB, "
                               "min_gpu_memory_mib is 80000")


def test_old_driver_is_refused_with_the_stack_minimum():
    state = seed_state(
        kernel_module={"version": "525.147.05", "open": False},
        driver={"driver_version": "525.147.05", "cuda_version": "12.0"},
        driver_packages={"nvidia-utils-525-server": "525.147.05-0ubuntu0.22.04.1"},
    )
    checks = names(check_host(state, validate({"gateway_open": True})))
    assert checks["driver_version"]["ok"] is False
    # The runtime is the lock's nvidia-cuda-runtime-cu12 (locks/stacks/vllm-0.6.3.txt).
    assert checks["driver_version"]["detail"] == (
        "driver 525.147.05; the vLLM 0.6.3 stack's CUDA runtime 12.1.105 (CUDA 12.1 Update 1, "
        "from its lock) needs >= 530.30.02")
    assert checks["driver_version"]["fix"] == (
        "install driver branch 530 or newer (nvidia_driver_branch)")
    assert checks["driver_cuda"]["ok"] is False


def test_the_example_fleet_s_stack_on_a_535_driver_names_both_and_branch_570():
    checks = names(check_host(seed_state(), validate({
        "gateway_open": True, "vllm_version": "0.17.0", "nvidia_driver_branch": "570-server"})))
    assert checks["driver_version"]["ok"] is False
    assert checks["driver_version"]["detail"] == (
        "driver 535.129.03; the vLLM 0.17.0 stack's CUDA runtime 12.8.90 (CUDA 12.8 Update 1, "
        "from its lock) needs >= 570.124.06")
    assert checks["driver_version"]["fix"].startswith("install driver branch 570 or newer")


def test_a_gpu_the_stack_s_torch_has_no_code_for_is_refused():
    # torch 2.10.0 (CUDA 12.8) carries sm_70 and newer; a Pascal P100 is compute 6.0.
    caps = {"00000000:17:00.0": "6.0", "00000000:65:00.0": "8.0"}
    checks = check_host(seed_state(compute_caps=caps), validate({
        "gateway_open": True, "vllm_version": "0.17.0", "nvidia_driver_branch": "570-server"}))
    arch = names(checks)["gpu_arch"]
    assert (arch["ok"], arch["severity"]) == (False, "error")
    assert arch["detail"] == (
        "GPU 0 (NVIDIA A100 80GB PCIe) has compute capability 6.0; the vLLM 0.17.0 stack's "
        "torch 2.10.0 carries code for sm_70 sm_75 sm_80 sm_86 sm_90 sm_100 sm_120 only")
    assert arch in blocking(checks)


def test_the_same_gpu_on_the_design_s_stack_passes():
    # torch 2.4.0 (CUDA 12.1) still carries sm_50 and sm_60.
    caps = {"00000000:17:00.0": "6.0", "00000000:65:00.0": "6.0"}
    arch = names(check_host(seed_state(compute_caps=caps), validate({"gateway_open": True})))
    assert arch["gpu_arch"]["ok"] is True
    assert arch["gpu_arch"]["detail"].startswith("compute capability 6.0; the vLLM 0.6.3 stack's")


def test_a_driver_without_the_compute_cap_field_is_not_judged():
    arch = names(check_host(seed_state(compute_caps=None), validate({"gateway_open": True})))
    assert (arch["gpu_arch"]["ok"], arch["gpu_arch"]["severity"]) == (None, "warning")


def test_architectures_run_as_cuda_s_compatibility_rules_say():
    assert arch_runs_on("sm_80", "8.6") and arch_runs_on("sm_70", "7.5")
    assert not arch_runs_on("sm_86", "8.0") and not arch_runs_on("sm_90", "10.0")
    assert arch_runs_on("sm_90a", "9.0") and not arch_runs_on("sm_90a", "9.1")
    assert arch_runs_on("compute_90", "12.0") and not arch_runs_on("compute_90", "8.9")
    assert arch_runs_on("sm_100", "10.3") and arch_runs_on("sm_120", "12.0")
    assert not arch_runs_on("gfx90a", "9.0")


def test_no_driver_is_not_a_failure_of_preflight():
    state = seed_state(kernel_module=None, driver=None, driver_packages={}, gpus=None, topology=None, nvlink=None)
    checks = check_host(state, validate({"gateway_open": True}))
    driver = names(checks)["driver_present"]
    assert driver["ok"] is None and driver["detail"] == "no NVIDIA driver"
    assert "nvidia-headless-535-server" in driver["fix"]
    assert blocking(checks) == []


def test_module_package_mismatch_means_reboot():
    state = seed_state(
        kernel_module={"version": "535.104.05", "open": False},
        driver=None,
        gpus=None,
        topology=None,
        nvml_error={"error": "Failed to initialize NVML: Driver/library version mismatch", "nvml_library_version": "535.129"},
    )
    failed = blocking(check_host(state, validate({"gateway_open": True})))
    assert failed[0]["name"] == "driver_module_match"
    assert "535.104.05" in failed[0]["detail"] and "535.129.03" in failed[0]["detail"]
    assert failed[0]["fix"].startswith("reboot the host")


def test_unsupported_os():
    state = seed_state(os={"name": "CentOS", "major": 7, "minor": 9, "release_meta": {"PRETTY_NAME": "CentOS Linux 7"}})
    check = names(check_host(state, validate({"gateway_open": True})))["os"]
    assert check == {
        "name": "os", "ok": False, "severity": "error",
        "detail": "CentOS Linux 7 is not supported",
        "fix": "use Ubuntu 22.04, Ubuntu 24.04 or Debian 12",
    }


def test_tensor_parallel_one_skips_the_link_check():
    checks = check_host(seed_state(gpus=[a100(0)]), validate({"tensor_parallel_size": 1, "gateway_open": True}))
    assert "tp_nvlink" not in names(checks)
    assert blocking(checks) == []


def test_version_tuple():
    assert version_tuple("535.129.03") == (535, 129, 3)
    assert version_tuple("570.26") > version_tuple("530.30.02")
    assert version_tuple("13.0") >= version_tuple("12.1")
    assert version_tuple(None) == ()


def test_installed_but_not_loaded_is_left_to_the_driver_stage():
    state = seed_state(
        kernel_module=None,
        driver=None,
        gpus=None,
        topology=None,
        nvlink=None,
        nvml_error={
            "error": "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
            "driver. Make sure that the latest NVIDIA driver is installed and running.",
            "nvml_library_version": None,
        },
    )
    checks = check_host(state, validate({"gateway_open": True}))
    loaded = names(checks)["driver_loaded"]
    assert loaded["ok"] is None
    assert loaded["detail"] == (
        "nvidia-utils-535-server 535.129.03 is installed but no NVIDIA kernel module is "
        "loaded: reboot required"
    )
    assert blocking(checks) == []


XID_79 = {"source": "journal", "events": [{
    "time": "2026-12-02T02:42:57+0000", "pci": "0000:17:00", "code": 79, "pid": None,
    "process": None, "text": "GPU has fallen off the bus."}]}


def test_a_failing_gpu_the_engine_uses_stops_the_host_with_the_action():
    checks = names(check_host(seed_state(xid=XID_79), validate({"gateway_open": True})))
    health = checks["gpu_health"]
    assert health["ok"] is False and health["severity"] == "error"
    assert health["detail"].startswith("GPU0 00000000:17:00.0: ")
    assert "79" in health["detail"] and health["fix"]
    assert [c["name"] for c in blocking(list(checks.values()))] == ["gpu_health"]


def test_a_failing_gpu_is_a_warning_when_allowed():
    settings = validate({"gateway_open": True, "allow_failing_gpus": True})
    health = names(check_host(seed_state(xid=XID_79), settings))["gpu_health"]
    assert (health["ok"], health["severity"]) == (False, "warning")


def test_a_failing_gpu_the_engine_does_not_use_is_a_warning():
    # Three GPUs, the first two joined by NVLink: the engine runs on GPU0 and GPU1.
    third = a100(2, pci_bus_id="00000000:B3:00.0")
    links = {"GPU0": {"GPU1": "NV12", "GPU2": "SYS"}, "GPU1": {"GPU0": "NV12", "GPU2": "SYS"},
             "GPU2": {"GPU0": "SYS", "GPU1": "SYS"}}
    xid = {"source": "dmesg", "events": [dict(XID_79["events"][0], pci="0000:b3:00")]}
    state = seed_state(gpus=[a100(0), a100(1), third], xid=xid,
                       topology=dict(topology("NV12"), gpus=["GPU0", "GPU1", "GPU2"],
                                     links=links))
    checks = names(check_host(state, validate({"gateway_open": True})))
    assert checks["gpu_health"]["ok"] is True
    assert checks["gpu_health_degraded"]["severity"] == "warning"
    assert checks["gpu_health_degraded"]["detail"].startswith("GPU2 00000000:B3:00.0: ")


def test_no_gpu_data_no_health_check():
    checks = check_host(seed_state(gpus=None, gpu_health=None), validate({"gateway_open": True}))
    assert "gpu_health" not in names(checks)
