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
from pyinfra.api import QuoteString, StringCommand, operation
from pyinfra.operations import apt

from facts.driver import DriverPackages, HeldPackages
from pyinfra_vllm.operations import file_set
from pyinfra_vllm.plans.driver import (
    BLACKLIST_FILE,
    CUDA_KEY_DIR,
    CUDA_KEY_FILE,
    CUDA_KEY_FINGERPRINT,
    CUDA_KEYRING,
    CUDA_REPO_BASE,
    CUDA_SOURCE,
    DRIVER_PACKAGE_PREFIXES,
    render_blacklist,
    unheld_packages,
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
