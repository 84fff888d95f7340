"""Turn MIG off on every GPU, the way NVIDIA's mig-parted does it.

mig-parted's state machine (NVIDIA/mig-parted, cmd/nvidia-mig-parted reconfigure): read the current and
the pending mode of each GPU; a GPU already disabled in both is left alone (no command
at all); otherwise set the pending mode (``nvidia-smi -i N -mig 0``), reset the GPU so
the mode takes effect (``nvidia-smi -i N -r``, which needs a GPU nobody uses), and check
the current mode afterwards. Our own vLLM service is stopped first (the vllm_service
stage starts it again); any other process on such a GPU stops the host with its PIDs,
before anything is changed. A mode still pending after the reset needs a reboot.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from pyinfra import host
from pyinfra.api import FunctionCommand, QuoteString, StringCommand, operation
from pyinfra.facts.systemd import SystemdStatus
from pyinfra.operations import server

from facts.gpus import GpuInventory, GpuProcesses
from facts.units import UnitPids
from pyinfra_vllm.operations import gate
from pyinfra_vllm.plans.mig import (
    VLLM_UNIT,
    busy_gpus,
    busy_reason,
    mig_disabled_on,
    plan_mig,
)

logger = logging.getLogger("pyinfra")


def _still_enabled(indices: list[int]) -> list[int]:
    gpus = {gpu["index"]: gpu for gpu in host.get_fact(GpuInventory) or []}
    return [index for index in indices if index not in gpus or not mig_disabled_on(gpus[index])]


def _verify_mig_disabled(state, host, indices: list[int], rebooted: bool) -> bool:
    gpus = {gpu["index"]: gpu for gpu in host.get_fact(GpuInventory) or []}
    failed = False
    for index in indices:
        gpu = gpus.get(index)
        if gpu is not None and mig_disabled_on(gpu):
            continue
        failed = True
        if gpu is None:
            message = f"GPU {index} no longer answers nvidia-smi after the MIG change"
        elif rebooted:
            message = (
                f"MIG still enabled on GPU {index} after reset and reboot (current "
                f"{gpu.get('mig_current')}, pending {gpu.get('mig_pending')}): check for a "
                "loaded nvidia_drm module or GPU passthrough (mig-parted#9, #181)"
            )
        else:
            message = (
                f"MIG still pending after reset on GPU {index}: reboot required; re-run "
                "after rebooting or set allow_reboot=true"
            )
        host.log_styled(message, fg="red", log_func=logger.error)
    return not failed


def _service_state(service: str | None) -> tuple[bool, list[int]]:
    """Whether our unit ``service`` runs, and the PIDs of its processes: a GPU they alone
    use is not busy, since the unit is stopped before the reset."""
    service_running = False
    service_pids: list[int] = []
    if service is not None:
        service_running = bool(host.get_fact(SystemdStatus, services=[service]).get(service))
        if service_running:
            service_pids = host.get_fact(UnitPids, unit=service)
    return service_running, service_pids


def _mig_turned_off(
    steps: list[dict], service: str | None, service_running: bool
) -> Iterator[StringCommand]:
    """``service`` stopped when it runs, then each GPU's pending mode set and the GPU reset,
    as ``steps`` (plan_mig) say."""
    if service is not None and service_running:
        yield StringCommand("systemctl", "stop", QuoteString(service))
    for step in steps:
        index = QuoteString(str(step["index"]))
        if step["set_pending"]:
            yield StringCommand("nvidia-smi", "-i", index, "-mig", "0")
        if step["reset"]:
            yield StringCommand("nvidia-smi", "-i", index, "-r")


def _mig_checked(
    indices: list[int], allow_reboot: bool, reboot_timeout: int
) -> Iterator[StringCommand | FunctionCommand]:
    """The check that MIG is off on the GPUs ``indices`` after their reset, with a reboot
    first where ``allow_reboot`` and a mode is still pending."""
    rebooted = False
    # Read when the reset commands have run (pyinfra runs an operation's commands as
    # they are yielded); at prepare time the generator never gets here.
    if allow_reboot and _still_enabled(indices):
        yield from server.reboot._inner(reboot_timeout=reboot_timeout)
        rebooted = True
    yield FunctionCommand(_verify_mig_disabled, (indices, rebooted), {})


@operation()
def mig_disabled(
    service: str | None = VLLM_UNIT,
    allow_reboot: bool = False,
    reboot_timeout: int = 900,
    gpus: list[dict] | None = None,
):
    """
    Turn MIG mode off on every GPU (current and pending), resetting idle GPUs.

    + service: our systemd unit using the GPUs, stopped first when it runs (None: none)
    + allow_reboot: reboot when the mode is still pending after the reset
    + reboot_timeout: seconds to wait for the host to come back after a reboot
    + gpus: the GpuInventory fact when the deploy already read it (saves a round trip)

    Already disabled everywhere: no command at all. A process other than ``service``'s
    on a GPU to change: the host is refused with the PIDs and nothing changes.

    **Example:**

    .. code:: python

        mig.mig_disabled(name="MIG off", allow_reboot=False)
    """
    if gpus is None:
        gpus = host.get_fact(GpuInventory)
    if gpus is None:
        host.noop("no NVIDIA driver answers nvidia-smi; MIG is checked once it does")
        return
    steps = plan_mig(gpus)
    if not steps:
        host.noop("MIG is disabled on every GPU")
        return

    processes = host.get_fact(GpuProcesses)
    if processes is None:
        # Unknown is not idle: a reset would kill whatever runs there.
        yield from gate.refuse._inner(reasons=[
            "the processes on the GPUs could not be read (nvidia-smi --query-compute-apps "
            "failed); refusing to reset a GPU that may be in use; check nvidia-smi and re-run"
        ])
        return
    service_running, service_pids = _service_state(service)
    busy = busy_gpus(steps, processes, service_pids)
    if busy:
        yield from gate.refuse._inner(reasons=[busy_reason(busy, processes)])
        return

    yield from _mig_turned_off(steps, service, service_running)
    yield from _mig_checked([step["index"] for step in steps], allow_reboot, reboot_timeout)
