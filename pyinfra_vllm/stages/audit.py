"""Audit: read every host's OS, driver, GPUs, MIG, persistence, topology, NVLink and GPU
health state, judge it against the settings, and write a JSON and a Markdown report.

Changes nothing on any host: it only reads facts. Invalid settings, which stop every
other stage before any change, do not stop the audit: the host is reported refused, with
each problem (``settings: <key>: <problem>``) and the OS and GPU state read without
settings, and its one operation fails it when the run executes, changing nothing, so
that the run exits 1 while the other hosts are audited.

A router host (the inventory's ``routers`` group) is audited as the front door, never as
a serving host: HAProxy active, its pool as its runtime API says it, its files and secrets
as the router stage writes them; a front door that cannot serve is refused, named
(docs/router.md). Each serving host's entry gets the front door's view of it when the
report is made (pyinfra_vllm/report/front_door.py).

    pyinfra inventory.py deploys/audit.py                  # state and verdicts
    python -m tools.audit inventory.py                     # ... plus drift; exit 1 on drift

Drift: loaded after deploys/full.py in one ``--dry`` run (what ``python -m tools.audit``
runs: ``pyinfra --dry inventory.py deploys/full.py deploys/audit.py``), it also records,
per host, the operations deploys/full.py would change and the reasons a stage refused
the host. pyinfra prepares each file for every host before the next file
(pyinfra_cli/cli.py ``_prepare_deploy_operations``), so when this file runs for a host,
all of deploys/full.py's operations for it are in pyinfra's state with their change
flag, and the stages' refusals are in the run context they share.

With the model lock (tools.model_lock; the run context reads it, or the ``model_lock``
setting names it), the report also carries the compatibility checks and the capacity
plan of the model on each host; with model_verify deep (``python -m tools.audit
INVENTORY --deep``), every model file re-hashed on the host against it
(``model_integrity``: the files that no longer match).
"""

from __future__ import annotations

import datetime
from typing import Any

from pyinfra import host, state
from pyinfra.api import deploy
from pyinfra.facts.files import Sha1File

from facts.bench import BenchRecord
from facts.files import PathModes
from facts.nginx import NginxServers
from facts.router import RouterPool
from facts.sentinel import SentinelState
from facts.units import UnitActivation, UnitDropIns
from facts.vllm_service import EngineProcess, EngineServing
from pyinfra_vllm.core.settings import Settings, SettingsError
from pyinfra_vllm.plans import access, engine_access
from pyinfra_vllm.plans import bench as bench_plan
from pyinfra_vllm.plans import persistence as persistence_plan
from pyinfra_vllm.plans import router as router_plan
from pyinfra_vllm.plans import sentinel as sentinel_plan
from pyinfra_vllm.plans import vllm_service as vllm_service_plan
from pyinfra_vllm.plans.gates import installed_registry
from pyinfra_vllm.plans.units import foreign_drop_ins
from pyinfra_vllm.report.drift import host_plan
from pyinfra_vllm.report.runs import previous_entry, record
from pyinfra_vllm.report.verdicts import (
    environment_findings,
    environment_integrity,
    integrity,
    integrity_problems,
    model_integrity,
    model_plans,
    router_summary,
    settings_problems,
    settings_refusal,
    summarize,
)
from pyinfra_vllm.run import host_reads
from pyinfra_vllm.run.context import HostContext, collect, context, refuse
from pyinfra_vllm.run.host_reads import Read
from pyinfra_vllm.stages.persistence import persistence_reads
from pyinfra_vllm.stages.router import front_door_files, is_router
from pyinfra_vllm.stages.vllm_service import vllm_service_reads

# The audit reads a host without a model lock too (it then says so); deploys/full.py,
# when it runs first in the same process, has already required one.


def audit_reads(settings: Settings, place: engine_access.Endpoint) -> list[Read]:
    """deploys/audit.py on its own: what the audit stage reads besides the preflight's,
    at the engine's endpoint ``place`` the run's context decided (HostContext.endpoint)."""
    reads = [*vllm_service_reads(settings, place), *persistence_reads(settings, place)]
    if "gateway" not in settings.skip_stages:
        reads += [Read(NginxServers), Read(PathModes, access.read(settings, "gateway", place))]
    if settings.vllm_start and "vllm_service" not in settings.skip_stages:
        reads.append(Read(EngineServing, engine_serving_read(place)))
    reads.append(Read(BenchRecord, bench_plan.RECORD_READ))
    if settings.sentinel:
        reads.append(Read(SentinelState, sentinel_plan.STATE_READ))
    return reads


def engine_serving_read(place: engine_access.Endpoint) -> dict:
    """EngineServing's arguments: the engine's endpoint ``place``, its user (a listener of
    anyone else's is not asked) and its own key's file."""
    return {"url": place.url(""), "socket": place.socket,
            "user": vllm_service_plan.SERVICE_USER, "key_file": engine_access.KEY_ENV_PATH}


@deploy("audit")
def audit() -> None:
    """Audit: read every host's OS, driver, GPUs, MIG, persistence, topology and NVLink"""
    try:
        # A router host is read as the router stage reads it, never as a serving host.
        ctx = context(host, lock_required=False,
                      stages=("router",) if is_router(host) else ("audit",))
    except SettingsError as error:
        _refuse_for_settings(str(error))
        return
    if is_router(host):
        _audit_router(ctx)
        return
    settings = ctx.settings
    previous = previous_entry(host.state, host.name, settings.audit_report_dir,
                              settings.audit_report_keep)
    entry = summarize(host.name, ctx.state, settings, previous)
    entry["sentinel"] = _sentinel(ctx)
    entry.update(host_plan(state, host, ctx.refused, ctx.refusals, planned=bool(ctx.stages_asked)))
    # What was changed by hand, named: the operations above say only what would be redone.
    entry["findings"] = environment_findings(ctx.environments(host), ctx.environment_path(host))
    registry = (
        installed_registry(ctx.environments(host), ctx.environment_path(host)) if ctx.lock else None
    )
    plans = model_plans(ctx.settings, ctx.lock, ctx.state, registry)
    entry.update(
        compatibility=plans["compatibility"],
        capacity=plans["capacity"],
        model_note=plans["why"],
    )
    if settings.vllm_start and "vllm_service" not in settings.skip_stages:
        # What the engine itself says it serves, asked on the host (in the audit only:
        # one more command after deploys/full.py, in the one read on its own).
        entry["engine"] = host.get_fact(EngineServing, **engine_serving_read(ctx.endpoint))
    if settings.deep_model_check and ctx.lock:
        # The model stage's deep check when it ran in this process, else read here.
        path = settings.model_path
        entry["model_integrity"] = model_integrity(ctx.deep_model_check(host, path), path)
    if settings.deep_env_check:
        # Read with the environments (HostContext.environments), once per run.
        entry["environment_integrity"] = environment_integrity(ctx.env_content,
                                                               ctx.env_checked)
    entry["integrity"] = _integrity(ctx)
    entry["findings"] += integrity_problems(entry) + _access_findings(settings, ctx.endpoint)
    # The last benchmark (python -m tools.bench) and its age; below the thresholds, named.
    last = host.get_fact(BenchRecord, **bench_plan.RECORD_READ)
    entry["bench"] = {"record": last, "age_s": last and bench_plan.age_s(
        last, datetime.datetime.now(datetime.timezone.utc))}
    entry["findings"] += bench_plan.problems(settings, last)
    record(host.state, host.name, entry, report_dir=ctx.settings.audit_report_dir,
           keep=ctx.settings.audit_report_keep)


def _sentinel(ctx: HostContext) -> dict[str, Any]:
    """The sentinel's state and last events (pyinfra_vllm/plans/sentinel.py ``verdict``);
    a host it took out of rotation is refused, named (the audit exits 1)."""
    found = (host.get_fact(SentinelState, **sentinel_plan.STATE_READ)
             if ctx.settings.sentinel else None)
    judged = sentinel_plan.verdict(found, ctx.settings.sentinel)
    if judged["ok"] is False:
        ctx.refuse("Audit: host out of rotation by its sentinel",
                   [sentinel_plan.refusal(host.name, judged)])
    return judged


def _audit_router(ctx: HostContext) -> None:
    """A router host's entry: HAProxy active, its pool as its runtime API says it, each
    of the front door's files as the router stage writes it, and the drift. A front door
    that cannot serve (HAProxy not active, its pool unreadable or empty) is refused,
    named (the audit exits 1), as a host out of rotation by its sentinel is."""
    judged = router_plan.verdict(host.get_fact(RouterPool, **router_plan.POOL_READ),
                                 host.get_fact(UnitActivation, unit=router_plan.UNIT))
    if judged["ok"] is False:
        ctx.refuse("Audit: the front door cannot serve",
                   [router_plan.refusal(host.name, judged)])
    entry = router_summary(ctx.state, judged)
    entry.update(host_plan(state, host, ctx.refused, ctx.refusals, planned=bool(ctx.stages_asked)))
    entry["findings"] = _router_findings(ctx)
    record(host.state, host.name, entry, report_dir=ctx.settings.audit_report_dir,
           keep=ctx.settings.audit_report_keep)


def _router_findings(ctx: HostContext) -> list[str]:
    """What was changed by hand on a router host, named: a file of the front door that is
    not the router stage's (none compared where the stage refused the host: it says
    why), a secret's owner or mode (the access table), a foreign drop-in for haproxy."""
    settings, place = ctx.settings, ctx.endpoint
    _problems, wanted = front_door_files(settings, host.name)
    lines = router_plan.file_findings(
        wanted, {path: host.get_fact(Sha1File, path=path) for path in wanted})
    found = host.get_fact(PathModes, **access.read(settings, access.ROUTER_STAGE, place))
    lines += access.findings(access.rows(settings, access.ROUTER_STAGE, place), found)
    drop_ins = host.get_fact(UnitDropIns, unit=router_plan.UNIT)
    lines += [f"foreign drop-in for {router_plan.UNIT}: {drop_in['path']}"
              for drop_in in foreign_drop_ins(drop_ins, (router_plan.DROPIN_PATH,))]
    return lines


def _access_findings(settings: Settings, place: engine_access.Endpoint) -> list[str]:
    """The secrets and the engine's access paths (the engine on ``place``) whose owner,
    group, mode or kind is not the access table's (pyinfra_vllm/plans/access.py), named:
    the operation that puts them back says only that it would."""
    lines = []
    for stage in access.STAGES:
        if stage not in settings.skip_stages:
            found = host.get_fact(PathModes, **access.read(settings, stage, place))
            lines += access.findings(access.rows(settings, stage, place), found)
    return lines


def _refuse_for_settings(message: str) -> None:
    """Refuse a host whose settings are invalid (``message``: the SettingsError's): its
    problems logged and reported, its OS and GPU state read all the same (those reads
    need no setting), and one operation that fails the host, changing nothing, when the
    run executes (pyinfra_vllm/operations/gate.py): the run exits 1, the other hosts are audited."""
    entry = settings_refusal(collect(host), message)
    # Without valid settings there is no HostContext to refuse through.
    refuse("Audit: host refused for its settings", entry["refused"])
    report_dir, keep = _report_place({key for key, _ in settings_problems(message)})
    record(host.state, host.name, entry, report_dir=report_dir, keep=keep)


def _report_place(invalid: set[str | None]) -> tuple[str, int]:
    """audit_report_dir and audit_report_keep of a host whose settings are invalid: as
    its data gives them, or their defaults where they are not given or ``invalid``."""
    defaults = Settings.model_fields
    report_dir = None if "audit_report_dir" in invalid else host.data.get("audit_report_dir")
    keep = None if "audit_report_keep" in invalid else host.data.get("audit_report_keep")
    return (defaults["audit_report_dir"].default if report_dir is None else str(report_dir),
            defaults["audit_report_keep"].default if keep is None else int(keep))


def _integrity(ctx) -> dict:
    """Hand changes around the suite's units, nginx and engine (report.integrity), from
    the run's one read (pyinfra_vllm/run/host_reads.py)."""
    settings = ctx.settings
    units = [vllm_service_plan.UNIT]
    if settings.vllm_device != "cpu":
        units.append(persistence_plan.PERSISTENCED_UNIT)
    drop_ins = {unit: host.get_fact(UnitDropIns, unit=unit) for unit in units}
    ports = None
    nginx = None
    if "gateway" not in settings.skip_stages:
        ports = [settings.gateway_port] + (
            [settings.gateway_http_redirect_port] if settings.gateway_http_redirect_port else [])
        nginx = host.get_fact(NginxServers)
    engine = None
    if ctx.engine_expected is not None:
        engine = host.get_fact(EngineProcess, **vllm_service_plan.ENGINE_PROCESS_READ)
    return integrity(
        drop_ins,
        {persistence_plan.PERSISTENCED_UNIT: [persistence_plan.PERSISTENCED_DROP_IN]},
        nginx, ports, engine, ctx.engine_expected,
    )


host_reads.declare("audit", audit_reads)
