"""Small helpers shared by the sandbox modules: running commands with clear errors, paths."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Keys, known_hosts, state and the generated inventory live in the (git-ignored) checkout dir;
# bulky per-host data (overlay upper dirs, loop images) lives outside the repo.
STATE_DIR = Path(os.environ.get("SANDBOX_STATE_DIR", REPO_ROOT / ".sandbox"))
CACHE_DIR = Path(os.environ.get("SANDBOX_CACHE_DIR", "/var/cache/pyinfra-vllm-sandbox"))
RUN_DIR = Path(os.environ.get("SANDBOX_RUN_DIR", "/var/lib/pyinfra-vllm-sandbox"))


class SandboxError(RuntimeError):
    """A sandbox step failed; the message names the step and carries the command's stderr."""


def run(
    args: list[str],
    *,
    step: str,
    check: bool = True,
    input: str | None = None,
    timeout: float | None = 600,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command (argument list, never a shell) and raise SandboxError naming `step`."""
    try:
        proc = subprocess.run(
            args,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except FileNotFoundError as exc:
        raise SandboxError(f"{step}: command not found: {args[0]}") from exc
    except subprocess.TimeoutExpired as exc:
        raise SandboxError(f"{step}: timed out after {timeout}s: {' '.join(args)}") from exc
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()[-4000:]
        raise SandboxError(f"{step} failed (exit {proc.returncode}): {' '.join(args)}\n{detail}")
    return proc


def remove_tree(path: Path, *, step: str) -> str | None:
    """``path`` removed by ``rm -rf`` in a process of its own; what failed, or None.

    Not shutil.rmtree in this process: where gevent has patched it (importing pyinfra_cli
    runs ``monkey.patch_all()``; the test suite's process is patched so), gevent's
    ``os.close`` (gevent/os.py, since 25.8.1) defers closing a directory's descriptor until
    its loop runs, and the loop does not run during the walk. A host with its own caches
    holds tens of thousands of directories: the process ran out of descriptors (EMFILE),
    and ``ignore_errors`` hid the tree it left. ``--one-file-system``: nothing on a file
    system still mounted below ``path`` is removed."""
    proc = run(["rm", "-rf", "--one-file-system", "--", str(path)], step=step, check=False)
    if proc.returncode != 0 or path.exists():
        return f"{step}: {path} not removed: {proc.stderr.strip()[-300:]}"
    return None


def write_file(path: Path, text: str, mode: int = 0o644) -> None:
    """Write a text file, creating parent dirs, with an explicit mode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
