#!/usr/bin/env python3
"""A stand-in for the vLLM OpenAI server, for tests only: it never runs a model.

The gateway's end-to-end test runs it on a sandbox host in place of the engine, so nginx
has a real upstream that streams. Standard library only (the host has bare python3).

- ``GET /health``: 200 with an empty body, as vLLM answers.
- ``GET /metrics``: a few lines in the Prometheus text format, with vLLM's metric names.
- ``POST /v1/completions``, ``POST /v1/chat/completions``: with ``"stream": true``,
  Server-Sent Events ``data: {...}\\n\\n``, one every ``--interval`` seconds for
  ``--chunks`` chunks, then ``data: [DONE]``; otherwise one JSON completion. Bodies of
  any size are read (the gateway decides what is too big).

    python3 openai_stub.py --port 8000 [--chunks 10] [--interval 0.2]
    python3 openai_stub.py --uds /run/vllm-engine/engine.sock ...

With ``--stall-completions`` no completion is ever answered while ``/health`` answers
200: an engine whose core is frozen (files/sentinel.py's tests).

With ``--uds`` it listens on that Unix socket instead (as the engine does where its
stack's server has one), made connectable (0666): its directory decides who gets in.
The engine's other options (``--model``, ``--tensor-parallel-size``...) are taken and
ignored, so it starts from the engine's own command line (tools/engine_trial.py's tests).
Like vLLM, it demands ``VLLM_API_KEY`` from its environment, where set, as
``Authorization: Bearer`` on the paths under ``/v1`` (401 otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

METRICS = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="stub"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="stub"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="stub"} 0.0
"""


class Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 so nginx can keep its upstream connections alive (chunked streams).
    protocol_version = "HTTP/1.1"
    chunks = 10
    interval = 0.2
    stall = False

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass  # quiet: the journal would only fill with test traffic

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, b"")
        elif self.path == "/metrics":
            self._send(200, METRICS.encode(), "text/plain; version=0.0.4")
        else:
            self._send(404, b'{"detail": "Not Found"}')

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _authorized(self) -> bool:
        """vLLM's check (its API server's authentication): the key, on /v1 only."""
        key = os.environ.get("VLLM_API_KEY")
        if not key or not self.path.startswith("/v1"):
            return True
        if self.headers.get("Authorization") == f"Bearer {key}":
            return True
        self._send(401, b'{"error": "Unauthorized"}')
        return False

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not self._authorized():
            return
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self._send(404, b'{"detail": "Not Found"}')
            return
        try:
            request = json.loads(raw or b"{}")
        except ValueError:
            self._send(400, b'{"error": {"message": "body is not JSON"}}')
            return
        if self.stall:
            # An engine whose core is frozen: /health still answers, completions never.
            time.sleep(3600)
            return
        chat = self.path.endswith("chat/completions")
        model = request.get("model", "stub")
        if not request.get("stream"):
            text = f"stub reply to {len(raw)} bytes"
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": 0, "text": text}
            )
            choice["finish_reason"] = "stop"
            body = {
                "id": "cmpl-stub",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [choice],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
            self._send(200, json.dumps(body).encode())
            return

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for index in range(self.chunks):
            delta = {"delta": {"content": f"t{index} "}} if chat else {"text": f"t{index} "}
            event = {
                "id": "cmpl-stub",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "model": model,
                "choices": [{"index": 0, **delta, "finish_reason": None}],
            }
            self._chunk(f"data: {json.dumps(event)}\n\n".encode())
            time.sleep(self.interval)
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")  # the chunked encoding's last (empty) chunk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--chunks", type=int, default=10)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--uds", help="listen on this Unix socket instead")
    parser.add_argument("--stall-completions", action="store_true",
                        help="never answer a completion (/health still answers 200)")
    args, _engine_options = parser.parse_known_args()
    Handler.chunks, Handler.interval = args.chunks, args.interval
    Handler.stall = args.stall_completions
    if args.uds is None:
        ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
        return
    if os.path.exists(args.uds):
        os.unlink(args.uds)
    server = _UnixServer(args.uds, Handler)
    os.chmod(args.uds, 0o666)
    server.serve_forever()


class _UnixServer(ThreadingHTTPServer):
    address_family = socket.AF_UNIX

    def server_bind(self) -> None:
        self.socket.bind(self.server_address)
        self.server_name, self.server_port = "localhost", 0

    def get_request(self):
        conn, _ = self.socket.accept()
        return conn, ("local", 0)  # http.server logs client_address[0]


if __name__ == "__main__":
    main()
