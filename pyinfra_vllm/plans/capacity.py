"""Capacity planner: does ``max_model_len`` fit on the GPUs, computed from config.json.

Pure arithmetic over the model's ``config.json`` (a dict) and the engine settings; no
host access. ``plan`` returns the numbers and a check dict (``pyinfra_vllm.plans.checks`` shape)
that refuses when not even one ``max_model_len`` sequence fits next to the weights.

Formulas (per GPU, tensor parallel size ``tp``):

* KV cache per token = 2 (K and V) x full-attention layers x KV heads x head_dim x
  dtype bytes (vLLM's ``get_kv_cache_spec``: a FullAttentionSpec per attention layer).
  KV heads are split over the TP ranks, at least one per rank (vLLM replicates KV heads
  when ``num_key_value_heads < tp``: ``ModelConfig.get_num_kv_heads``).
* Hybrid models (Qwen3.5/3.6 ``qwen3_5``, Qwen3-Next): only ``full_attention`` layers
  keep a KV cache. Each ``linear_attention`` (Gated DeltaNet) layer keeps a fixed state
  per sequence, whatever its length (vLLM 0.17.0
  ``MambaStateShapeCalculator.gated_delta_net_state_shape``):
  conv state = (linear_conv_kernel_dim - 1) x (2 x linear_num_key_heads x
  linear_key_head_dim + linear_num_value_heads x linear_value_head_dim) / tp elements of
  the model dtype; recurrent state = linear_num_value_heads / tp x linear_value_head_dim
  x linear_key_head_dim elements of ``mamba_ssm_dtype`` from config.json when set (vLLM
  0.17.0 ``models/config.py`` copies it into ``mamba_ssm_cache_dtype``; Qwen3.6 sets
  float32), else the model dtype.
* Layer types: ``layer_types`` when present, else every ``full_attention_interval``-th
  layer is full attention (default 4 for qwen3_5/qwen3_next: vLLM 0.17.0
  ``transformers_utils/configs/qwen3_5.py``), else every layer.
* ``text_config`` holds the language model of ConditionalGeneration configs.
* A sequence's KV is allocated in whole blocks: max_model_len rounds up to block_size.

Reserve: vLLM's budget is ``gpu_memory_utilization`` x total memory, and from it the
weights, the peak activations of its profiling forward pass and non-PyTorch memory
(CUDA context, cuBLAS workspaces, NCCL buffers, CUDA graphs) are taken before the KV
cache gets the rest (vLLM ``Worker.determine_num_available_blocks``). The planner runs
before the model ever loaded, so it holds back a fixed RESERVE_BYTES per GPU instead of
the profiled peak.
"""

from __future__ import annotations

from typing import Any

GIB = 1024**3
MIB = 1024**2

# 3 GiB per GPU, held back for what vLLM measures at start-up and we cannot:
# ~0.5-1 GiB CUDA context + cuBLAS/cuBLASLt workspaces (outside the PyTorch allocator,
# counted by vLLM as non-torch memory), ~0.5 GiB NCCL/custom all-reduce buffers for TP,
# ~1 GiB activation peak of a 4096-8192-token profiling pass at hidden size 5120
# (sampled-token logits over a 248K vocabulary in fp32 included), ~1 GiB CUDA graph
# pools when enforce_eager is off, as it is by default on cuda. The same reserve either
# way: the planner never reads enforce_eager. Measured (vLLM 0.22.0, one H200, tensor
# parallel 1: bench/gpu_engine.md), vLLM held back 1.8 GiB beside the weights eager and
# 4.1 GiB with CUDA graphs and torch.compile (0.93 GiB of graph pools); the planner's KV
# tokens were 0.4% and 3.4% above theirs, the whole sequences the same. A wrong guess
# shows up as a few percent more or fewer sequences than vLLM later reports
# (its log: "# GPU blocks"), never as a refusal of a setting that fits by a wide margin.
RESERVE_BYTES = 3 * GIB

DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float": 4,
    "float32": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

# Model types whose configs default to hybrid layers when layer_types is missing.
HYBRID_DEFAULT_INTERVAL = {"qwen3_5": 4, "qwen3_5_text": 4, "qwen3_next": 4}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: ``text_config`` when nested (ConditionalGeneration)."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def dtype_bytes(dtype: str, config: dict[str, Any]) -> int:
    """Bytes per element; "auto" takes the config's own dtype (bf16 when it names none)."""
    if dtype == "auto":
        text = text_config(config)
        dtype = str(
            text.get("dtype") or text.get("torch_dtype") or config.get("torch_dtype")
            or "bfloat16"
        )
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def layer_types(config: dict[str, Any]) -> list[str]:
    """'full_attention' or 'linear_attention' for every layer."""
    text = text_config(config)
    count = int(text["num_hidden_layers"])
    explicit = text.get("layer_types")
    if isinstance(explicit, list) and len(explicit) == count:
        return [str(t) for t in explicit]
    interval = text.get("full_attention_interval")
    if interval is None:
        interval = HYBRID_DEFAULT_INTERVAL.get(str(text.get("model_type")))
    if not interval:
        return ["full_attention"] * count
    # Same rule as vLLM's Qwen3_5TextConfig: layer i is full when (i + 1) % interval == 0.
    return [
        "full_attention" if (i + 1) % int(interval) == 0 else "linear_attention"
        for i in range(count)
    ]


def attention_shape(config: dict[str, Any]) -> tuple[int, int, int]:
    """(num_attention_heads, num_key_value_heads, head_dim)."""
    text = text_config(config)
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    return heads, kv_heads, head_dim


def kv_heads_per_gpu(kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads each TP rank stores: split evenly, replicated when fewer than ranks."""
    return max(1, kv_heads // tensor_parallel_size)


def linear_state_bytes(config: dict[str, Any], tensor_parallel_size: int, elem: int) -> int:
    """Gated DeltaNet state of one sequence in ONE linear-attention layer, per GPU."""
    text = text_config(config)
    k_heads = int(text.get("linear_num_key_heads") or 0)
    v_heads = int(text.get("linear_num_value_heads") or 0)
    k_dim = int(text.get("linear_key_head_dim") or 0)
    v_dim = int(text.get("linear_value_head_dim") or 0)
    kernel = int(text.get("linear_conv_kernel_dim") or 0)
    if not (k_heads and v_heads and k_dim and v_dim and kernel):
        return 0
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    conv = max(kernel - 1, 0) * (conv_dim // tensor_parallel_size) * elem
    ssm_dtype = text.get("mamba_ssm_dtype")
    ssm_elem = DTYPE_BYTES.get(str(ssm_dtype), elem) if ssm_dtype else elem
    recurrent = (v_heads // tensor_parallel_size) * v_dim * k_dim * ssm_elem
    return conv + recurrent


def estimate_parameters(config: dict[str, Any]) -> int:
    """Rough parameter count of the language model (dense or MoE; no vision tower).

    Used only when no lock gives the real safetensors sizes. Counts embeddings, lm_head
    (unless tied), attention (Qwen3.5's gated q_proj doubles q when attn_output_gate),
    Gated DeltaNet projections, and SwiGLU MLPs; norms and biases are ignored (< 0.1%).
    """
    text = text_config(config)
    hidden = int(text["hidden_size"])
    vocab = int(text.get("vocab_size") or config.get("vocab_size") or 0)
    heads, kv_heads, head_dim = attention_shape(config)
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    total = vocab * hidden * (1 if tied else 2)
    q_out = heads * head_dim * (2 if text.get("attn_output_gate") else 1)
    full = hidden * q_out + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    k_heads = int(text.get("linear_num_key_heads") or 0)
    v_heads = int(text.get("linear_num_value_heads") or 0)
    k_dim = int(text.get("linear_key_head_dim") or 0)
    v_dim = int(text.get("linear_value_head_dim") or 0)
    # in_proj_qkv + in_proj_z + in_proj_a/b + out_proj (vLLM qwen3_5.py names).
    linear = hidden * (2 * k_heads * k_dim + v_heads * v_dim) + hidden * v_heads * v_dim
    linear += 2 * hidden * v_heads + v_heads * v_dim * hidden
    experts = int(text.get("num_experts") or 0)
    if experts:
        moe = int(text.get("moe_intermediate_size") or 0)
        shared = int(text.get("shared_expert_intermediate_size") or 0)
        mlp = 3 * hidden * (experts * moe + shared) + hidden * experts
    else:
        mlp = 3 * hidden * int(text["intermediate_size"])
    for kind in layer_types(config):
        total += (full if kind == "full_attention" else linear) + mlp
    return total


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _gib(value: float) -> str:
    return f"{value / GIB:.2f} GiB"


def plan(
    config: dict[str, Any],
    *,
    dtype: str = "bfloat16",
    tensor_parallel_size: int = 2,
    gpu_memory_mib: int = 81920,
    gpu_memory_utilization: float = 0.92,
    max_model_len: int = 131072,
    block_size: int = 16,
    weights_bytes: int | None = None,
    reserve_bytes: int = RESERVE_BYTES,
) -> dict[str, Any]:
    """Memory plan of one model on ``tensor_parallel_size`` GPUs; see the module doc.

    ``weights_bytes``: total size of the safetensors files (from the model lock); when
    None, parameters are estimated from config.json. "Sequences" are full
    ``max_model_len`` sequences held at once by the TP group (each is split over its
    GPUs, so per-GPU and per-group counts are the same number).
    """
    tp = tensor_parallel_size
    elem = dtype_bytes(dtype, config)
    cache = _cache_per_sequence(config, tp, elem, max_model_len, block_size)
    if weights_bytes is None:
        weights_total, weights_source = estimate_parameters(config) * elem, "estimate"
    else:
        weights_total, weights_source = int(weights_bytes), "lock"
    # Column/row-parallel layers split the weights evenly over the ranks; the small
    # replicated parts (norms) are ignored.
    weights_gpu = weights_total // tp
    budget = int(gpu_memory_mib * MIB * gpu_memory_utilization)
    result = {
        "model_type": text_config(config).get("model_type") or config.get("model_type"),
        "architectures": config.get("architectures") or [],
        "dtype_bytes": elem,
        "tensor_parallel_size": tp,
        **cache,
        "weights_bytes": weights_total,
        "weights_source": weights_source,
        "weights_bytes_per_gpu": weights_gpu,
        "gpu_budget_bytes": budget,
        "reserve_bytes": reserve_bytes,
        **_what_fits(cache, budget - weights_gpu - reserve_bytes, block_size),
    }
    result["check"] = capacity_check(result, gpu_memory_mib, gpu_memory_utilization)
    return result


def _cache_per_sequence(config: dict[str, Any], tp: int, elem: int, max_model_len: int,
                        block_size: int) -> dict[str, int]:
    """What the engine keeps per sequence: the layers' shape, the KV cache per token and
    per max_model_len sequence (whole, and per GPU), and the linear-attention layers'
    fixed state per GPU."""
    kinds = layer_types(config)
    full_layers = kinds.count("full_attention")
    linear_layers = kinds.count("linear_attention")
    _, kv_heads, head_dim = attention_shape(config)
    kv_token = 2 * full_layers * kv_heads * head_dim * elem
    kv_token_gpu = 2 * full_layers * kv_heads_per_gpu(kv_heads, tp) * head_dim * elem
    tokens = _round_up(max_model_len, block_size)
    return {
        "layers": len(kinds),
        "full_attention_layers": full_layers,
        "linear_attention_layers": linear_layers,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "kv_bytes_per_token": kv_token,
        "kv_bytes_per_token_per_gpu": kv_token_gpu,
        "max_model_len": max_model_len,
        "kv_bytes_per_sequence": kv_token * tokens,
        "kv_bytes_per_sequence_per_gpu": kv_token_gpu * tokens,
        "linear_state_bytes_per_sequence_per_gpu": (
            linear_layers * linear_state_bytes(config, tp, elem)
        ),
    }


def _what_fits(cache: dict[str, int], free: int, block_size: int) -> dict[str, int]:
    """What a GPU's KV budget (``free``: its budget less the weights and the reserve)
    holds: whole max_model_len sequences at once, and the longest one sequence alone."""
    state_gpu = cache["linear_state_bytes_per_sequence_per_gpu"]
    per_seq_gpu = cache["kv_bytes_per_sequence_per_gpu"] + state_gpu
    kv_token_gpu = cache["kv_bytes_per_token_per_gpu"]
    sequences = max(free, 0) // per_seq_gpu if per_seq_gpu else 0
    fit_tokens = max(free - state_gpu, 0) // kv_token_gpu if kv_token_gpu else 0
    return {
        "kv_budget_bytes_per_gpu": max(free, 0),
        "sequences": int(sequences),
        "max_model_len_that_fits": int((fit_tokens // block_size) * block_size),
    }


def capacity_check(p: dict[str, Any], gpu_memory_mib: int, utilization: float) -> dict[str, Any]:
    """Refuse when not even one max_model_len sequence fits; show the arithmetic."""
    numbers = (
        f"per GPU: budget {_gib(p['gpu_budget_bytes'])} ({gpu_memory_mib} MiB x "
        f"{utilization}) - weights {_gib(p['weights_bytes_per_gpu'])} "
        f"({p['weights_source']}) - reserve {_gib(p['reserve_bytes'])} = "
        f"{_gib(p['kv_budget_bytes_per_gpu'])} for the KV cache; one "
        f"{p['max_model_len']}-token sequence needs {_gib(p['kv_bytes_per_sequence_per_gpu'])} "
        f"KV ({p['kv_bytes_per_token_per_gpu']} B/token: {p['full_attention_layers']} "
        f"attention layers x {p['num_kv_heads']} KV heads x {p['head_dim']} x 2 x "
        f"{p['dtype_bytes']} B / TP {p['tensor_parallel_size']})"
    )
    if p["linear_state_bytes_per_sequence_per_gpu"]:
        numbers += (
            f" + {p['linear_state_bytes_per_sequence_per_gpu'] / MIB:.1f} MiB linear-attention "
            f"state ({p['linear_attention_layers']} layers)"
        )
    ok = p["sequences"] >= 1
    if ok:
        detail = f"{p['sequences']} sequence(s) of {p['max_model_len']} tokens fit; {numbers}"
        return {"name": "capacity", "ok": True, "severity": "error", "detail": detail,
                "fix": ""}
    fit = p["max_model_len_that_fits"]
    fix = (
        f"lower max_model_len to {fit} or less, or raise gpu_memory_utilization or "
        "tensor_parallel_size"
        if fit > 0
        else "the weights alone leave no room: raise tensor_parallel_size or use GPUs "
        "with more memory"
    )
    detail = f"max_model_len {p['max_model_len']} does not fit: {numbers}"
    return {"name": "capacity", "ok": False, "severity": "error", "detail": detail, "fix": fix}
