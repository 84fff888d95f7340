"""Gates on the model, judged before the server is configured: can the stack's vLLM load
its architecture, does ``max_model_len`` fit the GPUs, is it within the model's limit.

Pure functions over the settings, the model lock (which carries config.json), the
host's collected state and, when the host already has the stack's environment, the
model registry read from it. Preflight refuses on them; the audit shows them.
"""

from __future__ import annotations

from typing import Any

from pyinfra_vllm.core.locks import safetensors_bytes
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.core.stacks import StackRow
from pyinfra_vllm.plans.capacity import MIB, attention_shape, dtype_bytes, plan, text_config
from pyinfra_vllm.plans.checks import check, cpu_reserve_bytes
from pyinfra_vllm.plans.compat import check_architecture


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


def cpu_plan(config: dict[str, Any], settings: Settings, state: dict[str, Any],
             weights_bytes: int | None) -> dict[str, Any]:
    """vllm_device "cpu": the capacity plan. vLLM's CPU build gives each worker a KV cache
    of VLLM_CPU_KVCACHE_SPACE (vllm_cpu_kvcache_space_gib) whatever the weights take
    (vllm/v1/worker/cpu_worker.py determine_available_memory), so the KV arithmetic is
    the GPU planner's with that budget; the host's memory must then hold the weights (in
    the engine's dtype), every worker's KV cache and the engine's processes."""
    tp = settings.tensor_parallel_size
    kv_bytes = settings.vllm_cpu_kvcache_space_gib * 1024**3
    p = plan(config, dtype=settings.dtype, tensor_parallel_size=tp,
             gpu_memory_mib=kv_bytes // MIB, gpu_memory_utilization=1.0,
             max_model_len=settings.max_model_len, block_size=settings.block_size,
             weights_bytes=0, reserve_bytes=0)
    if weights_bytes is None:
        weights = plan(config, dtype=settings.dtype, tensor_parallel_size=tp)["weights_bytes"]
        source = "estimate"
    else:
        # The checkpoint's dtype, converted to the engine's (bf16 -> float32 doubles it).
        weights = weights_bytes * dtype_bytes(settings.dtype, config) // dtype_bytes("auto", config)
        source = "lock"
    reserve = cpu_reserve_bytes(tp)
    total_mib = (state.get("cpu") or {}).get("memory_total_mib")
    need = weights + tp * kv_bytes + reserve
    p.update(weights_bytes=weights, weights_source=source, weights_bytes_per_gpu=weights // tp,
             reserve_bytes=reserve, memory_needed_bytes=need, memory_total_mib=total_mib)
    kv = (f"each of {tp} CPU worker(s) has a {settings.vllm_cpu_kvcache_space_gib} GiB KV cache "
          f"(vllm_cpu_kvcache_space_gib); one {p['max_model_len']}-token sequence needs "
          f"{p['kv_bytes_per_sequence_per_gpu'] / MIB:.1f} MiB of it "
          f"({p['kv_bytes_per_token_per_gpu']} B/token)")
    memory = (f"memory: weights {weights / MIB:.0f} MiB ({source}, {settings.dtype}) + KV "
              f"{tp} x {settings.vllm_cpu_kvcache_space_gib} GiB + {reserve / 1024**3:g} GiB for "
              f"the engine's {tp + 2} processes = {need // MIB} MiB of "
              + (f"the host's {total_mib} MiB" if total_mib else "an unread host memory"))
    if p["sequences"] < 1:
        fit = p["max_model_len_that_fits"]
        p["check"] = check(
            "capacity", False, f"max_model_len {p['max_model_len']} does not fit: {kv}; {memory}",
            f"lower max_model_len to {fit} or less, or raise vllm_cpu_kvcache_space_gib"
            if fit > 0 else "raise vllm_cpu_kvcache_space_gib")
    elif total_mib is not None and need > total_mib * MIB:
        p["check"] = check(
            "capacity", False, f"the host's memory is too small: {memory}; {kv}",
            "lower vllm_cpu_kvcache_space_gib or tensor_parallel_size, or use a host with "
            "more memory")
    else:
        p["check"] = check(
            "capacity", True if total_mib is not None else None,
            f"{p['sequences']} sequence(s) of {p['max_model_len']} tokens fit: {kv}; {memory}")
    return p


def check_cpu_head_size(config: dict[str, Any], stack: StackRow) -> dict[str, Any]:
    """The CPU attention backend knows a fixed set of head sizes (the stack's)."""
    _, _, head_dim = attention_shape(config)
    sizes = stack.head_sizes
    ok = head_dim in sizes
    return check(
        "cpu_head_size", ok,
        f"head_dim {head_dim}; vLLM's CPU attention supports {', '.join(map(str, sizes))}",
        "" if ok else "serve this model on GPUs (vllm_device cuda)",
    )


def model_gates(
    settings: Settings,
    lock: dict[str, Any],
    state: dict[str, Any],
    registry: list[str] | None = None,
) -> dict[str, Any]:
    """The model's checks (architecture, context length, capacity) and the memory plan."""
    config = lock["config"]
    if settings.vllm_device == "cpu":
        return _cpu_model_gates(settings, lock, state, registry)
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


def _cpu_model_gates(settings: Settings, lock: dict[str, Any], state: dict[str, Any],
                     registry: list[str] | None) -> dict[str, Any]:
    config = lock["config"]
    checks = [check_architecture(config, settings.stack, registry, settings.model_id),
              check_context_length(config, settings)]
    try:
        capacity = cpu_plan(config, settings, state, safetensors_bytes(lock))
        checks += [check_cpu_head_size(config, settings.stack), capacity["check"]]
    except (KeyError, ValueError, TypeError, ZeroDivisionError) as exc:
        words = f"config.json cannot be planned: {type(exc).__name__}: {exc}"
        capacity = {"error": words}
        checks.append(check("capacity", None, words, severity="warning"))
    return {"checks": checks, "capacity": capacity}


def installed_registry(environments: dict[str, Any], path: str) -> list[str] | None:
    """The model registry of the environment at ``path``, when it was built and proven."""
    marker = ((environments.get("envs") or {}).get(path) or {}).get("marker") or {}
    archs = (marker.get("runtime") or {}).get("architectures")
    return list(archs) if isinstance(archs, list) else None
