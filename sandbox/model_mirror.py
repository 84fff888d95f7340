"""The sandbox's model mirror: sandbox.mirror's HTTP server, run for the booted hosts.

One server process, bound to the first host's gateway address (the host-side end of its
veth pair). The other hosts reach that address through their own gateway, since it is a
local address of this machine; nothing binds to a public interface. The generated model
is cached under CACHE_DIR, so every `up` serves the same files and commit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from sandbox.mirror.model import DEFAULT_REPO_ID
from sandbox.util import CACHE_DIR, REPO_ROOT, RUN_DIR, STATE_DIR, SandboxError
from tools import model_lock

MIRROR_PORT = 8788
MIRROR_ROOT = CACHE_DIR / "mirror"
MIRROR_DIR = RUN_DIR / "mirror"
PID_FILE = MIRROR_DIR / "mirror.pid"
URL_FILE = MIRROR_DIR / "mirror.url"
LOG_FILE = MIRROR_DIR / "mirror.log"


def _pid() -> int | None:
    try:
        pid = int(PID_FILE.read_text())
    except (OSError, ValueError):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    # Guard against pid reuse: only our server counts.
    return pid if b"sandbox.mirror" in cmdline else None


LOCK_FILE = STATE_DIR / "locks" / (DEFAULT_REPO_ID.replace("/", "--") + ".json")


def write_lock(base_url: str) -> Path:
    """Lock the mirror's model the way an operator locks a Hub model (tools.model_lock)."""
    code = model_lock.main([DEFAULT_REPO_ID, "--base-url", base_url, "--out", str(LOCK_FILE)])
    if code != 0:
        raise SandboxError(f"tools.model_lock against the mirror {base_url} exited {code}")
    return LOCK_FILE


def start(bind: str, state: dict) -> str:
    """Start the mirror on ``bind``; return its base URL once it answers."""
    MIRROR_DIR.mkdir(parents=True, exist_ok=True)
    URL_FILE.unlink(missing_ok=True)
    argv = [
        sys.executable, "-m", "sandbox.mirror", "serve",
        "--root", str(MIRROR_ROOT), "--bind", bind, "--port", str(MIRROR_PORT),
        "--pid-file", str(PID_FILE), "--url-file", str(URL_FILE),
    ]
    with open(LOG_FILE, "ab") as log:
        proc = subprocess.Popen(
            argv, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
    state["services"]["model_mirror"] = proc.pid
    for _ in range(100):
        if proc.poll() is not None:
            raise SandboxError("model mirror exited: " + LOG_FILE.read_text()[-2000:])
        if URL_FILE.is_file() and URL_FILE.read_text().strip():
            return URL_FILE.read_text().strip()
        time.sleep(0.1)
    raise SandboxError("model mirror did not start in 10s: " + LOG_FILE.read_text()[-2000:])


def host_data(base_url: str) -> dict:
    """What a sandbox host's inventory data says about the mirror."""
    return {"model_base_url": base_url, "model_id": DEFAULT_REPO_ID,
            "model_lock": str(LOCK_FILE)}


def stop() -> list[str]:
    pid = _pid()
    problems = []
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        for _ in range(50):
            if _pid() is None:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            problems.append(f"model mirror pid {pid} ignored SIGTERM; killed")
    PID_FILE.unlink(missing_ok=True)
    URL_FILE.unlink(missing_ok=True)
    return problems


def leftovers() -> list[str]:
    pid = _pid()
    return [f"model mirror pid {pid}"] if pid is not None else []
