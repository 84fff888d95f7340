"""One host's engine is planned once per run: its endpoint is decided once, by the run's
context (HostContext.endpoint), and its flags, environment and unit once, by the
vllm_service stage (pyinfra_vllm/plans/engine_plan.py); the vllm_service, gateway and
audit stages take them from there. Planned here for one host against a real pyinfra
State, the way deploys/full.py and the audit plan it, each fact answered as a bare host
would answer it (what the fact makes of no output)."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pyinfra
import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.host import Host
from pyinfra.api.state import StateStage
from pyinfra.context import ctx_host, ctx_state

from pyinfra_vllm.core.settings import validate
from pyinfra_vllm.core.stack_locks import read_lock
from pyinfra_vllm.plans import engine_access
from pyinfra_vllm.plans import gateway as gateway_plan
from pyinfra_vllm.plans import python_env as python_env_plan
from pyinfra_vllm.plans import vllm_service as vllm_service_plan
from pyinfra_vllm.plans.engine_access import SOCKET_PATH, Endpoint
from pyinfra_vllm.plans.engine_plan import engine_expected, engine_plan, render_unit
from pyinfra_vllm.report import runs as report_runs
from pyinfra_vllm.run import host_reads
from pyinfra_vllm.run.context import context
from pyinfra_vllm.stages import audit as audit_stage
from pyinfra_vllm.stages import gateway as gateway_stage
from pyinfra_vllm.stages import vllm_service as vllm_service_stage

MODEL = "/srv/models/m"
# The stages whose reads the context makes up front, as deploys/full.py's context does.
PLANNED = ("vllm_service", "gateway", "audit")
ON_SOCKET = {"vllm_version": "0.17.0", "vllm_device": "cpu"}  # a stack with --uds
ON_TCP: dict[str, Any] = {}  # vLLM 0.6.3: no --uds


def proven_environment(settings) -> dict[str, Any]:
    """facts.python_env.VllmEnvironments of a host whose stack environment is built and
    proven, its server's flags recorded (so the flags are the installed server's)."""
    stack = settings.stack
    path = python_env_plan.environment_base(
        settings.python_env_root, stack, settings.python_env_manager,
        python_env_plan.interpreter(settings.python_env_manager, stack))
    flags = vllm_service_plan.server_flags(settings, MODEL, place=engine_access.endpoint(
        settings)) + ["--shutdown-timeout"]
    marker = {"requirements_sha256": read_lock(stack).sha256, "runtime": {"flags": flags}}
    return {"envs": {path: {"marker": marker, "integrity": {"state": "intact"},
                            "installed": {python_env_plan.distribution(stack): stack.vllm}}},
            "current": path}


def bare_host(monkeypatch, answers: dict[str, Any]) -> list[tuple[str, dict]]:
    """Every host's facts answered from ``answers`` (by the fact's name; a callable is
    called with the fact's arguments: ``{"Sha1File": lambda path: ...}``), else as a bare
    host's: what the fact makes of no output. The reads made, in order."""
    made: list[tuple[str, dict]] = []

    def get_fact(self, fact, *args, **kwargs):
        made.append((fact.__name__, kwargs))
        if fact.__name__ in answers:
            answer = answers[fact.__name__]
            return answer(**kwargs) if callable(answer) else copy.deepcopy(answer)
        try:
            return fact().process([])
        except Exception:  # a fact that needs output: its default
            return fact().default()

    monkeypatch.setattr(Host, "get_fact", get_fact)
    return made


def counted(monkeypatch, targets: list[tuple[Any, str]]
            ) -> tuple[Counter, dict[str, list[tuple[tuple, dict]]]]:
    """Each ``(module, name)`` replaced by itself, counting its calls: how many (by name),
    and the arguments of each."""
    calls: Counter = Counter()
    seen: dict[str, list[tuple[tuple, dict]]] = {}

    def wrap(name: str, real: Callable) -> Callable:
        def call(*args, **kwargs):
            calls[name] += 1
            seen.setdefault(name, []).append((args, kwargs))
            return real(*args, **kwargs)
        return call

    for module, name in targets:
        monkeypatch.setattr(module, name, wrap(name, getattr(module, name)))
    return calls, seen


@pytest.fixture
def planned(monkeypatch, tmp_path):
    """``planned(data)``: the vllm_service, gateway and audit stages planned for one host
    with ``data``: the run's context, the calls counted once it was made and their
    arguments, the facts read, and the endpoint's calls counted from before the context
    was made (its stages' reads included)."""
    monkeypatch.setattr(pyinfra, "is_cli", True)
    monkeypatch.setattr(report_runs.atexit, "register", lambda *args, **kwargs: None)

    def plan(data: dict[str, Any]):
        data = {"gateway_open": True, "skip_stages": ["model"],
                "audit_report_dir": str(tmp_path), **data}
        settings = validate(data)
        made = bare_host(monkeypatch, {
            "FilesystemSize": 16 << 30,
            "VllmEnvironments": proven_environment(settings),
            "CpuHostState": {"cpus": [0, 1, 2, 3], "numa_nodes": 1, "mem_total_kib": 1 << 26,
                             "flags": []},
        })
        inventory = Inventory((["gpu-1"], data))
        state = State(inventory, Config())
        state.set_stage(StateStage.Prepare)
        host = inventory.get_host("gpu-1")
        state.activate_host(host)
        with ctx_state.use(state), ctx_host.use(host):
            whole, _ = counted(monkeypatch, [(engine_access, "endpoint")])
            ctx = context(host, lock_required=False, stages=PLANNED)
            calls, seen = counted(monkeypatch, [
                (engine_access, "endpoint"), (vllm_service_plan, "server_flags"),
                (vllm_service_plan, "environment_pairs"), (vllm_service_stage, "engine_plan"),
                (vllm_service_stage, "render_unit"), (gateway_plan, "render_site")])
            vllm_service_stage.vllm_service()
            gateway_stage.gateway()
            audit_stage.audit()
        return ctx, calls, seen, made, whole

    return plan


@pytest.mark.parametrize(("data", "place"), [
    (ON_SOCKET, Endpoint(socket=SOCKET_PATH, address="localhost")),
    (ON_TCP, Endpoint(socket=None, address="127.0.0.1:8000")),
], ids=["socket", "tcp"])
def test_one_plan_of_three_stages_computes_the_engine_once(planned, data, place):
    ctx, calls, seen, made, _whole = planned(data)
    assert ctx.refused == []
    assert ctx.endpoint == place
    # The endpoint was decided with the context; flags, environment and unit once, by the
    # vllm_service stage's one EnginePlan.
    assert calls["endpoint"] == 0
    assert (calls["engine_plan"], calls["server_flags"], calls["environment_pairs"],
            calls["render_unit"]) == (1, 1, 1, 1)
    [((plan,), _)] = seen["render_unit"]
    assert plan.endpoint is ctx.endpoint
    assert ctx.engine_expected == engine_expected(plan, None)
    # What each stage did with it: the gateway's upstream, the engine's health and what
    # the audit asks it, at the one endpoint.
    [(_, site)] = seen["render_site"]
    assert site["upstream"] == place.nginx_server
    asked = {(name, kwargs.get("url"), kwargs.get("socket")) for name, kwargs in made
             if name in ("EngineHealth", "EngineServing")}
    assert asked == {("EngineHealth", place.url(""), place.socket),
                     ("EngineServing", place.url(""), place.socket)}


@pytest.mark.parametrize("data", [ON_SOCKET, ON_TCP], ids=["socket", "tcp"])
def test_the_endpoint_is_computed_once_per_host_reads_included(monkeypatch, planned, data):
    # The context decides the endpoint before it reads the host: the reads each stage
    # declares (pyinfra_vllm/run/host_reads.py stage_reads) are handed that one, so making
    # the context and planning three stages computes it once in all.
    handed: list[tuple[str, Endpoint]] = []

    def recorded(stage: str, reads: Callable) -> Callable:
        def declared(settings, place):
            handed.append((stage, place))
            return reads(settings, place)
        return declared

    for stage, reads in list(host_reads.STAGE_READS.items()):
        monkeypatch.setitem(host_reads.STAGE_READS, stage, recorded(stage, reads))
    ctx, calls, _seen, _made, whole = planned(data)
    assert ctx.refused == []
    assert whole["endpoint"] == 1
    assert calls["endpoint"] == 0
    # Each stage's reads (the preflight's where its module is imported) made once.
    assert [stage for stage, _ in handed] == [
        stage for stage in ("preflight", *PLANNED) if stage in host_reads.STAGE_READS]
    assert {stage for stage, _ in handed} >= set(PLANNED)
    assert all(place is ctx.endpoint for _, place in handed)


def test_the_plan_takes_the_endpoint_it_is_given():
    # Settings of a stack without --uds, handed a socket: the flags, the unit and the
    # readiness wait follow the endpoint handed down, never one recomputed from settings.
    settings = validate({"gateway_open": True})
    given = Endpoint(socket=SOCKET_PATH, address="localhost")
    plan = engine_plan(settings, python="/p", model_path=MODEL, place=given)
    assert plan.endpoint is given
    assert plan.flags[plan.flags.index("--uds") + 1] == SOCKET_PATH
    assert "--host" not in plan.flags and "--port" not in plan.flags
    assert plan.argv == ["/p", "-m", vllm_service_plan.SERVER_MODULE, *plan.flags]
    assert f'"--url" "http://localhost/health" "--unix-socket" "{SOCKET_PATH}"' in (
        render_unit(plan))
    assert engine_expected(plan, "ab") == {"argv": plan.argv, "env": dict(plan.environment),
                                           "secret_sha256": {"VLLM_API_KEY": "ab"}}
