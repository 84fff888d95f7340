"""Fixtures that boot sandbox hosts for the e2e tests, once per module.

- Skips (with the reason) when not root or when the tools are missing.
- SANDBOX_REUSE=1 with an existing .sandbox/inventory.py: use the running sandbox as is and
  leave it running afterwards.
- SANDBOX_SCENARIOS (default "seed,bare") picks the scenarios of the `sandbox` fixture's
  hosts; modules that need other hosts boot them with ``booted([...])``.
- ``booted(..., leave_up_for=NAME)``: a module that ends with its hosts converged leaves
  them up for the next module booted with ``take_over=NAME`` and the same scenarios (the
  next in pytest's order; any other module tears them down, and so does the end of the
  session). That module's own first run then finds the hosts converged: the suite saves
  a fresh host's whole run.
"""

from __future__ import annotations

import json
import os
import runpy
import shlex
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Collection
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandbox import hosts as sbx
from sandbox import rootfs
from sandbox.util import REPO_ROOT, SandboxError

PYINFRA = str(Path(sys.executable).with_name("pyinfra"))

# Sandbox hosts serve with vLLM's CPU build by default (sandbox/hosts.py SERVING_DATA).
# The modules that test the GPU path (the simulated NVIDIA stack: driver, MIG, persistence,
# NVLink, the GPU guard, a CUDA environment) say so with these overrides; vllm_start is
# false because a sandbox host has no GPU to start a CUDA engine on.
# The example fleet's stack and driver branch (group_data/a100_nvlink.py), read from the
# file so that the fleet's tests follow it: test_full.py's converged hosts run on it.
_FLEET = runpy.run_path(str(REPO_ROOT / "group_data" / "a100_nvlink.py"))
FLEET_VERSION = _FLEET["vllm_version"]
FLEET_CUDA = ("--data", "vllm_device=cuda", "--data", f"vllm_version={FLEET_VERSION}",
              "--data", f"nvidia_driver_branch={_FLEET['nvidia_driver_branch']}",
              "--data", "vllm_start=false")
# The design's stack, vLLM 0.6.3 on the default 535 branch (the blog post's server):
# test_engine_stages.py installs it from its lock; test_host_stages.py's hosts carry 535.
CUDA_063 = ("--data", "vllm_device=cuda", "--data", "vllm_version=0.6.3",
            "--data", "vllm_start=false")


# One seed host serving with the sandbox's default data and SERVING_KEY, converged once:
# test_serving.py leaves it up for test_integrity.py, which leaves it up for
# test_engine_faults.py, which leaves it up for test_sentinel.py, which leaves it up for
# test_remove.py (booted's leave_up_for and take_over). HANDOVER runs them in that order,
# one after another, so the host is installed and its engine started once for the five.
SERVED_SEED = "served-seed"
SERVING_KEY = "sk-serve-" + "0123456789abcdef" * 2  # 41 characters: above the minimum
HANDOVER = ("test_serving.py", "test_integrity.py", "test_engine_faults.py", "test_sentinel.py",
            "test_remove.py")


def pytest_collection_modifyitems(session, config, items):
    """The HANDOVER modules in their order, together, where the first of them was."""
    here = Path(__file__).parent

    def handed(item) -> bool:  # tests/unit has modules of the same names
        return item.path.parent == here and item.path.name in HANDOVER

    chain = [item for item in items if handed(item)]
    if not chain:
        return
    first = items.index(chain[0])
    chain.sort(key=lambda item: HANDOVER.index(item.path.name))  # stable: tests keep order
    rest = [item for item in items if not handed(item)]
    items[:] = rest[:first] + chain + rest[first:]


@dataclass
class SandboxHost:
    name: str
    address: str
    scenario: str
    loop_device: str
    host_dir: Path
    # This machine's address on the host's link: where the mirror listens, and what the
    # host sees as another machine.
    gateway: str
    # A front door (booted's ``routers``): of the inventory's routers group.
    router: bool = False


@dataclass
class Sandbox:
    hosts: list[SandboxHost]
    inventory: Path
    reused: bool
    # The audit_report_dir of every run against these hosts: a temporary directory, never
    # the checkout's reports/ (tests/conftest.py checks).
    reports: Path

    def ssh(
        self, host: SandboxHost, command: str, *, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """Run a shell command line on a host as root (ssh as the operator, then sudo)."""
        argv = [*sbx.ssh_argv(host.address, host.host_dir), "--",
                "sudo -n sh -c " + shlex.quote(command)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            pytest.fail(
                f"{host.name}: `{command}` exited {proc.returncode}\n"
                f"stdout: {proc.stdout}\nstderr: {proc.stderr}"
            )
        return proc

    def host(self, name: str) -> SandboxHost:
        return next(host for host in self.hosts if host.name == name)

    def report_data(self) -> tuple[str, str]:
        """``--data`` for pyinfra and tools.audit: the audit's reports in ``reports``. A
        later ``--data audit_report_dir=...`` of the caller wins (pyinfra keeps the last)."""
        return ("--data", f"audit_report_dir={self.reports}")

    def pyinfra(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [PYINFRA, "-y", *self.report_data(), str(self.inventory), *args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def mirror_control(url: str, path: str, body: object | None = None,
                   method: str | None = None) -> object:
    """The sandbox mirror's test controls (sandbox/mirror/README.md: /_faults, /_stats),
    from this machine; the JSON answer, None for an empty one."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read()
    return json.loads(text) if text.strip() else None


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "sandbox hosts need root (network namespaces, mounts, loop devices, nspawn)"
    try:
        sbx.preflight(need_debootstrap=not rootfs.rootfs_path().is_dir())
    except SandboxError as exc:
        return str(exc)
    return None


def _from_state() -> list[SandboxHost]:
    state = json.loads(sbx.STATE_FILE.read_text())
    return [
        SandboxHost(h["name"], h["address"], h["scenario"], h["loop_device"], Path(h["host_dir"]),
                    h["gateway"], h.get("router", False))
        for h in state["hosts"]
    ]


# (name, scenarios) of the sandbox a module left up for the next (booted's leave_up_for).
_LEFT_UP: dict[str, tuple[str, tuple[str, ...]]] = {}


def _down() -> None:
    problems = sbx.down()
    if problems:
        # Not an assert in a finalizer: report loudly, the teardown test checks it.
        print("sandbox teardown problems:\n" + "\n".join(problems), file=sys.stderr)


@contextmanager
def booted(scenarios: list[str], leave_up_for: str | None = None,
           take_over: str | None = None, own_caches: bool | Collection[str] = False,
           routers: int = 0):
    """Boot one host per scenario (one sandbox per machine), tear it down afterwards; with
    ``leave_up_for``, leave it up for the next module booted with the same name as
    ``take_over`` and the same scenarios, which then uses it instead of booting.
    ``own_caches``: for the modules that build vLLM environments, each host (True), or
    each host named, gets its own hard-linked copy of the package caches and builds with
    hard links (``sandbox up --own-caches``): about 30 s less per environment than copying
    its several GB. Each host's copy costs a few seconds at ``up`` and at ``down`` (its
    downloads returned, its directory removed). test_full's eight hosts, three of which
    build CUDA stacks, name those three: in two whole-suite runs their set-up took 14-16 s
    and their teardown 16-17 s, against 33 s and 51 s with a copy for each of the eight,
    and the two runs that build 62-64 s and 42 s, against 84 s and 61 s.
    ``routers``: that many more hosts, front doors in front of the others' gateways, which
    then serve TLS (``sandbox up --routers N --tls``).

    With SANDBOX_REUSE=1 and a running sandbox, that sandbox is used as is and kept.
    """
    reason = _skip_reason()
    if reason:
        pytest.skip(f"e2e sandbox unavailable: {reason}")
    reuse = os.environ.get("SANDBOX_REUSE") == "1" and sbx.INVENTORY_FILE.is_file()
    left_up = _LEFT_UP.pop("sandbox", None)
    shape = (*scenarios, *["router"] * routers)
    taken_over = take_over is not None and left_up == (take_over, shape)
    if not reuse and not taken_over:
        try:
            # Tears down one left up, if any.
            sbx.up(len(scenarios), scenarios, own_caches=own_caches, routers=routers,
                   tls=routers > 0)
        except SandboxError as exc:
            pytest.fail(f"sandbox up failed: {exc}")
    try:
        with tempfile.TemporaryDirectory(prefix="pyinfra-vllm-e2e-reports-") as reports:
            yield Sandbox(hosts=_from_state(), inventory=sbx.INVENTORY_FILE, reused=reuse,
                          reports=Path(reports))
    finally:
        if not reuse:
            if leave_up_for is not None:
                _LEFT_UP["sandbox"] = (leave_up_for, shape)
            else:
                _down()


@pytest.fixture(scope="session", autouse=True)
def _no_sandbox_left_up():
    """The last sandbox a module left up for another goes down with the session."""
    yield
    if _LEFT_UP.pop("sandbox", None) is not None:
        _down()


# Module scope: each e2e module boots the hosts it needs (about 2 s) and tears them
# down before the next module boots its own.
@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    with booted(os.environ.get("SANDBOX_SCENARIOS", "seed,bare").split(",")) as booted_sandbox:
        yield booted_sandbox
