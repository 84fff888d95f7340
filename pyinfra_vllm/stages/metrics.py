"""Metrics: this host's verdicts for node_exporter's textfile collector.

The checks preflight ran (OS, driver, GPUs, NVLink, and the model's architecture,
context length and capacity), the stack, and the capacity plan, as Prometheus gauges in
``{textfile_collector_dir}/pyinfra_vllm.prom`` (pyinfra_vllm/textfile.py). node_exporter's
``--collector.textfile.directory`` reads it; Debian's and Ubuntu's
prometheus-node-exporter package reads /var/lib/prometheus/node-exporter. A host a
stage refused gets no new file: alert on the file's age or on a missing series. A run
that reboots into a driver it installed leaves the file to the next run: its verdicts
were read before the reboot.

    pyinfra inventory.py deploys/metrics.py
"""

from __future__ import annotations

from pyinfra import host, logger
from pyinfra.api import deploy

from operations import file_set
from pyinfra_vllm.context import context
from pyinfra_vllm.gates import model_gates
from pyinfra_vllm.report import summarize
from pyinfra_vllm.textfile import metrics_text


@deploy("metrics")
def metrics() -> None:
    """Metrics: this host's verdicts for node_exporter's textfile collector."""
    ctx = context(host)

    if ctx.proceed("metrics") and ctx.stale:
        # The verdicts would describe the host before its reboot into the new driver.
        host.log_styled("metrics: not written in a run that reboots into a new driver; the "
                        "next run writes them", fg="yellow", log_func=logger.warning)
    elif ctx.proceed("metrics"):
        settings = ctx.settings
        # The audit's own reading of the host: the same checks and versions it reports.
        summary = summarize(host.name, ctx.state, settings)
        checks = summary["checks"]
        capacity = None
        if ctx.lock is not None:
            gates = model_gates(settings, ctx.lock, ctx.state)
            checks += gates["checks"]
            capacity = gates["capacity"]
        driver = summary["summary"]["driver_version"]
        info = {
            "vllm": settings.vllm_version,
            "cuda_build": settings.stack["cuda"] or "none",
            "driver": driver or "none",
            "model": settings.model_id,
            "tensor_parallel_size": settings.tensor_parallel_size,
        }
        file_set.present(
            name="Metrics: verdicts for node_exporter's textfile collector",
            files={
                f"{settings.textfile_collector_dir}/pyinfra_vllm.prom": (
                    metrics_text(host.name, checks, info, capacity).encode(),
                    "644",
                )
            },
        )
