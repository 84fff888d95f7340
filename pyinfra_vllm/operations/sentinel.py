"""The sentinel's rotation flag, given back when the sentinel is turned off.

The flag (the gateway's ROTATION_FLAG) is shared: python -m tools.tune holds it too, empty.
Only a flag holding the sentinel's word is the sentinel's to remove.
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation

from facts.sentinel import SentinelState
from pyinfra_vllm.plans import sentinel as sentinel_plan
from pyinfra_vllm.plans.gateway import ROTATION_FLAG


@operation()
def rotation_flag_released():
    """
    Remove the rotation flag where the sentinel placed it (it holds ``sentinel``); a flag
    of another owner (tools.tune's) stays. No sentinel flag: no command.
    """
    found = host.get_fact(SentinelState, **sentinel_plan.STATE_READ)
    if (found or {}).get("rotation") != "sentinel":
        host.noop("no rotation flag of the sentinel's")
        return
    # Checked again on the host: the flag may have changed owner since it was read.
    flag = QuoteString(ROTATION_FLAG)
    yield StringCommand("if grep -qx sentinel", flag, "2>/dev/null; then rm -f --", flag,
                        "; fi")
