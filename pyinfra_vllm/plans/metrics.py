"""node_exporter from the distribution, on loopback, reading the suite's textfile directory.

Debian's and Ubuntu's ``prometheus-node-exporter`` package (Ubuntu 22.04: 1.3.1, Debian
12: 1.5.0) runs ``/usr/bin/prometheus-node-exporter $ARGS`` as user prometheus, with
``EnvironmentFile=/etc/default/prometheus-node-exporter`` (a conffile, ``ARGS=""``): it
listens on ``:9100``, every address. The suite leaves that conffile alone (an edited
conffile makes every package upgrade ask) and replaces the command line in a drop-in of
its own, which systemd reads after the package's unit (systemd.unit(5), "drop-in"): an
empty ``ExecStart=`` clears the package's, the next one is the suite's.
"""

from __future__ import annotations

from pyinfra_vllm.core.templating import render

PACKAGE = "prometheus-node-exporter"
UNIT = "prometheus-node-exporter.service"
BINARY = "/usr/bin/prometheus-node-exporter"
DROP_IN = "/etc/systemd/system/prometheus-node-exporter.service.d/50-pyinfra-vllm.conf"
DROP_IN_TEMPLATE = "prometheus-node-exporter-override.conf.j2"
# The units whose state the alert rules read (node_systemd_unit_state); node_exporter
# anchors the expression itself (^(?:...)$). "[.]", not "\.": systemd would read a
# backslash in ExecStart= as an escape.
SYSTEMD_UNITS = "(vllm|nginx|nvidia-persistenced|prometheus-node-exporter)[.]service"
# The file the metrics stage writes in textfile_collector_dir.
TEXTFILE_NAME = "pyinfra_vllm.prom"
# The GPUs' health, written by preflight (before it may refuse the host, so that the
# alerts name a failing GPU): pyinfra_vllm/plans/textfile.py gpu_health_text.
HEALTH_TEXTFILE_NAME = "pyinfra_vllm_gpu_health.prom"


def health_textfile(textfile_dir: str) -> str:
    """Where preflight writes the GPUs' health for node_exporter's textfile collector."""
    return f"{textfile_dir}/{HEALTH_TEXTFILE_NAME}"


# Written by the gateway stage before the scrape job moved to the operator's side
# (python -m tools.scrape_config): nothing reads it any more; the metrics stage removes it.
LEGACY_SCRAPE_JOB = "/etc/prometheus/scrape.d/vllm.yml"


def render_drop_in(port: int, textfile_dir: str) -> str:
    """The drop-in: node_exporter on 127.0.0.1:``port`` with its textfile collector on
    ``textfile_dir`` and the systemd collector for SYSTEMD_UNITS."""
    return render(
        DROP_IN_TEMPLATE,
        binary=BINARY,
        listen=f"127.0.0.1:{port}",
        textfile_dir=textfile_dir,
        units=SYSTEMD_UNITS,
    )
