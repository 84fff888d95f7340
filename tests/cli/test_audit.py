"""python -m tools.audit against @local, for real: always a --dry pyinfra run, so nothing
on this machine changes. This machine has no NVIDIA driver. With the model lock of
Qwen3.6-27B, preflight refuses it (vLLM 0.6.3, the default stack, cannot load the
model); without the model stage (no lock needed), the driver stage plans an install and
then refuses it ("reboot required")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyinfra_vllm.core.settings import STAGES

SYSCTL_DROP_IN = Path("/etc/sysctl.d/60-vllm.conf")
CONFIG = Path(__file__).resolve().parents[1] / "fixtures/hf/qwen3.6-27b/config.json"


def audit(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    # No API key here: the settings refuse that unless the gateway is opened on purpose.
    return subprocess.run(
        [sys.executable, "-m", "tools.audit", "@local", *args, "--data", "gateway_open=true"],
        capture_output=True, text=True, timeout=180, env=env,
    )


def report_of(run: subprocess.CompletedProcess, directory: Path) -> dict:
    (json_path,) = sorted(directory.glob("audit-*.json"))
    assert f"Audit reports written to {json_path}" in run.stderr
    return json.loads(json_path.read_text())["hosts"]["@local"]


def skip_all_but(*kept: str) -> str:
    return "skip_stages=" + json.dumps([stage for stage in STAGES if stage not in kept])


@pytest.fixture(scope="module", autouse=True)
def no_driver_here():
    if Path("/proc/driver/nvidia/version").exists():
        pytest.skip("these tests expect a machine without an NVIDIA driver")


@pytest.fixture
def qwen36_lock(tmp_path) -> Path:
    """A lock as tools.model_lock writes it (sizes of the real repo's weights)."""
    files = [{"path": "config.json", "size": 1234, "algo": "git-blob-sha1", "digest": "1" * 40,
              "lfs": False}]
    files += [{"path": f"model-0000{i}-of-00002.safetensors", "size": size, "algo": "sha256",
               "digest": str(i) * 64, "lfs": True}
              for i, size in ((1, 30_000_000_000), (2, 25_600_000_000))]
    lock = {"lock_version": 1, "model_id": "Qwen/Qwen3.6-27B", "revision": "main",
            "commit": "0" * 40, "base_url": "https://huggingface.co",
            "created": "2026-11-29T00:00:00+00:00", "total_size": 55_600_001_234,
            "config": json.loads(CONFIG.read_text()), "files": files}
    path = tmp_path / "lock.json"
    path.write_text(json.dumps(lock))
    return path


def supported_os(entry: dict) -> bool:
    return next(c["ok"] for c in entry["checks"] if c["name"] == "os") is True


def test_preflight_refuses_the_model_and_the_report_says_why(tmp_path, qwen36_lock):
    reports = tmp_path / "reports"
    run = audit("--data", f"audit_report_dir={reports}", "--data", f"model_lock={qwen36_lock}")
    assert run.returncode == 1, run.stderr
    entry = report_of(run, reports)
    reasons = entry["refused"]
    assert any(r.startswith("preflight model_architecture: vLLM 0.6.3 cannot load "
                            "Qwen3_5ForConditionalGeneration") for r in reasons), reasons
    for reason in reasons:
        assert f"drift: host @local: refused: {reason}" in run.stderr
    # Preflight stops the host before any stage plans a change.
    assert entry["drift"] == []
    assert "audit: 1 of 1 host(s) drifted or refused" in run.stderr
    arch = entry["compatibility"][0]
    assert (arch["name"], arch["ok"]) == ("model_architecture", False)
    assert entry["capacity"]["weights_source"] == "lock"
    assert entry["capacity"]["kv_bytes_per_token"] == 65536


def test_a_host_refused_after_planned_changes(tmp_path):
    run = audit("--data", f"audit_report_dir={tmp_path}", "--data", 'skip_stages=["model"]')
    assert run.returncode == 1, run.stderr
    entry = report_of(run, tmp_path)
    assert entry["refused"], entry
    for reason in entry["refused"]:
        assert f"drift: host @local: refused: {reason}" in run.stderr
    if supported_os(entry):
        # Preflight lets a driverless host through; the driver stage plans the install,
        # then stops the host until it reboots. The refusal itself is not drift.
        (reason,) = entry["refused"]
        assert "reboot required" in reason
        assert entry["drift"][0] == {
            "operation": "Driver: install nvidia-headless-535-server", "stage": "driver"
        }
        assert "Driver: reboot required" not in json.dumps(entry["drift"])
    assert entry["compatibility"] is None and entry["capacity"] is None
    assert entry["model_note"].startswith("no model lock")


def test_only_preflight_on_a_supported_host_is_converged(tmp_path):
    run = audit("--data", f"audit_report_dir={tmp_path}", "--data", skip_all_but("preflight"))
    entry = report_of(run, tmp_path)
    if not supported_os(entry):
        assert run.returncode == 1 and entry["refused"][0].startswith("preflight os")
        return
    assert run.returncode == 0, run.stderr
    assert (entry["drift"], entry["refused"]) == ([], [])
    assert run.stderr.rstrip().endswith("audit: 1 host(s) converged, none refused")
    (row,) = [line for line in run.stderr.splitlines() if line.startswith("@local  ")]
    assert row.endswith("  converged")  # the table's drift column


@pytest.mark.skipif(SYSCTL_DROP_IN.exists(), reason="the sysctl drop-in exists on this machine")
def test_sysctl_alone_would_write_its_drop_in(tmp_path):
    run = audit("--data", f"audit_report_dir={tmp_path}", "--data", skip_all_but("sysctl"))
    assert run.returncode == 1, run.stderr
    entry = report_of(run, tmp_path)
    sysctl = {"operation": "Sysctl: kernel parameters persisted and applied", "stage": "sysctl"}
    assert (entry["drift"], entry["refused"]) == ([sysctl], [])
    assert (
        "drift: host @local: 1 operation(s) would change: "
        "Sysctl: kernel parameters persisted and applied [sysctl]" in run.stderr
    )
    assert not SYSCTL_DROP_IN.exists()  # --dry: nothing was written
    md = sorted(tmp_path.glob("audit-*.md"))[0].read_text()
    assert "| @local | 1 change(s) | Sysctl: kernel parameters persisted and applied [sysctl] | - |" in md


def test_a_pyinfra_failure_exits_2_with_its_message(tmp_path):
    run = audit("--data", f"audit_report_dir={tmp_path}", "--data", "block_size=24")
    assert run.returncode == 2
    assert "audit: pyinfra failed (exit 1):" in run.stderr
    assert "block_size = 24: Input should be 8, 16 or 32" in run.stderr.split("audit: pyinfra")[1]
    assert not list(tmp_path.iterdir())


def test_the_audit_never_runs_with_yes():
    run = audit("-y")
    assert run.returncode == 2
    assert "never with -y" in run.stderr


def test_a_second_audit_says_what_changed_and_keeps_the_newest_sets(tmp_path):
    first = audit("--data", f"audit_report_dir={tmp_path}", "--data", skip_all_but("preflight"))
    assert first.returncode in (0, 1), first.stderr
    (first_json,) = sorted(tmp_path.glob("audit-*.json"))
    second = audit("--data", f"audit_report_dir={tmp_path}", "--data", skip_all_but("sysctl"),
                   "--data", "audit_report_keep=1")
    assert second.returncode in (1, 2), second.stderr
    # The first set is gone (keep 1), the second is what latest.* point at.
    (json_path,) = sorted(tmp_path.glob("audit-*.json"))
    assert json_path != first_json and not first_json.exists()
    assert sorted(p.suffix for p in tmp_path.glob("audit-*")) == [".html", ".json", ".md"]
    for suffix in (".json", ".md", ".html"):
        assert (tmp_path / f"latest{suffix}").resolve() == json_path.with_suffix(suffix).resolve()
    assert "1 older report set(s) removed (audit_report_keep)" in second.stderr
    found = json.loads(json_path.read_text())["changes"]
    assert found["previous"]["file"] == first_json.name
    assert (found["added"], found["removed"]) == ([], [])
    if not SYSCTL_DROP_IN.exists():
        # Only preflight ran first, converged or refused; now sysctl would write its drop-in.
        ops = next(c for c in found["hosts"]["@local"] if c["field"] == "operations")
        assert ops["added"] == ["Sysctl: kernel parameters persisted and applied [sysctl]"]
        md = json_path.with_suffix(".md").read_text()
        # The item is text from the host: its brackets escaped in Markdown.
        assert ("- @local: operations that would change, new: Sysctl: kernel parameters "
                "persisted and applied \\[sysctl\\]") in md
