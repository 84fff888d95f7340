"""Persistence mode, held by the nvidia-persistenced daemon and checked on every GPU.

NVIDIA recommends persistence mode on servers, through the daemon rather than the
deprecated legacy mode. Ubuntu's packaged unit starts the daemon with
``--no-persistence-mode`` (the daemon runs, persistence stays off), so the deploy
overrides ExecStart the way NVIDIA's own ansible-role-nvidia-driver does, and this
operation sets and verifies the mode GPU by GPU (``nvidia-smi -pm`` talks to the daemon
when it runs).
"""

from __future__ import annotations

import logging

from pyinfra import host
from pyinfra.api import FunctionCommand, QuoteString, StringCommand, operation

from facts.gpus import GpuInventory
from pyinfra_vllm.plans.persistence import (
    PERSISTENCED_UNIT,
)

logger = logging.getLogger("pyinfra")


def _verify_persistence(state, host, indices: list[int], wanted: str) -> bool:
    gpus = {gpu["index"]: gpu for gpu in host.get_fact(GpuInventory) or []}
    wrong = [
        index for index in indices if (gpus.get(index) or {}).get("persistence_mode") != wanted
    ]
    for index in wrong:
        shown = (gpus.get(index) or {}).get("persistence_mode")
        host.log_styled(
            f"persistence mode is {shown} on GPU {index}, wanted {wanted}, after "
            f"nvidia-smi -pm: check `systemctl status {PERSISTENCED_UNIT}` and "
            f"`journalctl -u {PERSISTENCED_UNIT}`",
            fg="red",
            log_func=logger.error,
        )
    return not wrong


@operation()
def persistence_mode(enabled: bool = True):
    """
    Set persistence mode on every GPU and verify it.

    + enabled: persistence mode wanted (True: Enabled, False: Disabled)

    GPUs already in the wanted mode: no command. Otherwise ``nvidia-smi -i N -pm 1|0``
    per GPU, then a check that fails the host with a readable message when a GPU still
    shows the other mode.

    **Example:**

    .. code:: python

        persistence.persistence_mode(name="Persistence mode on", enabled=True)
    """
    wanted = "Enabled" if enabled else "Disabled"
    gpus = host.get_fact(GpuInventory)
    if gpus is None:
        host.noop("no NVIDIA driver answers nvidia-smi; persistence mode is checked once it does")
        return
    wrong = sorted(
        gpu["index"] for gpu in gpus if gpu.get("persistence_mode") not in (wanted, None)
    )
    if not wrong:
        host.noop(f"persistence mode is {wanted} on every GPU")
        return
    for index in wrong:
        yield StringCommand(
            "nvidia-smi", "-i", QuoteString(str(index)), "-pm", "1" if enabled else "0"
        )
    yield FunctionCommand(_verify_persistence, (wrong, wanted), {})
