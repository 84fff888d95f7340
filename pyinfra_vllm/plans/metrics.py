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

from typing import Any

from pyinfra_vllm.core.settings import Settings
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


# The textfiles' directory the suite makes and owns: root's, 0755, every directory above
# it root's too (textfile_dir_problem), and node_exporter's --collector.textfile.directory.
TEXTFILE_DIR = Settings.model_fields["textfile_collector_dir"].default
TEXTFILE_DIR_MODE = "755"


def textfile_dir_problem(path: str, components: list[dict[str, Any]]) -> str | None:
    """Why root must not write node_exporter's textfiles in ``path``, from its components
    as facts.files.PathComponents reads them, or None. Root writes there (the metrics
    stage, preflight, the benchmark), so each directory from / down must be root's and
    writable by root alone: another account that owns or may write one could swap what
    is below it for a symbolic link and steer root's write to any file (Debian's
    prometheus-node-exporter makes /var/lib/prometheus prometheus's). A sticky one (/tmp)
    passes where the next directory exists (only an entry's owner renames it); missing
    ones below a safe directory are the suite's to make."""
    problem = None
    others_may_create = False
    for found in components:
        where, owner, kind = found["path"], found["owner"], found["kind"]
        if kind is None:
            if others_may_create:
                problem = f"{where} is missing in a directory others may write: one could make it first"
            break
        mode = int(found["mode"], 8)
        writable = bool(mode & 0o022)
        if kind == "link":
            problem = f"{where} is a symbolic link (owned by {owner})"
        elif kind != "directory":
            problem = f"{where} is not a directory"
        elif found["uid"] != 0:
            problem = f"{where} is owned by {owner}, who can swap what is in it for a symbolic link"
        elif writable and not mode & 0o1000:
            problem = f"{where} is writable by its group or others (mode {mode:04o})"
        if problem:
            break
        others_may_create = writable
    if problem is None:
        return None
    return (f"textfile_collector_dir {path}: {problem}, and so steer what root writes there "
            "(another file, or its mode); nothing is written there. Set "
            f"textfile_collector_dir to a directory of the suite's own (the default, "
            f"{TEXTFILE_DIR}: the metrics stage makes it root's, 0755, and points "
            "node_exporter at it), or make every directory of the path root's and "
            "writable by root alone (chown root:root DIR; chmod 755 DIR)")


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
