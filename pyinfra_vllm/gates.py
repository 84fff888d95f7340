"""Gates on the model, judged before the server is configured: can the stack's vLLM load
its architecture, does ``max_model_len`` fit the GPUs, is it within the model's limit.

Pure functions over the settings, the model lock (which carries config.json), the
host's collected state and, when the host already has the stack's environment, the
model registry read from it. Preflight refuses on them; the audit shows them.
"""

from __future__ import annotations

from typing import Any

from pyinfra_vllm.capacity import plan, text_config
from pyinfra_vllm.checks import check
from pyinfra_vllm.compat import check_architecture
from pyinfra_vllm.locks import safetensors_bytes
from pyinfra_vllm.settings import Settings


def gpu_memory_mib(state: dict[str, Any], settings: Settings) -> int:
    """The smallest memory among the GPUs the server uses; the setting without GPUs."""
    gpus = (state.get("gpus") or [])[: settings.tensor_parallel_size]
    sizes = [g["memory_total_mib"] for g in gpus if g.get("memory_total_mib")]
    return min(sizes) if sizes else settings.min_gpu_memory_mib


def check_context_length(config: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """vLLM refuses a max_model_len above the model's max_position_embeddings."""
    limit = text_config(config).get("max_position_embeddings") or config.get(
        "max_position_embeddings"
    )
    if not limit:
        return check("context_length", None, "config.json states no max_position_embeddings",
                     severity="warning")
    ok = settings.max_model_len <= limit
    return check(
        "context_length",
        ok,
        f"max_model_len {settings.max_model_len}; the model's max_position_embeddings is "
        f"{limit}",
        "" if ok else f"lower max_model_len to {limit} or less",
    )


def model_gates(
    settings: Settings,
    lock: dict[str, Any],
    state: dict[str, Any],
    registry: list[str] | None = None,
) -> dict[str, Any]:
    """The model's checks (architecture, context length, capacity) and the memory plan."""
    config = lock["config"]
    try:
        capacity = plan(
            config,
            dtype=settings.dtype,
            tensor_parallel_size=settings.tensor_parallel_size,
            gpu_memory_mib=gpu_memory_mib(state, settings),
            gpu_memory_utilization=settings.gpu_memory_utilization,
            max_model_len=settings.max_model_len,
            block_size=settings.block_size,
            weights_bytes=safetensors_bytes(lock),
        )
        capacity_check = capacity["check"]
    except (KeyError, ValueError, TypeError, ZeroDivisionError) as exc:
        # A config.json without the fields the planner reads (not a decoder LLM, or a
        # layout it does not know): not judged, said so, never a crash of the run.
        words = f"config.json cannot be planned: {type(exc).__name__}: {exc}"
        capacity = {"error": words}
        capacity_check = check("capacity", None, words, severity="warning")
    checks = [
        check_architecture(config, settings.stack, registry, settings.model_id),
        check_context_length(config, settings),
        capacity_check,
    ]
    return {"checks": checks, "capacity": capacity}


def installed_registry(environments: dict[str, Any], path: str) -> list[str] | None:
    """The model registry of the environment at ``path``, when it was built and proven."""
    marker = ((environments.get("envs") or {}).get(path) or {}).get("marker") or {}
    archs = (marker.get("runtime") or {}).get("architectures")
    return list(archs) if isinstance(archs, list) else None
