"""Which GPUs need MIG turned off, and which of them a process holds (pure functions of
facts.gpus; pyinfra_vllm/operations/mig.py turns it off)."""

from __future__ import annotations

from typing import Any

VLLM_UNIT = "vllm.service"


def mig_disabled_on(gpu: dict[str, Any]) -> bool:
    """Is MIG off on this GPU, now and after the next reset? (None: no MIG support.)"""
    return gpu.get("mig_current") != "Enabled" and gpu.get("mig_pending") != "Enabled"


def plan_mig(gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps that turn MIG off: ``[{"index", "uuid", "set_pending", "reset"}]``.

    ``set_pending``: the pending mode is not Disabled (``-mig 0`` is needed);
    ``reset``: the current mode is Enabled (only a reset, or a reboot, applies it).
    """
    steps = []
    for gpu in sorted(gpus, key=lambda g: g["index"]):
        if mig_disabled_on(gpu):
            continue
        steps.append(
            {
                "index": gpu["index"],
                "uuid": gpu.get("uuid"),
                "set_pending": gpu.get("mig_pending") != "Disabled",
                "reset": gpu.get("mig_current") == "Enabled",
            }
        )
    return steps


def busy_gpus(
    steps: list[dict[str, Any]],
    processes: list[dict[str, Any]] | None,
    ignore_pids: list[int] | None = None,
) -> dict[int, list[int]]:
    """``{gpu index: [pids]}`` of processes, other than ``ignore_pids``, on planned GPUs."""
    ignored = set(ignore_pids or [])
    busy: dict[int, list[int]] = {}
    for step in steps:
        pids = sorted(
            proc["pid"]
            for proc in processes or []
            if proc.get("gpu_uuid") == step["uuid"] and proc["pid"] not in ignored
        )
        if pids:
            busy[step["index"]] = pids
    return busy


def busy_reason(busy: dict[int, list[int]], processes: list[dict[str, Any]] | None) -> str:
    names = {proc["pid"]: proc.get("process_name") or "?" for proc in processes or []}
    parts = [
        f"GPU {index}: " + ", ".join(f"pid {pid} ({names.get(pid, '?')})" for pid in pids)
        for index, pids in sorted(busy.items())
    ]
    return (
        "MIG is enabled and the GPU is in use by processes that are not ours ("
        + "; ".join(parts)
        + "); nothing was changed: stop them and re-run (a GPU in use is never reset)"
    )
