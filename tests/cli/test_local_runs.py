"""Real pyinfra runs against @local (this machine has no NVIDIA driver): the settings
gate, the audit, and a fact from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PYINFRA = [sys.executable, "-m", "pyinfra"]


def pyinfra(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.run(
        [*PYINFRA, *args], capture_output=True, text=True, timeout=120, env=env, cwd=cwd
    )


@pytest.fixture(scope="module", autouse=True)
def no_driver_here():
    if Path("/proc/driver/nvidia/version").exists():
        pytest.skip("these tests expect a machine without an NVIDIA driver")


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ("block_size=24", ["block_size = 24", "allowed: 8, 16, 32"]),
        ("tensor_parallel_size=0", ["tensor_parallel_size = 0", "allowed: >= 1 and <= 16"]),
        ("gpu_memory_utilization=1.5", ["gpu_memory_utilization = 1.5", "allowed: > 0 and <= 1"]),
    ],
)
def test_bad_setting_stops_the_run_before_any_operation(data, words):
    run = pyinfra("@local", "deploys/full.py", "--dry", "--data", data)
    assert run.returncode == 1
    for word in words:
        assert word in run.stderr
    assert "Beginning operation run" not in run.stderr
    assert "Proposed changes" not in run.stderr


# One case per family of the security rules (tests/unit/test_settings_rejected.py has
# them all): the run stops with exit 1 naming the key, before any operation, and no
# secret of the input is in the output.
@pytest.mark.parametrize(
    ("data", "words", "secret"),
    [
        (["vllm_host=0.0.0.0"], ["vllm_host = '0.0.0.0': not a loopback address",
                                 "vllm_listen_beyond_loopback=true"], None),
        (['api_keys=["sk-short-SECRET1"]'],
         ["api_keys = <secret>: api_keys[0] is shorter than 32 characters"], "SECRET1"),
        ([], ["api_keys is empty: the gateway would serve /v1/ to anyone; set api_keys or "
              "api_keys_file, or gateway_open=true to serve without a key"], None),
        (["model_dir=/etc"], ["model_dir = '/etc': is /etc, the distribution's",
                              "use a directory of its own outside them"], None),
        (['sysctl={"vm.swappiness": "1; reboot"}'],
         ["the value of vm.swappiness is not words of letters"], None),
        (['metrics_allow=["all"]'], ["metrics_allow[0] 'all' is not an IPv4 or IPv6 network"],
         None),
        (["nvidia_apt_repo=http://10.0.0.1:8787/"],
         ["nvidia_apt_repo = 'http://10.0.0.1:8787/': a bare URL",
          "unsigned packages run their scripts as root"], None),
        (["pip_index_url=https://bob:hunter2-SECRET2@pypi.example/simple;x"],
         ["pip_index_url = 'https://bob:***@pypi.example/simple;x'", "percent-encode it"],
         "SECRET2"),
        (['gateway_extra_directives=["include /etc/nginx/other.conf;"]'],
         ["uses include, which is refused"], None),
        (["model_id=Org/.incoming"], ["model_id = 'Org/.incoming': .incoming is a name"], None),
    ],
    ids=["vllm_host", "api_keys", "closed", "model_dir", "sysctl", "metrics_allow",
         "nvidia_apt_repo", "pip_index_url", "gateway_extra_directives", "model_id"],
)
def test_unsafe_setting_stops_the_run_before_any_operation(data, words, secret):
    args = [arg for item in data for arg in ("--data", item)]
    run = pyinfra("@local", "deploys/full.py", "--dry", *args)
    assert run.returncode == 1
    for word in words:
        assert word in run.stderr
    assert "Beginning operation run" not in run.stderr
    assert "Proposed changes" not in run.stderr
    if secret is not None:
        assert secret not in run.stdout + run.stderr


def test_audit_of_a_machine_without_driver(tmp_path):
    run = pyinfra("-y", "@local", "deploys/audit.py", "--data", f"audit_report_dir={tmp_path}",
                  "--data", "gateway_open=true")
    assert run.returncode == 0, run.stderr
    assert "no NVIDIA driver" in run.stderr
    reports = sorted(tmp_path.glob("audit-*"))
    assert [p.suffix for p in reports] == [".html", ".json", ".md"]
    html, json_path, md = reports
    assert f"Audit reports written to {json_path} and {md}" in run.stderr
    assert f"HTML report: {html}; {tmp_path}/latest.{{json,md,html}} point at this audit" in run.stderr
    assert sorted(p.name for p in tmp_path.glob("latest.*")) == [
        "latest.html", "latest.json", "latest.md"]
    assert (tmp_path / "latest.json").resolve() == json_path.resolve()
    assert "<h2>Changed since the previous audit</h2>" in html.read_text()
    report = json.loads(json_path.read_text())
    entry = report["hosts"]["@local"]
    assert entry["summary"]["driver_present"] is False
    assert entry["summary"]["verdict"] == "no NVIDIA driver"
    assert entry["state"]["gpus"] is None
    assert entry["state"]["topology"] is None
    assert "## @local" in md.read_text()


def test_audit_of_a_host_with_invalid_settings_reports_it_refused(tmp_path):
    # The default settings refuse an empty api_keys: deploys/full.py stops the run on
    # them (above); the audit reports the host refused, with its facts, and fails it.
    run = pyinfra("-y", "@local", "deploys/audit.py", "--data", f"audit_report_dir={tmp_path}")
    assert run.returncode == 1, run.stderr
    reason = ("settings: api_keys: api_keys is empty: the gateway would serve /v1/ to "
              "anyone; set api_keys or api_keys_file, or gateway_open=true to serve "
              "without a key")
    assert f"[@local] {reason}" in run.stderr
    (row,) = [line for line in run.stderr.splitlines() if line.startswith("@local  ")]
    assert row.endswith(f"  {reason}  refused")
    assert "  no NVIDIA driver  " in row  # the GPUs column: read without the settings
    html, json_path, md = sorted(tmp_path.glob("audit-*"))
    entry = json.loads(json_path.read_text())["hosts"]["@local"]
    assert entry["refused"] == [reason]
    assert entry["summary"]["verdict"] == reason
    assert entry["summary"]["driver_present"] is False
    assert entry["state"]["gpus"] is None and entry["state"]["os"]["name"]
    assert f"- Refused: {reason}" in md.read_text()
    assert f"<p>Refused:</p><ul><li>{reason}</li></ul>" in html.read_text()


def test_fact_from_the_command_line_is_absent_without_driver():
    run = pyinfra("@local", "fact", "facts.topology.GpuTopology", "facts.topology.NvlinkStatus",
                  "facts.driver.KernelModule", "--json")
    assert run.returncode == 0, run.stderr
    facts = json.loads(run.stdout)
    assert facts["facts.topology.GpuTopology"]["@local"] is None
    assert facts["facts.topology.NvlinkStatus"]["@local"] is None
    assert facts["facts.driver.KernelModule"]["@local"] is None
