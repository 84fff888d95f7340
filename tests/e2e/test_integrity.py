"""Hand changes on a converged, serving host: each kind is named by the audit (exit 1) and
repaired by the next run with only its own operations changing; the run after changes
nothing.

One `seed` host converged once with the sandbox's own data (vLLM 0.17.0's CPU build, the
engine serving); then, as an operator with sudo might on a real server:

- the vLLM environment: a package downgraded with pip (uv) inside it, a file of vLLM
  deleted, a package uninstalled. The audit names each; the run builds a new generation
  of the environment beside the changed one, proves it, and moves the unit to it (the
  engine restarts once); the changed one stays for rollback (python_env_keep).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.conftest import REPO_ROOT, booted

pytestmark = pytest.mark.e2e

KEY = "sk-integrity-" + "0123456789abcdef" * 2
DATA = ["--data", f'api_keys=["{KEY}"]']
INSTALL_TIMEOUT = 2400
OP_ENV = "full | python_env | Python env: vLLM 0.17.0 (torch 2.10.0, CPU) built and proven"
OP_LINK = "full | python_env | Python env: current environment"
OP_UNIT = "full | vllm_service | vLLM service: systemd unit and its environment file"
OP_RESTART = "full | vllm_service | vLLM service: restarted for its new unit"


def run(sandbox, timeout: float = 900):
    proc = sandbox.pyinfra("--json", *DATA, "deploys/full.py", timeout=timeout)
    return proc, (json.loads(proc.stdout) if proc.stdout.strip() else None)


def changed(data: dict) -> set[str]:
    return {op["name"] for op in data["results"]["operations"] if op["success"]}


def audit(sandbox, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.audit", str(sandbox.inventory), *DATA, *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )


def found_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if ": found: " in line]


@pytest.fixture(scope="module")
def served():
    """One seed host, converged once with the engine started: (sandbox, host)."""
    with booted(["seed"]) as sandbox:
        host = sandbox.hosts[0]
        proc, data = run(sandbox, timeout=INSTALL_TIMEOUT)
        if data is None or proc.returncode != 0:
            pytest.fail(f"first run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        yield sandbox, host


def current_env(sandbox, host) -> str:
    return sandbox.ssh(host, "readlink /opt/vllm/current").stdout.strip()


def test_a_converged_host_audits_clean(served):
    sandbox, _ = served
    proc = audit(sandbox)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert found_lines(proc) == []


def test_environment_changes_are_named_then_rebuilt_beside(served):
    sandbox, host = served
    env = current_env(sandbox, host)
    site = sandbox.ssh(host, f"ls -d {env}/lib/python3*/site-packages").stdout.strip()
    # As root through sudo, which drops the proxy's CA from the environment.
    uv = "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt /opt/vllm/uv/bin/uv pip"
    target = f"--python {env}/bin/python"

    # 1. A package downgraded by hand (from the host's uv cache or PyPI).
    sandbox.ssh(host, f"{uv} install -q {target} --no-deps tqdm==4.67.1", timeout=600)
    proc = audit(sandbox)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert any("tqdm 4.70.1 -> 4.67.1" in line for line in found_lines(proc)), proc.stderr

    # 2. A file of vLLM deleted.
    sandbox.ssh(host, f"rm {site}/vllm/envs.py")
    # 3. A package removed by hand.
    sandbox.ssh(host, f"{uv} uninstall -q {target} six")
    proc = audit(sandbox)
    assert proc.returncode == 1
    found = " ".join(found_lines(proc))
    assert "tqdm 4.70.1 -> 4.67.1" in found
    assert "six 1.17.0 removed" in found
    assert "vllm: 1 file(s) changed" in found

    # The repair: a new generation beside the changed one, proven, the unit moved to it.
    before_pid = sandbox.ssh(host, "systemctl show vllm -p MainPID --value").stdout.strip()
    proc, data = run(sandbox, timeout=INSTALL_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert changed(data) == {OP_ENV, OP_LINK, OP_UNIT, OP_RESTART}, changed(data)
    repaired = current_env(sandbox, host)
    assert repaired == env + "-g2"
    shown = sandbox.ssh(host, f"test -d {env} && echo kept; systemctl is-active vllm; "
                              "systemctl show vllm -p MainPID --value").stdout.split()
    assert shown[:2] == ["kept", "active"] and shown[2] != before_pid
    assert f'"{repaired}/bin/python"' in sandbox.ssh(
        host, "cat /etc/systemd/system/vllm.service").stdout

    proc, data = run(sandbox)
    assert proc.returncode == 0
    assert data["results"]["totals"]["success"] == 0, changed(data)
    proc = audit(sandbox)
    assert proc.returncode == 0, proc.stderr[-3000:]
