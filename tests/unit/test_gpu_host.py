"""GpuHostState: one remote command that gives what the single facts give."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from pyinfra.api.exceptions import FactProcessError

from facts.gpu_host import NONCE, GpuHostState
from facts.host_state import MISSING_COMMAND, SECTION, STATUS
from facts.nvidia_smi import SMI_EXIT_MARKER, NvidiaSmiFact

CAPTURE = Path(__file__).parent.parent / "fixtures" / "nvidia" / "h200-device-20261129"
RAW = {
    "kernel_module": "proc-driver-nvidia-version.txt",
    "driver_packages": "dpkg-nvidia.txt",
    "cuda_toolkit": "nvcc-version.txt",
    "driver": "smi.txt",
    "nvml_error": "L.txt",
    "gpus": "query-gpu-csv-noheader-nounits.txt",
    # Captured the next day, on the same host.
    "compute_caps": "../h200-device-20261203/query-gpu-bus-id-compute-cap.txt",
    "processes": "query-compute-apps.txt",
    "topology": "topo-m.txt",
    "nvlink": "nvlink-s.txt",
    # The health captures are of the same host, three days later.
    "gpu_health": "../h200-ubuntu2404-driver580/q.txt",
    "nvlink_errors": "../h200-ubuntu2404-driver580/nvlink-e.txt",
}
# dmesg-NVRM.txt holds no Xid line: the kernel log section is its source marker alone.
XID_SECTION = ["##SOURCE dmesg"]
FACTS = GpuHostState.facts
SMI_SECTIONS = {name for name, fact in FACTS.items() if issubclass(fact, NvidiaSmiFact)}
# held_packages parses the driver_packages section: the same dpkg-query, run once.
SECTIONS = [name for name in FACTS if name != "held_packages"]


def combined_output(outputs: dict[str, list[str]]) -> list[str]:
    """What GpuHostState's command prints for these outputs of its facts' commands
    (facts.host_state.sections_command: each section behind its marker, in order, with
    its exit status after it)."""
    by_position = {position: name
                   for name, position in zip(FACTS, GpuHostState.arranged()[1], strict=True)
                   if name in SECTIONS}
    lines = []
    for position in sorted(by_position):
        name = by_position[position]
        lines += [f"{SECTION}-{NONCE} {position}", *outputs.get(name, []),
                  f"{STATUS}-{NONCE} 0"]
    return lines


def output_of_the_h200() -> list[str]:
    """What the combined command printed, rebuilt from the real capture's raw outputs."""
    outputs = {}
    for name in SECTIONS:
        lines = XID_SECTION if name == "xid" else (CAPTURE / RAW[name]).read_text().splitlines()
        outputs[name] = [*lines, f"{SMI_EXIT_MARKER}0"] if name in SMI_SECTIONS else lines
    return combined_output(outputs)


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
    state = json.loads(json.dumps(GpuHostState().process(output_of_the_h200())))
    assert set(state) == set(single) | {"gpu_health", "nvlink_errors", "xid", "compute_caps"}
    assert state["compute_caps"] == {"00000000:00:06.0": "9.0"}  # the next day's capture
    # The health sections, against their facts on the same raw outputs.
    for key in ("gpu_health", "nvlink_errors"):
        raw = (CAPTURE / RAW[key]).read_text().splitlines()
        fact = FACTS[key]
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
    # Sections whose binary is missing print pyinfra's missing-command line; /proc has no
    # nvidia entry, and nvcc and the kernel log print nothing.
    missing = {name: [MISSING_COMMAND] for name in SECTIONS
               if FACTS[name]().requires_command()}
    assert set(missing) == SMI_SECTIONS | {"driver_packages"}
    assert GpuHostState().process(combined_output(missing)) == {
        "kernel_module": None,
        "driver_packages": {},
        "held_packages": [],
        "cuda_toolkit": None,
        "driver": None,
        "nvml_error": None,
        "gpus": None,
        "compute_caps": None,
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
    state = GpuHostState().process(combined_output({name: error for name in SMI_SECTIONS}))
    assert state["nvml_error"] == {
        "error": "Failed to initialize NVML: Driver/library version mismatch",
        "nvml_library_version": "535.129",
    }
    assert state["gpus"] is None and state["topology"] is None and state["nvlink"] is None
    assert state["compute_caps"] is None


def test_one_command_guards_each_nvidia_smi_section():
    command = GpuHostState().command()
    # Each section twice: side by side, and one after another where no temporary
    # directory can be made (facts.host_state.side_by_side).
    assert command.count("if command -v nvidia-smi >/dev/null 2>&1; then ( nvidia-smi ") == 18
    assert command.count(f"echo '{SECTION}-{NONCE} ") == 2 * len(SECTIONS)
    assert command.count("dpkg-query -W") == 2  # DriverPackages and HeldPackages: one call
    assert command.endswith("; true")


@pytest.mark.parametrize("tmpdir", [None, "/nonexistent/pyinfra-vllm"])
def test_the_command_on_a_host_without_a_driver_gives_every_section_absent(tmpdir):
    # This machine: no driver, no nvidia-smi. Side by side and one after another alike.
    env = dict(os.environ, **({"TMPDIR": tmpdir} if tmpdir else {}))
    done = subprocess.run(["sh", "-c", GpuHostState().command()], capture_output=True,
                          text=True, check=True, env=env)
    lines = done.stdout.splitlines()
    assert [line for line in lines if line.startswith(SECTION)] == [
        f"{SECTION}-{NONCE} {position}" for position in range(len(SECTIONS))]
    assert lines[-1].startswith(f"{STATUS}-{NONCE} ")
    state = GpuHostState().process(lines)
    assert state["kernel_module"] is None and state["driver"] is None
    assert state["gpus"] is None and state["nvlink"] is None


# nvlink --status with a link speed no parser can read (two writes run together): the
# one output of an nvidia-smi fact on which its parser raises.
GARBLED_NVLINK = ["GPU 0: NVIDIA A100 80GB PCIe (UUID: GPU-0)", "\t Link 0: 25.25.0 GB/s",
                  f"{SMI_EXIT_MARKER}0"]


def test_a_section_its_fact_cannot_parse_fails_the_whole_fact_as_pyinfra_expects():
    with pytest.raises(FactProcessError) as raised:
        FACTS["nvlink"]().process(GARBLED_NVLINK)
    assert isinstance(raised.value.__cause__, ValueError)  # what pyinfra prints
    with pytest.raises(FactProcessError) as combined:
        GpuHostState().process(combined_output({"nvlink": GARBLED_NVLINK}))
    assert str(combined.value).startswith("facts.topology.NvlinkStatus could not parse")
