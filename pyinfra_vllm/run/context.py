"""What the stages of one run share per host: validated settings, the model lock, the
state read at the start, and whether an earlier stage refused the host.

Each stage is a ``@deploy`` function (``pyinfra_vllm/run/stage.py``) that pyinfra calls
once per host; the context is kept per host object, so the settings are validated and
the host's state is read once per host and run, not once per stage (every fact is a
remote round trip).

The state (``collect``) is everything the preflight and the audit judge. Every fact in
it returns an absent value (None) rather than failing when the thing it reads is missing
(no driver, no NVLink, no nvcc), so a bare host is collected too. The NVIDIA, CUDA and
package facts are reads of the run's one read (``host_reads.state_reads``), side by side,
not thirteen commands. A host whose engine runs on CPU (vllm_device "cpu") also gets its
CPUs, NUMA nodes and memory (CpuHostState, in the same read); the GPU state is still
read, for the audit's report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

from pyinfra import logger
from pyinfra.api.exceptions import DeployError
from pyinfra.context import ContextObject, ctx_host
from pyinfra.facts.server import KernelVersion, LinuxDistribution

from facts.cpu_host import CpuHostState
from facts.gpu_host import GpuHostState
from facts.model import ModelContent
from facts.python_env import EnvironmentContent, VllmEnvironments
from pyinfra_vllm.core.locks import load_lock
from pyinfra_vllm.core.settings import Settings, load_settings
from pyinfra_vllm.core.stack_locks import driver_floor, read_lock
from pyinfra_vllm.operations import gate
from pyinfra_vllm.operations.util.refusals import log_reasons
from pyinfra_vllm.plans import engine_access
from pyinfra_vllm.plans import python_env as python_env_plan
from pyinfra_vllm.plans.engine_access import Endpoint
from pyinfra_vllm.run import host_reads

# Keyed by pyinfra's Host object: a second run in the same process (pyinfra's API, a
# test) gets new Host objects and so a new context.
_CONTEXTS: WeakKeyDictionary[Any, HostContext] = WeakKeyDictionary()


def collect(host: Any, device: str = "cuda") -> dict[str, Any]:
    """The host's OS, driver, GPUs, topology and NVLink state, as plain data; on
    ``device`` "cpu" also its CPUs and memory (``"cpu"``). Each is its own fact, keyed
    as GpuHostState keys them (``held_packages`` from DriverPackages' dpkg-query); the
    run's one read (host_reads.state_reads) has read them all, the GPU facts side by
    side, so these reads cost no remote command."""
    state = {
        "os": host.get_fact(LinuxDistribution),
        "kernel": host.get_fact(KernelVersion),
        **{key: host.get_fact(fact) for key, fact in GpuHostState.facts.items()},
    }
    if device == "cpu":
        state["cpu"] = host.get_fact(CpuHostState)
    return state


def refuse(operation: str, reasons: list[str]) -> Any:
    """Refuse the current host, ``reasons`` logged once, while the run is planned (a dry
    run and the audit show them too): ``operation`` (pyinfra_vllm.operations.gate.refuse) fails the
    host when the run executes. What pyinfra returned, for the audit to know it by.
    Stages refuse through ``HostContext.refuse``, which also records it; only a host
    without a context (the audit's, whose settings are invalid) is refused here."""
    log_reasons(ctx_host.get(), reasons)
    return gate.refuse(name=operation, reasons=list(reasons))


@dataclass
class HostContext:
    settings: Settings
    state: dict[str, Any]
    # Where clients on the host reach the engine (engine_access.endpoint), decided once
    # per host as the context is made (``context``), before the host is read: the stages'
    # reads, the engine's flags and unit, its firewall, the access table's rows, the
    # gateway's upstream and the audit's reads of the engine all take this one instead
    # of each computing it again from the settings.
    endpoint: Endpoint
    # The model lock (tools.model_lock), read before any operation; None only when the
    # model stage is skipped and there is no lock.
    lock: dict[str, Any] | None = None
    # Reasons an earlier stage refused this host; later stages add nothing for it.
    refused: list[str] = field(default_factory=list)
    # The refusing operations (pyinfra_vllm/operations/gate.py) as pyinfra returned them: the audit
    # does not count them as drift.
    refusals: list[Any] = field(default_factory=list)
    # The stages that asked whether to proceed in this run: the audit's sign that a deploy
    # of the suite was planned before it.
    stages_asked: list[str] = field(default_factory=list)

    # True when this run reboots into a driver it installs: the state read at the start
    # no longer describes the host afterwards (the metrics stage then waits a run).
    stale: bool = False
    # The VllmEnvironments fact, read once for the stages that need it (preflight's
    # registry, the runtime, the unit): facts are not cached by pyinfra 3.
    environments_read: dict[str, Any] | None = None
    # What the engine's main process should run with (pyinfra_vllm/plans/engine_plan.py
    # engine_expected; secrets as sha256), set by the vllm_service stage for the audit.
    engine_expected: dict[str, Any] | None = None
    # The model stage's deep check (facts.model.ModelContent), once it ran
    # (``model_checked``; None content: no model directory): the audit reports it without
    # reading the whole model a second time.
    model_checked: bool = False
    model_content: dict[str, Any] | None = None
    # The model stage's refetch of files a deep check found corrupt (its OperationMeta):
    # the vllm_service stage restarts a running engine when it changed.
    model_repair: Any = None
    # The deep check of the environment the run would use (facts.python_env
    # .EnvironmentContent, python_env_verify deep), made with the environments' read:
    # its path, and what it found (None: not checked).
    env_checked: str | None = None
    env_content: dict[str, Any] | None = None
    # The environment link this run moves (python_env's ``current``), ``{"path",
    # "before"}``: its target before the run (None: there was none), read before any
    # change. The engine's restart puts it back where the rollout leaves the host on its
    # previous unit (a rejected canary, a host the rollout did not reach). None: not moved.
    env_link: dict[str, Any] | None = None

    def environments(self, host: Any) -> dict[str, Any]:
        """The host's vLLM environments (facts.python_env.VllmEnvironments), read once;
        with the deep check, the one the run would use re-hashed (``_deep_env_check``)."""
        if self.environments_read is None:
            found = host.get_fact(VllmEnvironments, root=self.settings.python_env_root)
            self.environments_read = self._deep_env_check(host, found)
        return self.environments_read

    def _deep_env_check(self, host: Any, environments: dict[str, Any]) -> dict[str, Any]:
        """With python_env_verify deep (or python_env_repair): the environment the run
        would use, when it is proven (the stat check trusts it), re-hashed against its
        wheels' RECORD files on the host, once per run (``env_content``). With
        python_env_repair, one whose files no longer match is marked changed: the run
        builds it again beside itself, as for a change the stat check finds."""
        settings = self.settings
        if not settings.deep_env_check:
            return environments
        path = self._environment_path(environments)
        if not python_env_plan.proven(environments, path, settings.stack):
            return environments  # nothing built there, or already to be built again
        self.env_checked = path
        self.env_content = host.get_fact(EnvironmentContent, path=path)
        content = self.env_content
        if settings.python_env_repair and content and not content["error"] and (
                content["problems"]):
            return python_env_plan.content_changed(environments, path, content)
        return environments

    def deep_model_check(self, host: Any, path: str) -> dict[str, Any] | None:
        """The deep check of the model in ``path`` (facts.model.ModelContent), read once
        per run: it reads every byte of the model."""
        if not self.model_checked:
            self.model_content = host.get_fact(ModelContent, path=path,
                                               lock=self.required_lock())
            self.model_checked = True
        return self.model_content

    def environment_path(self, host: Any) -> str:
        """Where this host's environment for the settings' stack and manager is, or is
        to be built (pyinfra_vllm/plans/python_env.py environment_path)."""
        return self._environment_path(self.environments(host))

    def _environment_path(self, environments: dict[str, Any]) -> str:
        settings = self.settings
        return python_env_plan.environment_path(
            settings.python_env_root,
            settings.stack,
            settings.python_env_manager,
            python_env_plan.interpreter(settings.python_env_manager, settings.stack),
            environments,
        )

    def required_lock(self) -> dict[str, Any]:
        """The model lock, for a stage that cannot go on without it."""
        if self.lock is None:
            # context() reads it whenever the model stage runs; only a caller that made
            # the context with lock_required=False gets here.
            raise DeployError("the model lock was not read for this run: see "
                              "python -m tools.model_lock --help")
        return self.lock

    def proceed(self, stage: str) -> bool:
        """Should ``stage`` add its operations for this host?"""
        self.stages_asked.append(stage)
        return not self.refused and stage not in self.settings.skip_stages

    def refuse(self, operation: str, reasons: list[str]) -> None:
        """Refuse this host: ``reasons`` logged once, kept so that later stages add
        nothing for it, and ``operation`` (``pyinfra_vllm.operations.gate.refuse``, which fails the
        host when it runs) recorded for the audit, which does not count it as drift."""
        self.refused.extend(reasons)
        self.refusals.append(refuse(operation, reasons))

    def gpu_stage(self, host: Any, stage: str) -> bool:
        """Should the GPU-only ``stage`` (driver, mig, persistence) add its operations? Not
        when the engine runs on CPU: logged with the reason, not an error."""
        if not self.proceed(stage):
            return False
        if self.settings.vllm_device == "cpu":
            host.log_styled(
                f"{stage}: skipped: vllm_device is cpu (vLLM's CPU build uses no GPU, so no "
                "NVIDIA driver, MIG mode or persistence daemon)",
                log_func=logger.info,
            )
            return False
        return True


def context(host: Any, lock_required: bool = True,
            stages: tuple[str, ...] = ()) -> HostContext:
    """The run's context for ``host``, made on first use. The model lock is required
    unless ``lock_required`` is False or the model stage is skipped. On first use, the
    engine's endpoint is decided (HostContext.endpoint), then the host's state for the
    preflight and ``stages`` is read in one remote command (pyinfra_vllm/run/host_reads.py),
    each stage's reads made with that endpoint."""
    # Keyed by the Host itself: pyinfra's ``host`` (the stages' argument) is one proxy
    # for every host, hashed as whichever is current; kept under it, a context outlived
    # its host and went to a later one whose object took the freed one's address.
    host = ctx_host.get() if isinstance(host, ContextObject) else host
    found = _CONTEXTS.get(host)
    if found is None:
        settings = load_settings(host)
        required = lock_required and "model" not in settings.skip_stages
        lock = load_lock(settings, required=required)
        # The stack's whole lock, checked against its row before any host changes, and the
        # driver its CUDA runtime needs known (StackLockError where it is not).
        read_lock(settings.stack)
        driver_floor(settings.stack)
        place = engine_access.endpoint(settings)
        reads = host_reads.stage_reads(settings, ("preflight", *stages), place)
        host_reads.answer_from(host, host_reads.read_all(host, reads))
        found = HostContext(settings=settings, state=collect(host, settings.vllm_device),
                            endpoint=place, lock=lock)
        _CONTEXTS[host] = found
    return found
