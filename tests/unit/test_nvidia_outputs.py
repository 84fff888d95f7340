"""The NVIDIA/CUDA parsers on every recorded output in tests/fixtures/nvidia, with exact values.

One test per fixture file (``test_every_fixture_file_has_a_test`` keeps it so), then the
layouts no fixture shows (NICs with GPU NUMA ID, NV4 pairs, ANSI codes elsewhere, CRLF),
the pure verdict functions, and the facts run for real through ``pyinfra @local`` against
a fake nvidia-smi and against a host without one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.facts.server import LinuxDistribution

from facts.cuda import CudaToolkit, parse_nvcc_version
from facts.driver import (
    DriverInfo,
    DriverPackages,
    HeldPackages,
    KernelModule,
    NvmlError,
    module_mismatch,
    parse_dpkg_packages,
    parse_driver_info,
    parse_held_dpkg,
    parse_kernel_module,
    parse_nvml_error,
    upstream_version,
    userspace_driver,
)
from facts.gpus import (
    GpuInventory,
    GpuProcesses,
    parse_gpu_inventory,
    parse_gpu_processes,
    parse_query_csv,
    split_unit,
)
from facts.nvidia_smi import SMI_EXIT_MARKER, nvml_failure
from facts.topology import (
    GpuTopology,
    NvlinkStatus,
    P2pRead,
    parse_nvlink_status,
    parse_p2p,
    parse_topology,
)
from pyinfra_vllm.plans.topology import nvlink_joined, tp_link_verdict

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "nvidia"
H200 = "h200-ubuntu2404-driver580/"


def lines(name: str) -> list[str]:
    return (FIXTURES / name).read_text(encoding="utf-8").splitlines()


def smi(name: str, status: int = 0) -> list[str]:
    """The fixture as the fact's command delivers it: output plus the exit marker."""
    return lines(name) + [f"{SMI_EXIT_MARKER}{status}"]


def pairs(topology: dict) -> dict[str, str]:
    return {
        f"{a}-{b}": code for a, row in topology["links"].items() for b, code in row.items() if a < b
    }


# topo -m
#


def test_topo_4xa100_pcie_nv12_bridged_pairs():
    topo = parse_topology(smi("topo-4xA100-pcie-80gb-NV12-bridged-pairs-01.txt"))
    assert topo["gpus"] == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert topo["links"]["GPU0"] == {"GPU1": "NV12", "GPU2": "SYS", "GPU3": "SYS"}
    assert topo["links"]["GPU2"]["GPU3"] == "NV12"
    assert topo["links"]["GPU3"]["GPU1"] == "SYS"
    assert topo["cpu_affinity"] == {
        "GPU0": "0-51,104-155",
        "GPU1": "0-51,104-155",
        "GPU2": "52-103,156-207",
        "GPU3": "52-103,156-207",
    }
    assert topo["numa_affinity"] == {"GPU0": "0", "GPU1": "0", "GPU2": "1", "GPU3": "1"}
    # the extra empty cell before N/A must not shift N/A into another column
    assert topo["gpu_numa_id"] == {"GPU0": None, "GPU1": None, "GPU2": None, "GPU3": None}
    assert (topo["nics"], topo["nic_links"], topo["nic_legend"]) == ([], {}, {})
    assert tp_link_verdict(topo, 2) == {
        "gpus": ["GPU0", "GPU1"],
        "indices": [0, 1],
        "codes": {"GPU0-GPU1": "NV12"},
        "nvlink": True,
    }
    assert nvlink_joined(topo, ["GPU2", "GPU3"]) is True
    assert nvlink_joined(topo, ["GPU1", "GPU2"]) is False
    verdict = tp_link_verdict(topo, 4)
    assert verdict["nvlink"] is False and verdict["gpus"] == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert verdict["codes"]["GPU0-GPU2"] == "SYS"


def test_topo_2xa100_pcie_node_no_nvlink():
    topo = parse_topology(lines("topo-2xA100-pcie-40gb-NODE-no-nvlink-01.txt"))
    assert topo["links"] == {"GPU0": {"GPU1": "NODE"}, "GPU1": {"GPU0": "NODE"}}
    assert topo["cpu_affinity"] == {"GPU0": "28-55,84-111", "GPU1": "28-55,84-111"}
    assert topo["numa_affinity"] == {"GPU0": "1", "GPU1": "1"}
    assert topo["gpu_numa_id"] == {"GPU0": None, "GPU1": None}
    assert tp_link_verdict(topo, 2) == {
        "gpus": ["GPU0", "GPU1"],
        "indices": [0, 1],
        "codes": {"GPU0-GPU1": "NODE"},
        "nvlink": False,
    }


def test_topo_8xa100_dgx_10_nics_with_legend():
    topo = parse_topology(smi("topo-8xA100-sxm4-40gb-dgx-10nic-nps4-01.txt"))
    assert topo["gpus"] == [f"GPU{i}" for i in range(8)]
    assert topo["nics"] == [f"NIC{i}" for i in range(10)]
    assert set(pairs(topo).values()) == {"NV12"} and len(pairs(topo)) == 28
    assert topo["numa_affinity"] == {
        "GPU0": "3", "GPU1": "3", "GPU2": "1", "GPU3": "1",
        "GPU4": "7", "GPU5": "7", "GPU6": "5", "GPU7": "5",
    }  # fmt: skip
    assert topo["cpu_affinity"]["GPU4"] == "112-127,240-255"
    assert topo["gpu_numa_id"]["GPU7"] is None  # no GPU NUMA ID column (driver 525)
    assert topo["nic_legend"] == {f"NIC{i}": f"mlx5_{i}" for i in range(10)}
    assert topo["nic_links"]["NIC0"]["GPU0"] == "PXB"
    assert topo["nic_links"]["NIC0"]["GPU2"] == "SYS"
    assert topo["nic_links"]["NIC0"]["NIC1"] == "PXB"
    assert topo["nic_links"]["NIC8"]["NIC9"] == "PIX"
    assert "NIC9" not in topo["nic_links"]["NIC9"]
    assert len(topo["nic_links"]["NIC5"]) == 17
    assert tp_link_verdict(topo, 8)["nvlink"] is True


def test_topo_8xh100_ansi_underlined_header_nv18():
    raw = lines("topo-8xH100-gcp-a3-NV18-noNIC-01.txt")
    assert "\x1b[4m" in raw[0] and "\x1b[0m" in raw[0]
    topo = parse_topology(raw)
    assert topo["gpus"] == [f"GPU{i}" for i in range(8)]
    assert set(pairs(topo).values()) == {"NV18"}
    assert topo["cpu_affinity"]["GPU0"] == "0-51,104-155"
    assert topo["cpu_affinity"]["GPU7"] == "52-103,156-207"
    assert topo["numa_affinity"]["GPU3"] == "0" and topo["numa_affinity"]["GPU4"] == "1"
    assert set(topo["gpu_numa_id"].values()) == {None}
    assert topo["nics"] == [] and topo["nic_legend"] == {}
    assert tp_link_verdict(topo, 4)["indices"] == [0, 1, 2, 3]


def test_topo_1xh100_pod_single_gpu_matrix():
    topo = parse_topology(lines("topo-1xH100-k8s-pod-single-gpu-01.txt"))
    assert topo["gpus"] == ["GPU0"]
    assert topo["links"] == {"GPU0": {}}
    assert topo["cpu_affinity"] == {"GPU0": "0-51,104-155"}
    assert topo["numa_affinity"] == {"GPU0": "0"}
    assert topo["gpu_numa_id"] == {"GPU0": None}
    assert tp_link_verdict(topo, 2) == {"gpus": [], "indices": [], "codes": {}, "nvlink": False}
    assert tp_link_verdict(topo, 1) == {
        "gpus": ["GPU0"],
        "indices": [0],
        "codes": {},
        "nvlink": False,
    }


def test_topo_6gpu_mlx5_columns_cpu_affinity_only():
    topo = parse_topology(lines("topo-6gpu-2mlx5-olddriver-cpuaffinity-only-01.txt"))
    assert topo["gpus"] == [f"GPU{i}" for i in range(6)]
    assert topo["nics"] == ["mlx5_1", "mlx5_0"]
    assert topo["links"]["GPU0"] == {
        "GPU1": "PIX", "GPU2": "NODE", "GPU3": "SYS", "GPU4": "SYS", "GPU5": "SYS",
    }  # fmt: skip
    assert topo["links"]["GPU5"]["GPU3"] == "NODE"
    assert topo["cpu_affinity"]["GPU2"] == "0-13,28-41"
    assert topo["cpu_affinity"]["GPU3"] == "14-27,42-55"
    assert set(topo["numa_affinity"].values()) == {None}  # column absent
    assert set(topo["gpu_numa_id"].values()) == {None}
    assert topo["nic_links"]["mlx5_1"] == {
        "GPU0": "SYS", "GPU1": "SYS", "GPU2": "SYS", "GPU3": "NODE", "GPU4": "NODE",
        "GPU5": "PIX", "mlx5_0": "SYS",
    }  # fmt: skip
    assert topo["nic_links"]["mlx5_0"]["GPU2"] == "PIX"
    assert topo["nic_legend"] == {}
    assert tp_link_verdict(topo, 2) == {
        "gpus": ["GPU0", "GPU1"],
        "indices": [0, 1],
        "codes": {"GPU0-GPU1": "PIX"},
        "nvlink": False,
    }


def test_topo_2gpu_nv2_spaces_aligned_numa_na():
    topo = parse_topology(lines("topo-2gpu-NV2-consumer-numa-NA-spaces-01.txt"))
    assert "\t" not in "".join(lines("topo-2gpu-NV2-consumer-numa-NA-spaces-01.txt"))
    assert topo["links"] == {"GPU0": {"GPU1": "NV2"}, "GPU1": {"GPU0": "NV2"}}
    assert topo["cpu_affinity"] == {"GPU0": "0-23", "GPU1": "0-23"}
    assert topo["numa_affinity"] == {"GPU0": None, "GPU1": None}
    assert tp_link_verdict(topo, 2)["codes"] == {"GPU0-GPU1": "NV2"}
    assert tp_link_verdict(topo, 2)["nvlink"] is True


def test_topo_h200_single_gpu_empty_cell_before_na():
    topo = parse_topology(smi(H200 + "topo-m.txt"))
    assert topo == {
        "gpus": ["GPU0"],
        "links": {"GPU0": {}},
        "cpu_affinity": {"GPU0": "0-15"},
        "numa_affinity": {"GPU0": "0"},
        "gpu_numa_id": {"GPU0": None},
        "nics": [],
        "nic_links": {},
        "nic_legend": {},
    }


def test_topo_p2p_read_h200():
    raw = lines(H200 + "topo-p2p-r.txt")
    assert parse_p2p(raw) == {"GPU0": {}}
    assert P2pRead().process(raw + [f"{SMI_EXIT_MARKER}0"]) == {"GPU0": {}}


# nvlink --status
#


def test_nvlink_v100_inactive_links():
    assert parse_nvlink_status(smi("nvlink-s-V100-sxm2-inactive-links-excerpt-01.txt")) == {
        3: [
            {"link": 0, "active": True, "speed_gbps": 25.781},
            {"link": 1, "active": True, "speed_gbps": 25.781},
            {"link": 2, "active": True, "speed_gbps": 25.781},
            {"link": 3, "active": False, "speed_gbps": None},
            {"link": 4, "active": True, "speed_gbps": 25.781},
            {"link": 5, "active": False, "speed_gbps": None},
        ]
    }


def test_nvlink_h100_18_links_tab_space_indent():
    status = parse_nvlink_status(lines("nvlink-s-H100-gcp-a3-gpu0-18links-tabs-01.txt"))
    assert list(status) == [0]
    assert [link["link"] for link in status[0]] == list(range(18))
    assert {(link["active"], link["speed_gbps"]) for link in status[0]} == {(True, 26.562)}


def test_nvlink_2xa100_pcie_all_links_inactive():
    raw = smi("nvlink-s-2xA100-pcie-40gb-all-links-inactive-01.txt")
    assert parse_nvlink_status(raw) == {0: [], 1: []}


def test_nvlink_h200_not_exposed_prints_nothing():
    assert lines(H200 + "nvlink-s.txt") == []
    assert parse_nvlink_status(smi(H200 + "nvlink-s.txt")) == {}
    assert NvlinkStatus().process([]) == {}


# --query-gpu CSV
#


def test_query_csv_8xh200_header_units():
    rows = parse_query_csv(lines("querygpu-csv-8xH200-index-name-mem-driver-power-pstate-01.txt"))
    assert len(rows) == 8
    assert rows[7] == {
        "index": "7",
        "name": "NVIDIA H200",
        "memory.total": "143771",
        "driver_version": "570.211.01",
        "power.limit": "700.00",
        "pstate": "P0",
    }
    assert split_unit("memory.total [MiB]") == ("memory.total", "MiB")
    assert split_unit("pstate") == ("pstate", None)


def test_query_csv_h100_pci_bus_id_mig_enabled():
    rows = parse_query_csv(lines("querygpu-csv-H100-pci-bus-id-mig-mode-current-enabled-01.txt"))
    assert rows == [{"pci.bus_id": "00000000:01:00.0", "mig.mode.current": "Enabled"}]


def test_query_csv_h200_full_header():
    rows = parse_query_csv(lines(H200 + "query-gpu-csv.txt"))
    assert rows == [
        {
            "index": "0",
            "name": "NVIDIA H200",
            "uuid": "GPU-f70fc72c-8ec5-a53a-cda1-f039fcfe7fab",
            "pci.bus_id": "00000000:00:06.0",
            "memory.total": "143771",
            "mig.mode.current": "Disabled",
            "mig.mode.pending": "Disabled",
            "persistence_mode": "Enabled",
            "driver_version": "580.159.04",
            "temperature.gpu": "43",
            "power.limit": "700.00",
            "clocks.max.sm": "1980",
            "ecc.mode.current": "Enabled",
        }
    ]


def test_query_csv_h200_noheader_nounits():
    fields = [
        "index", "name", "uuid", "memory.total", "mig.mode.current", "persistence_mode",
        "driver_version",
    ]  # fmt: skip
    rows = parse_query_csv(lines(H200 + "query-gpu-csv-noheader-nounits.txt"), fields)
    assert rows == [
        {
            "index": "0",
            "name": "NVIDIA H200",
            "uuid": "GPU-f70fc72c-8ec5-a53a-cda1-f039fcfe7fab",
            "memory.total": "143771",
            "mig.mode.current": "Disabled",
            "persistence_mode": "Enabled",
            "driver_version": "580.159.04",
        }
    ]


def test_query_csv_na_spellings_are_none():
    rows = parse_query_csv(
        ["name, mig.mode.current, power.draw [W], ecc", "A100, [N/A], [Not Supported], N/A"]
    )
    assert rows == [{"name": "A100", "mig.mode.current": None, "power.draw": None, "ecc": None}]


def test_gpu_inventory_types():
    gpus = parse_gpu_inventory(
        [
            "0, NVIDIA A100 80GB PCIe, GPU-a, 00000000:17:00.0, 81920, Enabled, Disabled, "
            "Enabled, 535.129.03",
            "1, NVIDIA A100 80GB PCIe, GPU-b, 00000000:65:00.0, 81920, [N/A], N/A, Disabled, "
            "535.129.03",
            f"{SMI_EXIT_MARKER}0",
        ]
    )
    assert gpus[0] == {
        "index": 0,
        "name": "NVIDIA A100 80GB PCIe",
        "uuid": "GPU-a",
        "pci_bus_id": "00000000:17:00.0",
        "memory_total_mib": 81920,
        "mig_current": "Enabled",
        "mig_pending": "Disabled",
        "persistence_mode": "Enabled",
        "driver_version": "535.129.03",
    }
    assert (gpus[1]["mig_current"], gpus[1]["mig_pending"]) == (None, None)
    assert gpus[1]["persistence_mode"] == "Disabled"


# nvidia-smi table, -q, -L, errors
#


def test_smi_4xa100_driver555_table():
    raw = smi("smi-4xA100-sxm4-80gb-driver555-01.txt")
    assert parse_driver_info(raw) == {"driver_version": "555.42.02", "cuda_version": "12.5"}
    assert parse_nvml_error(raw) is None


def test_smi_2xb200_r610_kmd_umd_header_partial():
    raw = lines("smi-2xB200-driver610-KMD-UMD-header-partial-01.txt")
    assert parse_driver_info(raw) == {"driver_version": "610.43.02", "cuda_version": "13.3"}


def test_smi_h200_driver580_table():
    assert DriverInfo().process(smi(H200 + "smi.txt")) == {
        "driver_version": "580.159.04",
        "cuda_version": "13.0",
    }


def test_q_1xh100_driver535():
    raw = lines("q-1xH100-driver535-persistence-disabled-passthrough-01.txt")
    assert parse_driver_info(raw) == {"driver_version": "535.309.01", "cuda_version": "12.2"}
    assert nvml_failure(raw) is None


def test_q_h200_driver580():
    raw = lines(H200 + "q.txt")
    assert parse_driver_info(raw) == {"driver_version": "580.159.04", "cuda_version": "13.0"}


def test_smi_error_driver_library_version_mismatch():
    raw = smi("smi-error-driver-library-version-mismatch-01.txt", 18)
    assert parse_nvml_error(raw) == {
        "error": "Failed to initialize NVML: Driver/library version mismatch",
        "nvml_library_version": "580.178",
    }
    # without the exit marker (raw recording) the message alone is enough
    assert parse_nvml_error(raw[:-1])["nvml_library_version"] == "580.178"
    for parse in (parse_topology, parse_nvlink_status, parse_gpu_inventory, parse_driver_info):
        assert parse(raw) is None, parse
    assert parse_gpu_processes(raw) is None
    assert parse_p2p(raw) is None
    # the module the same report shows (proc-driver-nvidia-version-proprietary-580.173.02)
    module = parse_kernel_module(lines("proc-driver-nvidia-version-proprietary-580.173.02-01.txt"))
    assert module_mismatch(module, {}, parse_nvml_error(raw)) == (
        "loaded kernel module 580.173.02 but the NVML library is 580.178: reboot required"
    )


def test_smi_mig_enable_output_is_not_an_error():
    raw = lines("smi-mig-enable-output-A100-aws-01.txt")
    assert nvml_failure(raw) is None
    assert parse_nvml_error(raw + [f"{SMI_EXIT_MARKER}0"]) is None


def test_l_h200_lists_one_gpu_without_error():
    assert NvmlError().process(smi(H200 + "L.txt")) is None


def test_mig_lgi_h200_no_mig_devices_is_not_an_nvml_failure():
    raw = lines(H200 + "mig-lgi.txt")
    assert raw == ["No MIG-enabled devices found."]
    assert nvml_failure(raw) is None


def test_no_driver_message():
    raw = [
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make "
        "sure that the latest NVIDIA driver is installed and running.",
        "",
        f"{SMI_EXIT_MARKER}9",
    ]
    assert parse_nvml_error(raw)["error"].startswith("NVIDIA-SMI has failed")
    assert parse_topology(raw) is None
    assert parse_nvlink_status(raw) is None
    assert parse_gpu_inventory(raw) is None
    assert parse_driver_info(raw) is None


# /proc/driver/nvidia/version, nvcc, os-release
#


def test_proc_version_open_565():
    module = KernelModule().process(
        lines("proc-driver-nvidia-version-open-565.57.01-ubuntu2404-01.txt")
    )
    assert module == {"version": "565.57.01", "open": True}


def test_proc_version_proprietary_580():
    module = parse_kernel_module(lines("proc-driver-nvidia-version-proprietary-580.173.02-01.txt"))
    assert module == {"version": "580.173.02", "open": False}


def test_proc_version_h200_open_580_trailing_spaces():
    module = parse_kernel_module(lines(H200 + "proc-driver-nvidia-version.txt"))
    assert module == {"version": "580.159.04", "open": True}
    packages = {"nvidia-utils-580-server": "580.159.04-0ubuntu0.24.04.1"}
    assert module_mismatch(module, packages, None) is None


def test_nvcc_cuda_12_6():
    assert parse_nvcc_version(lines("nvcc-version-cuda-12.6-01.txt")) == {
        "release": "12.6",
        "version": "12.6.77",
    }


def test_nvcc_cuda_11_1_old_build_line():
    assert CudaToolkit().process(lines("nvcc-version-cuda-11.1-01.txt")) == {
        "release": "11.1",
        "version": "11.1.105",
    }


def test_nvcc_cuda_10_1_no_build_line():
    assert parse_nvcc_version(lines("nvcc-version-cuda-10.1-no-build-line-01.txt")) == {
        "release": "10.1",
        "version": "10.1.243",
    }


def test_nvcc_h200_cuda_13_0():
    assert parse_nvcc_version(lines(H200 + "nvcc-version.txt")) == {
        "release": "13.0",
        "version": "13.0.88",
    }


def test_os_release_h200_through_pyinfra():
    output = ["/etc/os-release", *lines(H200 + "os-release.txt"), "---"]
    distro = LinuxDistribution().process(output)
    assert (distro["name"], distro["major"], distro["minor"]) == ("Ubuntu", 24, 4)
    assert distro["release_meta"]["VERSION_CODENAME"] == "noble"


def test_every_fixture_file_has_a_test():
    # The GPU-health outputs have their own test module, test_gpu_health.py.
    source = "".join(Path(__file__).with_name(name).read_text(encoding="utf-8")
                     for name in ("test_nvidia_outputs.py", "test_gpu_health.py"))
    # The device capture has its own test module, test_real_gpu_host.py.
    names = [
        str(path.relative_to(FIXTURES))
        for path in sorted(FIXTURES.rglob("*.txt"))
        if not path.parent.name.startswith("h200-device-")
    ]
    assert len(names) == 77
    missing = [
        name
        for name in names
        if f'"{name}"' not in source and f'H200 + "{name.removeprefix(H200)}"' not in source
        and f'"{name.rpartition("/")[2]}"' not in source
    ]
    assert missing == []


# Layouts no fixture shows (written from the format, not copied from a capture)
#

NICS_AND_GPU_NUMA_ID = [
    "\t\x1b[4mGPU0\tGPU1\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m",
    "GPU0\t X \tNV4\tPXB\tSYS\t0-31\t0\t\tN/A",
    "GPU1\tNV4\t X \tSYS\tPXB\t32-63\t1\t\tN/A",
    "NIC0\tPXB\tSYS\t X \tSYS\t\t\t\t",
    "NIC1\tSYS\tPXB\tSYS\t X \t\t\t\t",
    "",
    "Legend:",
    "",
    "  X    = Self",
    "  NV#  = Connection traversing a bonded set of # NVLinks",
    "",
    "NIC Legend:",
    "",
    "  NIC0: mlx5_0",
    "  NIC1: mlx5_1",
]


def test_nics_with_gpu_numa_id_column():
    topo = parse_topology(NICS_AND_GPU_NUMA_ID)
    assert topo["gpus"] == ["GPU0", "GPU1"] and topo["nics"] == ["NIC0", "NIC1"]
    assert topo["links"] == {"GPU0": {"GPU1": "NV4"}, "GPU1": {"GPU0": "NV4"}}
    assert topo["cpu_affinity"] == {"GPU0": "0-31", "GPU1": "32-63"}
    assert topo["numa_affinity"] == {"GPU0": "0", "GPU1": "1"}
    assert topo["gpu_numa_id"] == {"GPU0": None, "GPU1": None}
    assert topo["nic_links"] == {
        "NIC0": {"GPU0": "PXB", "GPU1": "SYS", "NIC1": "SYS"},
        "NIC1": {"GPU0": "SYS", "GPU1": "PXB", "NIC0": "SYS"},
    }
    assert topo["nic_legend"] == {"NIC0": "mlx5_0", "NIC1": "mlx5_1"}


def test_gpu_numa_id_values_are_kept():
    topo = parse_topology(
        [
            "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID",
            "GPU0\t X \tNV18\t0-71\t0\t\t2",
            "GPU1\tNV18\t X \t72-143\t1\t\t10",
        ]
    )
    assert topo["gpu_numa_id"] == {"GPU0": "2", "GPU1": "10"}
    assert topo["numa_affinity"] == {"GPU0": "0", "GPU1": "1"}


def test_four_gpus_nv4_pairs_and_pcie_ranking():
    topo = parse_topology(
        [
            "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity",
            "GPU0\t X \tPHB\tNV4\tSYS\t0-15",
            "GPU1\tPHB\t X \tSYS\tNV4\t0-15",
            "GPU2\tNV4\tSYS\t X \tPXB\t16-31",
            "GPU3\tSYS\tNV4\tPXB\t X \t16-31",
        ]
    )
    assert tp_link_verdict(topo, 2) == {
        "gpus": ["GPU0", "GPU2"],
        "indices": [0, 2],
        "codes": {"GPU0-GPU2": "NV4"},
        "nvlink": True,
    }
    three = tp_link_verdict(topo, 3)
    assert three["nvlink"] is False
    # every triple crosses a SYS link; the tie on the worst link goes to the best total
    assert three["gpus"] == ["GPU0", "GPU2", "GPU3"]
    assert three["codes"] == {"GPU0-GPU2": "NV4", "GPU0-GPU3": "SYS", "GPU2-GPU3": "PXB"}


def test_pcie_pair_ranking_prefers_pix_then_pxb_then_phb_then_node_then_sys():
    def pick(codes: dict[tuple[int, int], str]) -> list[str]:
        links: dict[str, dict[str, str]] = {f"GPU{i}": {} for i in range(4)}
        for (a, b), code in codes.items():
            links[f"GPU{a}"][f"GPU{b}"] = code
            links[f"GPU{b}"][f"GPU{a}"] = code
        return tp_link_verdict({"gpus": list(links), "links": links}, 2)["gpus"]

    base = {(0, 1): "SYS", (0, 2): "SYS", (0, 3): "SYS", (1, 2): "SYS", (1, 3): "SYS"}
    assert pick({**base, (2, 3): "NODE"}) == ["GPU2", "GPU3"]
    assert pick({**base, (1, 3): "PHB", (2, 3): "NODE"}) == ["GPU1", "GPU3"]
    assert pick({**base, (1, 2): "PXB", (1, 3): "PHB", (2, 3): "NODE"}) == ["GPU1", "GPU2"]
    assert pick({**base, (0, 3): "PIX", (1, 2): "PXB", (2, 3): "NV1"}) == ["GPU2", "GPU3"]


def test_ansi_codes_anywhere_and_crlf():
    topo = parse_topology(
        [
            "\x1b[1m\t\x1b[4mGPU0\tGPU1\x1b[0m\tCPU Affinity\tNUMA Affinity\r",
            "\x1b[1mGPU0\x1b[0m\t X \tNV12\t0-7\t0\r",
            "\x1b[1mGPU1\x1b[0m\tNV12\t X \t0-7\t0\r",
        ]
    )
    assert topo["links"]["GPU0"] == {"GPU1": "NV12"}
    assert topo["numa_affinity"] == {"GPU0": "0", "GPU1": "0"}


def test_spaces_aligned_with_nic_columns():
    topo = parse_topology(
        [
            "        GPU0    GPU1    mlx5_0  CPU Affinity    NUMA Affinity",
            "GPU0     X      NV1     PIX     0-11            0",
            "GPU1    NV1      X      PHB     0-11            0",
            "mlx5_0  PIX     PHB      X",
        ]
    )
    assert topo["nics"] == ["mlx5_0"]
    assert topo["nic_links"] == {"mlx5_0": {"GPU0": "PIX", "GPU1": "PHB"}}
    assert topo["cpu_affinity"] == {"GPU0": "0-11", "GPU1": "0-11"}


def test_truncated_topology_parses_what_is_there():
    raw = lines("topo-8xA100-sxm4-40gb-dgx-10nic-nps4-01.txt")[:3]
    topo = parse_topology(raw)
    assert topo["gpus"] == [f"GPU{i}" for i in range(8)]
    assert topo["links"]["GPU1"]["GPU0"] == "NV12"
    assert topo["links"]["GPU5"] == {}
    assert topo["cpu_affinity"]["GPU5"] is None
    # GPU rows give the NIC cells when NIC rows are missing
    assert topo["nic_links"]["NIC0"] == {"GPU0": "PXB", "GPU1": "PXB"}
    header_cut = parse_topology(["\tGPU0\tGPU1\tCPU Aff"])
    assert header_cut["gpus"] == ["GPU0", "GPU1"] and header_cut["links"]["GPU0"] == {}


def test_no_matrix_is_none():
    assert parse_topology([]) is None
    assert parse_topology([f"{SMI_EXIT_MARKER}0"]) is None
    assert GpuTopology().process(["Legend:", "  X    = Self"]) is None


def test_verdict_without_topology_or_gpus():
    empty = {"gpus": [], "indices": [], "codes": {}, "nvlink": False}
    assert tp_link_verdict(None, 2) == empty
    assert tp_link_verdict({"gpus": ["GPU0"], "links": {"GPU0": {}}}, 2) == empty
    assert nvlink_joined(None, ["GPU0", "GPU1"]) is False
    assert nvlink_joined({"gpus": ["GPU0"], "links": {}}, ["GPU0"]) is False


# GpuProcesses
#


def test_processes_none_running():
    assert GpuProcesses().process([f"{SMI_EXIT_MARKER}0"]) == []
    assert parse_gpu_processes(["No running processes found", f"{SMI_EXIT_MARKER}0"]) == []


def test_processes_rows():
    processes = parse_gpu_processes(
        [
            "GPU-a, 40213, /opt/vllm/bin/python3, 74212",
            "GPU-b, 40388, /opt/vllm/bin/python3, [N/A]",
            f"{SMI_EXIT_MARKER}0",
        ]
    )
    assert processes == [
        {"gpu_uuid": "GPU-a", "pid": 40213, "process_name": "/opt/vllm/bin/python3",
         "used_memory_mib": 74212},
        {"gpu_uuid": "GPU-b", "pid": 40388, "process_name": "/opt/vllm/bin/python3",
         "used_memory_mib": None},
    ]  # fmt: skip


# dpkg packages and the module/userspace verdict
#

DPKG = [
    "nvidia-utils-535-server\t535.129.03-0ubuntu0.22.04.1\thi ",
    "libnvidia-compute-535-server\t535.129.03-0ubuntu0.22.04.1\tii ",
    "nvidia-dkms-535-server\t535.104.05-0ubuntu0.22.04.1\trc ",
    "nvidia-utils-525\t\tun ",
]


def test_dpkg_packages_and_holds():
    assert parse_dpkg_packages(DPKG) == {
        "nvidia-utils-535-server": "535.129.03-0ubuntu0.22.04.1",
        "libnvidia-compute-535-server": "535.129.03-0ubuntu0.22.04.1",
    }
    assert parse_held_dpkg(DPKG) == ["nvidia-utils-535-server"]
    assert DriverPackages().process([]) == {} and DriverPackages.default() == {}
    assert HeldPackages().process(DPKG[1:]) == [] and HeldPackages.default() == []


def test_userspace_driver():
    packages = parse_dpkg_packages(DPKG)
    assert userspace_driver(packages) == ("nvidia-utils-535-server", "535.129.03")
    compute_only = {"libnvidia-compute-535-server": "535.129.03-0ubuntu0.22.04.1"}
    assert userspace_driver(compute_only) == ("libnvidia-compute-535-server", "535.129.03")
    assert userspace_driver({"nvidia-smi": "535.216.01-1~deb12u1"}) == ("nvidia-smi", "535.216.01")
    assert userspace_driver({"cuda-toolkit-12-1": "12.1.1-1"}) is None
    assert userspace_driver({}) is None and userspace_driver(None) is None
    assert upstream_version("1:575.57.08-0ubuntu1") == "575.57.08"


def test_module_mismatch():
    installed = {"nvidia-utils-535-server": "535.129.03-0ubuntu0.22.04.1"}
    old = {"version": "535.104.05", "open": False}
    assert module_mismatch(old, installed, None) == (
        "loaded kernel module 535.104.05 but installed nvidia-utils-535-server is 535.129.03: "
        "reboot required"
    )
    assert module_mismatch({"version": "535.129.03", "open": False}, installed, None) is None
    assert module_mismatch(None, installed, None) is None
    assert module_mismatch(old, {}, None) is None
    assert module_mismatch(None, None, None) is None
    error = {"error": "Failed to initialize NVML: Driver/library version mismatch",
             "nvml_library_version": None}  # fmt: skip
    assert module_mismatch(None, {}, error) == (
        "nvidia-smi reports Failed to initialize NVML: Driver/library version mismatch: "
        "reboot required"
    )
    same = {"error": "Failed to initialize NVML: Driver/library version mismatch",
            "nvml_library_version": "535.104"}  # fmt: skip
    assert module_mismatch(old, {}, same) == (
        "nvidia-smi reports Failed to initialize NVML: Driver/library version mismatch "
        "(loaded kernel module 535.104.05): reboot required"
    )


# A host without the driver: process() on nothing is the absent value
#


def test_absent_values():
    assert GpuTopology().process([]) is None
    assert P2pRead().process([]) is None
    assert GpuInventory().process([]) == []  # never reached: no output -> default() None
    assert GpuInventory.default() is None
    assert DriverInfo().process([]) is None
    assert NvmlError().process([]) is None
    assert KernelModule().process([]) is None
    assert CudaToolkit().process([]) is None
    for fact in (GpuTopology, P2pRead, NvlinkStatus, GpuInventory, GpuProcesses, DriverInfo,
                 NvmlError):  # fmt: skip
        assert fact().requires_command() == "nvidia-smi"
        assert fact.default() is None
        assert fact().command().endswith(f'2>&1; echo "{SMI_EXIT_MARKER}$?"')
    assert KernelModule().command() == (
        "! test -e /proc/driver/nvidia/version || cat /proc/driver/nvidia/version"
    )


# The facts through pyinfra itself (@local, a fake nvidia-smi on PATH)
#

PYINFRA = Path(sys.executable).parent / "pyinfra"
SMI_FACTS = [
    "facts.topology.GpuTopology",
    "facts.topology.NvlinkStatus",
    "facts.gpus.GpuInventory",
    "facts.driver.DriverInfo",
    "facts.gpus.GpuProcesses",
    "facts.driver.NvmlError",
    "facts.topology.P2pRead",
]
FAKE_SMI = """#!/bin/sh
F={fixtures}
case "$*" in
  "topo -m") cat "$F/topo-4xA100-pcie-80gb-NV12-bridged-pairs-01.txt" ;;
  "topo -p2p r") cat "$F/h200-ubuntu2404-driver580/topo-p2p-r.txt" ;;
  "nvlink --status") cat "$F/h200-ubuntu2404-driver580/nvlink-s.txt" ;;
  "-L") cat "$F/h200-ubuntu2404-driver580/L.txt" ;;
  "") cat "$F/h200-ubuntu2404-driver580/smi.txt" ;;
  --query-gpu=*) echo "0, NVIDIA H200, GPU-f70f, 00000000:00:06.0, 143771, Disabled, Disabled, \
Enabled, 580.159.04" ;;
  --query-compute-apps=*) ;;
  *) echo "unexpected arguments: $*"; exit 2 ;;
esac
"""
MISMATCH_SMI = """#!/bin/sh
cat {fixtures}/smi-error-driver-library-version-mismatch-01.txt
exit 18
"""


def run_facts(path_dir: Path, facts: list[str]) -> dict:
    # Only the fake directory, `sh` (pyinfra's local connector runs `sh -c`) and `cat` on
    # PATH, so a CI host's own nvidia-smi cannot leak in.
    for tool in ("sh", "cat"):
        (path_dir / tool).symlink_to(Path("/bin") / tool)
    env = {**os.environ, "PATH": str(path_dir)}
    result = subprocess.run(
        [str(PYINFRA), "@local", "fact", *facts, "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    # `pyinfra fact` prints null and exits 0 for a fact whose command failed: refuse that.
    assert "could not" not in result.stderr, result.stderr
    return {name: value["@local"] for name, value in json.loads(result.stdout).items()}


needs_pyinfra = pytest.mark.skipif(not PYINFRA.exists(), reason="pyinfra CLI not installed")


def fake_smi(tmp_path: Path, script: str) -> Path:
    path = tmp_path / "nvidia-smi"
    path.write_text(script.format(fixtures=FIXTURES))
    path.chmod(0o755)
    return tmp_path


@needs_pyinfra
def test_cli_without_nvidia_smi_every_fact_is_absent(tmp_path):
    facts = run_facts(tmp_path, SMI_FACTS)
    assert facts == {name: None for name in SMI_FACTS}


@needs_pyinfra
def test_cli_with_fake_nvidia_smi(tmp_path):
    facts = run_facts(fake_smi(tmp_path, FAKE_SMI), SMI_FACTS)
    topology = facts["facts.topology.GpuTopology"]
    assert topology["links"]["GPU0"] == {"GPU1": "NV12", "GPU2": "SYS", "GPU3": "SYS"}
    assert topology["numa_affinity"]["GPU2"] == "1"
    assert facts["facts.topology.NvlinkStatus"] == {}  # printed nothing, still not None
    assert facts["facts.gpus.GpuInventory"][0]["memory_total_mib"] == 143771
    assert facts["facts.driver.DriverInfo"] == {
        "driver_version": "580.159.04",
        "cuda_version": "13.0",
    }
    assert facts["facts.gpus.GpuProcesses"] == []
    assert facts["facts.driver.NvmlError"] is None
    assert facts["facts.topology.P2pRead"] == {"GPU0": {}}


@needs_pyinfra
def test_cli_with_failing_nvidia_smi_does_not_fail_the_host(tmp_path):
    facts = run_facts(fake_smi(tmp_path, MISMATCH_SMI), SMI_FACTS)
    assert facts.pop("facts.driver.NvmlError") == {
        "error": "Failed to initialize NVML: Driver/library version mismatch",
        "nvml_library_version": "580.178",
    }
    assert facts == {name: None for name in SMI_FACTS if name != "facts.driver.NvmlError"}


def test_fixture_copies_match_the_command_format():
    # pyinfra hands process() lines without "\n"; tabs and ESC bytes arrive untouched.
    first = lines("topo-8xH100-gcp-a3-NV18-noNIC-01.txt")[0]
    assert re.match(r"^\t\x1b\[4mGPU0\t", first)
