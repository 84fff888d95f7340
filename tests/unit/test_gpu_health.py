"""The GPU-health parsers and verdicts on every real output of the health fixture set
(and the H200 captures), with concrete values and the verdicts EXPECTED.md gives.

The files are in tests/fixtures/nvidia/health/ (public outputs, SOURCES.md says where
each comes from) and tests/fixtures/nvidia/h200-ubuntu2404-driver580/ (a real H200).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from pyinfra.api.exceptions import FactProcessError

from facts import gpu_health as g
from facts import gpu_health_csv as g_csv
from facts import gpu_health_input
from facts import gpu_health_logs as logs
from facts import gpu_health_nvlink as g_nvlink
from facts import gpu_health_record as g_record
from facts import gpu_health_smi as g_smi
from facts.gpu_health_input import MAX_LINE_CHARS, UnreadableOutput
from facts.topology import parse_nvlink_status
from pyinfra_vllm.plans.gpu_health import XID_CODES, gpu_verdict, host_gpu_health

REPO = Path(__file__).resolve().parents[2]
_ROOTS = [REPO / "tests" / "fixtures" / "nvidia"]
HEALTH = "health"
H200 = "h200-ubuntu2404-driver580"
H200_BUS = "00000000:00:06.0"


def path(folder: str, name: str) -> Path:
    for root in _ROOTS:
        candidate = root / folder / name
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{folder}/{name} in none of {_ROOTS}")


def text(folder: str, name: str) -> str:
    return path(folder, name).read_text(encoding="utf-8")


def lines(folder: str, name: str) -> list[str]:
    return text(folder, name).splitlines()


def verdict(record, **kwargs):
    result = gpu_verdict(record, **kwargs)
    return result["verdict"], [reason["code"] for reason in result["reasons"]]


# --- one test per file of the health folder ---------------------------------------------


def test_v100_xml_dbe_retired_pages_pending():
    parsed = g_smi.parse_query_xml(text(HEALTH, "q-x-xml-V100-SXM3-32GB-driver410-dbe-retired-pages-2-pending-01.xml"))
    # attached_gpus says 16; the file holds 1: one GPU parsed, the other 15 unknown.
    assert list(parsed) == ["00000000:34:00.0", "missing"]
    assert parsed["missing"]["unreadable"] == {
        "code": "gpu_missing", "detail": "nvidia-smi counts 16 attached GPU(s); its output lists 1",
        "attached": 16, "listed": 1}
    assert verdict(parsed["missing"]) == ("unknown", ["gpu_missing"])
    gpu = parsed["00000000:34:00.0"]
    assert gpu["name"] == "Tesla V100-SXM3-32GB" and gpu["ecc_mode"] == "Enabled"
    assert gpu["ecc"]["volatile"] == {"correctable": 1, "uncorrectable": 1}
    assert gpu["ecc"]["aggregate"] == {"correctable": 291, "uncorrectable": 7627}
    assert gpu["retired_pages"] == {"single_bit": 0, "double_bit": 2, "pending": True}
    assert gpu["remapped_rows"] == {"correctable": None, "uncorrectable": None,
                                    "pending": None, "failure": None}
    assert verdict(gpu) == ("failing", ["ecc_uncorrectable_pending", "ecc_volatile_uncorrectable"])


def test_k80_xml_keyed_by_pci_id_pending_blacklist():
    parsed = g_smi.parse_query_xml(text(HEALTH, "q-x-xml-4xK80-azure-driver430-ecc-aggregate-sbe-dbe-retired-pages-01.xml"))
    assert list(parsed) == ["00001580:00:00.0", "00002DF7:00:00.0", "00004968:00:00.0", "0000F8D6:00:00.0"]
    first, second = parsed["00001580:00:00.0"], parsed["00002DF7:00:00.0"]
    assert first["ecc"]["aggregate"] == {"correctable": 7, "uncorrectable": 7}
    assert second["ecc"]["aggregate"] == {"correctable": 34, "uncorrectable": 4}
    for gpu in (first, second):
        assert gpu["ecc"]["volatile"] == {"correctable": 0, "uncorrectable": 0}
        assert gpu["retired_pages"] == {"single_bit": 1, "double_bit": 1, "pending": False}
        assert gpu["clocks_event_reasons"]["active"] == ["applications_clocks_setting"]
    idle = parsed["00004968:00:00.0"]
    assert idle["pcie"]["gen_current"] == 1 and idle["pcie"]["gen_max"] == 3 and idle["pstate"] == "P8"
    for gpu in parsed.values():  # past errors already retired, nothing pending; idle link
        assert verdict(gpu) == ("ok", [])


def test_a100_excerpt_elided_remap_pending_correctable():
    parsed = g_smi.parse_query_text(lines(HEALTH, "ecc-remap-q-excerpt-A100-sxm4-80gb-driver510-dram-correctable-177-remap-pending-author-elided-01.txt"))
    gpu = parsed["00000000:10:1C.0"]
    assert gpu["name"] == "NVIDIA A100-SXM4-80GB"
    assert gpu["ecc"]["volatile"] == {"correctable": 177, "uncorrectable": 0}
    assert gpu["ecc"]["aggregate"] == {"correctable": 177, "uncorrectable": 0}
    assert gpu["remapped_rows"] == {"correctable": 1, "uncorrectable": 0, "pending": True, "failure": False}
    assert gpu["retired_pages"] == {"single_bit": None, "double_bit": None, "pending": None}
    assert verdict(gpu) == ("degraded", ["row_remap_pending"])  # needs a reset, not failing


def test_ecc_block_excerpt_without_gpu_header():
    parsed = g_smi.parse_query_text(lines(HEALTH, "ecc-q-block-excerpt-sram-uncorrectable-volatile-1-aggregate-5-01.txt"))
    assert list(parsed) == ["0"]
    gpu = parsed["0"]
    assert gpu["bus_id"] is None and gpu["index"] == 0
    assert gpu["ecc"]["volatile"] == {"correctable": 0, "uncorrectable": 1}
    assert gpu["ecc"]["aggregate"] == {"correctable": 0, "uncorrectable": 5}
    assert verdict(gpu) == ("degraded", ["ecc_volatile_uncorrectable"])


def test_a10_remapped_rows_pending_uncorrectable():
    parsed = g_smi.parse_query_text(lines(HEALTH, "q-A10-driver535-remapped-rows-pending-uncorrectable4-01.txt"))
    gpu = parsed["00000000:07:00.0"]
    assert gpu["name"] == "NVIDIA A10" and gpu["pstate"] == "P8"
    assert gpu["remapped_rows"] == {"correctable": 0, "uncorrectable": 4, "pending": True, "failure": False}
    assert gpu["ecc"]["volatile"] == {"correctable": 0, "uncorrectable": 0}
    assert verdict(gpu) == ("failing", ["ecc_uncorrectable_pending"])


def test_a100_driver460_old_layout_healthy():
    parsed = g_smi.parse_query_text(lines(HEALTH, "q-8xA100-sxm4-40gb-driver460-healthy-clocks-throttle-reasons-01.txt"))
    assert len(parsed) == 8
    assert list(parsed)[:2] == ["00000001:00:00.0", "00000002:00:00.0"]
    gpu = parsed["00000001:00:00.0"]
    assert gpu["index"] == 0 and gpu["clocks_event_reasons"] == {"active": ["idle"], "counters_us": None}
    assert gpu["power_draw_w"] == 55.63 and gpu["power_limit_w"] == 400.0
    assert gpu["pcie"] == {"gen_current": 4, "gen_max": 4, "width_current": 16, "width_max": 16, "replays": 0}
    assert gpu["temperature_c"] == 41 and gpu["memory_temperature_c"] == 40 and gpu["utilization_gpu"] == 0
    assert all(verdict(record) == ("ok", []) for record in parsed.values())


def test_h100_hw_power_brake_all_gpus():
    parsed = g_smi.parse_query_text(lines(HEALTH, "q-8xH100-driver535-hw-power-brake-slowdown-active-all-gpus-01.txt"))
    assert len(parsed) == 8
    replays = [gpu["pcie"]["replays"] for gpu in parsed.values()]
    assert min(replays) == 43 and max(replays) == 82
    for gpu in parsed.values():
        assert gpu["clocks_event_reasons"]["active"] == ["hw_slowdown", "hw_power_brake_slowdown"]
        assert verdict(gpu) == ("degraded", ["hw_slowdown"])


def test_h100_one_gpu_sw_power_cap_sw_thermal_power_brake():
    parsed = g_smi.parse_query_text(lines(HEALTH, "q-8xH100-driver535-sw-power-cap-sw-thermal-power-brake-one-gpu-01.txt"))
    odd = parsed["00000000:75:00.0"]
    assert odd["clocks_event_reasons"]["active"] == ["sw_power_cap", "sw_thermal_slowdown", "hw_power_brake_slowdown"]
    assert odd["temperature_c"] == 39 and odd["pcie"]["replays"] == 58
    assert verdict(odd) == ("degraded", ["hw_slowdown"])
    assert verdict(odd, busy=True) == ("degraded", ["hw_slowdown", "thermal_slowdown"])
    others = [gpu for key, gpu in parsed.items() if key != "00000000:75:00.0"]
    assert len(others) == 7
    assert all(gpu["clocks_event_reasons"]["active"] == ["idle"] and verdict(gpu) == ("ok", []) for gpu in others)


@pytest.mark.parametrize("name", [
    "q-d-ECC-H200-driver580-healthy-channel-tpc-repair-fields-01.txt",
    "q-d-ROW_REMAPPER-H200-driver580-healthy-inactive-fields-01.txt",
    "q-d-PERFORMANCE-H200-driver580-idle-event-reason-counters-01.txt",
])
def test_h200_580_sections(name):
    parsed = g_smi.parse_query_text(lines(HEALTH, name))
    gpu = parsed[H200_BUS]
    if "ECC" in name:
        assert gpu["ecc"]["volatile"] == {"correctable": 0, "uncorrectable": 0}
        assert gpu["ecc"]["pending"] is False and gpu["ecc_mode"] == "Enabled"
        assert gpu["remapped_rows"]["pending"] is None  # not in this section: unknown
    elif "ROW_REMAPPER" in name:
        assert gpu["remapped_rows"] == {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False}
        assert gpu["ecc"]["pending"] is None
    else:
        assert gpu["clocks_event_reasons"]["active"] == ["idle"]
        assert gpu["clocks_event_reasons"]["counters_us"] == {
            "sw_power_cap": 0, "sync_boost": 0, "sw_thermal_slowdown": 0,
            "hw_thermal_slowdown": 0, "hw_power_brake_slowdown": 0}
    assert verdict(gpu) == ("ok", [])


def test_580_repair_pending_yes_is_failing():
    source = text(HEALTH, "q-d-ECC-H200-driver580-healthy-channel-tpc-repair-fields-01.txt")
    changed = source.replace("TPC Repair Pending                             : No",
                             "TPC Repair Pending                             : Yes")
    assert changed != source
    gpu = g_smi.parse_query_text(changed.splitlines())[H200_BUS]
    assert gpu["ecc"]["pending"] is True
    assert verdict(gpu) == ("failing", ["ecc_uncorrectable_pending"])


def test_rtx_all_fields_csv_idle_gen1_sw_power_cap():
    parsed = g_csv.parse_health_csv(lines(HEALTH, "query-gpu-csv-all-fields-RTX2080S-driver595-idle-sw-power-cap-active-pcie-gen1-masked-01.txt"))
    gpu = parsed["00000000:0C:00.0"]
    assert gpu["name"] == "NVIDIA GeForce RTX 2080 SUPER" and gpu["pstate"] == "P8"
    assert gpu["pcie"] == {"gen_current": 1, "gen_max": 3, "width_current": 16, "width_max": 16, "replays": None}
    assert gpu["clocks_event_reasons"]["active"] == ["sw_power_cap"]
    assert gpu["clocks_event_reasons"]["counters_us"]["sw_power_cap"] == 212553937
    assert gpu["power_draw_w"] == 39.32 and gpu["power_limit_w"] == 250.0
    assert gpu["ecc"]["volatile"] == {"correctable": None, "uncorrectable": None}
    assert gpu["remapped_rows"]["pending"] is None and gpu["retired_pages"]["single_bit"] is None
    assert gpu["utilization_gpu"] == 0 and gpu["memory_temperature_c"] is None
    assert verdict(gpu) == ("ok", [])
    busy = dict(gpu, pstate="P0", utilization_gpu=90,
                clocks_event_reasons={"active": [], "counters_us": None})
    assert verdict(busy, busy=True) == ("degraded", ["pcie_degraded"])


def test_h200_csv_old_throttle_names():
    parsed = g_csv.parse_health_csv(lines(HEALTH, "query-gpu-csv-clocks-throttle-reasons-oldname-header-renamed-H200-driver580-01.txt"))
    assert list(parsed) == ["0"]
    assert parsed["0"]["clocks_event_reasons"]["active"] == ["idle"]
    renamed = ["index, clocks_throttle_reasons.active, clocks_throttle_reasons.hw_slowdown",
               "0, 0x0000000000000088, Active"]
    assert g_csv.parse_health_csv(renamed)["0"]["clocks_event_reasons"]["active"] == [
        "hw_slowdown", "hw_power_brake_slowdown"]


def test_h200_csv_pcie():
    gpu = g_csv.parse_health_csv(lines(HEALTH, "query-gpu-csv-pcie-link-gen-width-H200-driver580-healthy-01.txt"))[H200_BUS]
    assert gpu["index"] == 0
    assert gpu["pcie"] == {"gen_current": 5, "gen_max": 5, "width_current": 16, "width_max": 16, "replays": None}


def test_remapped_rows_csv():
    parsed = g_csv.parse_remapped_rows_csv(lines(HEALTH, "query-remapped-rows-csv-H200-driver580-healthy-01.txt"))
    assert parsed == {H200_BUS: {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False}}


@pytest.mark.parametrize("name,bus", [
    ("query-retired-pages-csv-H100-driver590-NA-placeholder-rows-masked-01.txt", "00000000:00:09.0"),
    ("query-retired-pages-csv-H200-driver580-NA-placeholder-rows-01.txt", H200_BUS),
])
def test_retired_pages_placeholders_are_zero(name, bus):
    parsed = g_csv.parse_retired_pages_csv(lines(HEALTH, name))
    assert parsed == {bus: {"single_bit": 0, "double_bit": 0, "pages": [], "applicable": False}}
    real = ["gpu_bus_id, retired_pages.address, retired_pages.cause",
            "00000000:00:09.0, 0x000000000044e99d, Double Bit ECC"]
    assert g_csv.parse_retired_pages_csv(real)["00000000:00:09.0"]["double_bit"] == 1


def test_nvlink_status_v100_inactive_links():
    source = lines(HEALTH, "nvlink-s-7xV100-sxm2-inactive-links-several-gpus-01.txt")
    state = g_nvlink.nvlink_applicability(source)
    assert sorted(state) == [0, 1, 2, 3, 4, 5, 6]
    inactive = {gpu: [link["link"] for link in entry["links"] if not link["active"]] for gpu, entry in state.items()}
    assert inactive == {0: [], 1: [], 2: [], 3: [3, 5], 4: [1], 5: [0, 4], 6: [1]}
    links = parse_nvlink_status(source)
    assert verdict(None, nvlink_links=links[3], tp_member=True) == ("failing", ["nvlink_down"])
    assert verdict(None, nvlink_links=links[3], tp_member=False) == ("ok", [])
    assert verdict(None, nvlink_links=links[0], tp_member=True) == ("ok", [])


def test_nvlink_status_b200_all_inactive():
    source = lines(HEALTH, "nvlink-s-B200-all-links-inactive-uuid-masked-01.txt")
    assert parse_nvlink_status(source) == {2: []}
    assert g_nvlink.nvlink_applicability(source) == {2: {"status": "all_inactive", "links": []}}
    counters = {0: {"replay": 0, "recovery": 0, "crc_flit": 0}}
    assert verdict(None, nvlink_links=[], nvlink_errors=counters, tp_member=True) == ("failing", ["nvlink_down"])
    assert verdict(None, nvlink_links=[], tp_member=True) == ("ok", [])  # no sign it has NVLink


@pytest.mark.parametrize("name,status", [
    ("nvlink-s-L40S-driver595-device-has-no-nvlink-masked-01.txt", "not_applicable"),
    ("nvlink-s-H100-mig-mode-driver590-nvlink-queries-not-supported-masked-01.txt", "unknown"),
])
def test_nvlink_status_not_applicable_or_unknown(name, status):
    source = lines(HEALTH, name)
    assert parse_nvlink_status(source) == {0: []}
    assert g_nvlink.nvlink_applicability(source) == {0: {"status": status, "links": []}}
    assert g.detect_kind(text(HEALTH, name)) == "nvlink_status"


def test_xid_79_fallen_off_bus_sxid_ignored():
    events = logs.parse_kernel_log(lines(HEALTH, "xid-dmesg-79-fallen-off-bus-plus-nvswitch-sxid-20034-blockquote-unwrapped-01.txt"))
    assert events == [{"time": "6781741.548779", "pci": "0000:91:00", "code": 79, "pid": None,
                       "process": None, "text": "GPU has fallen off the bus."}]
    assert verdict(None, xids=events) == ("failing", ["xid_79"])


def test_xid_119_dmesg_T_banner_domain_0001():
    events = logs.parse_kernel_log(lines(HEALTH, "xid-dmesg-T-119-gsp-timeout-banner-8xA100-sxm4-domain0001-01.txt"))
    assert [(e["pci"], e["code"], e["pid"], e["process"]) for e in events] == [
        ("0001:6c:00", 119, 10200, "NvmlTaskRunner"), ("0001:96:00", 119, 10200, "NvmlTaskRunner")]
    assert events[0]["time"] == "Sun Apr 26 23:12:26 2026"
    assert events[0]["text"].startswith("Timeout after 45s of waiting for RPC response from GPU5 GSP!")
    assert g_record.same_gpu("00000001:6C:00.0", events[0]["pci"]) and not g_record.same_gpu("00000000:6C:00.0", events[0]["pci"])


def test_xid_119_ctime_gpu4():
    events = logs.parse_kernel_log(lines(HEALTH, "xid-dmesg-ctime-119-gsp-rpc-timeout-H100-xe9680-01.txt"))
    assert len(events) == 5 and {e["code"] for e in events} == {119} and {e["pci"] for e in events} == {"0000:9b:00"}
    assert [e["process"] for e in events] == ["nvidia-smi"] * 3 + ["cache_mgr_main", "gpud"]
    result = gpu_verdict(None, xids=events)
    assert result["verdict"] == "failing"
    assert result["reasons"][0]["detail"] == ("Xid 119 (GSP RPC timeout): 5 event(s), first Sun Feb 23 "
                                              "16:24:18 2025, last Sun Feb 23 16:30:13 2025")


def test_xid_13_43_decode_iso_application_caused():
    events = logs.parse_kernel_log(lines(HEALTH, "xid-dmesg-decode-iso-13-43-sm-exception-cut-01.txt"))
    assert len(events) == 26
    assert [e["code"] for e in events].count(43) == 2 and events[15]["process"] == "pt_main_thread"
    assert events[15]["pid"] == 2815167 and events[0]["pid"] is None
    assert events[0]["time"] == "2025-01-21T02:21:33,498559+00:00"
    assert verdict(None, xids=events) == ("ok", [])  # the application's fault


def test_xid_48_63_94_iso():
    events = logs.parse_kernel_log(lines(HEALTH, "xid-dmesg-iso-48-63-94-dbe-row-remap-contained-01.txt"))
    assert [e["code"] for e in events] == [48, 63] + [94] * 9
    assert events[3]["pid"] == 1248209 and events[3]["process"] == "python3.10" and events[3]["text"] == "Ch 00000008"
    assert verdict(None, xids=events) == ("failing", ["xid_48", "xid_63", "xid_94"])
    assert verdict(None, xids=[e for e in events if e["code"] == 94]) == ("degraded", ["xid_94"])


def test_xid_31_journalctl():
    events = logs.parse_kernel_log(lines(HEALTH, "xid-journalctl-k-31-mmu-fault-RTX2080-driver450-uuid-redacted-01.txt"))
    assert [(e["time"], e["pci"], e["code"], e["pid"]) for e in events] == [
        ("Nov 29 11:28:11", "0000:c1:00", 31, 12890)] * 2
    assert events[0]["text"].startswith("Ch 0000003b, intr 00000000. MMU Fault")


def test_kernel_log_without_xid():
    source = lines(HEALTH, "dmesg-nvrm-grep-no-xid-H200-driver580-01.txt")
    assert logs.parse_kernel_log(source) == []
    assert g.detect_kind("\n".join(source)) == "kernel_log"


def test_kernel_log_journal_short_iso_and_bare():
    log = ["2026-12-02T02:42:57+0000 host kernel: NVRM: Xid (PCI:0000:17:00): 95, pid=1, name=x, Uncontained",
           "NVRM: Xid (PCI:0000:17:00): 64, pid='<unknown>', name=<unknown>, Row Remapper failed",
           "random text NVRM: Xid (PCI:0000:17:00): 79, GPU has fallen off the bus."]
    events = logs.parse_kernel_log(log)
    # An Xid behind a prefix no kernel log prints is still read, with no time.
    assert [(e["time"], e["code"]) for e in events] == [
        ("2026-12-02T02:42:57+0000", 95), (None, 64), (None, 79)]


def test_dcgmi_l40s_pcie_fail_internal_error_cut():
    diag = logs.parse_dcgmi_diag(lines(HEALTH, "dcgmi-diag-4xL40S-dcgm4.2.3-driver570-pcie-fail-internal-error-01.txt"))
    assert diag["complete"] is False and diag["metadata"]["DCGM Version"] == "4.2.3"
    assert {name: test["result"] for name, test in diag["tests"].items()} == {
        "software": "Pass", "memory": "Pass", "pcie": "Fail"}
    pcie = diag["tests"]["pcie"]
    assert pcie["gpus"] == {0: "Pass", 1: "Pass", 2: "Pass", 3: "Pass"}
    assert len(pcie["messages"]) == 4
    assert pcie["messages"][0]["text"] == (
        "There was an internal error during the test: 'A child process (152) exited with "
        "non-zero status 1' Check DCGM and system logs for errors. Reset GPU. Restart DCGM. "
        "Rerun diagnostics.")


def test_dcgmi_b200_complete():
    diag = logs.parse_dcgmi_diag(lines(HEALTH, "dcgmi-diag-r2-8xB200-dcgm4.4.1-driver570-pcie-fail-internal-error-01.txt"))
    assert diag["complete"] is True
    assert diag["tests"]["pcie"]["result"] == "Fail" and len(diag["tests"]["pcie"]["messages"]) == 1
    assert diag["tests"]["memory"]["gpus"] == {gpu: "Pass" for gpu in range(8)}
    assert "couldn't be parsed" in diag["tests"]["pcie"]["messages"][0]["text"]


def test_dcgmi_deployment_error_gpu3_joined():
    diag = logs.parse_dcgmi_diag(lines(HEALTH, "dcgmi-diag-excerpt-deployment-error-gpu3-uncorrectable-row-remap-pending-01.txt"))
    assert diag["complete"] is False
    test = diag["tests"]["Deployment"]
    assert test["messages"] == [{"level": "Error", "text": "GPU 3 has uncorrectable memory errors and row remappings are pending"}]
    assert test["gpus"] == {3: "Error"}


def test_dcgmi_gpu_memory_fail_gpu0_thermal():
    diag = logs.parse_dcgmi_diag(lines(HEALTH, "dcgmi-diag-r2-excerpt-gpu-memory-fail-gpu0-thermal-violation-warning-01.txt"))
    test = diag["tests"]["GPU Memory"]
    assert test["result"] == "Fail" and test["gpus"] == {0: "Fail", **{gpu: "Pass" for gpu in range(1, 8)}}
    assert test["messages"][0]["text"].startswith("GPU 0 Thermal violations totaling 13.3 seconds started at 9.7 seconds")
    assert test["messages"][0]["text"].endswith("and any other components.")
    assert diag["complete"] is False


EXPECTED_KINDS = {
    "dcgmi-diag": "dcgmi_diag", "dmesg-": "kernel_log", "xid-": "kernel_log",
    "ecc-": "query_text", "q-x-xml": "query_xml", "q-": "query_text", "nvlink-s": "nvlink_status",
    "query-gpu": "health_csv", "query-remapped": "remapped_rows_csv", "query-retired": "retired_pages_csv",
}


def test_every_health_file_has_a_test_and_a_kind():
    folder = path(HEALTH, "SOURCES.md").parent
    source = Path(__file__).read_text(encoding="utf-8")
    names = sorted(p.name for p in folder.iterdir() if p.suffix in (".txt", ".xml"))
    assert len(names) == 32
    for name in names:
        assert name in source, name
        prefix = next(p for p in EXPECTED_KINDS if name.startswith(p))
        assert g.detect_kind(text(HEALTH, name)) == EXPECTED_KINDS[prefix], name


# --- the H200 captures ---------------------------------------------------------------------

H200_HEALTH_FILES = [
    "q.txt", "q-d-CLOCK.txt", "q-d-ECC.txt", "q-d-PAGE_RETIREMENT.txt", "q-d-PERFORMANCE.txt",
    "q-d-ROW_REMAPPER.txt", "q-d-TEMPERATURE,POWER.txt", "q-x.xml", "query-gpu-health-csv.txt",
    "query-gpu-health-csv-noheader-nounits.txt", "query-gpu-csv.txt", "query-remapped-rows-csv.txt",
    "query-retired-pages-csv.txt", "nvlink-e.txt", "nvlink-s.txt", "dmesg-NVRM.txt",
]


def test_h200_q_whole():
    gpu = g_smi.parse_query_text(lines(H200, "q.txt"))[H200_BUS]
    assert gpu["name"] == "NVIDIA H200" and gpu["index"] == 0 and gpu["ecc_mode"] == "Enabled"
    assert gpu["ecc"] == {"volatile": {"correctable": 0, "uncorrectable": 0},
                          "aggregate": {"correctable": 0, "uncorrectable": 0}, "pending": False}
    assert gpu["retired_pages"] == {"single_bit": None, "double_bit": None, "pending": None}
    assert gpu["pcie"] == {"gen_current": 5, "gen_max": 5, "width_current": 16, "width_max": 16, "replays": 1}
    assert (gpu["temperature_c"], gpu["memory_temperature_c"], gpu["power_draw_w"], gpu["power_limit_w"]) == (43, 42, 133.46, 700.0)
    assert gpu["pstate"] == "P0" and gpu["utilization_gpu"] == 0
    assert verdict(gpu) == ("ok", [])
    marked = lines(H200, "q.txt") + ["##NVIDIA_SMI_EXIT=0"]
    assert g_smi.parse_query_text(marked)[H200_BUS] == gpu
    assert g_smi.parse_query_text(["Failed to initialize NVML: Driver/library version mismatch", "##NVIDIA_SMI_EXIT=18"]) is None
    assert g_smi.parse_query_text(["No devices were found", "##NVIDIA_SMI_EXIT=6"]) is None
    assert g_smi.parse_query_text(["##NVIDIA_SMI_EXIT=0"]) is None


def test_h200_xml_v13():
    gpu = g_smi.parse_query_xml(text(H200, "q-x.xml"))[H200_BUS]
    assert gpu["ecc"]["pending"] is False and gpu["remapped_rows"]["pending"] is False
    assert gpu["retired_pages"] == {"single_bit": None, "double_bit": None, "pending": None}
    assert gpu["power_draw_w"] == 78.59 and gpu["clocks_event_reasons"]["active"] == ["idle"]
    assert gpu["clocks_event_reasons"]["counters_us"]["hw_power_brake_slowdown"] == 0
    assert verdict(gpu) == ("ok", [])


def test_h200_sections_and_csvs():
    power = g_smi.parse_query_text(lines(H200, "q-d-TEMPERATURE,POWER.txt"))[H200_BUS]
    assert (power["temperature_c"], power["power_draw_w"], power["power_limit_w"]) == (37, 78.56, 700.0)
    pages = g_smi.parse_query_text(lines(H200, "q-d-PAGE_RETIREMENT.txt"))[H200_BUS]
    assert pages["retired_pages"] == {"single_bit": None, "double_bit": None, "pending": None}
    header = g_csv.parse_health_csv(lines(H200, "query-gpu-health-csv.txt"))[H200_BUS]
    bare = g_csv.parse_health_csv(lines(H200, "query-gpu-health-csv-noheader-nounits.txt"), g_csv.HEALTH_QUERY_FIELDS)[H200_BUS]
    for gpu in (header, bare):
        assert gpu["ecc"]["volatile"] == {"correctable": 0, "uncorrectable": 0}
        assert gpu["ecc"]["aggregate"] == {"correctable": None, "uncorrectable": 0}
        assert gpu["retired_pages"]["pending"] is None and gpu["remapped_rows"]["failure"] is False
        assert gpu["clocks_event_reasons"]["active"] == ["idle"] and gpu["memory_temperature_c"] == 39
    assert header["power_draw_w"] == 78.58 and bare["power_draw_w"] == 78.59
    uuid_only = g_csv.parse_retired_pages_csv(lines(H200, "query-retired-pages-csv.txt"))
    assert uuid_only == {"GPU-c0ba5029-d02f-7668-1bbf-cd987b370c34": {"single_bit": 0, "double_bit": 0, "pages": [], "applicable": False}}
    assert g_nvlink.parse_nvlink_errors(lines(H200, "nvlink-e.txt")) == {}
    assert logs.parse_kernel_log(lines(H200, "dmesg-NVRM.txt")) == []


def test_h200_every_health_capture_detected():
    kinds = {name: g.detect_kind(text(H200, name)) for name in H200_HEALTH_FILES}
    assert kinds["nvlink-e.txt"] is None and kinds["nvlink-s.txt"] is None  # empty
    assert kinds["q-x.xml"] == "query_xml" and kinds["query-retired-pages-csv.txt"] == "retired_pages_csv"
    assert kinds["query-gpu-health-csv-noheader-nounits.txt"] == "health_csv"
    assert g.detect_kind(text(H200, "L.txt")) is None and g.detect_kind(text(H200, "smi.txt")) is None


def test_nvlink_errors_layouts():
    h100 = ["GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-abcdefab-cdef-abdc-abcd-abababababab)",
            "         Link 0: Replay Errors: 0", "         Link 0: Recovery Errors: 0",
            "         Link 0: CRC Errors: 3", "", "         Link 1: Replay Errors: 2",
            "         Link 1: Data CRC Errors: N/A", "##NVIDIA_SMI_EXIT=0"]
    assert g_nvlink.parse_nvlink_errors(h100) == {0: {0: {"replay": 0, "recovery": 0, "crc_flit": 3},
                                               1: {"replay": 2, "crc_data": None}}}
    assert g.detect_kind("\n".join(h100)) == "nvlink_errors"
    assert g_nvlink.parse_nvlink_errors(["NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."]) is None


# --- verdict details and host_gpu_health -----------------------------------------------------


def test_xid_table_covers_the_codes():
    for code in (13, 31, 43, 45, 48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140):
        assert code in XID_CODES
    assert {XID_CODES[c][2] for c in (13, 31, 43, 45)} == {"info"}
    assert XID_CODES[94][2] == "degraded" and XID_CODES[95][2] == "failing"
    assert verdict(None, xids=[{"code": 9999, "pci": "0000:01:00", "time": None}]) == ("degraded", ["xid_9999"])


def test_rising_counters_need_previous():
    gpu = g_smi.parse_query_text(lines(H200, "q.txt"))[H200_BUS]
    later = g_record.merge_records({"pcie": {"replays": 9}, "ecc": {"aggregate": {"correctable": 4}}}, gpu)
    assert verdict(later) == ("ok", [])
    assert verdict(later, previous={"health": gpu}) == ("degraded", ["ecc_correctable_rising", "pcie_replays_rising"])
    errors_before = {0: {"replay": 1, "recovery": 0}}
    errors_now = {0: {"replay": 5, "recovery": 0}}
    assert verdict(None, nvlink_errors=errors_now, previous={"nvlink_errors": errors_before}) == (
        "degraded", ["nvlink_errors_rising"])


def test_row_remap_failure_is_rma():
    result = gpu_verdict({"remapped_rows": {"failure": True, "pending": False}})
    assert result["verdict"] == "failing" and result["reasons"][0]["code"] == "row_remap_failure"
    assert result["reasons"][0]["action"] == "replace the GPU (RMA)"


def _h200_state(**changes):
    state = {
        "gpu_health": g_smi.parse_query_text(lines(H200, "q.txt")),
        "gpus": [{"index": 0, "name": "NVIDIA H200", "uuid": "GPU-f70fc72c-8ec5-a53a-cda1-f039fcfe7fab",
                  "pci_bus_id": H200_BUS}],
        "nvlink": {}, "nvlink_errors": {}, "processes": [],
        "xid": {"source": "dmesg", "events": []},
    }
    state.update(changes)
    return state


def test_host_gpu_health_h200_ok_and_counters():
    result = host_gpu_health(_h200_state(), [0])
    assert list(result) == [H200_BUS]
    gpu = result[H200_BUS]
    assert (gpu["index"], gpu["name"], gpu["verdict"], gpu["reasons"]) == (0, "NVIDIA H200", "ok", [])
    assert gpu["counters"] == {
        "ecc_volatile_correctable": 0, "ecc_volatile_uncorrectable": 0, "ecc_aggregate_correctable": 0,
        "ecc_aggregate_uncorrectable": 0, "remapped_rows_correctable": 0, "remapped_rows_uncorrectable": 0,
        "remapped_rows_pending": 0, "remapped_rows_failure": 0, "pcie_replays": 1, "pcie_width_current": 16,
        "pcie_width_max": 16, "pcie_gen_current": 5, "pcie_gen_max": 5, "xid_events": 0}
    assert host_gpu_health({}, []) == {}
    assert host_gpu_health({"gpu_health": None, "gpus": None, "xid": None}, []) == {}


def test_host_gpu_health_xids_assigned_and_orphaned():
    events = logs.parse_kernel_log(lines(HEALTH, "xid-dmesg-79-fallen-off-bus-plus-nvswitch-sxid-20034-blockquote-unwrapped-01.txt"))
    mine = [dict(events[0], pci="0000:00:06", code=94)]
    result = host_gpu_health(_h200_state(xid={"source": "journal", "events": events + mine}), [0])
    assert result[H200_BUS]["verdict"] == "degraded" and result[H200_BUS]["counters"]["xid_events"] == 1
    assert result["0000:91:00"]["index"] is None and result["0000:91:00"]["verdict"] == "failing"
    assert [r["code"] for r in result["0000:91:00"]["reasons"]] == ["xid_79"]


def test_host_gpu_health_previous_and_nvlink():
    first = host_gpu_health(_h200_state(), [0])
    health = g_smi.parse_query_text(lines(H200, "q.txt"))
    health[H200_BUS]["pcie"]["replays"] = 7
    second = host_gpu_health(_h200_state(gpu_health=health), [0], previous=first)
    assert [r["code"] for r in second[H200_BUS]["reasons"]] == ["pcie_replays_rising"]
    down = [{"link": 0, "active": True, "speed_gbps": 26.5}, {"link": 1, "active": False, "speed_gbps": None}]
    third = host_gpu_health(_h200_state(nvlink={"0": down}, nvlink_errors={0: {0: {"replay": 2}}}), [0])
    assert third[H200_BUS]["verdict"] == "failing" and third[H200_BUS]["counters"]["nvlink_errors"] == 2
    assert host_gpu_health(_h200_state(nvlink={0: down}), [])[H200_BUS]["verdict"] == "ok"


def test_thermal_slowdown_only_while_busy():
    odd = g_smi.parse_query_text(lines(HEALTH, "q-8xH100-driver535-sw-power-cap-sw-thermal-power-brake-one-gpu-01.txt"))
    state = {"gpu_health": odd, "processes": [{"gpu_uuid": "GPU-x", "pid": 1}],
             "gpus": [{"index": 2, "name": "H100", "uuid": "GPU-x", "pci_bus_id": "00000000:75:00.0"}]}
    codes = [r["code"] for r in host_gpu_health(state, [])["00000000:75:00.0"]["reasons"]]
    assert codes == ["hw_slowdown", "thermal_slowdown"]


def test_h200_the_whole_query_agrees_with_nvml():
    # nvml-health-probe.txt: pynvml's answers on the same host, one per line
    # ("name = value", or "name ! error" where NVML says NotSupported).
    nvml = dict(line.split(" = ", 1) for line in lines(H200, "nvml-health-probe.txt")
                if " = " in line)
    gpu = g_smi.parse_query_text(lines(H200, "q.txt"))[H200_BUS]
    assert nvml["name"] == gpu["name"] == "NVIDIA H200"
    assert int(nvml["ecc_uncorr_volatile"]) == gpu["ecc"]["volatile"]["uncorrectable"] == 0
    assert int(nvml["ecc_corr_volatile"]) == gpu["ecc"]["volatile"]["correctable"] == 0
    assert nvml["remapped_rows"] == "(0, 0, 0, 0)"
    assert gpu["remapped_rows"] == {"correctable": 0, "uncorrectable": 0, "pending": False,
                                    "failure": False}
    assert g_record.reasons_from_mask(nvml["throttle_reasons"]) == ["idle"]
    assert nvml["pcie_gen"] == f"({gpu['pcie']['gen_current']}, {gpu['pcie']['gen_max']})"
    assert nvml["pcie_width"] == f"({gpu['pcie']['width_current']}, {gpu['pcie']['width_max']})"
    assert "nvlink0_state" not in nvml  # NotSupported: NVLink is not exposed in this VM


# --- fail closed: what cannot be read is never ok ---------------------------------------------

H200_XML = "q-x.xml"
V100_XML = "q-x-xml-V100-SXM3-32GB-driver410-dbe-retired-pages-2-pending-01.xml"


def h200_xml(product: str = "NVIDIA H200", volatile_dram_uncorrectable: int = 0) -> str:
    source = text(H200, H200_XML)
    changed = source.replace("<product_name>NVIDIA H200</product_name>",
                             f"<product_name>{product}</product_name>", 1)
    volatile = changed.index("<volatile>")
    return (changed[:volatile] + changed[volatile:].replace(
        "<dram_uncorrectable>0</dram_uncorrectable>",
        f"<dram_uncorrectable>{volatile_dram_uncorrectable}</dram_uncorrectable>", 1))


def test_the_xml_helper_changes_what_it_says():
    gpu = g_smi.parse_query_xml(h200_xml("NVIDIA H200 (five)", 5))[H200_BUS]
    assert gpu["name"] == "NVIDIA H200 (five)" and gpu["ecc"]["volatile"]["uncorrectable"] == 5
    assert verdict(gpu) == ("degraded", ["ecc_volatile_uncorrectable"])


def test_xml_cut_short_is_unreadable():
    source = text(HEALTH, V100_XML)
    with pytest.raises(UnreadableOutput, match=r"not well-formed XML \(unclosed token"):
        g_smi.parse_query_xml(source[: len(source) // 2])


def test_xml_with_a_control_character_is_unreadable():
    # Five uncorrectable errors, behind a name XML 1.0 does not allow: not "no GPU".
    with pytest.raises(UnreadableOutput, match="not well-formed XML"):
        g_smi.parse_query_xml(h200_xml("NVIDIA\x07H200", 5))


@pytest.mark.parametrize("declaration", [
    # The "billion laughs": each entity ten of the one before.
    '<!DOCTYPE nvidia_smi_log [\n  <!ENTITY lol "lol">\n'
    '  <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">\n'
    '  <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">\n]>',
    # Any entity at all: one can stand for any text, a count included.
    '<!DOCTYPE nvidia_smi_log [<!ENTITY name "NVIDIA H200">]>',
    '<!DOCTYPE nvidia_smi_log SYSTEM "http://example.invalid/evil.dtd">',
])
def test_xml_declaring_a_dtd_or_entity_is_unreadable(declaration):
    source = h200_xml("&lol3;" if "lol3" in declaration else "&name;", 5)
    source = source.replace('<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v13.dtd">', declaration)
    assert declaration in source
    with pytest.raises(UnreadableOutput, match="declares a DTD or an entity"):
        g_smi.parse_query_xml(source)
    assert g.detect_kind(source) == "query_xml"


def q_text(*gpu_lines: str, attached: int) -> list[str]:
    """The H200's -q whole, with ``Attached GPUs`` set and ``gpu_lines`` before its GPU."""
    source = lines(H200, "q.txt")
    header = source.index("GPU 00000000:00:06.0")
    source = [f"Attached GPUs                                          : {attached}"
              if line.startswith("Attached GPUs") else line for line in source]
    return source[:header] + list(gpu_lines) + source[header:]


def test_device_handle_error_is_unknown_and_gpu_lost_is_failing():
    parsed = g_smi.parse_query_text(q_text(
        "Unable to determine the device handle for GPU 0000:17:00.0: Unknown Error",
        "Unable to determine the device handle for gpu 0000:3B:00.0: GPU is lost.  Reboot the "
        "system to recover this GPU", attached=3))
    assert list(parsed) == ["00000000:17:00.0", "00000000:3B:00.0", H200_BUS]
    lost = parsed["00000000:17:00.0"]
    assert lost["unreadable"] == {"code": "gpu_unreadable", "detail": "nvidia-smi: Unable to "
                                  "determine the device handle for GPU 0000:17:00.0: Unknown Error"}
    assert lost["index"] == 0 and lost["ecc"] == g_record.empty_record()["ecc"]
    assert verdict(lost) == ("unknown", ["gpu_unreadable"])
    assert verdict(parsed["00000000:3B:00.0"]) == ("failing", ["gpu_lost"])
    assert parsed[H200_BUS]["index"] == 2 and "unreadable" not in parsed[H200_BUS]
    assert verdict(parsed[H200_BUS]) == ("ok", [])
    # Alone in a file (nvidia-smi's table or CSV printing only that): still read.
    only = "Unable to determine the device handle for GPU0000:65:00.0: Unknown Error"
    assert g.detect_kind(only) == "device_error"
    assert g_record.unreadable_gpus([only])["00000000:65:00.0"]["unreadable"]["code"] == "gpu_unreadable"


def test_a_gpu_block_with_no_data_is_unknown():
    parsed = g_smi.parse_query_text(q_text("GPU 00000000:17:00.0", attached=2))
    assert list(parsed) == ["00000000:17:00.0", H200_BUS]
    assert parsed["00000000:17:00.0"]["unreadable"] == {
        "code": "gpu_no_data", "detail": "GPU 00000000:17:00.0: its block in nvidia-smi -q holds nothing"}
    assert verdict(parsed["00000000:17:00.0"]) == ("unknown", ["gpu_no_data"])
    empty = text(H200, H200_XML).replace(text(H200, H200_XML)[
        text(H200, H200_XML).index('<gpu id'):text(H200, H200_XML).index("</gpu>") + 6],
        '<gpu id="00000000:00:06.0">\n\t</gpu>')
    assert verdict(g_smi.parse_query_xml(empty)[H200_BUS]) == ("unknown", ["gpu_no_data"])


def test_fewer_gpus_than_attached_is_unknown():
    parsed = g_smi.parse_query_text(q_text(attached=2))
    assert list(parsed) == [H200_BUS, "missing"]
    assert parsed["missing"]["unreadable"]["code"] == "gpu_missing"
    assert verdict(parsed[H200_BUS]) == ("ok", []) and verdict(parsed["missing"])[0] == "unknown"
    assert "missing" not in g_smi.parse_query_text(q_text(attached=1))


LONG_LINE_PARSERS = {
    "nvidia-smi -q": g_smi.parse_query_text,
    "nvidia-smi -q -x": lambda found: g_smi.parse_query_xml("\n".join(found)),
    "nvidia-smi --query CSV": g_csv.parse_health_csv,
    "nvidia-smi nvlink -e": g_nvlink.parse_nvlink_errors,
    "nvidia-smi nvlink -s": g_nvlink.nvlink_applicability,
    "kernel log": logs.read_kernel_log,
    "dcgmi diag": logs.parse_dcgmi_diag,
}


@pytest.mark.parametrize("length", [40_000, 1_000_000])
@pytest.mark.parametrize("name", sorted(LONG_LINE_PARSERS))
def test_a_line_over_the_bound_is_unreadable_before_any_pattern_runs(name, length):
    # The shapes the old patterns took quadratic time on (4 s and 15 s at 40,000
    # characters): spaces with no colon after them (the -q key/value pattern), a dcgmi
    # heading that never closes.
    for line in ("    a" + " " * length + "b", "|-- a" + " " * length + "b", "x" * length):
        found = ["GPU 00000000:17:00.0", line, "NVRM: Xid (PCI:0000:17:00): 79, x"]
        with pytest.raises(UnreadableOutput, match=rf"^{name}: line 2 is {len(line)} characters "
                                                   rf"long, over the {MAX_LINE_CHARS}"):
            LONG_LINE_PARSERS[name](found)
    for csv_parser in (g_csv.parse_remapped_rows_csv, g_csv.parse_retired_pages_csv):
        with pytest.raises(UnreadableOutput, match=r"^nvidia-smi --query CSV: line 2 is"):
            csv_parser(["gpu_bus_id, retired_pages.address", "x" * length])


def test_the_bound_lets_every_real_output_through():
    longest = max(len(line) for folder in (HEALTH, H200) for p in path(folder, "SOURCES.md"
                  if folder == HEALTH else "q.txt").parent.iterdir() if p.suffix in (".txt", ".xml")
                  for line in p.read_text(encoding="utf-8").splitlines())
    assert longest == 5901 and longest < MAX_LINE_CHARS
    # Detection looks at a line's first MAX_LINE_CHARS characters only, whatever its length.
    assert g.detect_kind("GPU 00000000:17:00.0\n" + " " * 1_000_000 + "a") == "query_text"


# --- the patterns are linear ----------------------------------------------------------

try:
    from re import _parser as sre_parse  # Python 3.11 and later
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse  # type: ignore[no-redef]

_ASCII = frozenset(range(128))
_CATEGORIES = {
    "CATEGORY_DIGIT": frozenset(map(ord, "0123456789")),
    "CATEGORY_SPACE": frozenset(map(ord, " \t\n\r\f\v")),
    "CATEGORY_WORD": frozenset(ord(c) for c in map(chr, range(128)) if c.isalnum() or c == "_"),
}


def _class(items) -> frozenset[int]:
    chars: set[int] = set()
    negate = False
    for op, av in items:
        name = str(op)
        if name == "NEGATE":
            negate = True
        elif name == "LITERAL":
            chars.add(av)
        elif name == "RANGE":
            chars.update(range(av[0], av[1] + 1))
        elif name == "CATEGORY":
            positive = str(av).replace("NOT_", "")
            found = _CATEGORIES[positive]
            chars.update(_ASCII - found if "NOT_" in str(av) else found)
    return frozenset(_ASCII - chars if negate else chars)


def _chars(seq) -> frozenset[int]:
    """Every character any position of ``seq`` can match."""
    found: set[int] = set()
    for op, av in seq:
        name = str(op)
        if name == "LITERAL":
            found.add(av)
        elif name == "NOT_LITERAL":
            found |= _ASCII - {av}
        elif name == "ANY":
            found |= _ASCII - {10}
        elif name == "IN":
            found |= _class(av)
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            found |= _chars(av[2])
        elif name == "SUBPATTERN":
            found |= _chars(av[3])
        elif name == "BRANCH":
            for branch in av[1]:
                found |= _chars(branch)
    return frozenset(found)


def _unbounded(op, av) -> bool:
    return str(op) in ("MAX_REPEAT", "MIN_REPEAT") and av[1] == sre_parse.MAXREPEAT


def _nullable(op, av) -> bool:
    name = str(op)
    if name == "AT":
        return True
    if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
        return av[0] == 0 or all(_nullable(*item) for item in av[2])
    if name == "SUBPATTERN":
        return all(_nullable(*item) for item in av[3])
    if name == "BRANCH":
        return any(all(_nullable(*item) for item in branch) for branch in av[1])
    return False


def _edge_repeats(op, av, last: bool) -> list[frozenset[int]]:
    """The characters of each unbounded repeat that can end (``last``) or begin this item."""
    if _unbounded(op, av):
        return [_chars(av[2])]
    name = str(op)
    seqs = ([av[3]] if name == "SUBPATTERN" else list(av[1]) if name == "BRANCH"
            else [av[2]] if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") else [])
    found: list[frozenset[int]] = []
    for seq in seqs:
        for item in (reversed(list(seq)) if last else seq):
            found += _edge_repeats(*item, last)
            if not _nullable(*item):
                break
    return found


def backtracking_shapes(pattern: str) -> list[str]:
    """Where ``pattern`` can take more than linear time: an unbounded repeat holding
    another, or one followed (through what can match nothing) by another unbounded
    repeat that matches some of the same characters."""
    problems: list[str] = []

    def walk(seq) -> None:
        items = list(seq)
        for position, (op, av) in enumerate(items):
            if _unbounded(op, av) and any(
                    _unbounded(*inner) or _edge_repeats(*inner, False) for inner in av[2]):
                problems.append(f"nested unbounded repeats at item {position}")
            for ending in _edge_repeats(op, av, True):
                for follower in items[position + 1:]:
                    if any(ending & starting for starting in _edge_repeats(*follower, False)):
                        problems.append(f"overlapping unbounded repeats after item {position}")
                    if not _nullable(*follower):
                        break
            name = str(op)
            inner = ([av[2]] if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
                     else [av[3]] if name == "SUBPATTERN"
                     else list(av[1]) if name == "BRANCH" else [])
            for sub in inner:
                walk(sub)

    walk(sre_parse.parse(pattern))
    return problems


def test_the_check_finds_the_patterns_that_took_quadratic_time():
    # The -q key/value, the dcgmi heading and the "Pass - GPUs:" patterns before, and
    # the number pattern of cell values: each took seconds on one long line.
    for old in (r"^( *)(\S.*?)\s+:\s?(.*)$", r"^[|+]-+\s+(\w[\w ]*?)\s+-+\+",
                r"^(Pass|Fail|Skip|Warn)\s*-\s*GPUs?:\s*([\d,\s]+)$",
                r"^(-?\d+)(?:\s*[A-Za-z%()]*)?\s*(?:x)?$", r"^(a+)+$"):
        assert backtracking_shapes(old), old
    for fine in (r"^Link (\d+): ([^:]+):\s*(\S.*)$", r"^GPU\s+([0-9A-F]{4,8}:\d\d)\s*$"):
        assert backtracking_shapes(fine) == [], fine


@pytest.mark.parametrize("module", [g, g_smi, g_csv, g_nvlink, g_record, logs, gpu_health_input])
def test_every_pattern_of_the_parsers_is_linear_and_at_module_level(module):
    patterns = {name: value for name, value in vars(module).items()
                if isinstance(value, re.Pattern)}
    assert patterns or module is gpu_health_input
    for name, pattern in patterns.items():
        assert backtracking_shapes(pattern.pattern) == [], name
    # No pattern hides in a function, out of this check's sight.
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    for function in [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]:
        calls = [node for node in ast.walk(function) if isinstance(node, ast.Call)
                 and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                 and node.func.value.id == "re"]
        assert calls == [], f"{module.__name__}.{function.name} calls re itself"


# --- the kernel log in every form, and the notices without an Xid ---------------------------

XID_LINE = "NVRM: Xid (PCI:0000:17:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


@pytest.mark.parametrize("line,time", [
    (f"{XID_LINE}", None),                                                        # dmesg -t, grep
    (f"[ 6781741.548779] {XID_LINE}", "6781741.548779"),                           # dmesg
    (f"[Sun Feb  3 16:24:18 2025] {XID_LINE}", "Sun Feb  3 16:24:18 2025"),         # dmesg -T
    (f"[  +0.000012] {XID_LINE}", "+0.000012"),                                     # dmesg --reltime
    (f"[Feb23 16:24] {XID_LINE}", "Feb23 16:24"),                                   # dmesg --reltime
    (f"2024-11-15T12:02:03,470068+00:00 {XID_LINE}", "2024-11-15T12:02:03,470068+00:00"),  # iso
    (f"kern  :warn  : [  12.500000] {XID_LINE}", "12.500000"),                      # dmesg -x
    (f"Nov 29 11:28:11 zeus kernel: {XID_LINE}", "Nov 29 11:28:11"),                # journalctl -k
    (f"Nov  9 11:28:11.123456 zeus kernel: {XID_LINE}", "Nov  9 11:28:11.123456"),  # short-precise
    (f"2026-12-02T02:42:57+0000 zeus kernel: {XID_LINE}", "2026-12-02T02:42:57+0000"),  # short-iso
    (f"2026-12-02T02:42:57.123456+00:00 zeus kernel: {XID_LINE}",
     "2026-12-02T02:42:57.123456+00:00"),                                         # short-iso-precise
    (f"Wed 2026-12-02 02:42:57 UTC zeus kernel: {XID_LINE}", "Wed 2026-12-02 02:42:57 UTC"),  # full
    (f"[  123.456789] zeus kernel: {XID_LINE}", "123.456789"),                     # short-monotonic
    (f"Dec  2 11:49:53 worker4 kernel: [  885.242168] {XID_LINE}", "Dec  2 11:49:53"),  # syslog
])
def test_xid_lines_in_every_form_dmesg_and_journalctl_print(line, time):
    assert logs.parse_kernel_log([line]) == [{"time": time, "pci": "0000:17:00", "code": 79,
                                              "pid": None, "process": None,
                                              "text": "GPU has fallen off the bus."}]
    assert g.detect_kind(line) == "kernel_log"


def test_an_xid_line_that_cannot_be_read_makes_the_log_unreadable():
    with pytest.raises(UnreadableOutput, match=r"line 2 is an Xid line whose PCI address or code"):
        logs.read_kernel_log([XID_LINE, "NVRM: Xid (PCI:garbled): 79, x"])
    mig = "NVRM: Xid (PCI:0000:3b:00 GPU-I:05): 43, pid=12, name=python3, Ch 00000001"
    assert logs.parse_kernel_log([mig])[0]["pci"] == "0000:3b:00"


def test_kernel_notices_of_a_failing_gpu_without_an_xid():
    log = read_notices = logs.read_kernel_log(lines(
        HEALTH, "xid-dmesg-79-fallen-off-bus-plus-nvswitch-sxid-20034-blockquote-unwrapped-01.txt"))
    assert read_notices["notices"] == [{"time": "6781741.548783", "pci": "0000:91:00",
                                        "notice": "fallen_off_bus",
                                        "text": "GPU has fallen off the bus."}]
    assert verdict(None, xids=log["events"], notices=log["notices"]) == (
        "failing", ["xid_79", "gpu_fallen_off_bus"])
    # NVIDIA/NVSentinel#155: the three-line form, no Xid; NVIDIA/gpu-operator#649, #1146.
    dmesg = ["[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0",
             "               NVRM: (PCI ID: 10de:26b5) installed in this system has",
             "               NVRM: fallen off the bus and is not responding to commands.",
             "[ 1843.439662] NVRM: The NVIDIA probe routine failed for 1 device(s).",
             "Dec  2 11:49:53 worker4 kernel: [  885.242168] NVRM: GPU 0000:0a:00.0: RmInitAdapter failed! (0x24:0x72:1568)",
             "Dec  2 11:49:53 worker4 kernel: [  885.242457] NVRM: GPU 0000:0a:00.0: rm_init_adapter failed, device minor number 5",
             "[ 1097.650377] NVRM: GPU 0000:04:01.0: GPU serial number is 1653723052734."]
    read = logs.read_kernel_log(dmesg)
    assert read["events"] == []
    assert [(n["time"], n["pci"], n["notice"]) for n in read["notices"]] == [
        ("1843.308145", "0000:b3:00", "fallen_off_bus"), ("Dec  2 11:49:53", "0000:0a:00", "init_failed"),
        ("Dec  2 11:49:53", "0000:0a:00", "init_failed")]
    assert read["notices"][0]["text"] == ("(PCI ID: 10de:26b5) installed in this system has fallen "
                                          "off the bus and is not responding to commands.")
    result = gpu_verdict(None, notices=read["notices"][1:])
    assert result["verdict"] == "failing" and [r["code"] for r in result["reasons"]] == ["gpu_init_failed"]
    assert result["reasons"][0]["detail"] == ("kernel log: the driver could not initialise the GPU "
                                              "(RmInitAdapter failed): 2 notice(s), first Dec  2 "
                                              "11:49:53, last Dec  2 11:49:53")


# --- the host's verdicts: what was read but says nothing of a GPU ---------------------------

def test_host_gpu_health_never_reads_what_it_could_not_read_as_ok():
    inventory = _h200_state()["gpus"] + [{"index": 1, "name": "NVIDIA H200", "uuid": "GPU-2",
                                          "pci_bus_id": "00000000:17:00.0"}]
    health = g_smi.parse_query_text(q_text(attached=2))  # one GPU listed, two attached
    result = host_gpu_health(_h200_state(gpus=inventory, gpu_health=health), [0, 1])
    assert list(result) == [H200_BUS, "00000000:17:00.0"]  # "missing": the inventory names it
    assert result[H200_BUS]["verdict"] == "ok"
    assert (result["00000000:17:00.0"]["verdict"], [r["code"] for r in result["00000000:17:00.0"]["reasons"]]) == (
        "unknown", ["health_not_read"])
    # Without an inventory the GPUs counted but not listed stand on their own.
    alone = host_gpu_health(_h200_state(gpus=None, gpu_health=health), [0])
    assert alone["missing"]["verdict"] == "unknown" and alone["missing"]["index"] is None
    # A kernel log that could not be read: every GPU unknown, never "no Xid".
    unread = host_gpu_health(_h200_state(xid=None), [0])[H200_BUS]
    assert (unread["verdict"], [r["code"] for r in unread["reasons"]]) == ("unknown", ["kernel_log_not_read"])
    assert "xid_events" not in unread["counters"]
    # A GPU the device-handle error names, and a notice of a GPU no longer listed.
    lost = g_smi.parse_query_text(q_text("Unable to determine the device handle for GPU 0000:17:00.0: "
                                     "Unknown Error", attached=2))
    notice = {"time": "1", "pci": "0000:b3:00", "notice": "fallen_off_bus", "text": "x"}
    result = host_gpu_health(_h200_state(gpu_health=lost, xid={"source": "journal", "events": [],
                                                              "notices": [notice]}), [0])
    assert result["00000000:17:00.0"]["verdict"] == "unknown"
    assert [r["code"] for r in result["0000:b3:00"]["reasons"]] == ["gpu_fallen_off_bus"]
    assert result["0000:b3:00"]["verdict"] == "failing" and result[H200_BUS]["verdict"] == "ok"
    # Not read at all (the key absent): nothing is said, as before.
    assert host_gpu_health({"gpus": inventory}, [0])[H200_BUS]["verdict"] == "ok"


def test_an_output_the_facts_cannot_read_fails_the_host_never_reads_healthy():
    # pyinfra's "could not process fact" fails that host alone, with the reason (facts/base.py).
    with pytest.raises(FactProcessError, match="line 2 is 40005 characters long"):
        g.GpuHealth().process(["GPU 00000000:17:00.0", "    a" + " " * 40_000])
    with pytest.raises(FactProcessError, match="Xid line whose PCI address or code"):
        g.XidEvents().process(["##SOURCE dmesg", "[ 1.5] NVRM: Xid (PCI:x): 79, text"])
    assert g.XidEvents().process(["##SOURCE dmesg", f"[ 1.5] {XID_LINE}"])["events"][0]["code"] == 79


def test_device_handle_errors_in_a_csv_and_a_q_with_no_gpu_block():
    bare = lines(H200, "query-gpu-health-csv-noheader-nounits.txt")
    lost = "Unable to determine the device handle for GPU 0000:17:00.0: Unknown Error"
    assert g_csv.health_csv_fields([lost] + bare) == g_csv.HEALTH_QUERY_FIELDS
    parsed = g_csv.parse_health_csv([lost] + bare, g_csv.health_csv_fields([lost] + bare))
    assert sorted(parsed) == ["00000000:00:06.0", "00000000:17:00.0"]
    assert verdict(parsed["00000000:17:00.0"]) == ("unknown", ["gpu_unreadable"])
    assert verdict(parsed[H200_BUS]) == ("ok", [])
    assert g_csv.health_csv_fields(lines(H200, "query-gpu-health-csv.txt")) is None
    # nvidia-smi -q saying two GPUs are attached and listing none of them.
    only = g_smi.parse_query_text(["==============NVSMI LOG==============",
                               "Attached GPUs                             : 2"])
    assert list(only) == ["missing"] and only["missing"]["unreadable"]["attached"] == 2
