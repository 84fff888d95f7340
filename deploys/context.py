"""What the stages of one run share per host: validated settings, the model lock, the
state read at the start, and whether an earlier stage refused the host.

pyinfra executes each stage file once per host; this module outlives those runs, so
the settings are validated and the host's state is read once per host, not once per
stage (every fact is a remote round trip).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deploys.host_state import collect
from deploys.locks import load_lock
from deploys.settings import Settings, load_settings
from facts.python_env import VllmEnvironments
from operations import python_env

_CONTEXTS: dict[str, HostContext] = {}


@dataclass
class HostContext:
    settings: Settings
    state: dict[str, Any]
    # The model lock (tools.model_lock), read before any operation; None only when the
    # model stage is skipped and there is no lock.
    lock: dict[str, Any] | None = None
    # Reasons an earlier stage refused this host; later stages add nothing for it.
    refused: list[str] = field(default_factory=list)

    # True when this run reboots into a driver it installs: the state read at the start
    # no longer describes the host afterwards (the metrics stage then waits a run).
    stale: bool = False
    # The VllmEnvironments fact, read once for the stages that need it (preflight's
    # registry, the runtime, the unit): facts are not cached by pyinfra 3.
    environments_read: dict[str, Any] | None = None

    def environments(self, host: Any) -> dict[str, Any]:
        """The host's vLLM environments (facts.python_env.VllmEnvironments), read once."""
        if self.environments_read is None:
            self.environments_read = host.get_fact(
                VllmEnvironments, root=self.settings.python_env_root
            )
        return self.environments_read

    @property
    def environment_path(self) -> str:
        """Where this host's environment for the settings' stack and manager lives."""
        settings = self.settings
        return python_env.environment_path(
            settings.python_env_root,
            settings.stack,
            settings.python_env_manager,
            python_env.interpreter(settings.python_env_manager, settings.stack),
        )

    def proceed(self, stage: str) -> bool:
        """Should ``stage`` add its operations for this host?"""
        return not self.refused and stage not in self.settings.skip_stages


def context(host: Any, lock_required: bool = True) -> HostContext:
    """The run's context for ``host``, made on first use. The model lock is required
    unless ``lock_required`` is False or the model stage is skipped."""
    found = _CONTEXTS.get(host.name)
    if found is None:
        settings = load_settings(host)
        required = lock_required and "model" not in settings.skip_stages
        lock = load_lock(settings, required=required)
        found = HostContext(settings=settings, state=collect(host), lock=lock)
        _CONTEXTS[host.name] = found
    return found
