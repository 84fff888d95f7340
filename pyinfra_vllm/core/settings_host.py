"""The host's settings: the stages it runs, its driver and kernel, the model's volume,
the Python environment, and where packages and the model come from (a section of
pyinfra_vllm/core/settings.py's Settings, where they are validated).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator

from pyinfra_vllm.core import (
    settings_checks,
    settings_checks_engine,
    settings_checks_keys,
    settings_checks_paths,
    settings_checks_sources,
)
from pyinfra_vllm.core.settings_docs import SettingsSection


class HostSettings(SettingsSection):
    """The host: its stages, driver and kernel, the model's volume, and where the
    environment and the model come from."""

    # --- host ------------------------------------------------------------------------
    skip_stages: list[str] = Field(default_factory=list)
    """Stages deploys/full.py skips, by name (see STAGES)."""
    min_gpu_memory_mib: int = Field(default=80000, ge=1)
    """Smallest memory per GPU, in MiB, preflight accepts: any 80 GB card. They report less
    than 80 x 1024: A100 80GB 81920 MiB, H100 80GB HBM3 81559 MiB (nvidia-smi on a real
    one); whether the model fits is the capacity planner's to say."""
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

    # --- rules of one setting (settings_checks* say what each allows) -----------------
    _revision = field_validator("model_revision")(settings_checks_engine.revision)
    _token_chars = field_validator("hf_token")(settings_checks_keys.token_chars)
    _token_file = field_validator("hf_token_file")(settings_checks_keys.token_file)
    _host_path = field_validator("model_dir", "python_env_root", "pip_ca_bundle")(
        settings_checks_paths.host_path
    )
    _device_path = field_validator("model_volume_device")(settings_checks_paths.device_path)
    _url = field_validator("pip_index_url", "http_proxy", "model_base_url")(
        settings_checks_sources.url
    )
    _no_credentials = field_validator("model_base_url")(settings_checks_sources.no_credentials)
    _apt_source = field_validator("nvidia_apt_repo")(settings_checks_sources.apt_source)
    _no_barrier_off = field_validator("model_volume_mount_options")(
        settings_checks_paths.no_barrier_off
    )
    _sysctl_keys = field_validator("sysctl")(settings_checks.sysctl_keys)
