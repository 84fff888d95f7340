"""The engine stages (python_env, model, vllm_service) on a real sandbox host: the gates, the real vLLM 0.6.3 from PyPI in a
uv environment, and the locked model from the sandbox mirror with faults injected.

One `seed` host (Debian 12, two simulated A100 80GB). In order:

1. Qwen3.6-27B (a lock carrying its config.json) on the default vLLM 0.6.3: preflight
   refuses before any change, naming Qwen3_5ForConditionalGeneration and 0.17.0.
2. The same model on 0.17.0 with a max_model_len that cannot fit: refused with the
   capacity numbers (and the driver minimum of that stack), still no change.
3. The tiny model, with the mirror dropping one shard's connection mid-file and
   corrupting a byte of another: the run converges; the drop was resumed with a Range
   request, the corrupt file fetched again; vLLM 0.6.3 really imports and its facts
   (version, torch.version.cuda, server flags, registry) are read back.
4. Second run: zero changes, nothing downloaded, nothing re-hashed.
5. A shard removed on the host while the mirror serves it corrupt every time: the run
   stops naming the file and both checksums, and no file sits under its final name;
   once the mirror is healthy, only the model operation changes.

The wheels come through the sandbox's uv cache (sandbox/hosts.py PACKAGE_CACHES), the
host's own hard-linked copy of it (``own_caches``): several GB from PyPI the first time
on a machine, kept back into the shared cache at teardown, from disk afterwards.

Every run here says vllm_device=cuda, vllm_version=0.6.3, vllm_start=false itself
(conftest.CUDA_063): the sandbox's own data serves with the CPU build
(tests/e2e/test_serving.py), and this module is about the CUDA path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import CUDA_063, booted
from tests.e2e.conftest import mirror_control as mirror

pytestmark = pytest.mark.e2e

QWEN_CONFIG = Path(__file__).resolve().parents[1] / "fixtures/hf/qwen3.6-27b/config.json"
MODEL_DIR = "/srv/models/sandbox/tiny-qwen2"
OP_ENV = "full | python_env | Python env: vLLM 0.6.3 (torch 2.4.0, CUDA 12.1) built and proven"
OP_MODEL_PREFIX = "full | model | Model: sandbox/tiny-qwen2@"
INSTALL_TIMEOUT = 1500  # a cold uv cache downloads about 3.5 GB of wheels


@pytest.fixture(scope="module")
def sandbox():
    with booted(["seed"], own_caches=True) as booted_sandbox:
        yield booted_sandbox


@pytest.fixture(scope="module")
def host(sandbox):
    return sandbox.hosts[0]


@pytest.fixture(scope="module")
def mirror_url(sandbox):
    text = sandbox.inventory.read_text()
    return text.split('"model_base_url": "', 1)[1].split('"', 1)[0]


def run(sandbox, *args: str, timeout: float = 300):
    proc = sandbox.pyinfra("--json", *CUDA_063, *args, "deploys/full.py", timeout=timeout)
    data = json.loads(proc.stdout) if proc.stdout.strip() else None
    return proc, data


def outcome(data: dict, result: str) -> set[str]:
    return {op["name"] for op in data["results"]["operations"] if op[result]}


@pytest.fixture(scope="module")
def qwen36_lock(tmp_path_factory) -> Path:
    # Constructed, not downloaded: the reconstructed config.json (tests/fixtures/hf) and
    # 15 shards totalling the research's 55.6 GB. The gates read nothing else.
    config = json.loads(QWEN_CONFIG.read_text())
    files = [{"path": "config.json", "size": 4096, "algo": "git-blob-sha1",
              "digest": "0" * 40, "lfs": False}]
    files += [{"path": f"model-{n:05d}-of-00015.safetensors", "size": 55_600_000_000 // 15,
               "algo": "sha256", "digest": "0" * 64, "lfs": True} for n in range(1, 16)]
    lock = {"lock_version": 1, "model_id": "Qwen/Qwen3.6-27B", "revision": "main",
            "commit": "1" * 40, "base_url": "https://huggingface.co", "created": "constructed",
            "total_size": sum(f["size"] for f in files), "config": config, "files": files}
    path = tmp_path_factory.mktemp("locks") / "Qwen--Qwen3.6-27B.json"
    path.write_text(json.dumps(lock))
    return path


def assert_untouched(sandbox, host):
    probe = sandbox.ssh(host, "test -e /opt/vllm && echo env; test -e /etc/nginx && echo nginx;"
                              "test -e /etc/sysctl.d/60-vllm.conf && echo sysctl; true")
    assert probe.stdout.split() == []


def test_qwen36_on_063_is_refused_before_any_change(sandbox, host, qwen36_lock):
    proc, data = run(sandbox, "--data", "model_id=Qwen/Qwen3.6-27B",
                     "--data", f"model_lock={qwen36_lock}")
    assert proc.returncode != 0
    assert "vLLM 0.6.3 cannot load Qwen3_5ForConditionalGeneration (Qwen/Qwen3.6-27B); it " \
           "is supported from vLLM 0.17.0" in proc.stderr
    # Every host failed, so pyinfra prints no JSON results; the host shows no change.
    assert data is None
    assert_untouched(sandbox, host)


def test_max_model_len_that_cannot_fit_is_refused_with_numbers(sandbox, host, qwen36_lock):
    proc, data = run(sandbox, "--data", "model_id=Qwen/Qwen3.6-27B",
                     "--data", f"model_lock={qwen36_lock}", "--data", "vllm_version=0.17.0",
                     "--data", "nvidia_driver_branch=570-server",
                     "--data", "max_model_len=262144", "--data", "gpu_memory_utilization=0.4")
    assert proc.returncode != 0
    # 81920 MiB x 0.4 = 32 GiB; 55.6 GB of weights / 2 = 25.89 GiB; 3 GiB reserve.
    assert ("preflight capacity: max_model_len 262144 does not fit: per GPU: budget 32.00 GiB "
            "(81920 MiB x 0.4) - weights 25.89 GiB (lock) - reserve 3.00 GiB = 3.11 GiB for "
            "the KV cache; one 262144-token sequence needs 8.00 GiB KV") in proc.stderr
    assert ("the vLLM 0.17.0 stack's CUDA runtime 12.8.90 (CUDA 12.8 Update 1, from its lock) "
            "needs >= 570.124.06") in proc.stderr
    assert data is None
    assert_untouched(sandbox, host)


def test_first_run_installs_vllm_and_survives_download_faults(sandbox, host, mirror_url):
    mirror(mirror_url, "/_faults", method="DELETE")
    mirror(mirror_url, "/_stats", method="DELETE")
    dropped, corrupted = "model-00002-of-00004.safetensors", "model-00003-of-00004.safetensors"
    mirror(mirror_url, "/_faults", {"mode": "drop", "path": dropped, "after_bytes": 600_000})
    mirror(mirror_url, "/_faults", {"mode": "corrupt", "path": corrupted, "offset": 1000})
    proc, data = run(sandbox, timeout=INSTALL_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert OP_ENV in outcome(data, "success")
    assert any(name.startswith(OP_MODEL_PREFIX) for name in outcome(data, "success"))

    snapshot = mirror(mirror_url, "/_stats")
    assert snapshot["faults_fired"] == 2
    stats = snapshot["files"]
    drop_stats = next(v for k, v in stats.items() if k.endswith(dropped))
    corrupt_stats = next(v for k, v in stats.items() if k.endswith(corrupted))
    assert drop_stats["ranged"] == 1 and drop_stats["get"] == 2  # resumed, not restarted
    assert corrupt_stats["get"] == 2  # fetched again from scratch after the bad hash

    # Every file on the host matches the lock's checksum.
    lock = json.loads(Path(sandbox.inventory.read_text().split('"model_lock": "', 1)[1]
                           .split('"', 1)[0]).read_text())
    sums = sandbox.ssh(host, f"cd {MODEL_DIR} && sha256sum *.safetensors").stdout
    on_host = {line.split()[1]: line.split()[0] for line in sums.splitlines()}
    assert on_host == {f["path"]: f["digest"] for f in lock["files"]
                       if f["path"].endswith(".safetensors")}
    assert sandbox.ssh(host, f"ls -A {MODEL_DIR}/.incoming").stdout == ""


def test_facts_read_the_installed_vllm(sandbox):
    proc = sandbox.pyinfra("fact", "facts.python_env.VllmEnvironments", "root=/opt/vllm")
    assert proc.returncode == 0, proc.stderr
    # pyinfra prints fact data on stderr, after its progress lines.
    text = proc.stdout + proc.stderr
    body = text[text.index("{", text.index("--> Fact data")):]
    fact = json.loads(body[: body.rindex("}") + 1])
    found = next(iter(fact.values()))
    env = found["envs"][found["current"]]
    runtime = env["marker"]["runtime"]
    assert (runtime["vllm"], runtime["torch"], runtime["torch_cuda"]) == ("0.6.3", "2.4.0",
                                                                          "12.1")
    assert env["installed"] == {"vllm": "0.6.3", "torch": "2.4.0"}
    assert len(runtime["flags"]) == 115
    assert {"--tensor-parallel-size", "--max-model-len", "--disable-custom-all-reduce",
            "--enable-chunked-prefill", "--served-model-name"} <= set(runtime["flags"])
    assert len(runtime["architectures"]) == 81 and "Qwen2ForCausalLM" in runtime["architectures"]
    assert found["uv"] == "0.13.9"


def test_second_run_changes_nothing_and_rehashes_nothing(sandbox, host, mirror_url):
    before = sandbox.ssh(host, f"stat -c %Y.%y {MODEL_DIR}/.verified.json").stdout
    mirror(mirror_url, "/_stats", method="DELETE")
    proc, data = run(sandbox)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert data["results"]["totals"]["success"] == 0 and data["results"]["totals"]["error"] == 0
    assert mirror(mirror_url, "/_stats")["totals"]["get"] == 0
    assert sandbox.ssh(host, f"stat -c %Y.%y {MODEL_DIR}/.verified.json").stdout == before


def test_a_file_that_stays_corrupt_stops_the_run_then_heals(sandbox, host, mirror_url):
    shard = "model-00004-of-00004.safetensors"
    sandbox.ssh(host, f"rm {MODEL_DIR}/{shard}")
    mirror(mirror_url, "/_faults", method="DELETE")
    mirror(mirror_url, "/_faults", {"mode": "corrupt", "path": shard, "offset": 10, "times": -1})
    proc, data = run(sandbox)
    assert proc.returncode != 0 and data is None  # the only host failed: no JSON results
    assert f"{shard}: sha256 mismatch twice: expected " in proc.stderr
    assert sandbox.ssh(host, f"test -e {MODEL_DIR}/{shard}", check=False).returncode == 1

    mirror(mirror_url, "/_faults", method="DELETE")
    proc, data = run(sandbox)
    assert proc.returncode == 0, proc.stderr[-3000:]
    changed = outcome(data, "success")
    assert len(changed) == 1 and next(iter(changed)).startswith(OP_MODEL_PREFIX)


# --- the vLLM unit: installed and enabled, never started by the sandbox's own
# data (vllm_start=false: no GPU), started on purpose below to see the GPU guard refuse.
OP_UNIT = "full | vllm_service | vLLM service: systemd unit and its environment file"
OP_RESTART = "full | vllm_service | vLLM service: restarted for its new unit"


def test_unit_installed_enabled_not_started(sandbox, host):
    shown = sandbox.ssh(host, "systemctl is-enabled vllm; systemctl is-active vllm; "
                              "stat -c '%a %U' /etc/vllm/vllm.env; id -u vllm >/dev/null "
                              "&& getent passwd vllm | cut -d: -f6,7", check=False).stdout
    assert shown.split() == ["enabled", "inactive", "600", "root",
                             "/var/lib/vllm:/usr/sbin/nologin"]
    unit = sandbox.ssh(host, "cat /etc/systemd/system/vllm.service").stdout
    env = sandbox.ssh(host, "readlink /opt/vllm/current").stdout.strip()
    assert f'ExecStart="{env}/bin/python" "-m" "vllm.entrypoints.openai.api_server"' in unit
    assert '"--tensor-parallel-size" "2"' in unit and '"--host" "127.0.0.1"' in unit
    assert 'Environment="CUDA_VISIBLE_DEVICES=0,1"' in unit  # the NV12 pair preflight found
    assert "KillMode=control-group" in unit and "User=vllm" in unit
    verify = sandbox.ssh(host, "systemd-analyze verify /etc/systemd/system/vllm.service 2>&1",
                         check=False)
    assert "Unknown key" not in verify.stdout and "Invalid" not in verify.stdout


def test_the_gpu_guard_stops_the_engine_and_the_deploy_says_why(sandbox, host):
    proc, data = run(sandbox, "--data", "vllm_start=true")
    assert proc.returncode != 0 and data is None  # the only host failed
    assert "gpu-guard: NVML unavailable: NVML Shared Library Not Found" in proc.stderr
    journal = sandbox.ssh(host, "journalctl -u vllm -o cat --no-pager").stdout
    assert "gpu-guard: NVML unavailable: NVML Shared Library Not Found" in journal
    state = sandbox.ssh(host, "systemctl is-active vllm", check=False).stdout.strip()
    assert state in ("failed", "activating")  # activating: Restart=on-failure waits 10 s
    # Restart=on-failure would try again in 10 s: stop it, as an operator would.
    sandbox.ssh(host, "systemctl stop vllm; systemctl reset-failed vllm")


def test_one_flag_changed_restarts_once_then_nothing(sandbox):
    proc, data = run(sandbox, "--data", "max_num_seqs=128")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert outcome(data, "success") == {OP_UNIT, OP_RESTART}
    proc, data = run(sandbox, "--data", "max_num_seqs=128")
    assert data["results"]["totals"]["success"] == 0
    proc, data = run(sandbox)  # back to the default: once more, and only that
    assert outcome(data, "success") == {OP_UNIT, OP_RESTART}


def test_a_flag_the_installed_server_lacks_stops_before_the_unit(sandbox, host):
    marker = sandbox.ssh(host, "ls /opt/vllm/current/pyinfra-vllm-env.json").stdout.strip()
    sandbox.ssh(host, f"cp {marker} /root/marker.bak && sed -i 's/\"--max-num-seqs\", //' "
                      f"{marker}")
    try:
        proc, data = run(sandbox, "--data", "max_num_seqs=64")
    finally:
        sandbox.ssh(host, f"mv /root/marker.bak {marker}")
    assert proc.returncode != 0 and data is None
    assert "the installed vLLM 0.6.3 server does not accept --max-num-seqs" in proc.stderr
    assert '"--max-num-seqs" "256"' in sandbox.ssh(
        host, "cat /etc/systemd/system/vllm.service").stdout
