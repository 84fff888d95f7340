"""GPU health the way fleets fail, on test_full.py's converged seed host.

Each fault is put on GPU 0 of gpu-sbx-1 (two A100s on the 580 branch, R580's layouts) with the simulator's ``gpusimctl fault`` (the
simulated nvidia-smi, NVLink and kernel log show it as the real ones would; the kernel
log is the simulator's, never this machine's). Then one ``deploys/full.py
deploys/audit.py`` run: preflight refuses a failing GPU (or warns for a degraded one),
writes the verdict to the health textfile the alert rules read, and the audit reports
the GPU's verdict and reasons. The fault cleared, the next run converges past preflight
again, through the vllm_service stage that a failing GPU kept it from, with the
textfile back to 0. The run is the example fleet's (conftest.FLEET_CUDA; vllm_start false: a
sandbox host has no GPU to start the CUDA engine on), so that stage keeps the unit in place
without starting it.
"""

from __future__ import annotations

import json
import re

import pytest

from pyinfra_vllm.core.stacks import STACKS
from tests.e2e.conftest import FLEET_CUDA, booted
from tests.e2e.test_full import BUILDERS, SCENARIOS, assert_built_and_probed, hosts_with

pytestmark = pytest.mark.e2e

HOST = "gpu-sbx-1"
BESIDE = "gpu-sbx-5"  # test_full.py's other seed host, converged beside HOST
BUS = "00000000:17:00.0"  # GPU 0 of the seed580 scenario (sandbox/gpusim)
TEXTFILE = "/var/lib/pyinfra-vllm-metrics/pyinfra_vllm_gpu_health.prom"
LABELS = f'host="{HOST}",gpu="0",bus_id="{BUS}"'

# (gpusimctl fault arguments, reason code, its severity, the textfile line the alert
# rule reads). A "rising" reason compares with the previous audit (the module's baseline,
# or the previous test's cleared run, with the counter at 0): the audit judges it, and
# the alert rule judges the counter's rise (monitoring/vllm-alerts.yml); preflight has
# no earlier value, so it neither warns nor writes a reason for it.
FAULTS = [
    ("0 ecc-uncorrectable 2", "ecc_uncorrectable_pending", "failing", None),
    ("0 ecc-correctable 177", "ecc_correctable_rising", "degraded",
     f"pyinfra_vllm_gpu_ecc_aggregate_correctable{{{LABELS}}} 177"),
    ("0 xid 79", "xid_79", "failing", None),
    ("0 nvlink-down 3", "nvlink_down", "failing", None),
    # Link 0 counts 120 CRC errors and the 120 replays they caused (nvlink -e).
    ("0 nvlink-crc 120", "nvlink_errors_rising", "degraded",
     f"pyinfra_vllm_gpu_nvlink_errors{{{LABELS}}} 240"),
    ("0 pcie-width 8", "pcie_degraded", "degraded", None),
    ("0 hw-slowdown", "hw_slowdown", "degraded", None),
]
VALUE = {"failing": 2, "degraded": 1}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with booted(SCENARIOS, take_over="gpu-health", own_caches=BUILDERS) as sandbox:
        reports = tmp_path_factory.mktemp("audit-reports")
        sandbox.reports = reports
        run(sandbox)  # the baseline audit the "rising" reasons compare with
        yield sandbox
        sandbox.ssh(sandbox.host(HOST), "gpusimctl fault clear")


def run(sandbox) -> tuple[object, dict]:
    """deploys/full.py then deploys/audit.py on HOST, reports in the module's directory;
    the process and the host's audit entry."""
    proc = sandbox.pyinfra("--limit", HOST, *FLEET_CUDA, "--data",
                           f"audit_report_dir={sandbox.reports}", "deploys/full.py",
                           "deploys/audit.py", timeout=600)
    latest = json.loads((sandbox.reports / "latest.json").read_text())
    return proc, latest["hosts"][HOST]


def engine_stage_ran(proc) -> bool:
    """Whether the run reached the vllm_service stage, the one that starts the engine."""
    return any(line.startswith("--> Starting operation: full | vllm_service |")
               for line in proc.stdout.splitlines() + proc.stderr.splitlines())


def checks(entry: dict) -> dict:
    """The audit's checks of the host by name (its refusals: pyinfra runs with -y here,
    so the audit plans no drift)."""
    return {check["name"]: check for check in entry["checks"]}


def textfile(sandbox) -> str:
    return sandbox.ssh(sandbox.host(HOST), f"cat {TEXTFILE}").stdout


@pytest.mark.parametrize(("fault", "reason", "severity", "line"), FAULTS,
                         ids=[fault.split()[1] for fault, *_ in FAULTS])
def test_a_gpu_fault_is_reported_refused_and_alerted_then_cleared(fleet, fault, reason,
                                                                  severity, line):
    sbx_host = fleet.host(HOST)
    fleet.ssh(sbx_host, f"gpusimctl fault {fault}")
    proc, entry = run(fleet)
    gpu = entry["gpu_health"][BUS]
    assert gpu["verdict"] == severity, gpu
    assert reason in [r["code"] for r in gpu["reasons"]], gpu
    logged = [text for text in proc.stderr.splitlines() if f"[{HOST}]" in text]
    rising = reason.endswith("_rising")
    if severity == "failing":
        assert proc.returncode != 0
        assert checks(entry)["gpu_health"]["ok"] is False
        assert any("preflight gpu_health: GPU0 " + BUS in text for text in logged), logged
        assert checks(entry)["gpu_health"]["severity"] == "error"
        assert entry["summary"]["health"].startswith("GPU0 failing (")
        assert not engine_stage_ran(proc)
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert rising or any("warning: GPU0 " + BUS in text for text in logged), logged
        assert checks(entry)["gpu_health"]["ok"] is True
        assert entry["summary"]["health"].startswith("GPU0 degraded (")
    prom = textfile(fleet).splitlines()
    value = 0 if rising else VALUE[severity]
    assert f"pyinfra_vllm_gpu_health{{{LABELS}}} {value}" in prom
    assert (line or f'pyinfra_vllm_gpu_health_reason{{{LABELS},reason="{reason}",'
            f'severity="{severity}"}} 1') in prom
    if rising:  # the counter's move, in "changed since the previous audit"
        counter = line.split("{")[0].removeprefix("pyinfra_vllm_gpu_")
        moved = json.loads((fleet.reports / "latest.json").read_text())["changes"]["hosts"][HOST]
        assert {"field": "gpu_counter", "gpu": f"GPU0 {BUS}", "counter": counter,
                "before": 0, "after": int(line.split()[-1])} in moved

    fleet.ssh(sbx_host, "gpusimctl fault clear")
    proc, entry = run(fleet)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert engine_stage_ran(proc)
    assert entry["gpu_health"][BUS]["verdict"] == "ok"
    assert entry["summary"]["health"] == "ok"
    assert checks(entry)["gpu_health"]["ok"] is True
    assert f"pyinfra_vllm_gpu_health{{{LABELS}}} 0" in textfile(fleet).splitlines()


def test_a_parser_error_fails_that_host_and_the_run_goes_on(fleet):
    """nvlink-garbled: HOST's nvidia-smi prints NVLink speeds no parser can read. The
    run's one read (pyinfra_vllm/run/host_reads.py) hands that section to NvlinkStatus,
    whose parser fails: pyinfra's "could not process fact" fails HOST alone, as pyinfra
    fails a host for a fact read on its own, and the host beside it runs to its end."""
    sbx_host = fleet.host(HOST)
    fleet.ssh(sbx_host, "gpusimctl fault 0 nvlink-garbled")
    limits = ("--limit", HOST, "--limit", BESIDE)
    try:
        proc = fleet.pyinfra("--json", *limits, *FLEET_CUDA, "deploys/full.py", timeout=600)
    finally:
        fleet.ssh(sbx_host, "gpusimctl fault clear")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["results"]["failed_hosts"] == [HOST]
    logged = [line.strip() for line in proc.stderr.splitlines()
              if re.match(rf"\s*\[{HOST}\]", line)]
    assert any("Error: could not process fact: facts.topology.NvlinkStatus" in line
               for line in logged), logged
    assert any("ValueError: could not convert string to float: '25.25.25'" in line
               for line in logged), logged
    # BESIDE ran every stage: its operations ran (test_full.py's drift test left one of its
    # kernel parameters to put back), none failed.
    assert BESIDE not in hosts_with(data, "error")
    assert BESIDE in hosts_with(data, "success") | hosts_with(data, "no_change")

    # The fault cleared, HOST's one read parses again and both converge.
    proc = fleet.pyinfra("--json", *limits, *FLEET_CUDA, "deploys/full.py", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["results"]["failed_hosts"] == []


# --- the CUDA stack real servers get, on test_full.py's H200 host ------------------------
H200 = "gpu-sbx-6"  # the h200 scenario: one H200, driver 580.159.04, packages and module
STACK = STACKS["0.17.0"]
# The 0.17.0 row needs driver branch 570 or newer (the settings refuse the default 535);
# the host's driver is 580.
CUDA_0_17 = ("--data", "vllm_device=cuda", "--data", f"vllm_version={STACK.vllm}",
             "--data", "nvidia_driver_branch=580-server",
             "--data", "vllm_start=false", "--data", "tensor_parallel_size=1")


def test_the_h200_host_builds_the_cuda_0_17_stack_from_its_lock_and_probes_it(fleet):
    """vLLM 0.17.0 (CUDA 12.8, driver 570 or newer: the 580 host passes the gate), the
    previous row operators roll back to, installed from its lock with hashes and probed
    (test_full.assert_built_and_probed: tests/fixtures/vllm-cuda-0.17.0)."""
    proc = fleet.pyinfra("--json", "--limit", H200, *CUDA_0_17, "deploys/full.py", timeout=2400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_built_and_probed(fleet, H200, STACK)
    proc = fleet.pyinfra("--json", "--limit", H200, *CUDA_0_17, "deploys/full.py", timeout=600)
    assert proc.returncode == 0 and json.loads(proc.stdout)["results"]["totals"]["success"] == 0
