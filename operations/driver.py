"""Keep the NVIDIA driver where it was installed: packages on hold, unattended upgrades off them.

Driver drift is the most common recurring failure of GPU servers (DeepOps issue 1186;
NVIDIA/ubuntu-packaging-nvidia-driver issue 3):
unattended-upgrades replaces the userspace libraries while the old kernel module stays
loaded, and every NVML call then fails with "Driver/library version mismatch". Two locks
prevent it: ``apt-mark hold`` on the installed packages, and an unattended-upgrades
blacklist drop-in that also covers packages installed later.
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import OperationValueError, QuoteString, StringCommand, operation
from pyinfra.operations import apt

from facts.driver import DriverPackages, HeldPackages
from operations import file_set

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


@operation()
def packages_held(prefixes: list[str] | None = None):
    """
    Put every installed NVIDIA driver and CUDA package on hold (``apt-mark hold``).

    + prefixes: package name prefixes to hold (default: nvidia-, libnvidia-, cuda-)

    Reads the installed and held packages when it runs, so packages installed by an
    earlier operation of the same run are held too. Already held: no change.

    **Example:**

    .. code:: python

        driver.packages_held(name="Hold the driver packages")
    """
    wanted = tuple(prefixes) if prefixes is not None else DRIVER_PACKAGE_PREFIXES
    installed = host.get_fact(DriverPackages)
    to_hold = unheld_packages(installed, host.get_fact(HeldPackages), wanted)
    if not to_hold:
        if installed:
            host.noop("the NVIDIA driver and CUDA packages are on hold")
        else:
            host.noop("no NVIDIA driver or CUDA package is installed")
        return
    yield StringCommand("apt-mark", "hold", *[QuoteString(name) for name in to_hold])


@operation()
def upgrade_blacklist(path: str = BLACKLIST_FILE, prefixes: list[str] | None = None):
    """
    Keep unattended-upgrades off the NVIDIA driver and CUDA packages.

    + path: the apt.conf drop-in to write
    + prefixes: package name prefixes (regular expressions matched from the start of
      the name) to blacklist (default: nvidia-, libnvidia-, cuda-)

    Written through ``file_set.present`` (root:root 0644): one remote read when the
    drop-in is in place.

    **Example:**

    .. code:: python

        driver.upgrade_blacklist(name="Blacklist the driver in unattended-upgrades")
    """
    content = render_blacklist(tuple(prefixes) if prefixes is not None else DRIVER_PACKAGE_PREFIXES)
    # One FileDigests read instead of files.put's File, Directory and Sha1File facts.
    yield from file_set.present._inner(files={path: (content.encode(), "644")})


def cuda_repo_distro(distro_name: str | None, major: int | None, minor: int | None = None) -> str:
    """NVIDIA's repository directory for a distribution: ubuntu2204, debian12, ..."""
    if distro_name == "Ubuntu" and major is not None:
        return f"ubuntu{major}{(minor or 4):02d}"
    if distro_name == "Debian" and major is not None:
        return f"debian{major}"
    raise OperationValueError(
        f"NVIDIA's CUDA repository has no directory for {distro_name} {major}"
    )


@operation()
def cuda_toolkit(cuda_version: str, repo_distro: str, arch: str = "x86_64"):
    """
    Install the CUDA toolkit from NVIDIA's repository, signed by NVIDIA's key.

    + cuda_version: the toolkit's CUDA version, e.g. ``12.1`` (installs cuda-toolkit-12-1)
    + repo_distro: NVIDIA's directory for the distribution, e.g. ``ubuntu2204``
    + arch: NVIDIA's directory for the architecture (``x86_64``, ``sbsa``)

    Installed already: no change (no apt update either). Without NVIDIA's cuda-keyring
    package, the repository's key is fetched over https into a root-only directory and
    trusted only with the pinned fingerprint; the source names it with ``signed-by``.

    **Example:**

    .. code:: python

        driver.cuda_toolkit(cuda_version="12.1", repo_distro="ubuntu2204")
    """
    package = "cuda-toolkit-" + cuda_version.replace(".", "-")
    installed = host.get_fact(DriverPackages) or {}
    if package in installed:
        host.noop(f"{package} is installed")
        return
    if "cuda-keyring" not in installed:
        repo = f"{CUDA_REPO_BASE}/{repo_distro}/{arch}/"
        key = f"{CUDA_KEY_DIR}/{CUDA_KEY_FILE}"
        yield StringCommand(
            "install -d -m 700", QuoteString(CUDA_KEY_DIR),
            "&& curl -fsSL --proto =https --retry 3 -o", QuoteString(key),
            QuoteString(repo + CUDA_KEY_FILE),
            "&& test \"$(gpg --show-keys --with-colons", QuoteString(key),
            "| awk -F: '$1 == \"fpr\" {print $10; exit}')\" =", QuoteString(CUDA_KEY_FINGERPRINT),
            "|| { echo", QuoteString(f"{repo}{CUDA_KEY_FILE} is not NVIDIA's key "
                                     f"{CUDA_KEY_FINGERPRINT}: not trusted"),
            ">&2; rm -f", QuoteString(key), "; exit 1; }",
        )
        yield StringCommand(
            "install -d -m 755 /etc/apt/keyrings && gpg --dearmor <", QuoteString(key), ">",
            QuoteString(CUDA_KEYRING + ".new"), "&& chmod 644", QuoteString(CUDA_KEYRING + ".new"),
            "&& mv -f", QuoteString(CUDA_KEYRING + ".new"), QuoteString(CUDA_KEYRING),
            "&& echo", QuoteString(f"deb [signed-by={CUDA_KEYRING}] {repo} /"), ">",
            QuoteString(CUDA_SOURCE),
        )
    yield from apt.packages._inner(packages=[package], update=True, no_recommends=True)
