"""Sentinel: a one-token completion to the engine every sentinel_interval_s; after
sentinel_failures failures in a row the host leaves the rotation and, with
sentinel_restart, the engine is restarted; back in rotation once it answers.

files/sentinel.py runs under ``vllm-sentinel.service``, root's uid without a capability,
beside the path unit ``vllm-sentinel-restart.path`` that restarts the engine when it
asks (pyinfra_vllm/plans/sentinel.py says why so). The stage uploads it (and
engine_client.py, which it imports), writes the three units, restarts the sentinel when
one of them changed and keeps both enabled and running; a unit changed by hand is
written back, a foreign drop-in for the sentinel's unit moved aside. A converged host: no
change. ``sentinel`` false: both units stopped and disabled, the units, the helper, the
state and the textfile removed, and the rotation flag where the sentinel placed it (only
then). docs/runtime.md, "The sentinel".

    pyinfra inventory.py deploys/sentinel.py
"""

from __future__ import annotations

from pyinfra.facts.systemd import SystemdStatus
from pyinfra.operations import systemd
from pyinfra.operations.util import any_changed

from facts.files import FileDigests, PathTypes
from facts.sentinel import SentinelState
from facts.units import UnitActivation, UnitDropIns
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.operations import file_set, units
from pyinfra_vllm.operations import remove as remove_ops
from pyinfra_vllm.operations import sentinel as sentinel_ops
from pyinfra_vllm.plans import sentinel as sentinel_plan
from pyinfra_vllm.plans import vllm_service as vllm_service_plan
from pyinfra_vllm.plans.engine_access import Endpoint
from pyinfra_vllm.run.context import HostContext
from pyinfra_vllm.run.host_reads import Read
from pyinfra_vllm.run.stage import stage

SERVICES = [sentinel_plan.UNIT, sentinel_plan.RESTART_PATH_UNIT]
# Modes as the vllm_service stage gives its helpers (it uploads engine_client.py too).
HELPERS = {sentinel_plan.HELPER_PATH: ("files/sentinel.py", "755"),
           vllm_service_plan.CLIENT_PATH: ("files/engine_client.py", "644")}


# Each unit with its files, in the order they are stopped.
UNIT_FILES = {
    sentinel_plan.RESTART_PATH_UNIT: [sentinel_plan.RESTART_PATH_UNIT_PATH],
    sentinel_plan.UNIT: [sentinel_plan.UNIT_PATH, f"{sentinel_plan.UNIT_PATH}.d"],
    sentinel_plan.RESTART_SERVICE: [sentinel_plan.RESTART_SERVICE_PATH],
}


def removed_paths(settings: Settings) -> list[str]:
    """What the sentinel wrote besides its units, removed when it is off."""
    return [sentinel_plan.HELPER_PATH, sentinel_plan.STATE_DIR,
            sentinel_plan.textfile(settings)]


def sentinel_reads(settings: Settings, _place: Endpoint) -> list[Read]:
    """What the sentinel stage reads of a converged host: the run's one read."""
    # Read with the run, for the audit that follows it (python -m tools.audit).
    reads = [Read(SentinelState, sentinel_plan.STATE_READ)]
    if not settings.sentinel:
        return [*reads,
                *(Read(UnitActivation, {"unit": unit}) for unit in UNIT_FILES),
                *(Read(PathTypes, {"paths": sorted(paths)}) for paths in UNIT_FILES.values()),
                Read(PathTypes, {"paths": sorted(removed_paths(settings))})]
    # SystemdStatus: pyinfra's systemd.service reads the units' state while the run is
    # planned (the restart's _if is only asked when the run executes).
    return [*reads,
            Read(FileDigests, {"paths": sorted([*HELPERS, *sentinel_plan.UNIT_PATHS])}),
            Read(UnitDropIns, {"unit": sentinel_plan.UNIT}),
            *(Read(SystemdStatus, {"services": [unit]}) for unit in SERVICES),
            *(Read(UnitActivation, {"unit": unit}) for unit in SERVICES)]


@stage(lock_required=False, reads=sentinel_reads)
def sentinel(ctx: HostContext) -> None:
    """Sentinel: a one-token completion every interval; the host out of rotation and the
    engine restarted when they fail."""
    if not ctx.settings.sentinel:
        sentinel_removed(ctx.settings)
        return
    foreign = units.drop_ins_only(name="Sentinel: no foreign drop-in for its unit",
                                  unit=sentinel_plan.UNIT)
    files: dict[str, tuple[str | bytes, str]] = dict(HELPERS)
    files.update({path: (text.encode(), "644") for path, text in
                  sentinel_plan.render_units(ctx.settings, ctx.endpoint).items()})
    written = file_set.present(name="Sentinel: its program and units", files=files)
    systemd.daemon_reload(name="Sentinel: reload systemd units", _if=written.did_change)
    for unit in SERVICES:
        # A running unit keeps what it started with until restarted (a fresh host's is
        # started here, once).
        systemd.service(name=f"Sentinel: restart {unit} with its new files", service=unit,
                        running=True, restarted=True, _if=any_changed(written, foreign))
        units.enabled_and_running(name=f"Sentinel: {unit} enabled and running", unit=unit)


def sentinel_removed(settings: Settings, label: str = "Sentinel") -> None:
    """The sentinel off (or the suite removed: pyinfra_vllm/stages/remove.py, ``label``
    "Remove"): its units stopped, disabled and removed, the path unit first (no restart
    asked for meanwhile), its rotation flag given back, its program, state and textfile
    removed. engine_client.py stays: the engine's helpers import it."""
    for unit, paths in UNIT_FILES.items():
        remove_ops.unit_removed(name=f"{label}: {unit} stopped, disabled and removed",
                                unit=unit, paths=paths)
    sentinel_ops.rotation_flag_released(name=f"{label}: the sentinel's rotation flag removed")
    file_set.absent(name=f"{label}: the sentinel's program, state and textfile",
                    paths=removed_paths(settings))
