"""tools/gpu_health.py run as a subprocess on real saved outputs: exit status and JSON
(0 every GPU ok, 1 one is not, 2 input that could not be read)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_gpu_health import (
    H200,
    H200_BUS,
    H200_HEALTH_FILES,
    HEALTH,
    REPO,
    h200_xml,
    path,
    q_text,
    text,
)


def run(*args: str) -> tuple[int, dict, str]:
    done = subprocess.run([sys.executable, "-m", "tools.gpu_health", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    report = json.loads(done.stdout) if done.stdout.strip() else {}
    return done.returncode, report, done.stderr


OK = {"verdict": "ok", "codes": [], "reasons": []}


def test_h200_every_health_capture_is_ok():
    files = [str(path(H200, name)) for name in H200_HEALTH_FILES]
    code, report, _ = run(*files)
    assert code == 0
    assert report["gpus"] == {H200_BUS: OK}
    assert (report["verdict"], report["codes"], report["reasons"]) == ("ok", [], [])
    kinds = {name.rsplit("/", 1)[-1]: kind for name, kind in report["files"].items()}
    assert kinds["q.txt"] == "query_text" and kinds["q-x.xml"] == "query_xml"
    assert kinds["nvlink-e.txt"] == "empty" and kinds["dmesg-NVRM.txt"] == "kernel_log"
    assert kinds["query-retired-pages-csv.txt"] == "retired_pages_csv"
    assert len(kinds) == len(H200_HEALTH_FILES) and "unreadable" not in report


def test_the_whole_h200_support_bundle_as_captured_is_ok():
    # python -m tools.gpu_health tests/fixtures/nvidia/h200-device-*: every file of the
    # captured bundles (folders), whatever their kinds.
    folders = sorted(str(p) for p in (REPO / "tests/fixtures/nvidia").glob("h200-device-*"))
    assert len(folders) == 3
    code, report, stderr = run(*folders)
    assert (code, stderr) == (0, "")
    assert report["gpus"] == {H200_BUS: OK} and report["verdict"] == "ok"
    every_file = sorted(str(p) for folder in folders for p in Path(folder).rglob("*") if p.is_file())
    assert sorted(report["files"]) == every_file
    kinds = {name.split("nvidia/", 1)[1]: kind for name, kind in report["files"].items()}
    assert kinds["h200-device-20261202/q.txt"] == "query_text"
    assert kinds["h200-device-20261202/q-x.txt"] == "query_xml"
    assert kinds["h200-device-20261129/q-d-performance.txt"] == "query_text"
    for other in ("h200-device-20261202/topo-m.txt", "h200-device-20261202/smi.txt",
                  "h200-device-20261202/query-gpu-csv.txt", "h200-device-20261202/pyinfra-facts.json",
                  "h200-device-20261203/query-gpu-unknown-field.txt"):
        assert kinds[other] == "unknown", other
    assert kinds["h200-device-20261202/nvlink-e.txt"] == "empty"


def test_a_truncated_failing_xml_exits_2_and_names_it(tmp_path):
    source = text(HEALTH, "q-x-xml-V100-SXM3-32GB-driver410-dbe-retired-pages-2-pending-01.xml")
    code, report, _ = run(str(path(HEALTH, "q-x-xml-V100-SXM3-32GB-driver410-dbe-retired-pages-2-pending-01.xml")))
    assert code == 1 and report["gpus"]["00000000:34:00.0"]["verdict"] == "failing"  # whole
    cut = tmp_path / "q-x-cut.xml"
    cut.write_text(source[: len(source) // 2], encoding="utf-8")
    code, report, stderr = run(str(cut), str(path(H200, "q.txt")))
    assert code == 2
    assert report["unreadable"] == {str(cut): "nvidia-smi -q -x: not well-formed XML (unclosed "
                                    "token: line 265, column 4): cut short, or holding a character "
                                    "XML does not allow"}
    assert report["files"][str(cut)] == "query_xml" and str(cut) in stderr
    assert report["gpus"] == {H200_BUS: OK}  # what the other file said is still printed


@pytest.mark.parametrize("product,declaration", [
    ("NVIDIA\x07H200", None),
    ("&lol2;", '<!DOCTYPE nvidia_smi_log [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;">]>'),
])
def test_xml_with_a_control_character_or_an_entity_exits_2(tmp_path, product, declaration):
    source = h200_xml(product, 5)
    if declaration:
        source = source.replace('<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v13.dtd">', declaration)
    bad = tmp_path / "q-x.xml"
    bad.write_text(source, encoding="utf-8")
    code, report, _ = run(str(bad))
    assert code == 2 and report["gpus"] == {} and list(report["unreadable"]) == [str(bad)]


def test_files_of_kinds_it_does_not_know_are_listed_and_skipped():
    topo = str(path("", "topo-4xA100-pcie-80gb-NV12-bridged-pairs-01.txt"))
    inventory = str(path("", "querygpu-csv-8xH200-index-name-mem-driver-power-pstate-01.txt"))
    other = str(path(H200, "os-release.txt"))
    code, report, stderr = run(str(path(H200, "q.txt")), topo, inventory, other)
    assert (code, stderr) == (0, "")
    assert [report["files"][name] for name in (topo, inventory, other)] == ["unknown"] * 3
    assert report["gpus"] == {H200_BUS: OK}
    # Nothing but such files: no GPU was judged, which is not "ok".
    code, report, _ = run(topo, other)
    assert code == 1 and report["gpus"] == {} and report["codes"] == ["no_gpu"]


def test_a_file_that_cannot_be_opened_exits_2_and_names_it():
    code, report, stderr = run("/nonexistent/gpu-health.txt")
    assert code == 2 and report == {} and "/nonexistent/gpu-health.txt" in stderr
    code, report, stderr = run(str(path(H200, "q.txt")), "/nonexistent/gpu-health.txt")
    assert code == 2 and report["files"]["/nonexistent/gpu-health.txt"] == "unreadable"
    assert report["unreadable"]["/nonexistent/gpu-health.txt"].startswith("cannot be opened: ")
    assert report["gpus"] == {H200_BUS: OK}


def test_a_device_handle_error_and_an_empty_gpu_block_are_not_ok(tmp_path):
    lost = tmp_path / "smi.txt"
    lost.write_text("Unable to determine the device handle for GPU 0000:0B:00.0: Unknown Error\n",
                    encoding="utf-8")
    code, report, _ = run(str(lost))
    assert code == 1 and report["files"][str(lost)] == "device_error"
    assert report["gpus"]["00000000:0B:00.0"]["verdict"] == "unknown"
    assert report["gpus"]["00000000:0B:00.0"]["codes"] == ["gpu_unreadable"]
    empty = tmp_path / "q.txt"
    empty.write_text("\n".join(q_text("GPU 00000000:17:00.0", attached=2)), encoding="utf-8")
    code, report, _ = run(str(empty))
    assert code == 1 and report["gpus"]["00000000:17:00.0"]["codes"] == ["gpu_no_data"]
    assert report["gpus"][H200_BUS] == OK and report["verdict"] == "unknown"


@pytest.mark.parametrize("length", [40_000, 1_000_000])
def test_a_gpu_header_and_one_long_line_exit_2(tmp_path, length):
    long = tmp_path / "q.txt"
    # Spaces with no colon after them: the shape the old key/value pattern took
    # quadratic time on (4 s at 40,000 characters).
    long.write_text("GPU 00000000:17:00.0\n" + "    a" + " " * length + "b\n", encoding="utf-8")
    code, report, stderr = run(str(long))
    assert code == 2 and report["files"][str(long)] == "query_text"
    assert report["unreadable"][str(long)] == (
        f"nvidia-smi -q: line 2 is {length + 6} characters long, over the 16384 a line of it may "
        "have: the output is not read")


def test_nvidia_smi_that_cannot_talk_to_nvml_is_not_ok():
    mismatch = str(path("", "smi-error-driver-library-version-mismatch-01.txt"))
    code, report, _ = run(mismatch, str(path(H200, "dmesg-NVRM.txt")))
    assert code == 1 and report["files"][mismatch] == "nvml_error"
    assert report["codes"] == ["nvml_error", "no_gpu"] and report["verdict"] == "unknown"
    assert "Driver/library version mismatch" in report["reasons"][0]


def test_a10_pending_remap_is_failing():
    code, report, _ = run(str(path(HEALTH, "q-A10-driver535-remapped-rows-pending-uncorrectable4-01.txt")))
    assert code == 1 and report["verdict"] == "failing"
    gpu = report["gpus"]["00000000:07:00.0"]
    assert gpu["verdict"] == "failing"
    assert gpu["reasons"] == ["uncorrectable memory errors with a repair (row remap, page retirement, "
                              "channel/TPC repair) pending a reset: reset the GPU when no process uses "
                              "it (nvidia-smi -r -i N), or reboot"]


def test_xid_of_a_gpu_nvidia_smi_no_longer_lists():
    code, report, _ = run(str(path(H200, "q.txt")),
                          str(path(HEALTH, "xid-dmesg-79-fallen-off-bus-plus-nvswitch-sxid-20034-blockquote-unwrapped-01.txt")))
    assert code == 1
    assert report["gpus"][H200_BUS]["verdict"] == "ok"
    assert report["gpus"]["0000:91:00"]["verdict"] == "failing"
    assert report["gpus"]["0000:91:00"]["reasons"][0].startswith("Xid 79 (GPU has fallen off the bus): 1 event(s)")
    assert report["gpus"]["0000:91:00"]["codes"] == ["xid_79", "gpu_fallen_off_bus"]


def test_dcgmi_verdicts_and_the_exit_status_agree():
    code, report, _ = run(str(path(HEALTH, "dcgmi-diag-r2-excerpt-gpu-memory-fail-gpu0-thermal-violation-warning-01.txt")))
    assert code == 1
    assert report["gpus"]["0"]["verdict"] == "failing"
    assert report["gpus"]["0"]["codes"] == ["dcgmi_failed", "dcgmi_incomplete"]
    # The table is cut short: the tests after the cut are unknown, not passed.
    assert report["gpus"]["1"]["verdict"] == "unknown" and report["gpus"]["1"]["codes"] == ["dcgmi_incomplete"]
    assert report["diag"]["tests"]["GPU Memory"]["result"] == "Fail"
    code, report, _ = run(str(path(HEALTH, "dcgmi-diag-r2-8xB200-dcgm4.4.1-driver570-pcie-fail-internal-error-01.txt")))
    # pcie failed with an internal error, no GPU blamed: its result on each GPU is unknown.
    assert code == 1 and report["verdict"] == "unknown"
    assert sorted(report["gpus"]) == [str(i) for i in range(8)]
    assert {gpu["verdict"] for gpu in report["gpus"].values()} == {"unknown"}
    assert report["gpus"]["3"]["reasons"] == [
        "dcgmi diag test 'pcie' failed and blamed no GPU (an internal error): its result on GPU 3 "
        "is unknown: check DCGM and its logs, then run dcgmi diag again and save all of its output"]


def test_rtx_idle_gen1_is_ok_and_nvlink_tp():
    code, report, _ = run(str(path(HEALTH, "query-gpu-csv-all-fields-RTX2080S-driver595-idle-sw-power-cap-active-pcie-gen1-masked-01.txt")))
    assert code == 0 and report["gpus"]["00000000:0C:00.0"]["verdict"] == "ok"
    v100 = str(path(HEALTH, "nvlink-s-7xV100-sxm2-inactive-links-several-gpus-01.txt"))
    code, report, _ = run(v100)
    assert code == 0  # no tensor-parallel group named: links are not judged
    code, report, _ = run("--tp", "2,3", v100)
    assert code == 1
    assert report["gpus"]["3"]["verdict"] == "failing" and report["gpus"]["2"]["verdict"] == "ok"
    for name in ("nvlink-s-L40S-driver595-device-has-no-nvlink-masked-01.txt",
                 "nvlink-s-H100-mig-mode-driver590-nvlink-queries-not-supported-masked-01.txt"):
        code, report, _ = run("--tp", "0", str(path(HEALTH, name)))
        assert code == 0 and report["gpus"]["0"]["verdict"] == "ok"
