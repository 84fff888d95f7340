"""Stop a host, with its reasons, without stopping the others.

pyinfra aborts the whole run when deploy code raises, which is right for bad settings
(an operator error, the same on every host) and wrong for one host's state (a missing
NVLink bridge on one server must not hold up the fleet). ``refuse`` turns a host's
problems into one failing operation: the host is marked failed, its later operations
are skipped, the other hosts go on. The stages refuse through
``HostContext.refuse`` (pyinfra_vllm/run/context.py), which logs the reasons in red
while the run is planned and records the refusal for the audit.
"""

from __future__ import annotations

from pyinfra.api import FunctionCommand, operation


def _refuse(state, host, reasons: list[str]) -> bool:
    # The reasons were logged while the run was planned (HostContext.refuse), so that a
    # dry run and the audit show them too. False fails the operation, and with it this
    # host, and nothing else.
    return False


@operation(is_idempotent=False)
def refuse(reasons: list[str]):
    """
    Fail this host with the given reasons; change nothing on it.

    + reasons: one sentence per problem: what is wrong and what to do about it

    **Example:**

    .. code:: python

        gate.refuse(
            name="Preflight",
            reasons=["GPU0-GPU1 PHB: no NVLink; fit the bridge"],
        )
    """
    yield FunctionCommand(_refuse, (list(reasons),), {})
