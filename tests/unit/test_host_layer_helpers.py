"""Pure helpers of the host layer (driver, MIG, persistence, sysctl, model volume)."""

from __future__ import annotations

import re

import pytest
from pyinfra.api import OperationValueError

from deploys.settings import SettingsError, validate
from facts.services import UnitPids
from facts.storage import MountPoint, parse_blkid_export, parse_fstab
from facts.sysctl import KernelParam, normalize, proc_sys_path
from operations.nvidia_driver import (
    apt_source_line,
    cuda_repo_distro,
    driver_packages,
    render_blacklist,
    unheld_packages,
)
from operations.nvidia_mig import busy_gpus, busy_reason, mig_disabled_on, plan_mig
from operations.sysctl import TEMPLATE, drop_in_path, plan_sysctl
from operations.templating import render
from operations.xfs_volume import (
    describe_signature,
    fstab_options,
    fstab_with_entry,
    missing_options,
    render_fstab_line,
)

UUID = "6e0f8d0c-4c41-4bf4-9d0a-2f6f1e9b7a11"


# --- driver ----------------------------------------------------------------------------


def test_blacklist_is_an_apt_conf_list_of_prefix_regexes():
    text = render_blacklist()
    assert 'Unattended-Upgrade::Package-Blacklist {\n    "nvidia-";\n    "libnvidia-";\n' in text
    assert text.endswith('    "cuda-";\n};\n')
    entries = re.findall(r'^\s+"([^"]+)";$', text, flags=re.M)
    # unattended-upgrades matches each entry with re.match against the package name.
    def blacklisted(name):
        return any(re.match(entry, name) for entry in entries)

    for name in ("nvidia-utils-535-server", "libnvidia-compute-535-server", "cuda-toolkit-12-1",
                 "nvidia-headless-535-server", "libnvidia-gl-535"):
        assert blacklisted(name), name
    for name in ("linux-image-generic", "libc6", "xserver-xorg-video-nvidia-535"):
        assert not blacklisted(name), name


def test_blacklist_refuses_what_apt_conf_cannot_hold():
    with pytest.raises(OperationValueError):
        render_blacklist(['nvidia-"; "x'])


def test_apt_source_line():
    assert apt_source_line("http://10.0.0.1:8787/") == "deb [trusted=yes] http://10.0.0.1:8787/ ./"
    line = "deb [signed-by=/etc/apt/keyrings/x.gpg] https://mirror/ubuntu jammy main"
    assert apt_source_line(line) == line


def test_driver_packages_and_cuda_distro():
    assert driver_packages("535-server") == [
        "nvidia-headless-535-server", "nvidia-utils-535-server"]
    assert cuda_repo_distro("Ubuntu", 22, 4) == "ubuntu2204"
    assert cuda_repo_distro("Ubuntu", 24, 4) == "ubuntu2404"
    assert cuda_repo_distro("Debian", 12) == "debian12"
    with pytest.raises(OperationValueError):
        cuda_repo_distro("Fedora", 40)


def test_unheld_packages_only_driver_and_cuda_not_yet_held():
    installed = {"nvidia-utils-535-server": "1", "libnvidia-compute-535-server": "1",
                 "cuda-toolkit-12-1": "1", "vim": "1"}
    assert unheld_packages(installed, ["nvidia-utils-535-server"]) == [
        "cuda-toolkit-12-1", "libnvidia-compute-535-server"]
    assert unheld_packages(installed, sorted(installed)) == []
    assert unheld_packages(None, None) == []


@pytest.mark.parametrize("value", ["http://10.0.0.1:8787/", "deb [trusted=yes] file:/srv/repo ./"])
def test_nvidia_apt_repo_setting_accepts_url_or_line(value):
    assert validate({"nvidia_apt_repo": value}).nvidia_apt_repo == value


def test_nvidia_apt_repo_setting_refuses_other_text():
    with pytest.raises(SettingsError, match="nvidia_apt_repo"):
        validate({"nvidia_apt_repo": "ppa:graphics-drivers/ppa"})


# --- MIG -------------------------------------------------------------------------------


def _gpu(index, current="Disabled", pending="Disabled"):
    return {"index": index, "uuid": f"GPU-{index}", "mig_current": current, "mig_pending": pending}


def test_mig_plan_follows_mig_parted():
    gpus = [_gpu(1, "Enabled", "Enabled"), _gpu(0), _gpu(2, "Disabled", "Enabled"),
            _gpu(3, "Enabled", "Disabled"), _gpu(4, None, None)]
    assert plan_mig(gpus) == [
        {"index": 1, "uuid": "GPU-1", "set_pending": True, "reset": True},
        {"index": 2, "uuid": "GPU-2", "set_pending": True, "reset": False},
        {"index": 3, "uuid": "GPU-3", "set_pending": False, "reset": True},
    ]
    assert mig_disabled_on(_gpu(4, None, None))  # no MIG support: nothing to do
    assert plan_mig([_gpu(0), _gpu(1)]) == []


def test_busy_gpus_ignores_our_service_and_other_gpus():
    steps = plan_mig([_gpu(0, "Enabled", "Enabled"), _gpu(1)])
    processes = [
        {"gpu_uuid": "GPU-0", "pid": 10, "process_name": "python3"},
        {"gpu_uuid": "GPU-0", "pid": 11, "process_name": "nvtop"},
        {"gpu_uuid": "GPU-1", "pid": 12, "process_name": "other"},
    ]
    assert busy_gpus(steps, processes, ignore_pids=[10]) == {0: [11]}
    assert busy_gpus(steps, processes, ignore_pids=[10, 11]) == {}
    assert busy_gpus(steps, None) == {}
    reason = busy_reason({0: [11]}, processes)
    assert "GPU 0: pid 11 (nvtop)" in reason and "nothing was changed" in reason


class _Host:
    """Just what the execute-time checks use of a pyinfra host."""

    def __init__(self, inventory):
        self.inventory = inventory
        self.logged = []

    def get_fact(self, fact, *args, **kwargs):
        return self.inventory

    def log_styled(self, message, **kwargs):
        self.logged.append(message)


def test_mig_verification_messages():
    from operations.nvidia_mig import _verify_mig_disabled

    host = _Host([_gpu(0), _gpu(1, "Enabled", "Disabled")])
    assert _verify_mig_disabled(None, host, [0], False) is True
    assert _verify_mig_disabled(None, host, [0, 1], False) is False
    assert host.logged == [
        "MIG still pending after reset on GPU 1: reboot required; re-run after rebooting or "
        "set allow_reboot=true"
    ]
    host.logged.clear()
    assert _verify_mig_disabled(None, host, [1], True) is False
    assert host.logged[0].startswith("MIG still enabled on GPU 1 after reset and reboot")
    assert _verify_mig_disabled(None, _Host(None), [0], False) is False


def test_persistence_verification():
    from operations.nvidia_persistence import _verify_persistence

    host = _Host([{"index": 0, "persistence_mode": "Enabled"},
                  {"index": 1, "persistence_mode": "Disabled"}])
    assert _verify_persistence(None, host, [0], "Enabled") is True
    assert _verify_persistence(None, host, [0, 1], "Enabled") is False
    assert host.logged[0].startswith("persistence mode is Disabled on GPU 1, wanted Enabled")


# --- sysctl ----------------------------------------------------------------------------


def test_sysctl_plan_per_key():
    params = {"vm.swappiness": 1, "net.core.somaxconn": 65535, "net.ipv4.ip_local_port_range":
              "1024 65000", "vm.gone": 1}
    current = {
        "vm.swappiness": {"value": "60", "writable": False},
        "net.core.somaxconn": {"value": "4096", "writable": True},
        "net.ipv4.ip_local_port_range": {"value": "1024 65000", "writable": True},
        "vm.gone": None,
    }
    to_write, not_applied = plan_sysctl(params, current)
    assert to_write == [("net.core.somaxconn", "65535")]
    assert not_applied == {
        "vm.swappiness": "/proc/sys is read-only here; running value 60",
        "vm.gone": "unknown to this kernel",
    }


def test_sysctl_paths_and_values():
    assert drop_in_path(60) == "/etc/sysctl.d/60-vllm.conf"
    assert proc_sys_path("net.core.somaxconn") == "/proc/sys/net/core/somaxconn"
    assert normalize("32768\t60999") == "32768 60999"
    assert KernelParam().process(["read-only", "60"]) == {"value": "60", "writable": False}
    assert KernelParam().process(["writable", "32768\t60999"]) == {
        "value": "32768 60999", "writable": True}


def test_sysctl_template_renders_one_line_per_key():
    # The renderer operations/sysctl.py drop_in uses (strict, keep_trailing_newline).
    text = render(TEMPLATE, params=[("vm.swappiness", "1"), ("net.core.somaxconn", "65535")])
    body = [line for line in text.splitlines() if not line.startswith("#")]
    assert body == ["vm.swappiness = 1", "net.core.somaxconn = 65535"]
    assert text.endswith("65535\n")


# --- model volume ----------------------------------------------------------------------


def test_fstab_line_by_uuid_with_nofail():
    assert render_fstab_line(UUID, "/srv/models", ["noatime"]) == (
        f"UUID={UUID} /srv/models xfs noatime,nofail 0 0")
    assert fstab_options(["noatime", "nofail"]) == "noatime,nofail"
    assert fstab_options([]) == "nofail"
    with pytest.raises(OperationValueError):
        render_fstab_line(UUID, "/srv/my models", ["noatime"])


def test_fstab_rewrite_keeps_other_lines_and_is_idempotent():
    wanted = render_fstab_line(UUID, "/srv/models", ["noatime"])
    old = parse_fstab([
        "# /etc/fstab",
        "UUID=abc / ext4 errors=remount-ro 0 1",
        "/dev/loop3 /srv/models xfs defaults 0 0",
        "",
        "/swap.img none swap sw 0 0",
    ])
    content, changed = fstab_with_entry(old, wanted, "/srv/models", ["/dev/loop3"])
    assert changed
    assert content.splitlines() == [
        "# /etc/fstab", "UUID=abc / ext4 errors=remount-ro 0 1", wanted, "",
        "/swap.img none swap sw 0 0"]
    again, changed_again = fstab_with_entry(parse_fstab(content.splitlines()), wanted,
                                            "/srv/models", ["/dev/loop3"])
    assert (again, changed_again) == (content, False)
    # The same line with other spacing is not a change; a duplicate is.
    spaced = parse_fstab([f"UUID={UUID}\t/srv/models  xfs noatime,nofail 0 0"])
    assert fstab_with_entry(spaced, wanted, "/srv/models", [])[1] is False
    dup = parse_fstab([wanted, f"/dev/disk/by-uuid/{UUID} /mnt/x xfs defaults 0 0"])
    content, changed = fstab_with_entry(dup, wanted, "/srv/models", [f"/dev/disk/by-uuid/{UUID}"])
    assert changed and content == wanted + "\n"


def test_options_and_signatures():
    assert missing_options(["noatime", "nofail"], ["rw", "noatime"]) == []
    assert missing_options(["noatime"], ["rw", "relatime"]) == ["noatime"]
    assert describe_signature({"fstype": "ext4", "uuid": "u"}) == "ext4 (UUID u)"
    assert describe_signature({"fstype": None, "pttype": "gpt"}) == "a gpt partition table"


def test_blkid_parsing():
    assert parse_blkid_export([]) is None
    empty = parse_blkid_export(["BLOCK_DEVICE", "REALPATH=/dev/loop3", "BLKID_EXIT=2"])
    assert empty == {"path": "/dev/loop3", "fstype": None, "uuid": None, "pttype": None,
                     "usage": None, "probe_error": None}
    ext4 = parse_blkid_export(["BLOCK_DEVICE", "REALPATH=/dev/loop3", "DEVNAME=/dev/loop3",
                               "UUID=u-1", "BLOCK_SIZE=4096", "TYPE=ext4", "USAGE=filesystem",
                               "BLKID_EXIT=0"])
    assert (ext4["fstype"], ext4["uuid"], ext4["probe_error"]) == ("ext4", "u-1", None)
    gpt = parse_blkid_export(["BLOCK_DEVICE", "REALPATH=/dev/sdb", "PTUUID=x", "PTTYPE=gpt",
                              "BLKID_EXIT=0"])
    assert gpt["pttype"] == "gpt" and gpt["fstype"] is None
    odd = parse_blkid_export(["BLOCK_DEVICE", "REALPATH=/dev/sdb", "BLKID_EXIT=8"])
    assert odd["probe_error"] == "blkid -p exited 8"


def test_mount_and_unit_facts_parse():
    assert MountPoint().process(["/dev/loop3 xfs rw,noatime,inode64"]) == {
        "source": "/dev/loop3", "fstype": "xfs", "options": ["rw", "noatime", "inode64"]}
    assert MountPoint().process(["/dev/my\\x20disk xfs rw"])["source"] == "/dev/my disk"
    assert UnitPids().process(["4242", "17", ""]) == [17, 4242]
