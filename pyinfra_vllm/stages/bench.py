"""Bench: the acceptance benchmark, through the host's gateway, with vLLM's own client.

On a converged host whose engine runs: vLLM's ``vllm bench serve`` client (its module,
from the engine's environment) as a transient job on the host, against the gateway on
loopback with TLS and the first API key, in the settings' shape (bench_*); its record
kept on the host for the audit and the alert rules (pyinfra_vllm/plans/bench.py), and
handed to ``python -m tools.bench``, which writes the reports. A host whose engine does
not run, or whose environment was never built, is refused, named, and nothing runs on it.

    python -m tools.bench inventory.py
"""

from __future__ import annotations

from pyinfra import host

from facts.units import UnitActivation
from pyinfra_vllm.operations import bench as bench_ops
from pyinfra_vllm.plans import bench as bench_plan
from pyinfra_vllm.plans import vllm_service as vllm_service_plan
from pyinfra_vllm.run.context import HostContext
from pyinfra_vllm.run.stage import stage
from pyinfra_vllm.stages.router import is_router


@stage(lock_required=False, runbook=False)
def bench(ctx: HostContext) -> None:
    """Bench: the acceptance benchmark, through the host's gateway, with vLLM's own client."""
    if is_router(host):  # a front door has no engine of its own: its pool's hosts are measured
        host.noop(f"{host.name} is a front door: nothing of its own to measure")
        return
    settings = ctx.settings
    env_path = ctx.environment_path(host)
    unit = host.get_fact(UnitActivation, unit=vllm_service_plan.UNIT) or {}
    problems = []
    if env_path not in ctx.environments(host)["envs"]:
        problems.append(f"bench: no environment at {env_path} for the settings' stack: "
                        "converge the host with deploys/full.py first")
    if unit.get("active") != "active":
        problems.append(f"bench: {vllm_service_plan.UNIT} is "
                        f"{unit.get('active') or 'not installed'}, not active: nothing "
                        "to measure; converge the host with deploys/full.py first")
    if problems:
        ctx.refuse("Bench: host refused", problems)
        return
    shape = settings.bench_shape
    bench_ops.measured(
        name=f"Bench: {shape['requests']} requests of {shape['input_len']} + "
        f"{shape['output_len']} tokens, {shape['concurrency']} at once, through the gateway",
        python=f"{env_path}/bin/python",
        args=bench_plan.client_args(settings, shape),
        env=bench_plan.client_env(settings),
        shape=shape,
        stack=bench_plan.stack_words(settings),
        textfile=bench_plan.textfile_path(settings),
    )
