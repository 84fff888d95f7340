"""The shape of every stage: a pyinfra ``@deploy`` function, once per host, that adds its
operations only when the host should get them.

    @stage("model")
    def model(ctx: HostContext) -> None:
        ...

``stage`` makes the run's context for the host (settings validated, the host's state
read in one command, ``pyinfra_vllm/run/context.py``) and calls the stage's body with it
only when ``ctx.proceed`` says so: no earlier stage refused the host and the settings do
not skip the stage. A GPU-only stage (``gpu_only``: driver, MIG, persistence) is also
skipped, with its reason logged, when the engine runs on CPU. The body refuses a host with
``ctx.refuse``, never with ``pyinfra_vllm.operations.gate`` itself, so every refusal is logged once
and recorded for the audit.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Concatenate, ParamSpec

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.api.operation import PyinfraOperation

from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.run import host_reads
from pyinfra_vllm.run.context import HostContext, context
from pyinfra_vllm.run.host_reads import Read

P = ParamSpec("P")


def stage(name: str, *, gpu_only: bool = False, lock_required: bool = True,
          reads: Callable[[Settings], list[Read]] | None = None,
          ) -> Callable[[Callable[Concatenate[HostContext, P], None]], PyinfraOperation[P]]:
    """
    Make ``body(ctx, ...)`` the stage ``name``: a ``@deploy`` of that name.

    + name: the stage's name, as settings' ``skip_stages`` and the run's reads know it
    + gpu_only: skipped (and logged) when ``vllm_device`` is cpu
    + lock_required: the stage needs the model lock (``False``: read only when the model
      stage runs)
    + reads: what the stage reads of a converged host, from its settings (the same facts
      and arguments its operations read): read with the run's one read
    """
    if reads is not None:
        host_reads.declare(name, reads)

    def wrap(body: Callable[Concatenate[HostContext, P], None]) -> PyinfraOperation[P]:
        @wraps(body)
        def run(*args: P.args, **kwargs: P.kwargs) -> None:
            ctx = context(host, lock_required=lock_required, stages=(name,))
            if ctx.gpu_stage(host, name) if gpu_only else ctx.proceed(name):
                body(ctx, *args, **kwargs)

        return deploy(name)(run)

    return wrap
