"""The host stages (preflight, driver, mig, persistence, sysctl, model_volume) on real
sandbox hosts: one fleet run over every scenario, a second run that changes nothing,
and one repaired drift per kind, each changing only itself.

Hosts (booted once for this module): two `seed` (2x A100 80GB PCIe + NVLink), `pcie`
(no bridge), `mig` (MIG enabled on GPU0, a process attached to it), `mismatch` (loaded
module older than the installed packages), `bare` (no driver; a local apt repository
with the simulated driver packages). Change counts come from `pyinfra -y --json`.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import CUDA_063, booted

pytestmark = pytest.mark.e2e

SCENARIOS = ["seed", "seed", "pcie", "mig", "mismatch", "bare"]
SEED, SEED2, PCIE, MIG, MISMATCH, BARE = (f"gpu-sbx-{n}" for n in range(1, 7))

OP_SYSCTL = "full | sysctl | Sysctl: kernel parameters persisted and applied"
OP_HOLD = "full | driver | Driver: hold the NVIDIA and CUDA packages"
OP_MIG = "full | mig | MIG: disabled on every GPU"
OP_PERSISTENCED = "full | persistence | Persistence: nvidia-persistenced enabled and running"
OP_VOLUME = "full | model_volume | Model volume: XFS mounted at the model directory"
OP_METRICS = "full | metrics | Metrics: verdicts for node_exporter's textfile collector"
# Preflight writes the GPUs' health before it judges, also on a host it then refuses.
OP_HEALTH = "full | preflight | Preflight: GPU health for node_exporter's textfile collector"


class Run:
    """One `pyinfra -y --json ... deploys/full.py` run: its per-host results."""

    def __init__(self, proc):
        self.proc = proc
        self.stderr = proc.stderr
        self.data = json.loads(proc.stdout)
        self.results = self.data["results"]

    def ops(self, host: str, outcome: str) -> set[str]:
        return {op["name"] for op in self.results["operations"] if host in op[outcome]}

    def changed(self, host: str) -> set[str]:
        return self.ops(host, "success")

    def failed(self, host: str) -> set[str]:
        return self.ops(host, "error")

    def says(self, host: str, words: str) -> bool:
        return any(
            line.strip().startswith(f"[{host}]") and words in line
            for line in self.stderr.splitlines()
        )


# The host stages (and the cheap gateway): the runtime, several GB per host, has its own
# module, tests/e2e/test_engine_stages.py. vllm_device=cuda (CUDA_063): the GPU stages run
# only for a GPU engine, and the sandbox's own data serves on CPU.
HOST_LAYER_ONLY = [*CUDA_063, "--data", 'skip_stages=["python_env","model","vllm_service"]']


def full_run(sandbox, *args: str, timeout: float = 600) -> Run:
    proc = sandbox.pyinfra("--json", *HOST_LAYER_ONLY, *args, "deploys/full.py",
                           timeout=timeout)
    if not proc.stdout.strip():
        # pyinfra prints no JSON when every host failed; show why, with the journal.
        name = args[args.index("--limit") + 1] if "--limit" in args else sandbox.hosts[0].name
        journal = sandbox.ssh(
            sandbox.host(name), "journalctl -n 40 --no-pager -o short-monotonic", check=False
        ).stdout
        pytest.fail(
            f"pyinfra printed no JSON (exit {proc.returncode}):\n{proc.stderr[-3000:]}\n"
            f"journal of {name}:\n{journal}"
        )
    return Run(proc)


@pytest.fixture(scope="module")
def fleet():
    with booted(SCENARIOS) as sandbox:
        # A foreign process holds the MIG host's GPU0 for the first run.
        sandbox.ssh(sandbox.host(MIG), "gpusimctl attach-process --gpu 0 --name e2e-holder")
        first = full_run(sandbox)
        yield sandbox, first


def smi(sandbox, host: str, query: str) -> str:
    return sandbox.ssh(
        sandbox.host(host), f"nvidia-smi --query-gpu={query} --format=csv,noheader"
    ).stdout.strip()


def test_two_seed_hosts_show_nvlink(fleet):
    sandbox, _ = fleet
    proc = sandbox.pyinfra(
        "--limit", SEED, "--limit", SEED2,
        "fact", "server.Hostname", "facts.topology.GpuTopology", "--json",
    )
    facts = json.loads(proc.stdout)
    assert facts["server.Hostname"] == {SEED: SEED, SEED2: SEED2}
    for name in (SEED, SEED2):
        assert facts["facts.topology.GpuTopology"][name]["links"]["GPU0"]["GPU1"] == "NV12"


def test_first_run_converges_the_seed_hosts(fleet):
    _, first = fleet
    for name in (SEED, SEED2):
        assert first.failed(name) == set()
        assert OP_VOLUME in first.changed(name)
        assert OP_PERSISTENCED in first.changed(name)


def test_the_failing_hosts_do_not_stop_the_others(fleet):
    _, first = fleet
    assert first.proc.returncode == 1
    assert set(first.data["results"]["failed_hosts"]) >= {PCIE, MISMATCH, BARE, MIG}
    assert SEED not in first.data["results"]["failed_hosts"]


def test_pcie_host_stops_at_preflight_naming_the_code_and_the_setting(fleet):
    sandbox, first = fleet
    assert first.says(PCIE, "preflight tp_nvlink: no 2 GPUs are joined by NVLink")
    assert first.says(PCIE, "GPU0-GPU1 PHB")
    assert first.says(PCIE, "set allow_pcie_tensor_parallel=true")
    assert first.changed(PCIE) == {OP_HEALTH}
    sandbox.ssh(sandbox.host(PCIE), "! test -e /etc/sysctl.d/60-vllm.conf")


def test_mismatch_host_needs_a_reboot_before_any_change(fleet):
    sandbox, first = fleet
    assert first.says(
        MISMATCH,
        "loaded kernel module 535.104.05 but installed nvidia-utils-535-server is "
        "535.129.03: reboot required",
    )
    assert first.changed(MISMATCH) == set()
    assert first.failed(MISMATCH) == {"full | preflight | Preflight: host refused"}


def test_bare_host_gets_the_driver_held_and_reboot_required(fleet):
    sandbox, first = fleet
    bare = sandbox.host(BARE)
    assert "full | driver | Driver: install nvidia-headless-535-server" in first.changed(BARE)
    assert first.says(BARE, "driver 535-server installed; reboot required")
    installed = sandbox.ssh(bare, "dpkg-query -W -f '${Version}' nvidia-utils-535-server").stdout
    assert installed == "535.129.03-0ubuntu0.22.04.1"
    held = sandbox.ssh(bare, "apt-mark showhold").stdout.split()
    assert {"nvidia-utils-535-server", "nvidia-headless-535-server"} <= set(held)
    blacklist = sandbox.ssh(bare, "cat /etc/apt/apt.conf.d/51pyinfra-vllm-nvidia-blacklist").stdout
    assert '"nvidia-";' in blacklist
    # Installed, not loaded: the module appears only after a reboot.
    sandbox.ssh(bare, "! test -e /proc/driver/nvidia/version")


def test_bare_host_with_allow_reboot_reboots_and_converges(fleet):
    sandbox, _ = fleet
    bare = sandbox.host(BARE)
    run = full_run(sandbox, "--limit", BARE, "--data", "allow_reboot=true", timeout=900)
    assert run.failed(BARE) == set(), run.stderr
    assert "full | driver | Driver: reboot to load the new kernel module" in run.changed(BARE)
    module = sandbox.ssh(bare, "cat /proc/driver/nvidia/version").stdout
    assert "Kernel Module  535.129.03" in module
    assert smi(sandbox, BARE, "persistence_mode").splitlines() == ["Enabled", "Enabled"]
    assert run.says(BARE, "metrics: not written in a run that reboots into a new driver")
    # The next run records the verdicts and the GPUs' health read with the driver loaded
    # (the run before read them without one), and nothing else; the one after changes
    # nothing.
    again = full_run(sandbox, "--limit", BARE)
    assert again.changed(BARE) == {OP_METRICS, OP_HEALTH}, again.changed(BARE)
    third = full_run(sandbox, "--limit", BARE)
    assert (third.results["totals"]["success"], third.results["totals"]["error"]) == (0, 0), (
        third.changed(BARE)
    )


def test_mig_host_with_a_process_is_refused_with_its_pid(fleet):
    sandbox, first = fleet
    pid = sandbox.ssh(
        sandbox.host(MIG),
        "nvidia-smi --query-compute-apps=pid --format=csv,noheader",
    ).stdout.strip()
    assert pid.isdigit()
    assert first.says(MIG, pid)
    assert OP_MIG in first.failed(MIG)
    # Nothing was reset: GPU0 is still in MIG mode.
    assert smi(sandbox, MIG, "index,mig.mode.current,mig.mode.pending").splitlines()[0] == (
        "0, Enabled, Enabled"
    )


def test_mig_host_without_the_process_gets_mig_disabled(fleet):
    sandbox, _ = fleet
    sandbox.ssh(sandbox.host(MIG), "gpusimctl detach-process --all")
    run = full_run(sandbox, "--limit", MIG)
    assert run.failed(MIG) == set(), run.stderr
    assert OP_MIG in run.changed(MIG)
    assert smi(sandbox, MIG, "mig.mode.current,mig.mode.pending").splitlines() == [
        "Disabled, Disabled",
        "Disabled, Disabled",
    ]


def test_second_run_changes_nothing(fleet):
    sandbox, _ = fleet
    run = full_run(sandbox, "--limit", SEED)
    totals = run.results["totals"]
    assert (totals["success"], totals["error"]) == (0, 0), run.changed(SEED)
    assert totals["no_change"] > 0


DRIFTS = [
    (
        "sysctl value changed at runtime",
        "sysctl -w net.core.somaxconn=128",
        {OP_SYSCTL},
        "sysctl -n net.core.somaxconn",
        "65535",
    ),
    (
        "sysctl file edited",
        "sed -i 's/^net.core.somaxconn = .*/net.core.somaxconn = 1024/' /etc/sysctl.d/60-vllm.conf",
        {OP_SYSCTL},
        "grep -c '^net.core.somaxconn = 65535$' /etc/sysctl.d/60-vllm.conf",
        "1",
    ),
    (
        "persistence daemon stopped",
        "systemctl stop nvidia-persistenced",
        {OP_PERSISTENCED},
        "nvidia-smi --query-gpu=persistence_mode --format=csv,noheader | sort -u",
        "Enabled",
    ),
    (
        "MIG enabled, pending only",
        "gpusimctl configure --mig-auto-reset off && nvidia-smi -i 0 -mig 1 >/dev/null",
        {OP_MIG},
        "nvidia-smi -i 0 --query-gpu=mig.mode.current,mig.mode.pending --format=csv,noheader",
        "Disabled, Disabled",
    ),
    (
        "MIG enabled, current",
        "gpusimctl configure --mig-auto-reset on && nvidia-smi -i 0 -mig 1 >/dev/null",
        {OP_MIG},
        "nvidia-smi -i 0 --query-gpu=mig.mode.current,mig.mode.pending --format=csv,noheader",
        "Disabled, Disabled",
    ),
    (
        "fstab line removed",
        "sed -i '\\#/srv/models#d' /etc/fstab",
        {OP_VOLUME},
        "grep -c ' /srv/models xfs noatime,nofail 0 0$' /etc/fstab",
        "1",
    ),
    (
        "volume unmounted",
        "umount /srv/models",
        {OP_VOLUME},
        "findmnt -rno FSTYPE,OPTIONS /srv/models | cut -d, -f1-2",
        "xfs rw,noatime",
    ),
    (
        "package hold removed",
        "apt-mark unhold nvidia-utils-535-server >/dev/null",
        {OP_HOLD},
        "apt-mark showhold | grep -c '^nvidia-utils-535-server$'",
        "1",
    ),
]


@pytest.mark.parametrize(
    ("drift", "break_it", "repairs", "check", "expected"), DRIFTS, ids=[d[0] for d in DRIFTS]
)
def test_drift_is_repaired_and_only_the_drift_changes(
    fleet, drift, break_it, repairs, check, expected
):
    sandbox, _ = fleet
    seed = sandbox.host(SEED)
    sandbox.ssh(seed, break_it)
    run = full_run(sandbox, "--limit", SEED)
    assert run.failed(SEED) == set(), run.stderr
    assert run.changed(SEED) == repairs
    assert sandbox.ssh(seed, check).stdout.strip() == expected
    again = full_run(sandbox, "--limit", SEED)
    assert again.results["totals"]["success"] == 0, again.changed(SEED)
