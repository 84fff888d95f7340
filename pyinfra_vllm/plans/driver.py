"""What the driver stage should put on a host: the driver branch's packages, their
upgrade blacklist, the CUDA apt source and its key (pure functions;
pyinfra_vllm/operations/driver.py installs them)."""

from __future__ import annotations

from pyinfra.api import OperationValueError

# Package name prefixes of the driver and CUDA: what is held and blacklisted.
DRIVER_PACKAGE_PREFIXES = ("nvidia-", "libnvidia-", "cuda-")

BLACKLIST_FILE = "/etc/apt/apt.conf.d/51pyinfra-vllm-nvidia-blacklist"

CUDA_REPO_BASE = "https://developer.download.nvidia.com/compute/cuda/repos"
# NVIDIA's CUDA repository signing key (3bf863cc.pub, in use since NVIDIA's April 2022 key
# rotation): fetched over https into a root-only directory and used only if its
# fingerprint is this one. Never the cuda-keyring .deb: that would be a root-run package
# no checksum covers.
CUDA_KEY_FILE = "3bf863cc.pub"
CUDA_KEY_FINGERPRINT = "EB693B3035CD5710E231E123A4B469963BF863CC"
CUDA_KEY_DIR = "/var/lib/pyinfra-vllm/keys"
CUDA_KEYRING = "/etc/apt/keyrings/cuda-archive-keyring.gpg"
CUDA_SOURCE = "/etc/apt/sources.list.d/pyinfra-vllm-cuda.list"


def driver_packages(branch: str) -> list[str]:
    """The distribution packages of a headless driver branch (Ubuntu's names)."""
    return [f"nvidia-headless-{branch}", f"nvidia-utils-{branch}"]


def apt_source_line(repo: str) -> str:
    """An apt one-line source from the ``nvidia_apt_repo`` setting.

    A line starting with ``deb `` is used as given. A bare http(s) URL is a flat
    repository the operator trusts (a local mirror, the sandbox's repo): ``deb
    [trusted=yes] URL ./``.
    """
    repo = repo.strip()
    if repo.startswith("deb "):
        return repo
    return f"deb [trusted=yes] {repo} ./"


def render_blacklist(prefixes: tuple[str, ...] | list[str] = DRIVER_PACKAGE_PREFIXES) -> str:
    """The unattended-upgrades drop-in that keeps its hands off the driver.

    ``Unattended-Upgrade::Package-Blacklist`` entries are Python regular expressions
    matched from the start of the package name (unattended-upgrades >= 1.0; Ubuntu
    22.04 ships 2.8, Debian 12 2.9), so ``"nvidia-"`` is every package starting with
    ``nvidia-``. apt appends list entries from later files, so this file adds to the
    stock ``50unattended-upgrades`` list instead of replacing it.
    """
    for prefix in prefixes:
        if not prefix or any(char in prefix for char in '";{}\n'):
            raise OperationValueError(f"{prefix!r} cannot be written into an apt.conf list")
    lines = [
        "// Managed by pyinfra-vllm (deploys/driver.py); local edits are overwritten.",
        "// The NVIDIA driver and CUDA are upgraded deliberately, with a reboot, never by",
        "// unattended-upgrades (a new userspace library under an old kernel module breaks",
        "// NVML: \"Driver/library version mismatch\"). Entries are regular expressions",
        "// matched from the start of the package name.",
        "Unattended-Upgrade::Package-Blacklist {",
        *[f'    "{prefix}";' for prefix in prefixes],
        "};",
    ]
    return "\n".join(lines) + "\n"


def unheld_packages(
    installed: dict[str, str] | None,
    held: list[str] | None,
    prefixes: tuple[str, ...] | list[str] = DRIVER_PACKAGE_PREFIXES,
) -> list[str]:
    """Installed driver/CUDA packages that are not on hold yet, sorted."""
    held_set = set(held or [])
    return sorted(
        name
        for name in (installed or {})
        if name.startswith(tuple(prefixes)) and name not in held_set
    )


def cuda_repo_distro(distro_name: str | None, major: int | None, minor: int | None = None) -> str:
    """NVIDIA's repository directory for a distribution: ubuntu2204, debian12, ..."""
    if distro_name == "Ubuntu" and major is not None:
        return f"ubuntu{major}{(minor or 4):02d}"
    if distro_name == "Debian" and major is not None:
        return f"debian{major}"
    raise OperationValueError(
        f"NVIDIA's CUDA repository has no directory for {distro_name} {major}"
    )
