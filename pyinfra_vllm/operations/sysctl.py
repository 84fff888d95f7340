"""Kernel parameters: persisted in a sysctl.d drop-in, applied now, drift repaired per key.

pyinfra's ``server.sysctl(persist=True)`` appends a second line when a value changes
(its persist step is a ``files.line`` whose regex includes the value), so the drop-in is templated whole. Each key is then
compared with /proc/sys and only the keys that drifted are set with ``sysctl -w``. A
key this host cannot write (a container's read-only /proc/sys) is persisted and
reported, never claimed as applied, and never counted as a change.
"""

from __future__ import annotations

import logging
import posixpath
from typing import Any

import click
from pyinfra import host
from pyinfra.api import OperationValueError, QuoteString, StringCommand, operation

from facts.sysctl import KernelParam, normalize
from pyinfra_vllm.core.templating import render
from pyinfra_vllm.operations import file_set
from pyinfra_vllm.plans.sysctl import (
    TEMPLATE,
    plan_sysctl,
)

logger = logging.getLogger("pyinfra")

# (host name, key, reason) already warned about in this process: the prepare and the
# execute phase both run the operation, and the operator needs to read it once.
_WARNED: set[tuple[str, str, str]] = set()


def _warn(key: str, reason: str, path: str) -> None:
    marker = (host.name, key, reason)
    if marker in _WARNED:
        return
    _WARNED.add(marker)
    message = f"warning: sysctl {key} NOT applied ({reason}); persisted in {path} for the next boot"
    logger.warning("%s%s", host.print_prefix, click.style(message, fg="yellow"))


@operation()
def drop_in(params: dict[str, Any], path: str, template: str = TEMPLATE):
    """
    Persist kernel parameters in a sysctl.d drop-in and apply the ones that drifted.

    + params: ``{key: value}``, e.g. ``{"vm.swappiness": 1}``
    + path: the drop-in, e.g. ``/etc/sysctl.d/60-vllm.conf``
    + template: jinja2 template of the drop-in in the suite's ``templates/`` directory
      (gets ``params`` as (key, value) pairs); a path such as
      ``templates/sysctl-vllm.conf.j2`` names the file by its basename there

    The file is rewritten when it differs (a hand edit is undone). Each key whose running
    value differs is set with ``sysctl -w``; a key the host cannot write (read-only
    /proc/sys in a container) or does not know is reported as a warning naming it, is not
    applied and yields no command, so it never makes a run report a change.

    **Example:**

    .. code:: python

        sysctl.drop_in(
            name="Kernel parameters",
            params={"vm.swappiness": 1, "net.core.somaxconn": 65535},
            path="/etc/sysctl.d/60-vllm.conf",
        )
    """
    for key, value in params.items():
        if not key or "/" in key or any(char.isspace() for char in key) or "\n" in str(value):
            raise OperationValueError(f"{key!r} = {value!r} is not a sysctl setting")

    # Rendered here and kept by file_set.present (root:root 0644): one FileDigests read
    # instead of files.template's File, Directory and Sha1File facts.
    content = render(
        posixpath.basename(template),
        params=[(key, normalize(value)) for key, value in params.items()],
    )
    yield from file_set.present._inner(files={path: (content.encode(), "644")})

    current = {key: host.get_fact(KernelParam, key=key) for key in params}
    to_write, not_applied = plan_sysctl(params, current)
    for key, value in to_write:
        yield StringCommand("sysctl", "-w", QuoteString(f"{key}={value}"))
    for key, reason in not_applied.items():
        _warn(key, reason, path)
    if not_applied:
        host.noop(
            "not applied, persisted only: "
            + ", ".join(f"{key} ({reason})" for key, reason in not_applied.items())
        )
    elif not to_write:
        host.noop("every kernel parameter has its value")
