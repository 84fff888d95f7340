"""Stop a host, with its reasons, without stopping the others.

pyinfra aborts the whole run when deploy code raises, which is right for bad settings
(an operator error, the same on every host) and wrong for one host's state (a missing
NVLink bridge on one server must not hold up the fleet). ``refuse`` turns a host's
problems into one failing operation: the host is marked failed, its later operations
are skipped, the other hosts go on. Every reason is logged once, in red: a stage's while
the run is planned (``HostContext.refuse``, pyinfra_vllm/run/context.py, which also
records the refusal for the audit), one made inside another operation when it runs.
"""

from __future__ import annotations

import logging

from pyinfra.api import FunctionCommand, operation

from pyinfra_vllm.operations.util.refusals import logged_reasons

logger = logging.getLogger("pyinfra")

def _refuse(state, host, reasons: list[str]) -> bool:
    # A refusal made inside another operation (MIG, the model volume) logs its reasons
    # here, once, when it runs; a stage's were logged while the run was planned.
    logged = logged_reasons(host)
    for reason in reasons:
        if reason not in logged:
            host.log_styled(reason, fg="red", log_func=logger.error)
    # False fails the operation, and with it this host, and nothing else.
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
