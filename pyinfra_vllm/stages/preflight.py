"""Preflight: check the host can serve the stack before anything changes.

Supported OS; the driver loaded, matching its installed packages, and new enough for
the stack's CUDA build; enough GPUs with enough memory; the tensor-parallel GPUs
joined by NVLink; no GPU the engine runs on failing its health (uncorrectable memory
errors pending a reset, a row-remapping failure, a fatal Xid in the kernel log since
boot, the tensor-parallel NVLink down: pyinfra_vllm/plans/gpu_health.py). Then the model, from the config.json in its lock: the stack's vLLM
loads its architecture (the host's installed registry when it has the stack, else the
built-in table), max_model_len is within the model's limit, and it fits the GPUs next
to the weights (the numbers are shown). A failed check stops this host (and only this
host) with what is wrong and what to do. Changes nothing but one file: the GPUs' health
for node_exporter's textfile collector (unless the metrics stage is skipped), written
before the checks are judged, so that a host refused for a failing GPU still tells the
alert rules which GPU and why; and only where every directory of textfile_collector_dir
is root's and writable by root alone: else the host is refused, nothing written
(pyinfra_vllm/plans/metrics.py ``textfile_dir_problem``).

    pyinfra inventory.py deploys/preflight.py
"""

from __future__ import annotations

from pyinfra import host, logger

from facts.files import FileDigests, PathComponents
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.operations import file_set
from pyinfra_vllm.plans import metrics as metrics_plan
from pyinfra_vllm.plans.checks import blocking, check_gpu_health, check_host, gpu_health
from pyinfra_vllm.plans.engine_access import Endpoint
from pyinfra_vllm.plans.gates import installed_registry, model_gates
from pyinfra_vllm.plans.textfile import gpu_health_text
from pyinfra_vllm.run.context import HostContext
from pyinfra_vllm.run.host_reads import Read
from pyinfra_vllm.run.stage import stage
from pyinfra_vllm.stages.metrics import textfile_dir_problem


def preflight_reads(settings: Settings, _place: Endpoint) -> list[Read]:
    """What the preflight stage reads of a converged host: the run's one read."""
    reads = []
    if "metrics" not in settings.skip_stages:
        reads.append(Read(PathComponents, {"path": settings.textfile_collector_dir}))
        reads.append(Read(FileDigests, {"paths": [metrics_plan.health_textfile(settings.textfile_collector_dir)]}))
    return reads


@stage(reads=preflight_reads)
def preflight(ctx: HostContext) -> None:
    """Preflight: check the host can serve the stack before anything changes."""
    settings = ctx.settings
    health = gpu_health(ctx.state, settings)
    checks = check_host(ctx.state, settings, health)
    if settings.vllm_device == "cpu":
        # The CPU engine uses no GPU: their health is reported, never a stop.
        checks += [dict(c, severity="warning") for c in check_gpu_health(
            ctx.state, settings, health)]
    # Root writes node_exporter's textfiles (this health file first): refused here, before
    # any change, where another account could steer those writes.
    textfile_problem = textfile_dir_problem(settings)
    if textfile_problem is None:
        health_textfile(settings, health)
    if ctx.lock is not None:
        registry = installed_registry(ctx.environments(host), ctx.environment_path(host))
        checks += model_gates(settings, ctx.lock, ctx.state, registry)["checks"]
    for check in checks:
        if check["ok"] is False and check["severity"] == "warning":
            host.log_styled(f"warning: {check['detail']}: {check['fix']}", fg="yellow",
                            log_func=logger.warning)
    reasons = [f"preflight {c['name']}: {c['detail']}; {c['fix']}" for c in blocking(checks)]
    if textfile_problem is not None:
        reasons.append(f"preflight: {textfile_problem}")
    if reasons:
        ctx.refuse("Preflight: host refused", reasons)


def health_textfile(settings: Settings, health: dict) -> None:
    """The GPUs' health for node_exporter's textfile collector (nothing without GPUs)."""
    if health and "metrics" not in settings.skip_stages:
        path = metrics_plan.health_textfile(settings.textfile_collector_dir)
        file_set.present(
            name="Preflight: GPU health for node_exporter's textfile collector",
            files={path: (gpu_health_text(host.name, health).encode(), "644")},
            parent_mode=metrics_plan.TEXTFILE_DIR_MODE,
        )
