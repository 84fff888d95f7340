"""Sysctl: kernel parameters for a long-context server, persisted and applied.

The ``sysctl`` setting is written to ``/etc/sysctl.d/<sysctl_file_priority>-vllm.conf``
(a drop-in, not /etc/sysctl.conf) and each key whose running value drifted is set back
with ``sysctl -w``. A key this host cannot write (a container's read-only /proc/sys) is
persisted and reported as NOT applied, with its name, and counts as no change.

    pyinfra inventory.py deploys/sysctl.py
"""

from __future__ import annotations

from facts.files import FileDigests
from facts.sysctl import KernelParam
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.operations import sysctl as sysctl_ops
from pyinfra_vllm.plans import sysctl as sysctl_plan
from pyinfra_vllm.plans.engine_access import Endpoint
from pyinfra_vllm.run.context import HostContext
from pyinfra_vllm.run.host_reads import Read
from pyinfra_vllm.run.stage import stage


def sysctl_reads(settings: Settings, _place: Endpoint) -> list[Read]:
    """What the sysctl stage reads of a converged host: the run's one read."""
    path = sysctl_plan.drop_in_path(settings.sysctl_file_priority)
    return [Read(FileDigests, {"paths": [path]}),
            *(Read(KernelParam, {"key": key}) for key in settings.sysctl)]


@stage(reads=sysctl_reads)
def sysctl(ctx: HostContext) -> None:
    """Sysctl: kernel parameters for a long-context server, persisted and applied."""
    sysctl_ops.drop_in(
        name="Sysctl: kernel parameters persisted and applied",
        params=dict(ctx.settings.sysctl),
        path=sysctl_plan.drop_in_path(ctx.settings.sysctl_file_priority),
    )
