"""What the stages of one run share per host: validated settings, the state read at
the start, and whether an earlier stage refused the host.

pyinfra executes each stage file once per host; this module outlives those runs, so
the settings are validated and the host's state is read once per host, not once per
stage (every fact is a remote round trip).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deploys.host_state import collect
from deploys.settings import Settings, load_settings

_CONTEXTS: dict[str, HostContext] = {}


@dataclass
class HostContext:
    settings: Settings
    state: dict[str, Any]
    # Reasons an earlier stage refused this host; later stages add nothing for it.
    refused: list[str] = field(default_factory=list)

    def proceed(self, stage: str) -> bool:
        """Should ``stage`` add its operations for this host?"""
        return not self.refused and stage not in self.settings.skip_stages


def context(host: Any) -> HostContext:
    """The run's context for ``host``, made on first use."""
    found = _CONTEXTS.get(host.name)
    if found is None:
        settings = load_settings(host)
        found = HostContext(settings=settings, state=collect(host))
        _CONTEXTS[host.name] = found
    return found
