"""Facts about the NVIDIA driver: the version nvidia-smi and NVML report, the loaded
kernel module, the installed and held driver packages, and whether module and userspace
match.

Absent (None, or empty) on a host without a driver; never a failed host.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, TypeVar

from typing_extensions import override

from facts.base import FactBase
from facts.nvidia_smi import NvidiaSmiFact, device_error, nvml_failure, split_smi_output
from facts.versions import version_tuple

T = TypeVar("T")


_DRIVER_RE = re.compile(r"(?:Driver|KMD) Version\s*:\s*([0-9][\w.]*)")


_CUDA_RE = re.compile(r"CUDA (?:UMD )?Version\s*:\s*([0-9][\w.]*)")


def parse_driver_info(lines: Iterable[str]) -> dict[str, str | None] | None:
    """Driver and supported CUDA version from nvidia-smi's table header (or ``-q``).

    Reads ``Driver Version: X  CUDA Version: Y`` and R610's ``KMD Version: X  CUDA UMD
    Version: Y``. Returns ``{"driver_version": str, "cuda_version": str|None}`` or None.
    """
    lines, _status = split_smi_output(lines)
    if nvml_failure(lines) is not None:
        return None
    driver: str | None = None
    cuda: str | None = None
    for line in lines:
        if driver is None:
            match = _DRIVER_RE.search(line)
            driver = match.group(1) if match is not None else None
        if cuda is None:
            match = _CUDA_RE.search(line)
            cuda = match.group(1) if match is not None else None
        if driver is not None and cuda is not None:
            break
    if driver is None:
        return None
    return {"driver_version": driver, "cuda_version": cuda}


_NVML_LIBRARY_RE = re.compile(r"^NVML library version:\s*(\S+)")


def parse_nvml_error(lines: Iterable[str]) -> dict[str, str | None] | None:
    """Why ``nvidia-smi -L`` fails: ``{"error": str, "nvml_library_version": str|None}``.

    None when it works. Without the exit marker (raw recorded output) only the known
    error lines count; with it, any non-zero exit is an error (its first line).
    """
    lines, status = split_smi_output(lines)
    error = nvml_failure(lines) or device_error(lines)
    if error is None and status not in (None, 0):
        first = next((line.strip() for line in lines if line.strip()), None)
        error = first if first is not None else f"nvidia-smi -L exited {status}"
    if error is None:
        return None
    library = None
    for line in lines:
        match = _NVML_LIBRARY_RE.match(line.strip())
        if match is not None:
            library = match.group(1)
            break
    return {"error": error, "nvml_library_version": library}


_MODULE_VERSION_RE = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)")


def parse_kernel_module(lines: Iterable[str]) -> dict[str, Any] | None:
    """``NVRM version: NVIDIA UNIX [Open ]Kernel Module ... 565.57.01 ...`` ->
    ``{"version": "565.57.01", "open": True}``; None without an NVRM line."""
    for line in lines:
        if not line.startswith("NVRM version:"):
            continue
        match = _MODULE_VERSION_RE.search(line)
        if match is None:
            return None
        return {"version": match.group(1), "open": "Open Kernel Module" in line}
    return None


_UPSTREAM_VERSION_RE = re.compile(r"^(?:\d+:)?(\d+(?:\.\d+)+)")


# Which package says which userspace driver is installed, most telling first: Ubuntu's
# nvidia-utils-<branch>[-server], libnvidia-compute-<branch>[-server], then Debian's names.
_USERSPACE_PACKAGES = (
    re.compile(r"^nvidia-utils-\d+(-server)?$"),
    re.compile(r"^libnvidia-compute-\d+(-server)?$"),
    re.compile(r"^nvidia-smi$"),
    re.compile(r"^libnvidia-ml1$"),
    re.compile(r"^nvidia-driver-\d+(-server)?$"),
    re.compile(r"^nvidia-headless-no-dkms-\d+(-server)?$"),
)


def parse_dpkg_packages(lines: Iterable[str]) -> dict[str, str]:
    """``package<TAB>version<TAB>status`` lines -> ``{package: version}`` for installed
    (``ii``) and held (``hi``) packages."""
    packages: dict[str, str] = {}
    for line in lines:
        parts = line.rstrip("\r\n").split("\t")
        if len(parts) < 3:
            continue
        name, version, status = parts[0].strip(), parts[1].strip(), parts[2].strip()
        if status[:2] in ("ii", "hi") and name != "" and version != "":
            packages[name] = version
    return packages


def parse_held_dpkg(lines: Iterable[str]) -> list[str]:
    """Held packages (status ``h?``) from the same dpkg-query lines."""
    held = []
    for line in lines:
        parts = line.rstrip("\r\n").split("\t")
        if len(parts) >= 3 and parts[2].strip().startswith("h"):
            held.append(parts[0].strip())
    return held


def upstream_version(version: str | None) -> str | None:
    """``535.129.03-0ubuntu0.22.04.1`` -> ``535.129.03`` (epoch and revision dropped)."""
    if version is None:
        return None
    match = _UPSTREAM_VERSION_RE.match(version.strip())
    return match.group(1) if match is not None else None


def userspace_driver(packages: dict[str, str] | None) -> tuple[str, str] | None:
    """``(package, upstream_version)`` of the installed userspace driver, or None."""
    if not packages:
        return None
    for pattern in _USERSPACE_PACKAGES:
        for name in sorted(packages):
            if pattern.match(name) is None:
                continue
            version = upstream_version(packages[name])
            if version is not None:
                return name, version
    return None


def _same_release(a: str, b: str) -> bool:
    """Equal over the parts both give: NVML prints ``580.178`` for ``580.178.xx``."""
    left, right = version_tuple(a), version_tuple(b)
    common = min(len(left), len(right))
    return common > 0 and left[:common] == right[:common]


def module_mismatch(
    kernel_module: dict[str, Any] | None,
    packages: dict[str, str] | None,
    nvml_error: dict[str, Any] | None,
) -> str | None:
    """A sentence when the loaded kernel module is not the installed userspace driver.

    This is the "Driver/library version mismatch" state an apt upgrade leaves until the
    next reboot. Compares the module with the userspace package, then with the NVML
    library version nvidia-smi printed; NVML's own mismatch message counts even when
    no version is known. None when consistent or unknown.
    """
    module = (kernel_module or {}).get("version")
    userspace = userspace_driver(packages)
    if module is not None and userspace is not None:
        name, version = userspace
        if version != module:
            return (
                f"loaded kernel module {module} but installed {name} is {version}: reboot required"
            )
        return None
    error = (nvml_error or {}).get("error") or ""
    library = (nvml_error or {}).get("nvml_library_version")
    if module is not None and library is not None and not _same_release(module, library):
        return f"loaded kernel module {module} but the NVML library is {library}: reboot required"
    if "version mismatch" in error.lower():
        loaded = f" (loaded kernel module {module})" if module is not None else ""
        return f"nvidia-smi reports {error}{loaded}: reboot required"
    return None


class DriverInfo(NvidiaSmiFact[dict[str, str | None] | None]):
    """
    Returns the driver version and the CUDA version it supports, from the header of
    nvidia-smi's default table: ``{"driver_version": "535.129.03", "cuda_version":
    "12.2"}``, or None without nvidia-smi or on an NVML error.
    """

    # The default table: its header is the one place both versions are printed.
    arguments = ""

    @override
    def process(self, output: list[str]) -> dict[str, str | None] | None:
        return parse_driver_info(output)


class NvmlError(NvidiaSmiFact[dict[str, str | None] | None]):
    """
    Returns why ``nvidia-smi -L`` fails, or None when it works or is absent:

    .. code:: python

        {"error": "Failed to initialize NVML: Driver/library version mismatch",
         "nvml_library_version": "580.178"}
    """

    arguments = "-L"

    @override
    def process(self, output: list[str]) -> dict[str, str | None] | None:
        return parse_nvml_error(output)


KERNEL_MODULE_VERSION_FILE = "/proc/driver/nvidia/version"


class KernelModule(FactBase[dict[str, Any] | None]):
    """
    Returns the loaded NVIDIA kernel module from ``/proc/driver/nvidia/version``:
    ``{"version": "565.57.01", "open": True}``, or None when no module is loaded.
    """

    @override
    def command(self) -> str:
        path = KERNEL_MODULE_VERSION_FILE
        return f"! test -e {path} || cat {path}"

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        return parse_kernel_module(output)


DRIVER_PACKAGE_PATTERNS = ("nvidia-*", "libnvidia-*", "cuda-*")


class DriverPackageQuery(FactBase[T]):
    """
    Base of the facts read from one ``dpkg-query`` over the NVIDIA driver and CUDA
    packages (``DRIVER_PACKAGE_PATTERNS``); absent (the fact's default) without dpkg.
    """

    @override
    def requires_command(self) -> str:
        return "dpkg-query"

    @override
    def command(self) -> str:
        patterns = " ".join(f"'{pattern}'" for pattern in DRIVER_PACKAGE_PATTERNS)
        # dpkg-query exits 1 when a pattern matches nothing (a host without CUDA
        # packages), 2 on real errors: only the first is normal.
        return (
            "dpkg-query -W -f '${Package}\\t${Version}\\t${db:Status-Abbrev}\\n' "
            f"{patterns} 2>/dev/null || test $? -eq 1"
        )


class DriverPackages(DriverPackageQuery[dict[str, str]]):
    """
    Returns the installed NVIDIA driver and CUDA packages (status ``ii`` or ``hi``),
    ``{}`` when there are none or dpkg is absent:

    .. code:: python

        {"nvidia-utils-535-server": "535.129.03-0ubuntu0.22.04.1"}
    """

    @override
    @staticmethod
    def default() -> dict[str, str]:
        return {}

    @override
    def process(self, output: list[str]) -> dict[str, str]:
        return parse_dpkg_packages(output)


class HeldPackages(DriverPackageQuery[list[str]]):
    """
    Returns the NVIDIA driver and CUDA packages on hold (dpkg selection ``hold``, what
    ``apt-mark hold`` sets), ``[]`` when none or dpkg is absent.
    """

    @override
    @staticmethod
    def default() -> list[str]:
        return []

    @override
    def process(self, output: list[str]) -> list[str]:
        return parse_held_dpkg(output)
