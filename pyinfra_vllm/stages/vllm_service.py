"""vLLM service: the OpenAI server under systemd, tensor parallel on the NVLink-joined GPUs.

A dedicated ``vllm`` user runs ``python -m vllm.entrypoints.openai.api_server`` from the
stack's environment behind the gateway: on a Unix socket only nginx's workers can reach
where the stack's server has one, else on 127.0.0.1 (or beyond loopback where asked). It
demands a key of its own, made on the host (pyinfra_vllm/plans/engine_access.py). Every flag comes from settings and is checked against the installed
server's ``--help`` before the unit is written. Before
each start the GPU guard checks GPU count, MIG, foreign processes and NVLink (one line in
the journal when it refuses); after it, the unit stays "activating" until /health, a
one-token completion and the warm-ups answered. A change to the unit, or model files the
model stage repaired (model_repair), restarts the engine once; no change, no restart. The
restart rolls (pyinfra_vllm/operations/rolling.py): at most rolling_batch hosts of the run at once,
each drained first, the new unit moved in from its staged copy inside the host's slot,
and the rollout stopped at the first host that fails readiness. A drop-in for the unit that the suite did not write is moved
aside (/var/lib/pyinfra-vllm/disabled-drop-ins/), and an engine whose main process runs
with another command line or environment than its unit gives (edited without a restart)
is restarted: both once, with the unit's own restart. On vllm_device "cpu" the workers are CPU processes with
their threads bound to the host's CPUs (VLLM_CPU_OMP_THREADS_BIND from the CPUs preflight
read, or vllm_cpu_threads_bind) and no GPU guard runs. The engine's key, its environment
file, its socket directory and socket, its firewall file and the spools keep the owner and
mode of the access table (pyinfra_vllm/plans/access.py): one changed by hand is put back
without a restart, one replaced by a link or another kind refuses the host.

    pyinfra inventory.py deploys/vllm_service.py
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from pyinfra import host, state
from pyinfra.facts.deb import DebPackage
from pyinfra.operations.util import any_changed

from facts.accounts import Account
from facts.bench import BenchRecord
from facts.files import FileDigests, PathModes, PathTypes
from facts.python_env import MARKER
from facts.storage import FilesystemSize
from facts.units import UnitActivation, UnitDropIns
from facts.vllm_service import EngineFirewall, EngineHealth, EngineKey, EngineProcess
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.operations import access as access_ops
from pyinfra_vllm.operations import accounts, file_set, rolling, units
from pyinfra_vllm.operations import vllm_service as vllm_service_ops
from pyinfra_vllm.operations.util import rolling as rolling_util
from pyinfra_vllm.operations.util.packages import debian_package
from pyinfra_vllm.plans import access, engine_access
from pyinfra_vllm.plans import bench as bench_plan
from pyinfra_vllm.plans import python_env as python_env_plan
from pyinfra_vllm.plans import vllm_service as vllm_service_plan
from pyinfra_vllm.plans.engine_plan import EnginePlan, engine_expected, engine_plan, render_unit
from pyinfra_vllm.plans.topology import tp_link_verdict
from pyinfra_vllm.run.context import HostContext
from pyinfra_vllm.run.host_reads import Read
from pyinfra_vllm.run.stage import stage

logger = logging.getLogger("pyinfra")


def vllm_service_reads(settings: Settings, place: engine_access.Endpoint) -> list[Read]:
    """What the vllm_service stage reads of a converged host: the run's one read, at the
    engine's endpoint ``place`` the run's context decided (HostContext.endpoint)."""
    ops = vllm_service_plan
    helpers = [ops.READY_PATH, ops.IDLE_PATH, ops.CLIENT_PATH, bench_plan.HELPER_PATH]
    helpers.append(ops.AMX_PERMISSION_PATH if settings.vllm_device == "cpu" else ops.GUARD_PATH)
    return [
        Read(FilesystemSize, {"path": "/dev/shm"}),
        Read(Account, {"account": ops.SERVICE_USER}),
        Read(FileDigests, {"paths": sorted(helpers)}),
        Read(UnitDropIns, {"unit": ops.UNIT}),
        Read(FileDigests, {"paths": sorted([ops.UNIT_PATH, ops.ENV_PATH])}),
        Read(EngineProcess, ops.ENGINE_PROCESS_READ),
        Read(EngineKey, engine_access.KEY_READ),
        Read(EngineHealth, engine_health_read(place)),
        Read(UnitActivation, {"unit": ops.UNIT}),
        Read(PathTypes, rolling.FLAGS_READ),
        Read(EngineFirewall, engine_access.FIREWALL_READ),
        *_firewall_reads(place),
        Read(PathModes, access.read(settings, "vllm_service", place)),
        # The last benchmark, for the restart's canary: read while the run is planned
        # (the restart's _if is only asked when the run executes).
        *([Read(BenchRecord, bench_plan.RECORD_READ)]
          if settings.rollout_canary and settings.vllm_start else []),
    ]


def _firewall_reads(place: engine_access.Endpoint) -> list[Read]:
    """The firewall's file and package where the engine listens on TCP; else whether a
    file of an earlier TCP engine is left."""
    if place.socket:
        return [Read(PathTypes, {"paths": [engine_access.FIREWALL_PATH]})]
    return [Read(DebPackage, {"package": "nftables"}),
            Read(FileDigests, {"paths": [engine_access.FIREWALL_PATH]})]


def engine_health_read(place: engine_access.Endpoint) -> dict[str, Any]:
    """EngineHealth's arguments: the engine's endpoint ``place``."""
    return {"url": place.url(""), "socket": place.socket}


@stage(reads=vllm_service_reads)
def vllm_service(ctx: HostContext) -> None:
    """vLLM service: the OpenAI server under systemd, tensor parallel on the NVLink-joined GPUs."""
    settings = ctx.settings
    env_path = ctx.environment_path(host)
    marker = (ctx.environments(host)["envs"].get(env_path) or {}).get("marker")
    accepted = set(marker["runtime"]["flags"]) if marker else None
    plan = _engine_plan(ctx, f"{env_path}/bin/python", accepted)

    problems = _problems(ctx, plan, accepted)
    if problems:
        ctx.refuse("vLLM service: host refused", problems)
        return
    accounts.system_account(
        name="vLLM service: system account vllm (no login)",
        account=vllm_service_plan.SERVICE_USER,
        home=vllm_service_plan.STATE_DIR,
    )
    # The engine's key, environment file, socket and the spools as the access table says;
    # its socket directory too, which only the engine's next start would make 0750 again.
    access_ops.kept(
        name="vLLM service: owner and mode of its key, environment file, socket and spools",
        paths=access.wanted(settings, "vllm_service", plan.endpoint),
    )
    _helpers(settings.vllm_device)
    _firewall(plan)
    if marker is None:
        # Built in this run: its --help was unknown when the run was planned.
        vllm_service_ops.flags_accepted(
            name="vLLM service: flags accepted by the new environment's server",
            python=plan.python,
            marker=f"{env_path}/{MARKER}",
            flags=list(plan.flags),
        )
    foreign = units.drop_ins_only(
        name="vLLM service: no foreign drop-in for its unit",
        unit=vllm_service_plan.UNIT,
    )
    unit_files, unit = _unit(plan)
    key_sha256 = host.get_fact(EngineKey, **engine_access.KEY_READ)
    stale = _engine_current(ctx, plan, key_sha256)
    answering = _answering(plan.endpoint)
    _restarted(ctx, plan, unit_files, [unit, foreign, stale, answering],
               new_key=key_sha256 is None)
    vllm_service_ops.running(name="vLLM service: enabled and running"
                             if settings.vllm_start else "vLLM service: enabled",
                             start=settings.vllm_start)
    rolling.not_draining(name="vLLM service: the gateway serves (no drain left)")


def _engine_plan(ctx: HostContext, python: str, accepted: set[str] | None) -> EnginePlan:
    """This host's engine (pyinfra_vllm/plans/engine_plan.py), built once for the stage:
    on the endpoint the run's context decided, on the GPUs or CPUs preflight judged, run
    by ``python`` with the flags its server accepts (``accepted``; None: not built yet)."""
    devices, threads_bind = _engine_placement(ctx)
    return engine_plan(ctx.settings, python=python, model_path=ctx.settings.model_path,
                       devices=devices, accepted=accepted, threads_bind=threads_bind,
                       place=ctx.endpoint)


def _unit(plan: EnginePlan) -> tuple[dict[str, bytes], Any]:
    """The unit and its environment file for the engine ``plan``, as their bytes, and the
    operation that stages them beside the live ones (the restart moves them in)."""
    unit_files = _unit_files(plan)
    unit = file_set.present(
        name="vLLM service: systemd unit and its environment file",
        files={
            vllm_service_plan.UNIT_PATH: (unit_files[vllm_service_plan.UNIT_PATH], "644"),
            vllm_service_plan.ENV_PATH: (unit_files[vllm_service_plan.ENV_PATH],
                                         access.mode(vllm_service_plan.ENV_PATH)),
        },
        stage=True,
    )
    return unit_files, unit


def _engine_current(ctx: HostContext, plan: EnginePlan, key_sha256: str | None) -> Any:
    """The running engine against what its unit gives (kept in ``ctx.engine_expected``
    for the audit): changed where it differs."""
    ctx.engine_expected = engine_expected(plan, key_sha256)
    return vllm_service_ops.engine_current(
        name="vLLM service: the running engine has its unit's command line, "
        "environment and hardening",
        expected=ctx.engine_expected,
    )


def _answering(place: engine_access.Endpoint) -> Any:
    """The engine active and answering /health within 5 s, or named (plan time, for the
    audit, and when the run executes) and restarted: alive but not answering (stopped with
    SIGSTOP, or wedged), it would pass every other check."""
    active = (host.get_fact(UnitActivation, unit=vllm_service_plan.UNIT) or {}).get(
        "active") == "active"
    status = host.get_fact(EngineHealth, **engine_health_read(place))
    if active and status not in (200, None):
        host.log_styled(
            f"vLLM service: active, but /health did not answer 200 within 5 s "
            f"({'no answer' if status == 0 else f'HTTP {status}'}): restarted",
            fg="yellow", log_func=logger.warning)
    return vllm_service_ops.answering(
        name="vLLM service: the active engine answers /health", active=active, status=status)


def _engine_placement(ctx: HostContext) -> tuple[list[int] | None, str | None]:
    """The GPUs the engine gets (the NVLink-joined set preflight judged, when there is
    one), or on CPU the CPUs its workers' threads are bound to (the CPUs preflight read;
    the setting, when given, wins)."""
    settings = ctx.settings
    if settings.vllm_device == "cpu":
        cpu = ctx.state.get("cpu") or {}
        return None, settings.vllm_cpu_threads_bind or vllm_service_plan.cpu_threads_bind(
            cpu.get("cpus") or [], cpu.get("numa_nodes"), settings.tensor_parallel_size)
    verdict = tp_link_verdict(ctx.state.get("topology"), settings.tensor_parallel_size)
    return verdict["indices"] or None, None


def _problems(ctx: HostContext, plan: EnginePlan, accepted: set[str] | None) -> list[str]:
    """Why this host cannot run the engine ``plan`` (its server's options ``accepted``),
    if it cannot."""
    settings = ctx.settings
    problems = []
    unknown = vllm_service_plan.unknown_flags(plan.flags, accepted) if accepted else []
    if unknown:
        problems.append(
            f"vllm_service: the installed vLLM {settings.vllm_version} server does not accept "
            f"{', '.join(unknown)}: change the setting that adds it, or vllm_version"
        )
    shm = vllm_service_plan.shm_problem(host.get_fact(FilesystemSize, path="/dev/shm"),
                                        settings.vllm_min_shm_mib)
    if shm:
        problems.append(f"vllm_service: {shm}; raise it (fstab: tmpfs /dev/shm size=...) "
                        "or lower vllm_min_shm_mib")
    if settings.vllm_device == "cpu" and plan.threads_bind is None:
        problems.append(
            f"vllm_service: fewer online CPUs than the {settings.tensor_parallel_size} CPU "
            "workers (tensor_parallel_size): lower it or set vllm_cpu_threads_bind"
        )
    # A secret or the socket's directory replaced by a link or another kind of file.
    problems += access.wrong_kinds(access.rows(settings, "vllm_service", plan.endpoint),
                                   host.get_fact(PathModes, **access.read(
                                       settings, "vllm_service", plan.endpoint)))
    return problems


def _helpers(device: str) -> None:
    """The unit's helper scripts: the readiness wait, the idle check and the canary's
    benchmark client; on GPUs the guard (no GPU guard on CPU: the unit has no
    ExecStartPre for it), on CPUs the engine's AMX permission."""
    files: dict[str, tuple[str | bytes, str]] = {
        vllm_service_plan.READY_PATH: ("files/wait_ready.py", "755"),
        vllm_service_plan.IDLE_PATH: ("files/engine_idle.py", "755"),
        vllm_service_plan.CLIENT_PATH: ("files/engine_client.py", "644"),
        bench_plan.HELPER_PATH: (bench_plan.CLIENT_FILE, "755"),
    }
    if device == "cpu":
        file_set.present(
            name="vLLM service: readiness wait and AMX permission",
            files={vllm_service_plan.AMX_PERMISSION_PATH: ("files/amx_permission.py", "644"),
                   **files},
        )
    else:
        file_set.present(
            name="vLLM service: GPU guard and readiness wait",
            files={vllm_service_plan.GUARD_PATH: ("files/gpu_guard.py", "755"), **files},
        )


def _firewall(plan: EnginePlan) -> None:
    """On TCP, the engine's nftables table (pyinfra_vllm/plans/engine_access.py): its file,
    loaded before the engine's next start by the unit and now wherever the loaded table
    differs. On a Unix socket none, and an earlier TCP engine's table and file gone."""
    rules = engine_access.render_firewall(plan.settings, vllm_service_plan.SERVICE_USER,
                                          plan.endpoint)
    if rules is None:
        file_set.absent(name="vLLM service: no engine firewall on its Unix socket",
                        paths=[engine_access.FIREWALL_PATH])
    else:
        debian_package("vLLM service: nftables installed", "nftables")
        file_set.present(name="vLLM service: engine firewall file",
                         files={engine_access.FIREWALL_PATH: (
                             rules.encode(), access.mode(engine_access.FIREWALL_PATH))})
    vllm_service_ops.engine_firewall(
        name="vLLM service: engine firewall loaded" if rules else
        "vLLM service: no engine firewall loaded", rules=rules)


def _unit_files(plan: EnginePlan) -> dict[str, bytes]:
    """The unit and its environment file, as their bytes.

    The environment file holds no secret by default: the weights are local
    (HF_HUB_OFFLINE=1) and the gateway checks the API keys, so the engine on loopback
    needs no HF_TOKEN. The engine's own key is in a file of its own, made on the host
    (``engine_access.KEY_ENV_PATH``), never on its command line, which ps shows to every
    user. Both are staged beside the live files
    and moved into place inside the rolling restart's slot: a host the rollout never
    reaches (another failed readiness) keeps its unit, and its engine the configuration
    it runs with."""
    return {
        vllm_service_plan.UNIT_PATH: render_unit(plan).encode(),
        vllm_service_plan.ENV_PATH: vllm_service_plan.render_env().encode(),
    }


def _restarted(ctx: HostContext, plan: EnginePlan, unit_files: dict[str, bytes],
               changes: list, new_key: bool) -> None:
    """One rolling restart for every reason: the unit or its environment file changed, a
    foreign drop-in set aside, the running engine stale, or model files the model stage
    fetched again (model_repair: an engine started before may hold their bad bytes), or
    the engine's own key to be made (``new_key``: made inside the host's slot, nginx
    reloaded for it before the host is put back), or an engine active but not answering.
    ``vllm_start`` False: try-restart, so an engine that is not running stays stopped."""
    settings = ctx.settings
    repaired = [] if ctx.model_repair is None else [ctx.model_repair]
    # Here, while the run is planned: hosts with another rolling_batch stop the run
    # before any change.
    rolling_util.rollout(state, settings.rolling_batch, host.name)
    # The drain asks the engine that runs now: a run that moves it (a socket to TCP, a
    # port) would otherwise ask the new place, find nothing and cut what is in flight.
    running = host.get_fact(EngineProcess, **vllm_service_plan.ENGINE_PROCESS_READ)
    place = (running and engine_access.running_endpoint(running["argv"])) or plan.endpoint
    changed = any_changed(*changes, *repaired)
    vllm_service_ops.restarted(
        name="vLLM service: restarted for its new unit" if not repaired else
        "vLLM service: restarted for its new unit or repaired model files",
        start=settings.vllm_start,
        staged={path: hashlib.sha256(data).hexdigest() for path, data in unit_files.items()},
        batch=settings.rolling_batch,
        leave_s=settings.drain_leave_s,
        grace_s=settings.drain_grace_s,
        python=plan.python,
        metrics_url=place.url("/metrics"),
        client=engine_access.client_args(place),
        new_key=new_key,
        canary=_canary(ctx, plan, running) if settings.rollout_canary else None,
        # The link the python_env stage moved: back with the unit where the rollout
        # leaves the host on its previous one.
        env_link=ctx.env_link,
        _if=lambda: new_key or changed(),
    )


def _canary(ctx: HostContext, plan: EnginePlan, running: dict[str, Any] | None
            ) -> dict[str, Any] | None:
    """What the restart's canary benchmark needs (pyinfra_vllm/operations/vllm_service.py
    restarted): the new environment's interpreter runs vLLM's client through the gateway. None in a
    run that moves the engine to another socket or address: the gateway, whose stage comes after,
    reaches it there only once its site is rewritten, so every request of a canary in the restart's
    slot would fail. ``plan``: the host's engine; ``running``: the engine now (EngineProcess)."""
    settings = ctx.settings
    if running and not engine_access.listens_as_settings(running["argv"], settings,
                                                         plan.endpoint):
        host.log_styled(
            "vLLM service: no canary in this run: the engine moves to "
            f"{' '.join(engine_access.server_listen_flags(settings, plan.endpoint))}, "
            "which the gateway follows only after the restart", fg="yellow",
            log_func=logger.warning)
        return None
    path = ctx.environment_path(host)
    if python_env_plan.returns_to_kept(ctx.environments(host), path, settings.stack):
        # The host's record was taken on what runs now: a rollback to an older, slower
        # release (vllm-cpu 0.17.0 measured up to 28% below 0.32.0 here) is refused by
        # a canary that holds it to the release it leaves.
        host.log_styled(
            f"vLLM service: the canary holds {path}, kept from before, to the record of "
            "the release it replaces; a rollback that must go through whatever it "
            "measures: --data rollout_canary=false", fg="yellow", log_func=logger.warning)
    return {"python": plan.python, "args": bench_plan.client_args(settings),
            "env": bench_plan.client_env(settings), "stack": bench_plan.stack_words(settings),
            "textfile": bench_plan.textfile_path(settings),
            "bound": settings.rollout_max_regression}
