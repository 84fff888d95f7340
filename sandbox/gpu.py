"""The simulated NVIDIA stack on sandbox hosts (integration of sandbox/gpusim).

Per scenario:
- seed / seed580 / pcie / mig / mismatch / h200: the gpusim .debs are installed into the host's overlay
  before its first boot (dpkg -i in a non-booted systemd-nspawn) and `gpusimctl init
  --scenario S` sets its simulated GPU state. That state lives in the host's upper dir, so it
  survives reboots. The packages carry Ubuntu's 535-server branch, h200's and seed580's the
  captured H200 host's 580.159.04 (DRIVER_PACKAGES), so installed packages and loaded
  module agree.
- bare: no driver. Instead a trusted apt repository carrying the same .debs (both branches)
  under Ubuntu's package names is served over HTTP on the host side of the host's veth; its URL is the host
  data `nvidia_apt_repo` (`sandbox_nvidia_apt_source` is the whole sources.list line), for the deploy
to install the driver from.

The .debs and the repo are built once per gpusim source version and cached outside the repo.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from sandbox.util import CACHE_DIR, REPO_ROOT, RUN_DIR, SandboxError, run


class Host(Protocol):
    """What this module needs of a sandbox host (sandbox.hosts.Host), named here so that
    the two modules do not import each other."""

    name: str
    scenario: str
    gateway: str

    @property
    def merged(self) -> Path: ...


GPUSIM_DIR = REPO_ROOT / "sandbox" / "gpusim"
BUILD_DEBS = GPUSIM_DIR / "build_debs.py"
REPO_PORT = 8787
SERVICE_DIR = RUN_DIR / "services"
REPO_PID = SERVICE_DIR / "apt-repo.pid"
DEBS_IN_HOST = "/var/cache/gpusim-debs"
# (branch, Debian version) of the driver packages a scenario installs where it is not the
# default (build_debs.build's 535-server): h200's loaded module is the captured host's
# 580.159.04 (gpusimctl h200_state), and so is its installed driver; seed580 is the seed's
# two NVLink-joined A100s on that driver, the branch the example fleet's stack needs
# (group_data/a100_nvlink.py). The bare hosts' apt repository carries every branch here
# besides the default, so a run may install any of them.
R580 = ("580-server", "580.159.04-0ubuntu0.22.04.1")
DRIVER_PACKAGES = {"h200": R580, "seed580": R580}


@dataclass
class GpuPlan:
    debs: list[Path] = field(default_factory=list)
    repo_dir: Path | None = None
    # The packages of the scenarios in DRIVER_PACKAGES, by scenario.
    scenario_debs: dict[str, list[Path]] = field(default_factory=dict)

    @property
    def available(self) -> bool:
        return bool(self.debs)

    def debs_for(self, scenario: str) -> list[Path]:
        return self.scenario_debs.get(scenario, self.debs)


def gpusim_available() -> bool:
    return BUILD_DEBS.is_file()


def _source_hash() -> str:
    digest = hashlib.sha256(repr(sorted(DRIVER_PACKAGES.items())).encode())
    for path in sorted(GPUSIM_DIR.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(GPUSIM_DIR)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _build(log) -> GpuPlan:
    """Build (or reuse) the .debs and the apt repo for the current gpusim sources."""
    cache = CACHE_DIR / f"gpusim-{_source_hash()}"
    done = cache / ".done"
    debs_dir, repo_dir = cache / "debs", cache / "repo"
    if not done.is_file():
        shutil.rmtree(cache, ignore_errors=True)
        debs_dir.mkdir(parents=True)
        log(f"building gpusim packages into {cache}")
        try:
            module = importlib.import_module("sandbox.gpusim.build_debs")
            debs = [Path(p) for p in module.build(debs_dir)]
            for branch, version in sorted(set(DRIVER_PACKAGES.values())):
                debs += [Path(p) for p in module.build(cache / f"debs-{version}",
                                                       branch=branch, version=version)]
            module.build_repo(debs, repo_dir)
        except Exception as exc:
            shutil.rmtree(cache, ignore_errors=True)
            raise SandboxError(f"gpusim: building the packages failed: {exc}") from exc
        done.write_text("\n".join(str(p.relative_to(cache)) for p in debs) + "\n")
    by_folder: dict[str, list[Path]] = {}
    for line in done.read_text().split():
        by_folder.setdefault(line.split("/", 1)[0], []).append(cache / line)
    return GpuPlan(debs=by_folder["debs"], repo_dir=repo_dir,
                   scenario_debs={scenario: by_folder[f"debs-{version}"]
                                  for scenario, (_, version) in DRIVER_PACKAGES.items()})


def plan(scenarios: list[str], log=print) -> GpuPlan:
    if gpusim_available():
        return _build(log)
    if any(s != "bare" for s in scenarios):
        raise SandboxError(
            f"{BUILD_DEBS.relative_to(REPO_ROOT)} does not exist yet: only scenario 'bare' "
            "(without an NVIDIA apt repo) can boot"
        )
    log("gpusim not available: bare hosts get no nvidia_apt_repo")
    return GpuPlan()


def prepare(host: Host, gpu_plan: GpuPlan) -> None:
    """Install the driver packages and set the simulated GPU state, before first boot."""
    if host.scenario == "bare" or not gpu_plan.available:
        return
    target = host.merged / DEBS_IN_HOST.lstrip("/")
    target.mkdir(parents=True, exist_ok=True)
    debs = gpu_plan.debs_for(host.scenario)
    for deb in debs:
        shutil.copy(deb, target / deb.name)
    inside = [f"{DEBS_IN_HOST}/{deb.name}" for deb in debs]
    _in_container(host, ["dpkg", "-i", *inside], "install gpusim packages")
    _in_container(
        host,
        ["/usr/sbin/gpusimctl", "init", "--scenario", host.scenario],
        f"gpusimctl init --scenario {host.scenario}",
    )
    shutil.rmtree(target)


def _in_container(host: Host, argv: list[str], what: str) -> None:
    # A non-booted nspawn (not chroot): /proc, /sys and /dev are set up like on a real host.
    run(
        [
            "systemd-nspawn",
            "--quiet",
            f"--directory={host.merged}",
            "--register=no",
            "--keep-unit",
            "--private-network",
            "--resolv-conf=off",
            "--timezone=off",
            "--link-journal=no",
            "--pipe",
            "--",
            *argv,
        ],
        step=f"{host.name}: {what}",
        timeout=300,
    )


def host_data(host: Host, gpu_plan: GpuPlan) -> dict:
    data: dict = {}
    if host.scenario == "bare" and gpu_plan.repo_dir is not None:
        url = f"http://{host.gateway}:{REPO_PORT}/"
        data["nvidia_apt_repo"] = url
        # An unsigned flat repository over http, served from this machine: trusted on
        # purpose (the settings refuse an unsigned source without this).
        data["nvidia_apt_repo_trusted"] = True
        # build_repo writes a flat repository (Packages at the top), hence the "./" suite.
        data["sandbox_nvidia_apt_source"] = f"deb [trusted=yes] {url} ./"
    return data


# ----------------------------------------------------------------- apt repo server (bare)


def start_services(hosts: list[Host], gpu_plan: GpuPlan, state: dict) -> None:
    """Serve the apt repo on the gateway address of every bare host (one process)."""
    bare = [h for h in hosts if h.scenario == "bare"]
    if not bare or gpu_plan.repo_dir is None:
        return
    SERVICE_DIR.mkdir(parents=True, exist_ok=True)
    log = open(SERVICE_DIR / "apt-repo.log", "ab")  # noqa: SIM115 - handed to the child
    argv = [
        sys.executable,
        "-m",
        "sandbox.reposerve",
        str(gpu_plan.repo_dir),
        str(REPO_PORT),
        *[h.gateway for h in bare],
    ]
    try:
        proc = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        log.close()
    REPO_PID.write_text(f"{proc.pid}\n")
    state["services"]["apt_repo"] = proc.pid
    # Fail now, with its log, rather than at deploy time.
    for _ in range(50):
        if proc.poll() is not None:
            raise SandboxError(
                "apt repo server exited: " + (SERVICE_DIR / "apt-repo.log").read_text()[-2000:]
            )
        if (SERVICE_DIR / "apt-repo.ready").is_file():
            return
        time.sleep(0.1)
    raise SandboxError("apt repo server did not become ready in 5s")


def _repo_pid() -> int | None:
    try:
        pid = int(REPO_PID.read_text())
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if b"sandbox.reposerve" in cmd else None


def live_services(state: dict | None) -> list[str]:
    pid = _repo_pid()
    return [f"apt repo server pid {pid}"] if pid else []


def stop_services(state: dict) -> list[str]:
    pid = _repo_pid()
    if pid:
        os.kill(pid, signal.SIGTERM)
        for _ in range(50):
            if _repo_pid() is None:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(SERVICE_DIR, ignore_errors=True)
    return []
