"""The sandbox hosts behave like real servers: systemd, sshd, a spare disk, apt/PyPI, reboot.

Boots two hosts once per session (tests/e2e/conftest.py). The last test tears the sandbox down
itself and checks that nothing is left behind, so keep it last in this file.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from sandbox import hosts as sbx
from sandbox import net, supervise

pytestmark = pytest.mark.e2e


def test_plan_cycles_scenarios() -> None:
    planned = sbx.plan(5, ["seed", "bare"])
    assert [h.scenario for h in planned] == ["seed", "bare", "seed", "bare", "seed"]
    assert [h.address for h in planned[:2]] == ["10.213.1.2", "10.213.2.2"]
    with pytest.raises(sbx.SandboxError, match="unknown scenario"):
        sbx.plan(1, ["gpu"])


def test_two_distinct_hostnames(sandbox) -> None:
    proc = sandbox.pyinfra("fact", "server.Hostname", "--json")
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)["server.Hostname"]
    assert facts == {h.name: h.name for h in sandbox.hosts}
    assert len(set(facts.values())) == 2


def test_inventory_host_data(sandbox) -> None:
    proc = sandbox.pyinfra("debug-inventory", "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout + proc.stderr
    for host in sandbox.hosts:
        assert host.name in text
    for key in ("ssh_known_hosts_file", "sandbox_scenario", "model_volume_device",
                "api_keys_file"):
        assert key in text


def test_reached_as_operators_reach_servers(sandbox) -> None:
    host = sandbox.hosts[0]
    argv = sbx.ssh_argv(host.address)
    # The operator logs in with its key and gets root only through passwordless sudo.
    login = subprocess.run([*argv, "--", "id -un; sudo -n id -u"], capture_output=True,
                           text=True, timeout=30)
    assert login.stdout.split() == ["ubuntu", "0"], login.stderr
    # Root cannot log in, even with the same key.
    as_root = [*argv[:-1], f"root@{host.address}", "--", "true"]
    refused = subprocess.run(as_root, capture_output=True, text=True, timeout=30)
    assert refused.returncode == 255 and "Permission denied" in refused.stderr
    # pyinfra logs in as the operator and runs its commands under sudo.
    proc = sandbox.pyinfra("--json", "fact", "server.User", "--sudo", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert set(json.loads(proc.stdout)["server.User"].values()) == {"root"}


def test_calls_share_one_connection_per_host(sandbox) -> None:
    # One TCP connection from this machine to each host's sshd, the same each time
    # (ssh_argv's ControlMaster): logged in once.
    ssh_in = "ss -Htn state established '( sport = :22 )'"
    seen = [sandbox.ssh(host, ssh_in).stdout.split() for host in (*sandbox.hosts, *sandbox.hosts)]
    count = len(sandbox.hosts)
    assert seen[:count] == seen[count:] and all(len(fields) == 4 for fields in seen), seen


@pytest.mark.parametrize("index", [0, 1])
def test_systemd_is_pid1_and_running(sandbox, index: int) -> None:
    host = sandbox.hosts[index]
    assert sandbox.ssh(host, "cat /proc/1/comm").stdout.strip() == "systemd"
    state = sandbox.ssh(host, "systemctl is-system-running", check=False).stdout.strip()
    assert state in ("running", "degraded")
    assert sandbox.ssh(host, "systemd-detect-virt", check=False).stdout.strip() == "systemd-nspawn"


def test_each_host_has_a_cgroup_tree_of_its_own(sandbox) -> None:
    # In one tree, both containers' systemd managed one vllm.service cgroup holding both
    # hosts' engines (sandbox/supervise.py).
    for host in sandbox.hosts:
        init = next(pid for pid in _container_pids(host)
                    if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd")
        lines = Path(f"/proc/{init}/cgroup").read_text().splitlines()
        unified = next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))
        assert unified == f"/{supervise.CGROUP_NAME}/{host.name}/payload/init.scope", unified


def test_loop_device_takes_xfs_noatime(sandbox) -> None:
    host = sandbox.hosts[-1]
    dev = host.loop_device
    mnt = "/mnt/sandbox-e2e"
    out = sandbox.ssh(
        host,
        f"mkfs.xfs -q -f {dev} && mkdir -p {mnt} && mount -o noatime {dev} {mnt} && "
        f"findmnt -no FSTYPE,OPTIONS {mnt}; umount {mnt}; rmdir {mnt}; wipefs -a -q {dev}",
    ).stdout
    fstype, options = out.split()[0:2]
    assert fstype == "xfs"
    assert "noatime" in options.split(",")
    # Left blank for the deploy, which must format it itself.
    assert sandbox.ssh(host, f"blkid -p {dev}", check=False).returncode != 0


def test_apt_and_pip_reach_registries(sandbox) -> None:
    host = sandbox.hosts[0]
    sandbox.ssh(host, "apt-get update -q", timeout=300)
    sandbox.ssh(
        host,
        "python3 -m venv /tmp/e2e-venv && /tmp/e2e-venv/bin/pip download -q --no-deps "
        "--cert /etc/ssl/certs/ca-certificates.crt -d /tmp/e2e-dl six && ls /tmp/e2e-dl "
        "&& rm -rf /tmp/e2e-venv /tmp/e2e-dl",
        timeout=300,
    )


def test_gpu_scenarios(sandbox) -> None:
    for host in sandbox.hosts:
        smi = sandbox.ssh(host, "nvidia-smi -L", check=False)
        if host.scenario == "bare":
            assert smi.returncode != 0  # no driver
            repo = f"http://10.213.{host.name.rsplit('-', 1)[1]}.1:8787/Packages"
            packages = sandbox.ssh(host, f"curl -fsS {repo}").stdout
            assert "Package: nvidia-headless-535-server" in packages
        elif host.scenario in ("seed", "pcie", "mig"):
            assert smi.returncode == 0, smi.stdout + smi.stderr
            assert smi.stdout.count("NVIDIA A100 80GB PCIe") == 2


def test_reboot_boots_the_same_host(sandbox) -> None:
    host = sandbox.hosts[0]
    before = sandbox.ssh(host, "touch /root/e2e-marker; cat /proc/sys/kernel/random/boot_id")
    # delay=3: the container is down within a second of `reboot`, no need for the default 10.
    proc = sandbox.pyinfra("--limit", host.name, "server.reboot", "delay=3", timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    after = sandbox.ssh(
        host,
        "cat /proc/sys/kernel/random/boot_id; ls /root/e2e-marker; "
        f"test -b {host.loop_device} && echo disk-ok; rm /root/e2e-marker",
    )
    assert after.stdout.split()[0] != before.stdout.strip()
    assert "disk-ok" in after.stdout


def test_teardown_leaves_nothing(sandbox) -> None:
    if sandbox.reused:
        pytest.skip("SANDBOX_REUSE=1: the sandbox is left running")
    pids = [p for h in sandbox.hosts for p in _container_pids(h)]
    assert pids, "expected running containers before teardown"
    masters = [p for h in sandbox.hosts for p in _ssh_masters(h)]
    assert len(masters) == len(sandbox.hosts), masters  # the tests' calls share them
    assert sbx.down() == []
    assert [p for p in masters if _alive(p)] == [], "a shared ssh connection survived"
    assert not [n for n in net.netns_list() if n.startswith("gpu-sbx-")]
    losetup = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    assert str(sbx.RUN_DIR) not in losetup
    findmnt = subprocess.run(["findmnt", "-rn"], capture_output=True, text=True).stdout
    assert str(sbx.RUN_DIR) not in findmnt
    alive = [p for p in pids if _alive(p)]
    assert alive == [], "nspawn/container processes (sshd, systemd) survived teardown"
    assert net.leftover_rules() == []
    assert sbx.leftovers() == []
    assert [root for root in supervise.CGROUP_ROOTS if (root / supervise.CGROUP_NAME).exists()] == []


def _container_pids(host) -> list[int]:
    pid_file = host.host_dir / "nspawn.pid"
    return sbx._descendants(int(pid_file.read_text())) if pid_file.is_file() else []


def _ssh_masters(host) -> list[int]:
    """The ssh processes holding a connection shared through the host's directory."""
    found = subprocess.run(["pgrep", "-f", f"^ssh: {host.host_dir}/"],  # its title
                           capture_output=True, text=True).stdout
    return [int(pid) for pid in found.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return re.search(r"\) [^Z] ", stat.read()) is not None  # zombies count as gone
    except OSError:
        return False
