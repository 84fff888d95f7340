"""MIG: off on every GPU, so vLLM's tensor parallelism gets whole GPUs.

Follows mig-parted: read the current and pending mode; GPUs already disabled get no
command; otherwise our vLLM service is stopped (when it exists and runs), a GPU used by
any other process stops the host with the PIDs before anything changes, and idle GPUs
get ``nvidia-smi -i N -mig 0`` and ``nvidia-smi -i N -r``, then a check that the mode
took effect. Still pending after the reset: reboot (``allow_reboot``) or stop the host
with "reboot required". The operation reads the GPUs when it runs, so it also works
after the driver stage rebooted a fresh host.

On vllm_device "cpu" (vLLM's CPU build, no GPU) the stage is skipped, the reason logged.

    pyinfra inventory.py deploys/mig.py
"""

from __future__ import annotations

from facts.gpus import GpuInventory
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.operations import mig as mig_ops
from pyinfra_vllm.plans import mig as mig_plan
from pyinfra_vllm.plans.engine_access import Endpoint
from pyinfra_vllm.run.context import HostContext
from pyinfra_vllm.run.host_reads import Read
from pyinfra_vllm.run.stage import stage


def mig_reads(settings: Settings, _place: Endpoint) -> list[Read]:
    """What the mig stage reads of a converged host: the run's one read."""
    return [] if settings.vllm_device == "cpu" else [Read(GpuInventory)]


@stage(gpu_only=True, reads=mig_reads)
def mig(ctx: HostContext) -> None:
    """MIG: off on every GPU, so vLLM's tensor parallelism gets whole GPUs."""
    # mig_mode allows only "disabled" (vLLM tensor parallelism needs whole GPUs).
    mig_ops.mig_disabled(
        name="MIG: disabled on every GPU",
        service=mig_plan.VLLM_UNIT,
        allow_reboot=ctx.settings.allow_reboot,
        gpus=ctx.state.get("gpus"),
    )
