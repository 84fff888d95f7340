"""GpuHostState: one remote command that gives what the single facts give."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from facts.gpu_host import END_MARKER, SECTION_MARKER, SECTIONS, GpuHostState, parse_gpu_host
from facts.nvidia_smi import SMI_EXIT_MARKER

CAPTURE = Path(__file__).parent.parent / "fixtures" / "nvidia" / "h200-device-20261129"
RAW = {
    "kernel_module": "proc-driver-nvidia-version.txt",
    "driver_packages": "dpkg-nvidia.txt",
    "cuda_toolkit": "nvcc-version.txt",
    "driver": "smi.txt",
    "nvml_error": "L.txt",
    "gpus": "query-gpu-csv-noheader-nounits.txt",
    "processes": "query-compute-apps.txt",
    "topology": "topo-m.txt",
    "nvlink": "nvlink-s.txt",
    # The health captures are of the same host, three days later.
    "gpu_health": "../h200-ubuntu2404-driver580/q.txt",
    "nvlink_errors": "../h200-ubuntu2404-driver580/nvlink-e.txt",
}
# dmesg-NVRM.txt holds no Xid line: the kernel log section is its source marker alone.
XID_SECTION = ["##SOURCE dmesg"]
SMI_SECTIONS = {name for name, (_fact, needs) in SECTIONS.items() if needs == "nvidia-smi"}


def output_of_the_h200() -> list[str]:
    """What the combined command printed, rebuilt from the real capture's raw outputs."""
    lines = []
    for name in SECTIONS:
        lines.append(SECTION_MARKER + name)
        lines += XID_SECTION if name == "xid" else (CAPTURE / RAW[name]).read_text().splitlines()
        if name in SMI_SECTIONS:
            lines.append(f"{SMI_EXIT_MARKER}0")
    return [*lines, END_MARKER]


def test_same_values_as_the_single_facts_on_the_real_h200():
    recorded = json.loads((CAPTURE / "pyinfra-facts.json").read_text())
    single = {
        "kernel_module": "facts.driver.KernelModule",
        "driver_packages": "facts.driver.DriverPackages",
        "held_packages": "facts.driver.HeldPackages",
        "cuda_toolkit": "facts.cuda.CudaToolkit",
        "driver": "facts.driver.DriverInfo",
        "nvml_error": "facts.driver.NvmlError",
        "gpus": "facts.gpus.GpuInventory",
        "processes": "facts.gpus.GpuProcesses",
        "topology": "facts.topology.GpuTopology",
        "nvlink": "facts.topology.NvlinkStatus",
    }
    state = json.loads(json.dumps(parse_gpu_host(output_of_the_h200())))
    assert set(state) == set(single) | {"gpu_health", "nvlink_errors", "xid"}
    # The health sections, against their facts on the same raw outputs.
    for key in ("gpu_health", "nvlink_errors"):
        raw = (CAPTURE / RAW[key]).read_text().splitlines()
        fact = SECTIONS[key][0]
        expected = fact().process([*raw, f"{SMI_EXIT_MARKER}0"])
        assert state[key] == json.loads(json.dumps(expected)), key
    assert state["gpu_health"]["00000000:00:06.0"]["ecc"]["volatile"] == {
        "correctable": 0, "uncorrectable": 0}
    assert state["nvlink_errors"] == {}  # nvlink -e printed nothing: NVLink not exposed
    assert state["xid"] == {"source": "dmesg", "events": []}
    for key, fact in single.items():
        # Recorded before facts/nvidia.py was split by what it reads: the capture names
        # the NVIDIA facts by their module of the time.
        module, _, name = fact.rpartition(".")
        recorded_as = fact if module == "facts.cuda" else f"facts.nvidia.{name}"
        assert state[key] == recorded[recorded_as]["@local"], key


def test_a_host_without_driver_nvcc_or_dpkg():
    # Sections whose binary is missing print nothing; /proc has no nvidia entry.
    lines = [SECTION_MARKER + name for name in SECTIONS] + [END_MARKER]
    assert parse_gpu_host(lines) == {
        "kernel_module": None,
        "driver_packages": {},
        "held_packages": [],
        "cuda_toolkit": None,
        "driver": None,
        "nvml_error": None,
        "gpus": None,
        "processes": None,
        "topology": None,
        "nvlink": None,
        "gpu_health": None,
        "nvlink_errors": None,
        "xid": None,
    }


def test_nvml_mismatch_is_read_in_every_section():
    error = [
        "Failed to initialize NVML: Driver/library version mismatch",
        "NVML library version: 535.129",
        f"{SMI_EXIT_MARKER}18",
    ]
    lines = []
    for name in SECTIONS:
        lines.append(SECTION_MARKER + name)
        if name in SMI_SECTIONS:
            lines += error
    state = parse_gpu_host(lines)
    assert state["nvml_error"] == {
        "error": "Failed to initialize NVML: Driver/library version mismatch",
        "nvml_library_version": "535.129",
    }
    assert state["gpus"] is None and state["topology"] is None and state["nvlink"] is None


def test_one_command_guards_each_nvidia_smi_section():
    command = GpuHostState().command()
    # Each section twice: side by side, and one after another where no temporary
    # directory can be made (facts.host_state.side_by_side).
    assert command.count("if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi ") == 16
    assert command.count(SECTION_MARKER) == 2 * len(SECTIONS)
    assert command.endswith(f"echo '{END_MARKER}'")


@pytest.mark.parametrize("tmpdir", [None, "/nonexistent/pyinfra-vllm"])
def test_the_command_on_a_host_without_a_driver_gives_every_section_absent(tmpdir):
    # This machine: no driver, no nvidia-smi. Side by side and one after another alike.
    env = dict(os.environ, **({"TMPDIR": tmpdir} if tmpdir else {}))
    done = subprocess.run(["sh", "-c", GpuHostState().command()], capture_output=True,
                          text=True, check=True, env=env)
    lines = done.stdout.splitlines()
    assert [line for line in lines if line.startswith(SECTION_MARKER)] == [
        f"{SECTION_MARKER}{name}" for name in SECTIONS]
    assert lines[-1] == END_MARKER
    state = GpuHostState().process(lines)
    assert state["kernel_module"] is None and state["driver"] is None
    assert state["gpus"] is None and state["nvlink"] is None
