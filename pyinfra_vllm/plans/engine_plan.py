"""One host's engine as a run plans it (``EnginePlan``): where clients reach it, its
server's command line and its environment, computed once per host.

``engine_plan`` builds it from settings and what was read of the host (the vllm_service
stage does, from the run's context: its endpoint, environment and placement); its users
take its parts instead of recomputing them from settings: the unit (``render_unit``), the
running engine's comparison (``engine_expected``), the stage's checks, firewall and
restart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyinfra.api import OperationValueError

from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.core.templating import render
from pyinfra_vllm.plans import engine_access
from pyinfra_vllm.plans import vllm_service as vllm_service_plan
from pyinfra_vllm.plans.engine_access import Endpoint
from pyinfra_vllm.plans.python_env import compile_cache
from pyinfra_vllm.plans.vllm_service import exec_command, systemd_plain, systemd_quote


@dataclass(frozen=True)
class EnginePlan:
    """One host's engine as this run gives it, built once by ``engine_plan``: its users
    take its parts, never recompute them from settings."""

    settings: Settings
    # Where clients on the host reach it (the run's HostContext.endpoint).
    endpoint: Endpoint
    # The stack environment's interpreter, and the model's directory on the host.
    python: str
    model_path: str
    # The unit's GPUs (CUDA_VISIBLE_DEVICES); on vllm_device "cpu" its workers' numbers.
    devices: tuple[int, ...]
    # VLLM_CPU_OMP_THREADS_BIND on vllm_device "cpu"; None there: no binding, no unit
    # (the stage refuses such a host before it asks for one).
    threads_bind: str | None
    # The server's options (vllm_service.server_flags), the unit's environment
    # (vllm_service.environment_pairs), and whether the server serves its requests out
    # on SIGTERM (vllm_service.drains_on_sigterm).
    flags: tuple[str, ...]
    environment: tuple[tuple[str, str], ...]
    drains: bool

    @property
    def argv(self) -> list[str]:
        """The main process's command line: the interpreter itself runs the server."""
        return [self.python, "-m", vllm_service_plan.SERVER_MODULE, *self.flags]


def engine_plan(
    settings: Settings,
    *,
    python: str,
    model_path: str,
    devices: Sequence[int] | None = None,
    accepted: set[str] | None = None,
    threads_bind: str | None = None,
    place: Endpoint,
) -> EnginePlan:
    """The engine of one host for ``settings``.

    + settings: a validated ``pyinfra_vllm.core.settings.Settings``
    + python: the stack environment's interpreter, e.g. ``/opt/vllm/<env>/bin/python``
    + model_path: directory of the downloaded model (``--model``; ``RequiresMountsFor=``)
    + devices: NVML/CUDA indexes of the GPUs to use; default the first tensor_parallel_size
    + accepted: the installed server's options (the flags files/vllm_probe.py
      records), see ``vllm_service.server_flags``
    + threads_bind: vllm_device "cpu": VLLM_CPU_OMP_THREADS_BIND (``cpu_threads_bind``
      of the host's CPUs, or the vllm_cpu_threads_bind setting); devices is then unused
    + place: the endpoint the run's context decided for the host (HostContext.endpoint; a
      caller without a run: ``engine_access.endpoint(settings)``)
    """
    tp = settings.tensor_parallel_size
    chosen = tuple(range(tp) if devices is None or settings.vllm_device == "cpu" else devices)
    return EnginePlan(
        settings=settings,
        endpoint=place,
        python=python,
        model_path=model_path,
        devices=chosen,
        threads_bind=threads_bind,
        flags=tuple(vllm_service_plan.server_flags(settings, model_path, accepted,
                                                   place=place)),
        environment=tuple(vllm_service_plan.environment_pairs(settings, python, chosen,
                                                              threads_bind)),
        drains=vllm_service_plan.drains_on_sigterm(settings, accepted),
    )


# --- the unit --------------------------------------------------------------------------
def _unit_devices(plan: EnginePlan) -> list[int]:
    """The unit's GPUs (``plan.devices``), refused where they cannot make the unit: on
    vllm_device "cpu" without the CPUs its workers' threads are bound to, elsewhere
    another number of GPUs than tensor_parallel_size."""
    tp = plan.settings.tensor_parallel_size
    if plan.settings.vllm_device == "cpu" and plan.threads_bind is None:
        raise OperationValueError(
            f"no CPU binding for {tp} CPU worker(s): set vllm_cpu_threads_bind")
    chosen = list(plan.devices)
    if len(chosen) != tp:
        raise OperationValueError(
            f"{len(chosen)} GPU(s) {chosen} for tensor_parallel_size {tp}"
        )
    return chosen


def _guard_argv(settings: Settings, python: str, guard_path: str,
                devices: list[int]) -> list[str]:
    """files/gpu_guard.py's command line before each start: the unit's GPUs, joined by
    NVLink for tensor parallel unless allow_pcie_tensor_parallel."""
    tp = settings.tensor_parallel_size
    guard = [python, guard_path, "--expect-gpus", str(tp),
             "--devices", ",".join(str(d) for d in devices)]
    if not settings.allow_pcie_tensor_parallel and tp > 1:
        guard.append("--require-nvlink")
    return guard


def ready_argv(settings: Settings, python: str, ready_path: str,
               place: Endpoint) -> list[str]:
    """files/wait_ready.py's command line after each start (the unit's ExecStartPost, and
    tools/engine_trial.py's wait): /health, then completions."""
    return [python, ready_path, "--url", place.url("/health"),
            *engine_access.client_args(place), "--model", settings.model_name,
            "--warmups", str(settings.vllm_warmup_requests),
            "--request-timeout", str(settings.vllm_warmup_timeout_s)]


def stop_timeout_s(plan: EnginePlan) -> int:
    """How long a stop waits before SIGKILL (the unit's TimeoutStopSec): STOP_TIMEOUT_S, plus
    vllm_shutdown_timeout_s where the server serves its requests out on SIGTERM."""
    return vllm_service_plan.STOP_TIMEOUT_S + (
        plan.settings.vllm_shutdown_timeout_s if plan.drains else 0)


def _reach_words(place: Endpoint) -> dict[str, Any]:
    """The unit template's values for how the engine is reached: its Unix socket, or its
    TCP port behind its firewall, and the file of its own key."""
    return {
        "key_env_path": engine_access.KEY_ENV_PATH,
        "socket_dir": place.socket and engine_access.SOCKET_DIR,
        "socket_path": place.socket,
        "socket_group": engine_access.SOCKET_GROUP,
        "firewall_path": None if place.socket else engine_access.FIREWALL_PATH,
        "nft": engine_access.NFT,
    }


def render_unit(
    plan: EnginePlan,
    *,
    guard_path: str = vllm_service_plan.GUARD_PATH,
    ready_path: str = vllm_service_plan.READY_PATH,
    env_path: str = vllm_service_plan.ENV_PATH,
    systemd_version: int = 249,
) -> str:
    """The unit file ``vllm.service`` of the engine ``plan``.

    + plan: the host's engine (``engine_plan``)
    + guard_path, ready_path: where the deploy put files/gpu_guard.py and files/wait_ready.py
    + env_path: the secret EnvironmentFile
    + systemd_version: the host's systemd; RestartSteps= only from 254 on

    On vllm_device "cpu" the unit has no GPU guard, no nvidia-modprobe and no NVIDIA
    device or unit (the template says why).
    """
    settings = plan.settings
    devices = _unit_devices(plan)
    service = vllm_service_plan
    return render(
        service.UNIT_TEMPLATE,
        model_name=systemd_plain(settings.model_name, path=False),
        tp=settings.tensor_parallel_size,
        model_path=systemd_plain(plan.model_path),
        user=service.SERVICE_USER,
        state_dir=service.STATE_DIR,
        cache_dir_name=systemd_plain(compile_cache(plan.python).removeprefix("/var/cache/")),
        state_dir_name=service.STATE_DIR.removeprefix("/var/lib/"),
        env_path=env_path,
        **_reach_words(plan.endpoint),
        environment=[systemd_quote(f"{name}={value}", exec_line=False)
                     for name, value in plan.environment],
        cpu=settings.vllm_device == "cpu",
        guard_command=exec_command(_guard_argv(settings, plan.python, guard_path, devices)),
        exec_start=exec_command(plan.argv, continued=True),
        ready_command=exec_command(ready_argv(settings, plan.python, ready_path,
                                              plan.endpoint)),
        start_timeout_s=settings.vllm_start_timeout_s,
        drains_on_sigterm=plan.drains,
        stop_timeout_s=stop_timeout_s(plan),
        start_limit_burst=service.START_LIMIT_BURST,
        start_limit_interval_s=service.START_LIMIT_INTERVAL_S,
        restart_steps=systemd_version >= service.RESTART_STEPS_SINCE,
    )


# --- the running engine against its unit -----------------------------------------------
def engine_expected(plan: EnginePlan, key_sha256: str | None = None) -> dict[str, Any]:
    """What the engine's main process runs with when it was started from the unit and
    environment file of ``plan``: ``{"argv", "env", "secret_sha256"}``.

    ``ExecStart`` runs the interpreter itself (Type=exec, no shell or wrapper), so the
    main process's argv is exactly its words; its one secret is its own key
    (VLLM_API_KEY, pyinfra_vllm/plans/engine_access.py), as its sha256 (``key_sha256``:
    facts.vllm_service.EngineKey; None while the host has none yet: then any key differs).
    """
    return {
        "argv": plan.argv,
        "env": dict(plan.environment),
        "secret_sha256": {} if key_sha256 is None else {"VLLM_API_KEY": key_sha256},
    }
