"""A host the whole run has converged, as its facts read, for the stage-reads test
(tests/unit/test_stage_reads.py): every value what a host that the settings' run left in
place returns, so that planning it changes nothing and takes the path of a converged
host, which is the path the stages' declared reads describe.

The GPUs are a real four-GPU A100 80GB PCIe server's topology (NVLink bridges between
pairs, tests/fixtures/nvidia/topo-4xA100-pcie-80gb-NV12-bridged-pairs-01.txt) on the
settings' driver branch; the environment is the stack's proven one, its marker the
recorded probe of the stack where the repository has one (tests/fixtures/vllm-*/), else
the flags of the server's recorded ``--help``. The files the suite writes (units,
drop-ins, helpers, the nginx site) are in place with the content the operations would
write: the operations that write them tell it (``ConvergedHost.learn``), when they are
called, before they read the host.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api import FactBase
from pyinfra.facts.deb import DebPackage
from pyinfra.facts.files import Directory, Link, Sha1File
from pyinfra.facts.server import KernelVersion, LinuxDistribution
from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus

from facts.accounts import Account
from facts.bench import BenchRecord
from facts.cpu_host import CpuHostState
from facts.cuda import CudaToolkit
from facts.driver import (
    DriverInfo,
    DriverPackages,
    HeldPackages,
    KernelModule,
    NvmlError,
)
from facts.files import FileDigests, PathComponents, PathModes, PathTypes
from facts.gpu_health import GpuHealth, NvlinkErrors, XidEvents
from facts.gpu_host import GpuHostState
from facts.gpus import GpuComputeCapability, GpuInventory, GpuProcesses
from facts.model import ModelContent, ModelFiles
from facts.nginx import NginxServers
from facts.python_env import EnvironmentContent, VllmEnvironments
from facts.sentinel import SentinelState
from facts.storage import BlockDevice, FilesystemSize, Fstab, MountPoint
from facts.sysctl import KernelParam, normalize
from facts.topology import GpuTopology, NvlinkStatus, parse_topology
from facts.units import UnitActivation, UnitDropIns
from facts.vllm_service import (
    EngineFirewall,
    EngineHealth,
    EngineKey,
    EngineProcess,
    EngineServing,
)
from files.vllm_probe import server_flags
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.core.stack_locks import distribution, read_lock
from pyinfra_vllm.core.stacks import INSTALLERS, StackRow
from pyinfra_vllm.operations import file_set
from pyinfra_vllm.operations import gateway as gateway_ops
from pyinfra_vllm.operations import vllm_service as vllm_service_ops
from pyinfra_vllm.plans import access, engine_access
from pyinfra_vllm.plans import driver as driver_plan
from pyinfra_vllm.plans import gateway as gateway_plan
from pyinfra_vllm.plans import persistence as persistence_plan
from pyinfra_vllm.plans import python_env as python_env_plan
from pyinfra_vllm.plans import vllm_service as vllm_service_plan
from pyinfra_vllm.plans.model_volume import render_fstab_line

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TOPOLOGY = FIXTURES / "nvidia" / "topo-4xA100-pcie-80gb-NV12-bridged-pairs-01.txt"
# The recorded probes of the stacks the repository has them for (tests/fixtures/vllm-*/).
PROBES = {("cuda", "0.17.0"): "vllm-cuda-0.17.0", ("cuda", "0.33.0"): "vllm-cuda-0.33.0",
          ("cpu", "0.32.0"): "vllm-cpu-0.32.0"}
HELP_063 = FIXTURES / "vllm" / "vllm-0.6.3-api-server-help.txt"
# The driver of each branch a converged host runs (the branches the settings allow).
DRIVERS = {"535-server": "535.129.03", "570-server": "570.195.03",
           "580-server": "580.95.05"}
VOLUME_UUID = "3c6f4f4e-2f0b-4d55-9a43-6a1f9b1d2e11"
ENGINE_KEY_SHA256 = "5" * 64
ENGINE_PID = 4242


class ConvergedHost:
    """The facts of a host converged with ``settings`` (and the model ``lock``)."""

    def __init__(self, settings: Settings, lock: dict[str, Any] | None):
        self.settings = settings
        self.lock = lock
        # What the suite's operations write, by path: (content, octal mode, owner:group).
        self.files: dict[str, tuple[bytes, str, str]] = {}
        # The engine's main process as its unit gives it (vllm_service_ops.engine_current).
        self.engine: dict[str, Any] | None = None
        self.answers: dict[type[FactBase], Callable[..., Any]] = {
            LinuxDistribution: lambda: {
                "name": "Ubuntu", "major": 22, "minor": 4,
                "release_meta": {"ID": "ubuntu", "VERSION_ID": "22.04",
                                 "CODENAME": "jammy", "PRETTY_NAME": "Ubuntu 22.04.5 LTS"}},
            KernelVersion: lambda: "5.15.0-125-generic",
            VllmEnvironments: self.environments,
            CpuHostState: lambda: {
                "cpus": list(range(16)), "numa_nodes": 1, "memory_total_mib": 128_000,
                "flags": {"avx2": True, "avx512f": True, "avx512_bf16": True,
                          "amx_bf16": True}},
            **self.gpu_answers(),
            PathComponents: self.path_components,
            FileDigests: self.file_digests,
            Sha1File: self.sha1_file,
            PathTypes: lambda paths: dict.fromkeys(paths),
            PathModes: lambda paths: {path: self.path_mode(path) for path in paths},
            KernelParam: lambda key: {"value": normalize(self.settings.sysctl[key]),
                                      "writable": True},
            Directory: lambda path: {"user": "root", "group": "root", "mode": 755},
            BlockDevice: lambda device: {
                "path": device, "fstype": "xfs", "uuid": VOLUME_UUID, "pttype": None,
                "usage": "filesystem", "probe_error": None,
                "mountpoints": [self.settings.model_dir]},
            Fstab: self.fstab,
            MountPoint: lambda path: {"source": self.settings.model_volume_device,
                                      "fstype": "xfs",
                                      "options": ["rw", "noatime", "attr2", "inode64"]},
            Link: lambda path: {"link_target": self.environment_path(), "user": "root",
                                "group": "root"},
            ModelFiles: self.model_files,
            FilesystemSize: lambda path: 64 * 1024**3,
            Account: lambda account: {
                "user": {"uid": 999, "gid": 999, "home": vllm_service_plan.STATE_DIR,
                         "shell": "/usr/sbin/nologin"},
                "group": {"gid": 999}},
            UnitDropIns: self.drop_ins,
            UnitActivation: self.unit_activation,
            EngineProcess: self.engine_process,
            EngineKey: lambda env_path, nginx_path: ENGINE_KEY_SHA256,
            EngineHealth: lambda url, socket=None: 200 if self.settings.vllm_start else 0,
            EngineFirewall: self.engine_firewall,
            EngineServing: self.engine_serving,
            DebPackage: lambda package: {"name": package, "version": "1.0-1ubuntu1"},
            NginxServers: self.nginx_servers,
            BenchRecord: lambda path: None,
            # The sentinel's state: serving, nothing held (files/sentinel.py).
            SentinelState: lambda state_path, rotation_flag: {
                "state": "ok", "reason": "a one-token completion answered", "failures": 0,
                "restarts": 0, "last_latency_s": 0.05, "updated": 1796648531.0,
                "events": [], "rotation": None},
            ModelContent: lambda path, lock: {
                "files": len(lock["files"]), "bytes": sum(f["size"] for f in lock["files"]),
                "seconds": 61.2, "jobs": 16, "problems": {}, "error": None},
            EnvironmentContent: lambda path: {
                "files": 48211, "bytes": 5_368_709_120, "seconds": 9.3, "jobs": 16,
                "records": 164, "problems": {}, "packages": [], "error": None},
            SystemdStatus: self.systemd_running,
            SystemdEnabled: self.systemd_running,
        }

    def value(self, fact: type[FactBase], kwargs: dict[str, Any]) -> Any:
        """What ``fact`` read with ``kwargs`` returns on this host."""
        if fact not in self.answers:
            raise KeyError(f"tests/unit/converged_host.py has no value of {fact.__name__}: "
                           "add what a converged host returns")
        return self.answers[fact](**kwargs)

    # --- the host and its GPUs ---------------------------------------------------------

    def gpu_answers(self) -> dict[type[FactBase], Callable[[], Any]]:
        """The facts of GpuHostState: four A100 80GB PCIe, NVLink-bridged pairs, on the
        settings' driver branch, persistence mode as the settings want it, MIG off, idle,
        no NVLink error and no Xid (their ``nvidia-smi -q`` health records unread: the
        preflight warns, and refuses nothing); on a host whose engine runs on CPU, no
        NVIDIA driver and no GPU."""
        if self.settings.vllm_device == "cpu":
            return {**dict.fromkeys(GpuHostState.facts.values(), lambda: None),
                    DriverPackages: lambda: {}, HeldPackages: lambda: [],
                    XidEvents: lambda: {"source": "journal", "events": []}}
        branch = self.settings.nvidia_driver_branch
        version = DRIVERS[branch]
        persistence = "Enabled" if self.settings.persistence_mode else "Disabled"
        topology = parse_topology(TOPOLOGY.read_text(encoding="utf-8").splitlines())
        bus_ids = [f"00000000:{0x17 + 0x10 * index:02X}:00.0" for index in range(4)]
        gpus = [{"index": index, "name": "NVIDIA A100 80GB PCIe", "memory_total_mib": 81920,
                 "driver_version": version, "pci_bus_id": bus_id,
                 "uuid": f"GPU-5a1c0de{index}-7f3e-4b2a-9c1d-0e8f6a4b2c{index:02d}",
                 "persistence_mode": persistence, "mig_current": "Disabled",
                 "mig_pending": "Disabled"} for index, bus_id in enumerate(bus_ids)]
        packages = {name: f"{version}-0ubuntu0.22.04.1"
                    for name in driver_plan.driver_packages(branch)}
        links = [{"link": link, "active": True, "speed_gbps": 25.0} for link in range(12)]
        return {
            KernelModule: lambda: {"version": version, "open": False},
            DriverPackages: lambda: packages,
            HeldPackages: lambda: sorted(packages),
            CudaToolkit: lambda: None,
            DriverInfo: lambda: {"driver_version": version,
                                 "cuda_version": {"535": "12.2", "570": "12.8",
                                                  "580": "13.0"}[branch[:3]]},
            NvmlError: lambda: None,
            GpuInventory: lambda: gpus,
            GpuComputeCapability: lambda: dict.fromkeys(bus_ids, "8.0"),
            GpuProcesses: lambda: [],
            GpuTopology: lambda: topology,
            NvlinkStatus: lambda: {index: links for index in range(4)},
            GpuHealth: lambda: None,
            NvlinkErrors: lambda: {index: {link: {"replay": 0, "recovery": 0,
                                                   "crc_flit": 0} for link in range(12)}
                                   for index in range(4)},
            XidEvents: lambda: {"source": "journal", "events": []},
        }

    # --- files ---------------------------------------------------------------------------

    @contextmanager
    def learn(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        """Let the operations that write files tell this host what they write, as they
        are called (before they read it): file_set.present (and its ``_inner``, which
        other operations call), gateway.site, and the engine's main process from
        vllm_service.engine_current."""
        present = file_set.present

        def note(kwargs: dict[str, Any]) -> None:
            owner = f"{kwargs.get('user', 'root')}:{kwargs.get('group', 'root')}"
            for path, (source, mode) in kwargs["files"].items():
                content = source if isinstance(source, bytes) else Path(source).read_bytes()
                self.files[path] = (content, mode, owner)

        def present_noted(*args: Any, **kwargs: Any) -> Any:
            note(kwargs)
            return present(*args, **kwargs)

        def inner_noted(*args: Any, **kwargs: Any) -> Any:
            note(kwargs)
            return present._inner(*args, **kwargs)

        present_noted._inner = inner_noted  # type: ignore[attr-defined]
        site = gateway_ops.site

        def site_noted(*args: Any, **kwargs: Any) -> Any:
            live = {gateway_plan.SITE_PATH: (kwargs["site_content"], "644"),
                    gateway_plan.KEYS_PATH: (kwargs["keys_content"],
                                             access.mode(gateway_plan.KEYS_PATH)),
                    **(kwargs.get("extra_files") or {})}
            for path, (text, mode) in live.items():
                self.files[path] = (text.encode(), mode, "root:root")
            return site(*args, **kwargs)

        engine_current = vllm_service_ops.engine_current

        def engine_noted(*args: Any, **kwargs: Any) -> Any:
            self.engine = kwargs["expected"]
            return engine_current(*args, **kwargs)

        monkeypatch.setattr(file_set, "present", present_noted)
        monkeypatch.setattr(gateway_ops, "site", site_noted)
        monkeypatch.setattr(vllm_service_ops, "engine_current", engine_noted)
        yield

    def file_digests(self, paths: list[str]) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for path in paths:
            if path not in self.files:
                found[path] = None
                continue
            content, mode, owner = self.files[path]
            found[path] = {"sha256": hashlib.sha256(content).hexdigest(), "mode": mode,
                           "owner": owner}
        return found

    def sha1_file(self, path: str) -> str | None:
        if path not in self.files:
            return None
        return gateway_plan.sha1(self.files[path][0].decode())

    def path_mode(self, path: str) -> dict[str, str] | None:
        row = access.ROWS.get(path)
        if row is None:
            return None
        return {"owner": row.owner, "group": row.group, "mode": row.mode, "kind": row.kind}

    def path_components(self, path: str) -> list[dict[str, Any]]:
        parts = [part for part in path.split("/") if part]
        paths = ["/"] + ["/" + "/".join(parts[:end]) for end in range(1, len(parts) + 1)]
        return [{"path": each, "kind": "directory", "uid": 0, "owner": "root",
                 "mode": "755"} for each in paths]

    def systemd_running(self, user_mode: bool = False, machine: str | None = None,
                        user_name: str | None = None, services: list[str] | None = None
                        ) -> dict[str, bool]:
        """Every unit running and enabled; nvidia-persistenced stopped and disabled where
        persistence_mode is off."""
        off = {persistence_plan.PERSISTENCED_UNIT} if not self.settings.persistence_mode \
            else set()
        return {service: service not in off for service in services or []}

    def drop_ins(self, unit: str) -> list[dict[str, Any]]:
        if unit == persistence_plan.PERSISTENCED_UNIT and self.settings.persistence_mode:
            return [{"path": persistence_plan.PERSISTENCED_DROP_IN, "loaded": True,
                     "on_disk": True}]
        return []

    def fstab(self, path: str = "/etc/fstab") -> list[dict[str, Any]]:
        settings = self.settings
        line = render_fstab_line(VOLUME_UUID, settings.model_dir,
                                 list(settings.model_volume_mount_options))
        return Fstab().process(["UUID=4f1c2b7e-0000-4000-8000-000000000001 / ext4 "
                                "errors=remount-ro 0 1", line])

    # --- the stack, the model and the engine ---------------------------------------------

    def environment_path(self) -> str:
        settings = self.settings
        stack = settings.stack
        python = python_env_plan.interpreter(settings.python_env_manager, stack)
        return python_env_plan.environment_base(settings.python_env_root, stack,
                                                settings.python_env_manager, python)

    def environments(self, root: str) -> dict[str, Any]:
        stack = self.settings.stack
        path = self.environment_path()
        return {
            "current": path,
            "envs": {path: {"marker": marker(stack, self.settings.python_env_manager),
                            "installed": {distribution(stack): stack.vllm,
                                          "torch": stack.torch},
                            "built": 1764547200, "integrity": {"state": "intact"}}},
            "uv": INSTALLERS["uv"]["version"] if self.settings.python_env_manager == "uv"
            else None,
            "conda": self.settings.python_env_manager == "conda",
        }

    def model_files(self, path: str) -> dict[str, Any] | None:
        if self.lock is None:
            return None
        verified, files = {}, {}
        for number, entry in enumerate(self.lock["files"]):
            stat = {"size": entry["size"], "mtime_ns": 1764547200_000_000_000 + number}
            files[entry["path"]] = stat
            verified[entry["path"]] = {**stat, "algo": entry["algo"],
                                       "digest": entry["digest"]}
        return {"verified": verified, "files": files}

    def unit_activation(self, unit: str) -> dict[str, Any] | None:
        """Every unit enabled and running; the engine's only enabled where vllm_start is
        false; the sentinel's unknown where it is off."""
        if unit == vllm_service_plan.UNIT and not self.settings.vllm_start:
            return {"active": "inactive", "enabled": "enabled", "start_to_active_s": None}
        if unit.startswith("vllm-sentinel") and not self.settings.sentinel:
            return None  # removed: systemd does not know it
        return {"active": "active", "enabled": "enabled", "start_to_active_s": 41.5}

    def engine_process(self, unit: str, keys: list[str], secret_keys: list[str]
                       ) -> dict[str, Any] | None:
        if self.engine is None or not self.settings.vllm_start:
            return None
        return {"pid": ENGINE_PID, "argv": list(self.engine["argv"]),
                "env": {key: value for key, value in self.engine["env"].items()
                        if key in keys},
                "secret_sha256": dict(self.engine["secret_sha256"]),
                "status": dict(vllm_service_plan.HARDENING_EXPECTED)}

    def engine_firewall(self, nft: str, table: str, comment: str) -> str | None:
        rules = engine_access.render_firewall(self.settings, vllm_service_plan.SERVICE_USER,
                                              engine_access.endpoint(self.settings))
        return None if rules is None else engine_access.loaded_digest(rules)

    def engine_serving(self, url: str, socket: str | None = None, user: str = "",
                       key_file: str = "") -> dict[str, Any]:
        settings = self.settings
        name = settings.served_model_name or settings.model_id
        return {"models": [{"id": name, "max_model_len": settings.max_model_len}],
                "metrics": {"vllm:num_requests_running": 0.0,
                            "vllm:kv_cache_usage_perc": 0.0}}

    def nginx_servers(self) -> dict[str, Any]:
        settings = self.settings
        ports = [settings.gateway_port] + (
            [settings.gateway_http_redirect_port] if settings.gateway_http_redirect_port
            else [])
        site = {"path": gateway_plan.SITE_PATH, "symlink": False, "main": False,
                "servers": [{"line": 20 + index, "listen": [str(port)],
                             "server_name": ["_"], "locations": ["/"]}
                            for index, port in enumerate(ports)]}
        return {"files": [{"path": "/etc/nginx/nginx.conf", "symlink": False, "main": True,
                           "servers": []}, site],
                "server_tokens": []}


def marker(stack: StackRow, manager: str) -> dict[str, Any]:
    """The marker of the stack's proven environment: its recorded probe where the
    repository has one, else one whose runtime lists the recorded server's flags."""
    folder = PROBES.get((stack.device, stack.vllm))
    if folder is not None:
        recorded = json.loads((FIXTURES / folder / "probe.json").read_text())
        return {**recorded, "manager": manager}
    if (stack.device, stack.vllm) != ("cuda", "0.6.3"):
        raise KeyError(f"no recorded probe or --help of stack {stack.device} {stack.vllm}")
    flags = server_flags(HELP_063.read_text())
    return {"stack": stack.vllm, "manager": manager,
            "requirements_sha256": read_lock(stack).sha256,
            "runtime": {"vllm": stack.vllm, "vllm_dist": "vllm", "device": "cuda",
                        "torch": stack.torch, "torch_cuda": stack.cuda, "flags": flags}}

