"""tools/gpu_health.py run as a subprocess on real saved outputs: exit status and JSON."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.unit.test_gpu_health import H200, H200_BUS, H200_HEALTH_FILES, HEALTH, REPO, path


def run(*args: str) -> tuple[int, dict, str]:
    done = subprocess.run([sys.executable, "-m", "tools.gpu_health", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    report = json.loads(done.stdout) if done.stdout.strip() else {}
    return done.returncode, report, done.stderr


def test_h200_every_health_capture_is_ok():
    files = [str(path(H200, name)) for name in H200_HEALTH_FILES]
    code, report, _ = run(*files)
    assert code == 0
    assert report["gpus"] == {H200_BUS: {"verdict": "ok", "reasons": []}}
    kinds = {name.rsplit("/", 1)[-1]: kind for name, kind in report["files"].items()}
    assert kinds["q.txt"] == "query_text" and kinds["q-x.xml"] == "query_xml"
    assert kinds["nvlink-e.txt"] == "empty" and kinds["dmesg-NVRM.txt"] == "kernel_log"
    assert kinds["query-retired-pages-csv.txt"] == "retired_pages_csv"
    assert len(kinds) == len(H200_HEALTH_FILES)


def test_unknown_file_exits_2_and_names_it():
    other = str(path(H200, "os-release.txt"))
    code, report, stderr = run(str(path(H200, "q.txt")), other)
    assert code == 2 and report == {}
    assert other in stderr
    code, _, stderr = run("/nonexistent/gpu-health.txt")
    assert code == 2 and "/nonexistent/gpu-health.txt" in stderr


def test_a10_pending_remap_is_failing():
    code, report, _ = run(str(path(HEALTH, "q-A10-driver535-remapped-rows-pending-uncorrectable4-01.txt")))
    assert code == 1
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


def test_dcgmi_failed_gpu_and_unattributed_failure():
    code, report, _ = run(str(path(HEALTH, "dcgmi-diag-r2-excerpt-gpu-memory-fail-gpu0-thermal-violation-warning-01.txt")))
    assert code == 1
    assert report["gpus"]["0"]["verdict"] == "failing"
    assert report["gpus"]["1"] == {"verdict": "ok", "reasons": []}
    assert report["diag"]["tests"]["GPU Memory"]["result"] == "Fail"
    code, report, _ = run(str(path(HEALTH, "dcgmi-diag-r2-8xB200-dcgm4.4.1-driver570-pcie-fail-internal-error-01.txt")))
    assert code == 1  # pcie failed with an internal error, no GPU blamed
    assert sorted(report["gpus"]) == [str(i) for i in range(8)]
    assert all(gpu["verdict"] == "ok" for gpu in report["gpus"].values())


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
