"""Debian packages a stage needs from the distribution, installed only where missing."""

from __future__ import annotations

from pyinfra import host
from pyinfra.facts.deb import DebPackage
from pyinfra.operations import apt

# apt-get update before installing a Debian package, unless the package lists are newer
# than this (pyinfra's apt.update cache_time, Ansible's cache_valid_time): a fresh host
# refreshes them once per run, not once per stage that installs a package. Not for a
# package from an apt source the same run adds (the driver's): that one always refreshes.
APT_LISTS_MAX_AGE_S = 3600


def debian_package(name: str, package: str) -> None:
    """``package`` from the distribution where it is missing, the package lists refreshed
    first where they are older than APT_LISTS_MAX_AGE_S. Read once: a host with the
    package gets no apt operation at all (no apt-get update, no package list read)."""
    if host.get_fact(DebPackage, package=package):
        return
    apt.packages(
        name=name,
        packages=[package],
        update=True,
        cache_time=APT_LISTS_MAX_AGE_S,
        no_recommends=True,
    )
