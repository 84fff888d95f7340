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

from pyinfra_vllm.stacks import STACKS

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

    # Attribute docstrings become field descriptions: docs/settings.md's settings table
    # is generated from them (tests/unit/test_docs.py keeps the two in step).
    model_config = ConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)

    # --- stack and model -------------------------------------------------------------
    vllm_version: str = "0.6.3"
    """vLLM release; selects a row of pyinfra_vllm/stacks.py (Python, torch, CUDA build, minimum
    driver, companion pins). The seed's 0.6.3 cannot load Qwen3.6-27B: the compatibility
    gate says so before anything changes.
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
    GitHub vllm-project/vllm issue 8087); None leaves NCCL's own choice.
    """
    disable_custom_all_reduce: bool = False
    """--disable-custom-all-reduce (a workaround for TP hangs, GitHub vllm-project/vllm
    issue 8410)."""
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
    gateway_tls_cert: str | None = None
    """TLS for the gateway: a PEM certificate chain (the server's certificate first), a file
    on the operator's machine, installed as /etc/nginx/vllm-tls/cert.pem. Set with
    gateway_tls_key, or neither: nginx then speaks plain HTTP on gateway_port.
    """
    gateway_tls_key: str | None = None
    """The certificate's PEM private key, a file on the operator's machine that only its
    owner may read (chmod 600); installed as /etc/nginx/vllm-tls/key.pem (0600, root), never
    printed nor diffed. With both set nginx listens with TLS (1.2 and 1.3) on gateway_port.
    """
    gateway_http_redirect_port: int | None = Field(default=None, ge=1, le=65535)
    """With TLS: a plain HTTP port where every request gets a 301 to https on gateway_port
    and nothing else. A key sent there has already crossed the network in clear text:
    configure clients with the https:// URL; this only points lost ones the way.
    """

    @model_validator(mode="after")
    def _gateway_tls_files(self) -> Settings:
        # Imported here to keep this block self-contained.
        import stat
        from pathlib import Path

        cert, key = self.gateway_tls_cert, self.gateway_tls_key
        if (cert is None) != (key is None):
            raise ValueError("gateway_tls_cert and gateway_tls_key go together: set both or "
                             "neither")
        if self.gateway_http_redirect_port is not None:
            if cert is None:
                raise ValueError("gateway_http_redirect_port redirects to https: it needs "
                                 "gateway_tls_cert and gateway_tls_key")
            if self.gateway_http_redirect_port == self.gateway_port:
                raise ValueError("gateway_http_redirect_port must differ from gateway_port")
        if cert is None or key is None:
            return self
        for name, path, marker, what in (
            ("gateway_tls_cert", cert, "-----BEGIN CERTIFICATE-----", "certificate"),
            ("gateway_tls_key", key, "PRIVATE KEY-----", "private key"),
        ):
            try:
                text = Path(path).read_text(encoding="ascii", errors="replace")
                mode = Path(path).stat().st_mode
            except OSError as exc:
                raise ValueError(f"{name} {path}: cannot be read ({exc.strerror})") from None
            if marker not in text:
                raise ValueError(f"{name} {path}: holds no PEM {what}")
            if name == "gateway_tls_key" and mode & 0o077:
                raise ValueError(
                    f"gateway_tls_key {path}: mode {stat.S_IMODE(mode):04o} lets its group or "
                    "others at the private key; chmod 600 it"
                )
        return self

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
    def _driver_branch_serves_stack(self) -> Settings:
        # The driver stage installs this branch; a branch older than the stack's minimum
        # would install a driver the stack's CUDA build cannot use.
        if "driver" in self.skip_stages:
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
        return STACKS[self.vllm_version]

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
                    "--data KEY=VALUE; docs/settings.md lists every key with what it "
                    "allows.",
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
    """docs/settings.md's settings table: every key, its default, what it allows, its
    meaning."""
    rows = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        meaning = " ".join((field.description or "").split()).replace("|", "\\|")
        hint = (allowed(name) or "").removeprefix("allowed: ").replace("|", "\\|")
        rows.append(f"| `{name}` | {_default_words(name)} | {hint} | {meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(reference_markdown())
