"""Driver: install the pinned branch on a host without one, and keep it from drifting.

A host without a driver (no kernel module loaded, no driver package installed) gets
``nvidia-headless-<branch>`` and ``nvidia-utils-<branch>`` from the distribution (or
from the ``nvidia_apt_repo`` source). The kernel module of a new driver loads only
after a reboot: with ``allow_reboot`` the host is rebooted and the run goes on,
otherwise the host stops with "reboot required". A host whose driver packages are
installed but whose module is not loaded (installed by an earlier run, not rebooted
yet) gets the same verdict without a second install.

Every host with a driver gets its NVIDIA and CUDA packages held (``apt-mark hold``) and
an unattended-upgrades blacklist drop-in, so an upgrade never swaps the userspace under
the loaded module ("Driver/library version mismatch"). The CUDA toolkit, from NVIDIA's
repository, only with ``install_cuda_toolkit``.

On vllm_device "cpu" (vLLM's CPU build, no GPU) the stage is skipped, the reason logged.

    pyinfra inventory.py deploys/driver.py
"""

from __future__ import annotations

from pyinfra.operations import apt, server

from facts.driver import DriverPackages, HeldPackages
from facts.files import FileDigests
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.operations import driver as driver_ops
from pyinfra_vllm.plans import driver as driver_plan
from pyinfra_vllm.plans.engine_access import Endpoint
from pyinfra_vllm.run.context import HostContext
from pyinfra_vllm.run.host_reads import Read
from pyinfra_vllm.run.stage import stage


def driver_reads(settings: Settings, _place: Endpoint) -> list[Read]:
    """What the driver stage reads of a converged host: the run's one read."""
    if settings.vllm_device == "cpu":
        return []
    return [Read(DriverPackages), Read(HeldPackages),
            Read(FileDigests, {"paths": [driver_plan.BLACKLIST_FILE]})]


@stage(gpu_only=True, reads=driver_reads)
def driver(ctx: HostContext) -> None:
    """Driver: install the pinned branch on a host without one, and keep it from drifting."""
    settings = ctx.settings
    branch = settings.nvidia_driver_branch
    module_loaded = ctx.state.get("kernel_module") is not None
    installed = bool(ctx.state.get("driver_packages"))
    reboot_reason = (
        f"driver {branch} installed; reboot required to load its kernel module; re-run "
        "after rebooting or set allow_reboot=true"
    )

    install = None
    if not module_loaded and not installed:
        if settings.nvidia_apt_repo is not None:
            apt.repo(
                name="Driver: apt source for the NVIDIA packages",
                src=driver_plan.apt_source_line(settings.nvidia_apt_repo),
                filename="pyinfra-vllm-nvidia",
            )
        install = apt.packages(
            name=f"Driver: install nvidia-headless-{branch}",
            packages=driver_plan.driver_packages(branch),
            update=True,
            no_recommends=True,
        )

    # A GPU stage: its stack is a CUDA row, which names its CUDA build (StackRow).
    cuda = settings.stack.cuda
    if settings.install_cuda_toolkit and cuda is not None:
        distro = ctx.state.get("os") or {}
        driver_ops.cuda_toolkit(
            name=f"Driver: CUDA toolkit {cuda}",
            cuda_version=cuda,
            repo_distro=driver_plan.cuda_repo_distro(
                distro.get("name"), distro.get("major"), distro.get("minor")
            ),
        )

    driver_ops.upgrade_blacklist(name="Driver: keep unattended-upgrades off the driver")
    driver_ops.packages_held(name="Driver: hold the NVIDIA and CUDA packages")

    if not module_loaded and (install is not None or installed):
        if settings.allow_reboot:
            # A fresh install reboots only if apt really installed something; packages
            # installed by an earlier run (module still not loaded) reboot at once.
            ctx.stale = True
            server.reboot(
                name="Driver: reboot to load the new kernel module",
                reboot_timeout=900,
                _if=[install.did_change] if install is not None else [],
            )
        else:
            if install is None:
                reboot_reason = (
                    "driver packages are installed but no NVIDIA kernel module is loaded; "
                    "reboot required; re-run after rebooting or set allow_reboot=true"
                )
            # Later stages add nothing for this host; the refusal runs after the install.
            ctx.refuse("Driver: reboot required", [reboot_reason])

