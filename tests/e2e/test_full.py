"""The whole run on a fleet of eight sandbox hosts, as an operator runs it.

Mixed scenarios: two good servers on the example fleet's driver branch (seed580), one on
the design's 535 branch (seed), one without an NVLink bridge (pcie), two whose loaded
module is older than the installed driver (mismatch), one without a driver (bare) and one
with a single H200 (h200). One `deploys/full.py` run over all of them, with the example
fleet's stack and driver branch (conftest.FLEET_CUDA, read from group_data/a100_nvlink.py):
the seed580 hosts converge, the real CUDA environment of that stack built from its lock and
probed, the model included, and every other host stops alone with its scenario's reason
(the 535 hosts: the stack's CUDA runtime needs the 580 branch); the second run changes
nothing. Then the audit with drift (`python -m tools.audit`): no drift on the converged
hosts (exit 0), and after a sysctl is changed by hand on one of them, that host and that
operation (exit 1). vllm_start is false: a sandbox host has no GPU to start the CUDA
engine on, so the vllm_service stage keeps its unit in place without starting it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from files import vllm_probe
from pyinfra_vllm.core.stacks import STACKS, StackRow
from sandbox.util import REPO_ROOT
from tests.e2e.conftest import FLEET_CUDA, FLEET_VERSION, booted

pytestmark = pytest.mark.e2e

SCENARIOS = ["seed580", "pcie", "mismatch", "bare", "seed580", "h200", "seed", "mismatch"]
SEED = ["gpu-sbx-1", "gpu-sbx-5"]
# The hosts that build environments, each with its own copy of the package caches: the
# seed580 hosts here, the h200 host in test_full_gpu_health.py.
BUILDERS = [*SEED, "gpu-sbx-6"]
FLEET_STACK = STACKS[FLEET_VERSION]
DRIVER_FLOOR = (f"preflight driver_version: driver 535.129.03; the vLLM {FLEET_STACK.vllm} "
                f"stack's CUDA runtime")
REASONS = {
    "gpu-sbx-2": DRIVER_FLOOR,
    "gpu-sbx-3": "preflight driver_module_match: loaded kernel module 535.104.05",
    "gpu-sbx-4": "reboot required to load its kernel module",
    "gpu-sbx-6": "preflight gpu_count:",
    "gpu-sbx-7": DRIVER_FLOOR,
    "gpu-sbx-8": "preflight driver_module_match: loaded kernel module 535.104.05",
}
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
OP_SYSCTL = "full | sysctl | Sysctl: kernel parameters persisted and applied"


@pytest.fixture(scope="module")
def fleet():
    with booted(SCENARIOS, leave_up_for="gpu-health", own_caches=BUILDERS) as sandbox:
        yield sandbox


def full_run(sandbox, timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict]:
    proc = sandbox.pyinfra("--json", *FLEET_CUDA, "deploys/full.py", timeout=timeout)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return proc, json.loads(proc.stdout)


def hosts_with(data: dict, outcome: str) -> set[str]:
    return {host for op in data["results"]["operations"] for host in op[outcome]}


def audit(sandbox, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.audit", str(sandbox.inventory), *sandbox.report_data(),
         *FLEET_CUDA, *args],
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
        active = fleet.ssh(fleet.host(name), "systemctl is-enabled vllm && ls /srv/models/"
                                             "sandbox/tiny-qwen2/config.json").stdout.split()
        assert active == ["enabled", "/srv/models/sandbox/tiny-qwen2/config.json"]
        assert_built_and_probed(fleet, name, FLEET_STACK)


def assert_built_and_probed(sandbox, name: str, row: StackRow) -> None:
    """The host's active environment is the CUDA row's, installed from its lock and proven
    on a host without a real GPU: the probe finds what the development machine's install
    recorded (tests/fixtures/vllm-cuda-<version>), names what it could not check without a
    GPU, and the unit uses only options its server lists."""
    host = sandbox.host(name)
    env = sandbox.ssh(host, "readlink /opt/vllm/current").stdout.strip()
    assert env.startswith(f"/opt/vllm/envs/vllm-{row.vllm}-"), (name, env)
    runtime = json.loads(sandbox.ssh(host, f"cat {env}/pyinfra-vllm-env.json").stdout)["runtime"]
    recorded = json.loads((FIXTURES / f"vllm-cuda-{row.vllm}" / "probe.json").read_text())
    assert (runtime["vllm"], runtime["vllm_dist"], runtime["device"], runtime["torch"],
            runtime["torch_cuda"]) == (row.vllm, "vllm", "cuda", row.torch, row.cuda)
    assert tuple(runtime["cuda_archs"]) == row.cuda_archs
    assert "Qwen3_5ForConditionalGeneration" in runtime["architectures"]
    assert runtime["architectures"] == recorded["runtime"]["architectures"]
    assert runtime["flags"] == recorded["runtime"]["flags"]
    assert runtime["gpus"] is None
    assert runtime["unchecked"] == [vllm_probe.UNCHECKED_KERNELS, vllm_probe.UNCHECKED_GPUS,
                                    vllm_probe.UNCHECKED_HELP]
    unit = sandbox.ssh(host, "cat /etc/systemd/system/vllm.service").stdout
    start = unit.split("\nExecStart=", 1)[1].split("\nExecStartPost=", 1)[0]
    used = set(re.findall(r'"(--[a-z0-9][a-z0-9-]*)"', start))
    assert {"--tensor-parallel-size", "--uds", "--gpu-memory-utilization"} <= used
    assert used <= set(runtime["flags"]), used - set(runtime["flags"])
    assert f'"{env}/bin/python"' in unit


def test_second_run_changes_nothing(fleet):
    _, data = full_run(fleet)
    assert data["results"]["totals"]["success"] == 0
    assert hosts_with(data, "error") == set(REASONS)  # still refused, still untouched


def test_a_converged_host_is_read_in_at_most_five_remote_commands(fleet):
    # pyinfra_vllm/run/host_reads.py: the whole run's reads in one command; -vvv prints each
    # remote command once, behind ">>> ".
    proc = fleet.pyinfra("-vvv", *FLEET_CUDA, "deploys/full.py")
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
    proc = fleet.pyinfra("-v", "--debug", "--dry", *limits, *FLEET_CUDA, "deploys/full.py")
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
