"""The whole run on a fleet of eight sandbox hosts, as an operator runs it.

Mixed scenarios: two good servers (seed), two without an NVLink bridge (pcie), two whose
loaded module is older than the installed driver (mismatch), one without a driver
(bare) and one with a single H200 (h200). One `deploys/full.py` run over all of them:
the seed hosts converge, the real vLLM 0.6.3 and the model included, and every other
host stops alone with its scenario's reason; the second run changes nothing. Then the
audit with drift (`python -m tools.audit`): no drift on the converged hosts (exit 0),
and after a sysctl is changed by hand on one of them, that host and that operation
(exit 1). Every run and audit says vllm_device=cuda, vllm_version=0.6.3 (conftest.CUDA_063):
the fleet's scenarios are GPU failure modes, and the sandbox's own data serves on CPU.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from sandbox.util import REPO_ROOT
from tests.e2e.conftest import CUDA_063, booted

pytestmark = pytest.mark.e2e

SCENARIOS = ["seed", "pcie", "mismatch", "bare", "seed", "h200", "pcie", "mismatch"]
SEED = ["gpu-sbx-1", "gpu-sbx-5"]
REASONS = {
    "gpu-sbx-2": "preflight tp_nvlink: no 2 GPUs are joined by NVLink",
    "gpu-sbx-3": "preflight driver_module_match: loaded kernel module 535.104.05",
    "gpu-sbx-4": "reboot required to load its kernel module",
    "gpu-sbx-6": "preflight gpu_count:",
    "gpu-sbx-7": "preflight tp_nvlink: no 2 GPUs are joined by NVLink",
    "gpu-sbx-8": "preflight driver_module_match: loaded kernel module 535.104.05",
}
OP_SYSCTL = "full | sysctl | Sysctl: kernel parameters persisted and applied"


@pytest.fixture(scope="module")
def fleet():
    with booted(SCENARIOS, leave_up_for="gpu-health") as sandbox:
        yield sandbox


def full_run(sandbox, timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict]:
    proc = sandbox.pyinfra("--json", *CUDA_063, "deploys/full.py", timeout=timeout)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return proc, json.loads(proc.stdout)


def hosts_with(data: dict, outcome: str) -> set[str]:
    return {host for op in data["results"]["operations"] for host in op[outcome]}


def audit(sandbox, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.audit", str(sandbox.inventory), *sandbox.report_data(),
         *CUDA_063, *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )


def test_first_run_converges_the_good_hosts_and_stops_the_others(fleet):
    proc, data = full_run(fleet, timeout=1800)
    failed = hosts_with(data, "error")
    assert failed == set(REASONS)
    for name, reason in REASONS.items():
        assert any(line.strip().startswith(f"[{name}]") and reason in line
                   for line in proc.stderr.splitlines()), (name, proc.stderr[-4000:])
    for name in SEED:
        active = fleet.ssh(fleet.host(name), "readlink /opt/vllm/current && systemctl "
                                             "is-enabled vllm && ls /srv/models/sandbox/"
                                             "tiny-qwen2/config.json").stdout.split()
        assert active[1:] == ["enabled", "/srv/models/sandbox/tiny-qwen2/config.json"]


def test_second_run_changes_nothing(fleet):
    _, data = full_run(fleet)
    assert data["results"]["totals"]["success"] == 0
    assert hosts_with(data, "error") == set(REASONS)  # still refused, still untouched


def test_a_converged_host_is_read_in_at_most_five_remote_commands(fleet):
    # pyinfra_vllm/run/host_reads.py: the whole run's reads in one command; -vvv prints each
    # remote command once, behind ">>> ".
    proc = fleet.pyinfra("-vvv", *CUDA_063, "deploys/full.py")
    lines = (proc.stdout + proc.stderr).splitlines()
    for name in SEED:
        commands = [line for line in lines if line.strip().startswith(f"[{name}] >>> ")]
        assert 1 <= len(commands) <= 5, (name, [line[:160] for line in commands])


def test_planning_a_converged_host_reads_every_fact_in_the_one_command(fleet):
    # --dry plans the whole run and executes nothing: every fact the stages read is read
    # while planning. -v logs each fact pyinfra loads from a host ("Loaded fact"); --debug
    # logs each read the one read did not answer (pyinfra_vllm/run/host_reads.py: "was
    # not read with the host's state"). On a converged host the one read is the only fact
    # loaded.
    limits = [arg for name in SEED for arg in ("--limit", name)]
    proc = fleet.pyinfra("-v", "--debug", "--dry", *limits, *CUDA_063, "deploys/full.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    for name in SEED:
        loaded = [re.sub(r"^.*?Loaded fact ", "", line) for line in lines
                  if re.match(rf"\s*\[{name}\]\s+Loaded fact ", line)]
        assert [fact.split()[0] for fact in loaded] == ["facts.host_state.StateSections"], (
            name, loaded)
        alone = [line.strip() for line in lines if f"{name}: " in line
                 and "was not read with the host's state" in line]
        assert alone == [], (name, alone)
        failed = [line.strip() for line in lines if re.match(rf"\s*\[{name}\]", line)
                  and ("could not load fact" in line or "could not process fact" in line)]
        assert failed == [], (name, failed)


def test_audit_no_drift_then_one_drifted_host(fleet):
    limits = [arg for name in SEED for arg in ("--limit", name)]
    clean = audit(fleet, *limits)
    assert clean.returncode == 0, clean.stdout[-2000:] + clean.stderr[-2000:]

    fleet.ssh(fleet.host(SEED[1]), "sysctl -qw net.core.somaxconn=128")
    drifted = audit(fleet, *limits)
    assert drifted.returncode == 1
    lines = [line for line in drifted.stderr.splitlines() if line.startswith("drift:")]
    assert lines == [f"drift: host {SEED[1]}: 1 operation(s) would change: "
                     "Sysctl: kernel parameters persisted and applied [sysctl]"]

    everyone = audit(fleet)  # the refused hosts count too
    assert everyone.returncode == 1
    refused = {line.split()[2].rstrip(":") for line in everyone.stderr.splitlines()
               if line.startswith("drift: host") and ": refused:" in line}
    assert refused == set(REASONS)
