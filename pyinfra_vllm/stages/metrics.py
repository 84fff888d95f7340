"""Metrics: node_exporter on loopback, and this host's verdicts for its textfile collector.

With ``node_exporter_install`` (default) the distribution's prometheus-node-exporter is
installed, enabled and running, its command line set by the suite's drop-in
(pyinfra_vllm/plans/metrics.py): 127.0.0.1:``node_exporter_port`` only, the textfile
collector on ``textfile_collector_dir``, the systemd collector for the suite's units. The
drop-in is written before the package is installed, so the package's first start already
listens on loopback alone. A central Prometheus reads it through the gateway's
``/node-metrics`` (docs/monitoring.md).

Root writes the textfiles, so ``textfile_collector_dir`` (default: a directory of the
suite's own, made root's, 0755) and every directory above it must be root's and writable
by root alone: else the host is refused before anything is written, naming the directory
and its owner (pyinfra_vllm/plans/metrics.py ``textfile_dir_problem``). Debian's
/var/lib/prometheus/node-exporter is not: /var/lib/prometheus is prometheus's, which
could swap node-exporter for a symbolic link and steer root's writes to any file.

The checks preflight ran (OS, driver, GPUs, NVLink, and the model's architecture,
context length and capacity), the stack, and the capacity plan, as Prometheus gauges in
``{textfile_collector_dir}/pyinfra_vllm.prom`` (pyinfra_vllm/plans/textfile.py). node_exporter's
``--collector.textfile.directory`` reads it. A host a
stage refused gets no new file: alert on the file's age or on a missing series. A run
that reboots into a driver it installed leaves the file to the next run: its verdicts
were read before the reboot.

    pyinfra inventory.py deploys/metrics.py
"""

from __future__ import annotations

from pyinfra import host, logger
from pyinfra.facts.deb import DebPackage
from pyinfra.facts.systemd import SystemdStatus
from pyinfra.operations import systemd

from facts.files import FileDigests, PathComponents, PathTypes
from facts.units import UnitActivation
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.operations import file_set, units
from pyinfra_vllm.operations.util.packages import debian_package
from pyinfra_vllm.plans import bench as bench_plan
from pyinfra_vllm.plans import metrics as metrics_plan
from pyinfra_vllm.plans.engine_access import Endpoint
from pyinfra_vllm.plans.gates import model_gates
from pyinfra_vllm.plans.textfile import metrics_text
from pyinfra_vllm.report.verdicts import summarize
from pyinfra_vllm.run.context import HostContext
from pyinfra_vllm.run.host_reads import Read
from pyinfra_vllm.run.stage import stage


def node_exporter(port: int, textfile_dir: str) -> None:
    """node_exporter from the distribution, on loopback, with the suite's command line."""
    # Before the package: its postinst starts the service, which must already read this.
    override = file_set.present(
        name="Metrics: node_exporter on loopback, reading the suite's textfile directory",
        files={metrics_plan.DROP_IN: (
            metrics_plan.render_drop_in(port, textfile_dir).encode(), "644")},
    )
    debian_package("Metrics: prometheus-node-exporter installed", metrics_plan.PACKAGE)
    systemd.daemon_reload(name="Metrics: reload systemd units", _if=override.did_change)
    # A running node_exporter keeps its old command line until restarted.
    systemd.service(
        name="Metrics: restart node_exporter with its new command line",
        service=metrics_plan.UNIT,
        running=True,
        restarted=True,
        _if=override.did_change,
    )
    units.enabled_and_running(name="Metrics: node_exporter enabled and running",
                              unit=metrics_plan.UNIT)


def metrics_reads(settings: Settings, _place: Endpoint) -> list[Read]:
    """What the metrics stage reads of a converged host: the run's one read."""
    textfile = f"{settings.textfile_collector_dir}/{metrics_plan.TEXTFILE_NAME}"
    reads = [Read(PathTypes, {"paths": [metrics_plan.LEGACY_SCRAPE_JOB]}),
             Read(PathComponents, {"path": settings.textfile_collector_dir}),
             Read(FileDigests, {"paths": [textfile]})]
    if settings.node_exporter_install:
        # SystemdStatus: pyinfra's systemd.service of the restart reads it while the run
        # is planned (its _if is only asked when the run executes).
        reads += [Read(FileDigests, {"paths": [metrics_plan.DROP_IN]}),
                  Read(DebPackage, {"package": metrics_plan.PACKAGE}),
                  Read(SystemdStatus, {"services": [metrics_plan.UNIT]}),
                  Read(UnitActivation, {"unit": metrics_plan.UNIT})]
    return reads


@stage(reads=metrics_reads)
def metrics(ctx: HostContext) -> None:
    """Metrics: node_exporter on loopback, and this host's verdicts for its textfile
    collector."""
    problem = textfile_dir_problem(ctx.settings)
    if problem is not None:
        ctx.refuse("Metrics: host refused", [f"metrics: {problem}"])
        return
    if ctx.settings.node_exporter_install:
        node_exporter(ctx.settings.node_exporter_port, ctx.settings.textfile_collector_dir)
    file_set.absent(name="Metrics: no per-host scrape job (the operator's Prometheus "
                    "has the fleet's, from tools.scrape_config)",
                    paths=[metrics_plan.LEGACY_SCRAPE_JOB])
    if ctx.stale:
        # The verdicts would describe the host before its reboot into the new driver.
        host.log_styled("metrics: not written in a run that reboots into a new driver; the "
                        "next run writes them", fg="yellow", log_func=logger.warning)
        return
    _verdicts(ctx)


def textfile_dir_problem(settings: Settings) -> str | None:
    """Why root must not write node_exporter's textfiles in textfile_collector_dir on
    this host (``metrics_plan.textfile_dir_problem``), or None; None too where the metrics
    stage is skipped (nothing is written there then)."""
    if "metrics" in settings.skip_stages:
        return None
    path = settings.textfile_collector_dir
    return metrics_plan.textfile_dir_problem(path, host.get_fact(PathComponents, path=path))


def _verdicts(ctx: HostContext) -> None:
    """This host's checks, versions and capacity plan, for node_exporter's textfile
    collector."""
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
        "cuda_build": settings.stack.cuda or "none",
        "driver": driver or "none",
        "model": settings.model_id,
        "tensor_parallel_size": settings.tensor_parallel_size,
    }
    file_set.present(
        name="Metrics: verdicts for node_exporter's textfile collector",
        files={
            f"{settings.textfile_collector_dir}/{metrics_plan.TEXTFILE_NAME}": (
                (metrics_text(host.name, checks, info, capacity)
                 + bench_plan.thresholds_text(settings)).encode(),
                "644",
            )
        },
        parent_mode=metrics_plan.TEXTFILE_DIR_MODE,
    )
