"""files/wait_ready.py, the unit's ExecStartPost, against a real HTTP server on loopback
and real processes: it gives up as soon as the engine's main process ($MAINPID) is gone,
instead of waiting for the unit's start timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "files" / "wait_ready.py"


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def health_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/health"
    server.shutdown()


def closed_port_url() -> str:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    port = server.server_address[1]
    server.server_close()
    return f"http://127.0.0.1:{port}/health"


def wait_ready(*args: str, mainpid: int | None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "MAINPID"}
    if mainpid is not None:
        env["MAINPID"] = str(mainpid)
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_an_engine_that_exited_is_given_up_on_at_once():
    dead = subprocess.Popen(["true"])
    dead.wait()
    started = time.monotonic()
    run = wait_ready("--url", closed_port_url(), "--interval", "0.2", mainpid=dead.pid)
    assert run.returncode == 1
    assert f"the engine (PID {dead.pid}) exited" in run.stderr
    assert time.monotonic() - started < 10


def test_a_live_engine_is_waited_for_until_it_answers(health_url):
    run = wait_ready("--url", health_url, "--interval", "0.2", mainpid=os.getpid())
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"wait-ready: {health_url} answered 200 after ")


def test_without_mainpid_only_the_timeout_ends_the_wait():
    run = wait_ready("--url", closed_port_url(), "--interval", "0.2", "--timeout", "1",
                     mainpid=None)
    assert run.returncode == 1
    assert "not ready after" in run.stderr
