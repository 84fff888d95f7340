"""Preflight: check the host can serve the stack before anything changes.

Supported OS; the driver loaded, matching its installed packages, and new enough for
the stack's CUDA build; enough GPUs with enough memory; the tensor-parallel GPUs
joined by NVLink. Then the model, from the config.json in its lock: the stack's vLLM
loads its architecture (the host's installed registry when it has the stack, else the
built-in table), max_model_len is within the model's limit, and it fits the GPUs next
to the weights (the numbers are shown). A failed check stops this host (and only this
host) with what is wrong and what to do. Changes nothing.

    pyinfra inventory.py deploys/preflight.py
"""

from __future__ import annotations

from pyinfra import host, logger
from pyinfra.api import deploy

from operations import gate
from pyinfra_vllm.checks import blocking, check_host
from pyinfra_vllm.context import context
from pyinfra_vllm.gates import installed_registry, model_gates


@deploy("preflight")
def preflight() -> None:
    """Preflight: check the host can serve the stack before anything changes."""
    ctx = context(host, stages=("preflight",))

    if ctx.proceed("preflight"):
        settings = ctx.settings
        checks = check_host(ctx.state, settings)
        if ctx.lock is not None:
            registry = installed_registry(ctx.environments(host), ctx.environment_path(host))
            checks += model_gates(settings, ctx.lock, ctx.state, registry)["checks"]
        for check in checks:
            if check["ok"] is False and check["severity"] == "warning":
                host.log_styled(f"warning: {check['detail']}: {check['fix']}", fg="yellow",
                                log_func=logger.warning)
        failed = blocking(checks)
        if failed:
            ctx.refused = [f"preflight {c['name']}: {c['detail']}; {c['fix']}" for c in failed]
            for reason in ctx.refused:
                host.log_styled(reason, fg="red", log_func=logger.error)
            ctx.refusals.append(gate.refuse(name="Preflight: host refused", reasons=ctx.refused))
