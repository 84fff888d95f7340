"""Persistence: the nvidia-persistenced daemon keeps every GPU initialised.

With ``persistence_mode`` (default true) the daemon is started with persistence mode on
(a drop-in replaces Ubuntu's ``--no-persistence-mode``), enabled for boot and running;
then every GPU is checked, and a GPU still showing Disabled gets ``nvidia-smi -pm 1``
(through the daemon) and a verification that fails the host with a readable message.
A converged host: no change. ``persistence_mode`` false: the daemon stopped and
disabled, the mode off on every GPU. Either way, a drop-in for the daemon's unit that
the suite did not write (``systemctl edit``, a hand-made ``.conf``) is moved aside under
/var/lib/pyinfra-vllm/disabled-drop-ins/ and systemd reloaded.

On vllm_device "cpu" (vLLM's CPU build, no GPU) the stage is skipped, the reason logged.

    pyinfra inventory.py deploys/persistence.py
"""

from __future__ import annotations

from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus
from pyinfra.operations import systemd
from pyinfra.operations.util import any_changed

from facts.files import FileDigests
from facts.gpus import GpuInventory
from facts.units import UnitActivation, UnitDropIns
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.operations import file_set, units
from pyinfra_vllm.operations import persistence as persistence_ops
from pyinfra_vllm.plans import persistence as persistence_plan
from pyinfra_vllm.plans.engine_access import Endpoint
from pyinfra_vllm.run.context import HostContext
from pyinfra_vllm.run.host_reads import Read
from pyinfra_vllm.run.stage import stage


def persistence_reads(settings: Settings, _place: Endpoint) -> list[Read]:
    """What the persistence stage reads of a converged host: the run's one read."""
    if settings.vllm_device == "cpu":
        return []
    unit = persistence_plan.PERSISTENCED_UNIT
    # pyinfra's systemd.service reads the daemon's state while the run is planned, the
    # restart's too (its _if is only asked when the run executes); stopped and disabled,
    # whether it is enabled as well.
    reads = [Read(UnitDropIns, {"unit": unit}), Read(GpuInventory),
             Read(SystemdStatus, {"services": [unit]})]
    if settings.persistence_mode:
        reads += [Read(FileDigests, {"paths": [persistence_plan.PERSISTENCED_DROP_IN]}),
                  Read(UnitActivation, {"unit": unit})]
    else:
        reads.append(Read(SystemdEnabled, {"services": [unit]}))
    return reads


@stage(gpu_only=True, reads=persistence_reads)
def persistence(ctx: HostContext) -> None:
    """Persistence: the nvidia-persistenced daemon keeps every GPU initialised."""
    unit = persistence_plan.PERSISTENCED_UNIT
    # Before the suite's own drop-in: what the daemon runs with is the suite's alone.
    foreign = units.drop_ins_only(
        name="Persistence: no foreign drop-in for nvidia-persistenced",
        unit=unit,
        own=[persistence_plan.PERSISTENCED_DROP_IN],
    )
    if ctx.settings.persistence_mode:
        override = file_set.present(
            name="Persistence: nvidia-persistenced with persistence mode on",
            files={
                persistence_plan.PERSISTENCED_DROP_IN: (
                    "templates/nvidia-persistenced-override.conf",
                    "644",
                )
            },
        )
        systemd.daemon_reload(
            name="Persistence: reload systemd units", _if=override.did_change
        )
        # A foreign drop-in set aside changes the command line too (drop_ins_only has
        # already reloaded systemd).
        # A new command line takes effect on a restart (which also starts a stopped
        # daemon); placed first, a fresh host's daemon is started once, not twice.
        systemd.service(
            name="Persistence: restart nvidia-persistenced with its new command line",
            service=unit,
            running=True,
            restarted=True,
            _if=any_changed(override, foreign),
        )
        units.enabled_and_running(
            name="Persistence: nvidia-persistenced enabled and running",
            unit=unit,
        )
    else:
        systemd.service(
            name="Persistence: nvidia-persistenced stopped and disabled",
            service=unit,
            running=False,
            enabled=False,
        )
    persistence_ops.persistence_mode(
        name=f"Persistence: mode {'on' if ctx.settings.persistence_mode else 'off'} on every GPU",
        enabled=ctx.settings.persistence_mode,
    )
