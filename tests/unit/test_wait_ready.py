"""files/wait_ready.py: waits for 200 from a local server, gives up at --timeout, and at once
when the engine's main process ($MAINPID) is gone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.unit.impostor import impostor

SCRIPT = Path(__file__).resolve().parents[2] / "files" / "wait_ready.py"


def serve(statuses: list[int]):
    """A server on 127.0.0.1 answering /health with each status in turn, then the last."""
    answers = list(statuses)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            status = answers.pop(0) if len(answers) > 1 else answers[0]
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def run(url: str, *extra: str, env: dict[str, str] | None = None):
    return subprocess.run([sys.executable, str(SCRIPT), "--url", url, "--interval", "0.05",
                           *extra], capture_output=True, text=True, timeout=60, env=env)


def test_waits_through_errors_until_200():
    server = serve([503, 503, 200])
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/health"
        result = run(url)
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wait-ready: {url} answered 200 after ")
    assert result.stderr == ""


def test_gives_up_at_its_timeout_on_one_line():
    server = serve([503])
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/health"
        result = run(url, "--timeout", "0.2")
    finally:
        server.shutdown()
    assert result.returncode == 1
    assert result.stderr.startswith(f"wait-ready: {url} not ready after ")
    assert result.stderr.endswith("(HTTP 503)\n") and result.stderr.count("\n") == 1


def test_nothing_listening_is_no_answer():
    server = serve([200])
    port = server.server_address[1]
    server.shutdown()
    server.server_close()
    result = run(f"http://127.0.0.1:{port}/health", "--timeout", "0.2")
    assert result.returncode == 1 and result.stderr.endswith("(no answer)\n")


def serve_engine(completion_statuses: list[int]):
    """A server on 127.0.0.1: /health answers 200; each POST to /v1/completions answers
    the next status in turn (then the last), with one choice when it is 200."""
    answers = list(completion_statuses)
    requests: list[dict] = []
    authorizations: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self):  # noqa: N802
            length = int(self.headers.get("Content-Length", 0))
            requests.append(json.loads(self.rfile.read(length)))
            authorizations.append(self.headers.get("Authorization"))
            if self.path != "/v1/completions":
                status = 404
            else:
                status = answers.pop(0) if len(answers) > 1 else answers[0]
            answer = {"choices": [{"text": "x"}]} if status == 200 else {"error": "boom"}
            body = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.requests = requests  # type: ignore[attr-defined]
    server.authorizations = authorizations  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def run_model(completion_statuses: list[int], *extra: str):
    server = serve_engine(completion_statuses)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/health"
        result = run(url, "--timeout", "5", "--model", "tiny", "--request-timeout", "5", *extra)
    finally:
        server.shutdown()
        server.server_close()
    return result, server.requests  # type: ignore[attr-defined]


def test_model_mode_needs_a_completion_then_warms_up():
    result, requests = run_model([200])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and lines[0].endswith(" answered 200 after 0 s")
    assert re.fullmatch(r"wait-ready: first completion in \d+\.\d s; 3 warm-up\(s\) in \d+\.\d s",
                        lines[1]), lines[1]
    assert "failed" not in result.stdout and result.stderr == ""
    # the first one-token completion, then --warmups (default 3), all for the served name
    assert len(requests) == 4
    assert all(r["model"] == "tiny" and r["max_tokens"] == 1 for r in requests)


def test_model_mode_first_completion_failing_exits_1_naming_the_status():
    result, requests = run_model([500])
    assert result.returncode == 1
    assert result.stderr == (
        'wait-ready: the first one-token completion failed (500: {"error": "boom"})\n'
    )
    assert result.stderr.count("\n") == 1
    assert len(requests) == 1  # no warm-ups after a failed first completion


def test_model_mode_failed_warmups_are_reported_not_fatal():
    result, requests = run_model([200, 503])
    assert result.returncode == 0, result.stderr
    assert "wait-ready: first completion in " in result.stdout
    assert result.stdout.rstrip().endswith(", 3 failed")
    assert len(requests) == 4


def test_model_mode_warmups_count():
    result, requests = run_model([200], "--warmups", "0")
    assert result.returncode == 0, result.stderr
    assert " 0 warm-up(s) in " in result.stdout and len(requests) == 1


def test_model_mode_sends_the_engines_key_from_its_environment():
    # An engine beyond loopback demands VLLM_API_KEY (the unit's environment file).
    server = serve_engine([200])
    url = f"http://127.0.0.1:{server.server_address[1]}/health"
    try:
        env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
        plain = run(url, "--model", "tiny", "--warmups", "1", env=env)
        keyed = run(url, "--model", "tiny", "--warmups", "1",
                    env={**env, "VLLM_API_KEY": "sk-engine-1"})
    finally:
        server.shutdown()
        server.server_close()
    assert plain.returncode == 0 and keyed.returncode == 0, (plain.stderr, keyed.stderr)
    assert server.authorizations == [None, None] + ["Bearer sk-engine-1"] * 2
    assert "sk-engine-1" not in keyed.stdout + keyed.stderr


# The engine's main process ($MAINPID, which systemd sets for ExecStartPost): gone, the
# wait ends at once instead of at the unit's start timeout.

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


# The engine's endpoint: its Unix socket, and a listener of another user never asked.

class _UnixServer(ThreadingHTTPServer):
    address_family = __import__("socket").AF_UNIX

    def server_bind(self) -> None:
        self.socket.bind(self.server_address)
        self.server_name, self.server_port = "localhost", 0


def test_the_engine_is_reached_through_its_socket_made_connectable(tmp_path):
    path = str(tmp_path / "engine.sock")
    server = _UnixServer(path, Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    os.chmod(path, 0o700)  # as vLLM binds it under the unit's UMask=0077
    try:
        run = wait_ready("--url", "http://localhost/health", "--unix-socket", path,
                         "--interval", "0.2", "--timeout", "5", mainpid=os.getpid())
    finally:
        server.shutdown()
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("wait-ready: http://localhost/health answered 200 after ")
    # Connectable for nginx's workers: the socket's directory (0750) keeps others out.
    assert os.stat(path).st_mode & 0o777 == 0o666


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to listen as another user")
def test_a_listener_of_another_user_is_never_asked_nor_sent_the_key(tmp_path):
    # nobody takes a free port and logs every request it receives.
    seen = tmp_path / "seen"
    with impostor(seen) as port:
        env = {**os.environ, "VLLM_API_KEY": "sk-engine-own"}
        run = subprocess.run(
            [sys.executable, str(SCRIPT), "--url", f"http://127.0.0.1:{port}/health",
             "--interval", "0.2", "--timeout", "1.5", "--model", "m"],
            capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 1
    assert run.stderr.splitlines()[0] == (
        f"wait-ready: http://127.0.0.1:{port}/health is held by uid 65534, not the "
        f"engine's ({os.getuid()}): not asked")
    assert "not ready after" in run.stderr
    assert seen.read_text() == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the socket to another user")
def test_a_socket_another_user_owns_is_never_asked_nor_made_connectable(tmp_path):
    path = str(tmp_path / "engine.sock")
    server = _UnixServer(path, Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    os.chmod(path, 0o700)
    os.chown(path, 65534, 65534)  # the socket file's owner is who bound it
    try:
        run = wait_ready("--url", "http://localhost/health", "--unix-socket", path,
                         "--interval", "0.2", "--timeout", "1.5", mainpid=os.getpid())
    finally:
        server.shutdown()
    assert run.returncode == 1
    assert run.stderr.splitlines()[0].startswith(
        f"wait-ready: {path} is held by uid 65534, not the engine's ({os.getuid()})")
    assert os.stat(path).st_mode & 0o777 == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to listen as another user")
def test_an_ipv6_listener_of_another_user_is_never_asked(tmp_path):
    # /proc/net/tcp6 is read as /proc/net/tcp is: nobody on [::1].
    seen = tmp_path / "seen"
    with impostor(seen, "::1") as port:
        run = subprocess.run(
            [sys.executable, str(SCRIPT), "--url", f"http://[::1]:{port}/health",
             "--interval", "0.2", "--timeout", "1.5", "--model", "m"],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "VLLM_API_KEY": "sk-engine-own"})
    assert run.returncode == 1
    assert run.stderr.splitlines()[0].startswith(
        f"wait-ready: http://[::1]:{port}/health is held by uid 65534, not the engine's")
    assert seen.read_text() == ""
