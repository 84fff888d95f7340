"""files/wait_ready.py: waits for 200 from a local server, or gives up at --timeout."""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

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


def run(url: str, *extra: str):
    return subprocess.run([sys.executable, str(SCRIPT), "--url", url, "--interval", "0.05",
                           *extra], capture_output=True, text=True, timeout=60)


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
