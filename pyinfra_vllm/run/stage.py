"""The shape of every stage: a pyinfra ``@deploy`` function, once per host, that adds its
operations only when the host should get them.

    @stage()
    def model(ctx: HostContext) -> None:
        ...

The stage's name is the function's: one of pyinfra_vllm/core/settings.py ``STAGES``, the
one list of the stages (skip_stages is checked against it, the whole run's order is its
order). ``stage`` refuses, as the module defining it is imported, a function named after
no stage of STAGES; ``runbook_order`` refuses a whole run (pyinfra_vllm/stages/full.py
``full``, its calls read by ``runbook_of``) that does not run STAGES, each once, in their
order. To add a stage: its name in STAGES, at its place in the runbook; ``@stage() def
<name>(ctx)`` in pyinfra_vllm/stages/<name>.py; its call in ``full`` at the same place.

``stage`` makes the run's context for the host (settings validated, the host's state
read in one command, ``pyinfra_vllm/run/context.py``) and calls the stage's body with it
only when ``ctx.proceed`` says so: no earlier stage refused the host and the settings do
not skip the stage. A GPU-only stage (``gpu_only``: driver, MIG, persistence) is also
skipped, with its reason logged, when the engine runs on CPU. The body refuses a host with
``ctx.refuse``, never with ``pyinfra_vllm.operations.gate`` itself, so every refusal is logged once
and recorded for the audit.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping, Sequence
from functools import partial, wraps
from pathlib import Path
from typing import Any, Concatenate, ParamSpec

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.api.operation import PyinfraOperation

from pyinfra_vllm.core.settings import STAGES
from pyinfra_vllm.run import host_reads
from pyinfra_vllm.run.context import HostContext, context
from pyinfra_vllm.run.host_reads import StageReads

P = ParamSpec("P")

# The stage of each @stage function (the @deploy it made), and those that continue a
# stage another function starts: what runbook_order reads.
STAGE_OF: dict[Callable[..., Any], str] = {}
CONTINUING: set[Callable[..., Any]] = set()


def stage(*, gpu_only: bool = False, lock_required: bool = True,
          reads: StageReads | None = None,
          continues: Callable[..., Any] | None = None, runbook: bool = True,
          ) -> Callable[[Callable[Concatenate[HostContext, P], None]], PyinfraOperation[P]]:
    """
    Make ``body(ctx, ...)`` the stage named after it (``body.__name__``): a ``@deploy`` of
    that name.

    + gpu_only: skipped (and logged) when ``vllm_device`` is cpu
    + lock_required: the stage needs the model lock (``False``: read only when the model
      stage runs)
    + reads: what the stage reads of a converged host, from its settings and the engine's
      endpoint the run's context decided for the host (``reads(settings, place)``; the
      same facts and arguments its operations read): read with the run's one read
    + continues: the @stage function whose stage this one ends (python_env_built ends the
      build python_env(wait=False) starts): the stage is that one's
    + runbook: ``False``: a stage run on its own (bench), not one of STAGES, which
      skip_stages cannot name
    """

    def wrap(body: Callable[Concatenate[HostContext, P], None]) -> PyinfraOperation[P]:
        name = _stage_name(body, continues, runbook)
        if reads is not None:
            host_reads.declare(name, reads)

        @wraps(body)
        def run(*args: P.args, **kwargs: P.kwargs) -> None:
            ctx = context(host, lock_required=lock_required, stages=(name,))
            if ctx.gpu_stage(host, name) if gpu_only else ctx.proceed(name):
                body(ctx, *args, **kwargs)

        made = deploy(name)(run)
        STAGE_OF[made] = name
        if continues is not None:
            CONTINUING.add(made)
        return made

    return wrap


def _stage_name(body: Callable[..., Any], continues: Callable[..., Any] | None,
                runbook: bool) -> str:
    """The stage ``body`` makes: its own name, or the stage it continues; refused (the
    module defining it fails to import) where STAGES does not say the same."""
    where = f"@stage {body.__module__}.{body.__name__}"
    if continues is not None:
        if continues not in STAGE_OF:
            raise ValueError(f"{where}: continues={continues!r}, which is no @stage function")
        return STAGE_OF[continues]
    name = body.__name__
    if runbook and name not in STAGES:
        raise ValueError(
            f"{where}: {name!r} is no stage of pyinfra_vllm/core/settings.py STAGES "
            f"({', '.join(STAGES)}): name the function after its stage, or add the stage to "
            "STAGES at its place in the runbook (runbook=False: a stage run on its own)"
        )
    if not runbook and name in STAGES:
        raise ValueError(f"{where}: {name!r} is one of STAGES, run by the whole run: "
                         "remove runbook=False")
    return name


def runbook_of(path: str, function: str,
               names: Mapping[str, Any]) -> tuple[Callable[..., Any], ...]:
    """The @stage calls in the body of ``function`` of the module at ``path``, in the order
    written: each the stage function ``names`` (the module's globals) gives it, or a
    ``partial`` of it with the call's keywords (literals). Calls of anything else (the
    run's ``context``) are left out."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)
    body = next(node.body for node in tree.body
                if isinstance(node, ast.FunctionDef) and node.name == function)
    steps: list[Callable[..., Any]] = []
    for node in body:
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)):
            continue
        target = names.get(node.value.func.id)
        if target in STAGE_OF:
            keywords = {word.arg: ast.literal_eval(word.value) for word in node.value.keywords
                        if word.arg is not None}
            steps.append(partial(target, **keywords) if keywords else target)
    return tuple(steps)


def runbook_order(steps: Sequence[Callable[..., Any]]) -> None:
    """Refuse a whole run whose ``steps`` (@stage functions, or ``partial`` of them) do not
    start every stage of STAGES once, in STAGES' order, or end a stage (``continues``)
    that no step before starts."""
    started: list[str] = []
    for step in steps:
        function = step.func if isinstance(step, partial) else step
        if function not in STAGE_OF:
            raise ValueError(f"runbook: {function!r} is no @stage function")
        name = STAGE_OF[function]
        if function not in CONTINUING:
            started.append(name)
        elif name not in started:
            raise ValueError(f"runbook: {function.__name__} ends the stage {name}, which no "
                             "step before it starts")
    if started != list(STAGES):
        raise ValueError(
            f"runbook: the stages run in the order {', '.join(started) or '(none called)'}; "
            f"pyinfra_vllm/core/settings.py STAGES is {', '.join(STAGES)}: one order, STAGES'"
        )
