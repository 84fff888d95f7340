"""node_exporter on loopback, then a clean removal, then a full run converges again.

One `seed` host with the CUDA 0.6.3 stack (the engine not started: this module is about
what the suite installs, not serving). After deploys/full.py, node_exporter listens on
127.0.0.1 only and exposes the suite's textfile. deploys/remove.py then takes off the
unit, the gateway's files, the environments, the metrics files and drop-ins; nginx stays
installed and working, the model's files stay (no remove_model_files). A second removal
changes nothing, and deploys/full.py converges the host again: its environment build, a
transient systemd unit, survives the operator's run killed in the middle of it, and the
next run attaches to it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.e2e.conftest import CUDA_063, PYINFRA, REPO_ROOT, booted

pytestmark = pytest.mark.e2e

KEY = "sk-remove-" + "0123456789abcdef" * 2
DATA = [*CUDA_063, "--data", f'api_keys=["{KEY}"]']
INSTALL_TIMEOUT = 2400
MODEL_DIR = "/srv/models/sandbox/tiny-qwen2"


def run(sandbox, deploy: str, timeout: float = 900):
    proc = sandbox.pyinfra("--json", *DATA, deploy, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def changed(data: dict) -> set[str]:
    return {op["name"] for op in data["results"]["operations"] if op["success"]}


@pytest.fixture(scope="module")
def converged():
    with booted(["seed"]) as sandbox:
        run(sandbox, "deploys/full.py", timeout=INSTALL_TIMEOUT)
        yield sandbox, sandbox.hosts[0]


def test_node_exporter_listens_on_loopback_with_the_suite_textfile(converged):
    sandbox, host = converged
    listening = sandbox.ssh(host, "ss -Hltn 'sport = :9100' | awk '{print $4}'").stdout.split()
    assert listening == ["127.0.0.1:9100"]
    metrics = sandbox.ssh(host, "curl -s http://127.0.0.1:9100/metrics").stdout
    assert "\npyinfra_vllm_info{" in metrics


def test_remove_takes_off_what_the_suite_installed_and_full_converges_again(converged):
    sandbox, host = converged
    shards = sandbox.ssh(host, f"ls {MODEL_DIR}").stdout
    data = run(sandbox, "deploys/remove.py")
    assert data["results"]["totals"]["error"] == 0
    gone = sandbox.ssh(host, "for p in /etc/systemd/system/vllm.service /opt/vllm "
                             "/etc/nginx/conf.d/vllm.conf /etc/sysctl.d/60-vllm.conf; do "
                             "test -e $p && echo $p; done; true").stdout.split()
    assert gone == []
    state = sandbox.ssh(host, "nginx -t 2>&1 | tail -1; systemctl is-active nginx; "
                              "systemctl is-active prometheus-node-exporter; true").stdout
    assert "test is successful" in state and "\nactive\n" in state
    assert state.rstrip().endswith("inactive")
    assert sandbox.ssh(host, f"ls {MODEL_DIR}").stdout == shards  # kept without the setting

    again = run(sandbox, "deploys/remove.py")
    assert again["results"]["totals"]["success"] == 0, changed(again)

    # The environment is built again, as a transient unit: the operator's run killed in
    # the middle of it, the build goes on, and the next run attaches to it.
    argv = [PYINFRA, "-y", str(sandbox.inventory), *DATA, "deploys/full.py"]
    first = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    unit = ""
    deadline = time.monotonic() + 900
    while not unit and time.monotonic() < deadline and first.poll() is None:
        time.sleep(2)
        unit = sandbox.ssh(host, "systemctl list-units --no-legend --plain --state=active "
                                 "'pyinfra-vllm-env-*' | awk '{print $1}'").stdout.strip()
        unit = unit.removesuffix(".service")
    assert unit, "the build never started as a unit"
    os.killpg(first.pid, signal.SIGKILL)  # the laptop lid closes
    first.wait(timeout=30)
    time.sleep(5)
    assert sandbox.ssh(host, f"systemctl is-active {unit}").stdout.strip() == "active"
    proc = sandbox.pyinfra("--json", *DATA, "deploys/full.py", timeout=INSTALL_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "attached to " + unit in proc.stderr, proc.stderr[-4000:]
    after = run(sandbox, "deploys/full.py")
    assert after["results"]["totals"]["success"] == 0, changed(after)
