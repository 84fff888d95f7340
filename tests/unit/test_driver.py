"""The driver stage's helpers: the apt source, the packages, the holds and the unattended-upgrades blacklist."""

from __future__ import annotations

import re

import pytest
from pyinfra.api import OperationValueError

from pyinfra_vllm.core.settings import SettingsError, validate
from pyinfra_vllm.plans.driver import (
    apt_source_line,
    cuda_repo_distro,
    driver_packages,
    render_blacklist,
    unheld_packages,
)


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


SIGNED = ("deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] "
          "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2204/x86_64/ /")


@pytest.mark.parametrize("value", ["http://10.0.0.1:8787/", "deb [trusted=yes] file:/srv/repo ./"])
def test_nvidia_apt_repo_setting_accepts_url_or_line_when_trusted(value):
    settings = validate({"nvidia_apt_repo": value, "nvidia_apt_repo_trusted": True,
                         "gateway_open": True})
    assert settings.nvidia_apt_repo == value


def test_nvidia_apt_repo_setting_accepts_a_signed_https_line():
    assert validate({"nvidia_apt_repo": SIGNED, "gateway_open": True}).nvidia_apt_repo == SIGNED
    assert apt_source_line(SIGNED) == SIGNED


def test_nvidia_apt_repo_setting_refuses_other_text():
    with pytest.raises(SettingsError, match="nvidia_apt_repo"):
        validate({"nvidia_apt_repo": "ppa:graphics-drivers/ppa", "gateway_open": True})
