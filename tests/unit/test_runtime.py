"""The runtime layer's pure parts: requirements and environment paths, the probe's flag
reader, the host-python verdict, the model-file bookkeeping, the lock loader and the
model gates. The operations' commands are pinned by tests/operations/*; the facts' parsing
by tests/facts/*.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pyinfra.api import FileUploadCommand, StringCommand
from pyinfra.context import ctx_host, ctx_state
from pyinfra_testing.util import FakeState, create_host

from deploys.gates import check_context_length, gpu_memory_mib, installed_registry, model_gates
from deploys.locks import LockFileError, load_lock, lock_path, safetensors_bytes
from deploys.settings import validate
from deploys.stacks import STACKS
from facts.model import mtime_ns, unverified
from files.vllm_probe import server_flags
from operations import model as model_ops
from operations.python_env import (
    download_env,
    environment_path,
    interpreter,
    python_problem,
    requirements_text,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
QWEN36_CONFIG = FIXTURES / "hf/qwen3.6-27b/config.json"
HELP_063 = FIXTURES / "vllm/vllm-0.6.3-api-server-help.txt"
MODEL_ID = "Qwen/Qwen3.6-27B"
COMMIT = "5f1e0c3a9b7d2e4f6a8c0b1d3e5f7a9c2b4d6e8f"


# --- requirements and environment paths -----------------------------------------------
def test_requirements_text_of_the_063_stack():
    assert requirements_text(STACKS["0.6.3"]) == (
        "vllm==0.6.3\n"
        "numpy==1.26.4\n"
        "setuptools==75.1.0\n"
        "tokenizers==0.20.1\n"
        "torch==2.4.0\n"
        "torchvision==0.19.0\n"
        "transformers==4.45.2\n"
        "xformers==0.0.27.post2\n"
    )


def test_requirements_text_puts_vllm_first_then_sorted_pins():
    lines = requirements_text(STACKS["0.17.0"]).splitlines()
    assert lines[0] == "vllm==0.17.0"
    assert lines[1:] == sorted(lines[1:])
    assert "torch==2.10.0" in lines and "transformers==4.57.6" in lines


def test_interpreter_conda_installs_the_stack_python_others_use_python3():
    assert interpreter("conda", STACKS["0.6.3"]) == "3.10"
    assert interpreter("conda", STACKS["0.17.0"]) == "3.12"
    assert interpreter("uv", STACKS["0.6.3"]) == "python3"
    assert interpreter("venv", STACKS["0.17.0"]) == "python3"


def test_environment_path_is_stable_and_depends_on_stack_manager_and_python():
    stack = STACKS["0.6.3"]
    path = environment_path("/opt/vllm", stack, "uv", "python3")
    # Pinned: a change here moves every host to a new environment on its next run.
    assert path == "/opt/vllm/envs/vllm-0.6.3-fe3b02e1"
    assert environment_path("/opt/vllm", dict(stack), "uv", "python3") == path
    others = {
        environment_path("/opt/vllm", stack, "venv", "python3"),
        environment_path("/opt/vllm", stack, "conda", "3.10"),
        environment_path("/opt/vllm", stack, "conda", "3.11"),
        environment_path("/opt/vllm", STACKS["0.17.0"], "uv", "python3"),
    }
    assert len(others) == 4 and path not in others
    changed_pin = dict(stack, pins=dict(stack["pins"], transformers="4.45.1"))
    assert environment_path("/opt/vllm", changed_pin, "uv", "python3") != path
    assert environment_path("/srv/vllm", stack, "uv", "python3").startswith("/srv/vllm/envs/")


def test_download_env_adds_ca_and_proxy_only_when_set():
    plain = StringCommand(*download_env("https://pypi.org/simple", None, None)).get_raw_value()
    plain = plain.split()
    assert plain[0] == "env" and "PIP_INDEX_URL=https://pypi.org/simple" in plain
    assert not any("PROXY" in part.upper() or "CERT" in part for part in plain)
    full = StringCommand(*download_env("https://m/simple", "/ca.pem", "http://p:3128"))
    full = full.get_raw_value().split()
    for wanted in ("PIP_CERT=/ca.pem", "SSL_CERT_FILE=/ca.pem", "CURL_CA_BUNDLE=/ca.pem",
                   "HTTPS_PROXY=http://p:3128", "https_proxy=http://p:3128",
                   "UV_DEFAULT_INDEX=https://m/simple"):
        assert wanted in full


# --- the probe's flags ----------------------------------------------------------------
def test_server_flags_on_the_recorded_063_help():
    flags = server_flags(HELP_063.read_text())
    # 115 = 114 options vLLM 0.6.3's api_server defines + "--tool-call-parserto" (vLLM's
    # own help text runs that option into the next word). The pieces of options argparse
    # wraps after a hyphen ("--max-seq-len-to-" / "capture") are not counted;
    # tests/e2e/test_runtime.py pins the same 115.
    assert len(flags) == 115
    assert flags == sorted(set(flags))
    for flag in ("--tensor-parallel-size", "--enable-chunked-prefill",
                 "--disable-custom-all-reduce", "--served-model-name", "--max-model-len",
                 "--block-size", "--help", "--max-seq-len-to-capture"):
        assert flag in flags
    assert [flag for flag in flags if flag.endswith("-")] == []
    assert "--" not in flags and all(len(flag) > 3 for flag in flags)


def test_server_flags_ignores_single_dash_and_embedded_dashes():
    text = "usage: [-h] [--port PORT] a--b --x=1 (see --seed.) --Upper ---triple -- end"
    assert server_flags(text) == ["--port", "--seed", "--x"]


# --- the host's python3 -----------------------------------------------------------------
def test_python_problem_without_python3():
    problem = python_problem(None, ["3.8", "3.12"], "uv")
    assert problem is not None
    assert "python_env_manager=uv" in problem and "there is none" in problem
    assert "python_env_manager=conda" in problem


def test_python_problem_inside_the_range():
    assert python_problem("3.11.2", STACKS["0.6.3"]["python_range"], "uv") is None
    assert python_problem("3.12.9", STACKS["0.6.3"]["python_range"], "venv") is None
    assert python_problem("3.8.0", STACKS["0.6.3"]["python_range"], "venv") is None


def test_python_problem_outside_the_range():
    problem = python_problem("3.13.1", STACKS["0.6.3"]["python_range"], "venv")
    assert problem is not None
    assert "3.13.1" in problem and "3.8..3.12" in problem
    assert "python_env_manager=conda" in problem
    assert python_problem("3.9.2", STACKS["0.17.0"]["python_range"], "uv") is not None


# --- model files ------------------------------------------------------------------------
def test_mtime_ns_is_exact():
    assert mtime_ns("1700000000.1234567890") == 1700000000123456789
    assert mtime_ns("1700000000.5") == 1700000000500000000
    assert mtime_ns("1700000000") == 1700000000000000000
    assert mtime_ns("1700000000.0000000010") == 1700000000000000001


def _lock(*files: tuple[str, int, str]) -> dict:
    return {"model_id": MODEL_ID, "commit": COMMIT,
            "files": [{"path": p, "size": s, "algo": "sha256", "digest": d} for p, s, d in files]}


LOCK = _lock(("config.json", 10, "c" * 64), ("model.safetensors", 100, "a" * 64))
NOW = {"config.json": {"size": 10, "mtime_ns": 1}, "model.safetensors": {"size": 100,
                                                                           "mtime_ns": 2}}
RECORD = {"config.json": {"size": 10, "mtime_ns": 1, "algo": "sha256", "digest": "c" * 64},
          "model.safetensors": {"size": 100, "mtime_ns": 2, "algo": "sha256",
                                "digest": "a" * 64}}


def test_unverified_without_a_directory_is_every_file():
    assert unverified(None, LOCK) == ["config.json", "model.safetensors"]


def test_unverified_when_all_verified_and_unchanged():
    assert unverified({"verified": RECORD, "files": NOW}, LOCK) == []


@pytest.mark.parametrize(
    "verified, files, why",
    [
        (RECORD, {"config.json": NOW["config.json"]}, "file missing"),
        ({"config.json": RECORD["config.json"]}, NOW, "no record"),
        (RECORD, dict(NOW, **{"model.safetensors": {"size": 100, "mtime_ns": 3}}),
         "mtime changed"),
        (RECORD, dict(NOW, **{"model.safetensors": {"size": 99, "mtime_ns": 2}}),
         "size changed"),
        (dict(RECORD, **{"model.safetensors": dict(RECORD["model.safetensors"],
                                                   digest="b" * 64)}),
         NOW, "verified against another lock"),
    ],
)
def test_unverified_names_the_file(verified, files, why):
    assert unverified({"verified": verified, "files": files}, LOCK) == ["model.safetensors"], why


def test_unverified_when_the_lock_size_differs_from_file_and_record():
    # The lock moved to a new revision of the same path with another size.
    lock = _lock(("config.json", 10, "c" * 64), ("model.safetensors", 120, "a" * 64))
    assert unverified({"verified": RECORD, "files": NOW}, lock) == ["model.safetensors"]


# --- the model download op: the token never on a command line ---------------------------
def test_downloaded_keeps_the_token_out_of_every_command_string():
    token = "hf_unit-test-token-7c4f9e"
    lock = _lock(("config.json", 10, "c" * 64))
    state = FakeState()
    host = create_host(state, facts={"model.ModelFiles": {"path=/srv/m/Q": None}})
    with ctx_state.use(state), ctx_host.use(host):
        commands = list(model_ops.downloaded._inner(
            lock=lock, dest="/srv/m/Q", base_url="https://huggingface.co", token=token,
            proxy="http://proxy:3128",
        ))
    strings = [c for c in commands if isinstance(c, StringCommand)]
    uploads = [c for c in commands if isinstance(c, FileUploadCommand)]
    assert strings and uploads
    for command in strings:
        assert token not in command.get_raw_value()
        assert token not in command.get_masked_value()
    carrying = [u for u in uploads if hasattr(u.src, "getvalue") and token in u.src.getvalue()]
    assert [u.dest for u in carrying] == ["/run/pyinfra-vllm/hf_token"]
    last = strings[-1].get_raw_value()
    assert "--token-file /run/pyinfra-vllm/hf_token" in last
    assert last.endswith("rm -f /run/pyinfra-vllm/hf_token ; exit $rc")


def test_model_path():
    assert model_ops.model_path("/srv/models/", MODEL_ID) == "/srv/models/Qwen/Qwen3.6-27B"
    assert model_ops.model_path("/srv/models", "gpt2") == "/srv/models/gpt2"


# --- the model lock ----------------------------------------------------------------------
def _settings(tmp_path: Path, name: str, **extra):
    return validate({"model_id": MODEL_ID, "model_lock": str(tmp_path / name), **extra})


def _lock_file(**overrides) -> dict:
    data = {
        "lock_version": 1, "model_id": MODEL_ID, "revision": "main", "commit": COMMIT,
        "base_url": "https://huggingface.co", "created": "2026-06-01T12:00:00Z",
        "total_size": 10,
        "files": [{"path": "config.json", "size": 10, "algo": "git-blob-sha1",
                   "digest": "3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b", "lfs": False}],
        "config": {"architectures": ["Qwen3_5ForConditionalGeneration"]},
    }
    data.update(overrides)
    return data


def test_lock_path_default_and_setting(tmp_path):
    assert lock_path(validate({"model_id": MODEL_ID})) == Path("locks/Qwen--Qwen3.6-27B.json")
    assert lock_path(_settings(tmp_path, "x.json")) == tmp_path / "x.json"


def test_load_lock_missing_file(tmp_path):
    settings = _settings(tmp_path, "missing.json")
    with pytest.raises(LockFileError) as error:
        load_lock(settings)
    message = str(error.value)
    assert f"python -m tools.model_lock {MODEL_ID}" in message
    assert "--revision main" in message and f"--out {tmp_path / 'missing.json'}" in message
    assert load_lock(settings, required=False) is None


def test_load_lock_reads_and_checks(tmp_path):
    path = tmp_path / "good.json"
    path.write_text(json.dumps(_lock_file()))
    lock = load_lock(_settings(tmp_path, "good.json"))
    assert lock["commit"] == COMMIT
    # Read once per run: later calls answer from the cache, not the file.
    path.unlink()
    assert load_lock(_settings(tmp_path, "good.json"))["commit"] == COMMIT


def test_load_lock_accepts_the_commit_as_revision(tmp_path):
    (tmp_path / "by-commit.json").write_text(json.dumps(_lock_file()))
    assert load_lock(_settings(tmp_path, "by-commit.json", model_revision=COMMIT))


def test_load_lock_for_another_model(tmp_path):
    (tmp_path / "other.json").write_text(json.dumps(_lock_file(model_id="Qwen/Qwen2.5-7B")))
    with pytest.raises(LockFileError) as error:
        load_lock(_settings(tmp_path, "other.json"))
    message = str(error.value)
    assert "it locks 'Qwen/Qwen2.5-7B', model_id is 'Qwen/Qwen3.6-27B'" in message
    assert f"python -m tools.model_lock {MODEL_ID}" in message


def test_load_lock_without_config(tmp_path):
    data = _lock_file()
    del data["config"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    with pytest.raises(LockFileError, match="older tools.model_lock"):
        load_lock(_settings(tmp_path, "old.json"))


def test_load_lock_lists_every_problem(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps(_lock_file(lock_version=0, files=[],
                                                             revision="v1", commit="0" * 40)))
    with pytest.raises(LockFileError) as error:
        load_lock(_settings(tmp_path, "bad.json"))
    message = str(error.value)
    assert "lock_version 0, expected 1" in message
    assert "model_revision is 'main'" in message
    assert "it lists no files" in message


def test_load_lock_unreadable(tmp_path):
    (tmp_path / "cut.json").write_text('{"lock_version": 1, "files": [')
    with pytest.raises(LockFileError, match="unreadable"):
        load_lock(_settings(tmp_path, "cut.json"))


def test_safetensors_bytes():
    assert safetensors_bytes(_lock_file()) is None
    assert safetensors_bytes(_lock(("a.safetensors", 5, "x"), ("b.json", 7, "y"),
                                   ("c.safetensors", 6, "z"))) == 11


# --- the model gates ---------------------------------------------------------------------
def qwen36_lock() -> dict:
    """A lock built for the test, NOT a real one: the reconstructed Qwen3.6-27B config.json
    (tests/fixtures/hf) and 15 safetensors shards totalling 55.6 GB (14 x 3.71 GB +
    3.66 GB), plus the small files that do not count as weights."""
    shards = [(f"model-{i:05d}-of-00015.safetensors", 3_710_000_000, "a" * 64)
              for i in range(1, 15)]
    shards.append(("model-00015-of-00015.safetensors", 3_660_000_000, "a" * 64))
    lock = _lock(("config.json", 3000, "c" * 64), *shards,
                 ("model.safetensors.index.json", 90_000, "d" * 64))
    lock["config"] = json.loads(QWEN36_CONFIG.read_text())
    return lock


TWO_A100 = {"gpus": [{"index": 0, "memory_total_mib": 81920},
                     {"index": 1, "memory_total_mib": 81920}]}


def _gate_settings(**extra):
    data = {"model_id": MODEL_ID, **extra}
    if data.get("vllm_version") == "0.17.0":
        data.setdefault("nvidia_driver_branch", "570-server")  # the stack needs >= 570.124
    return validate(data)


def _by_name(gates: dict) -> dict:
    return {check["name"]: check for check in gates["checks"]}


def test_the_constructed_lock_weighs_55_6_gb():
    assert safetensors_bytes(qwen36_lock()) == 55_600_000_000


def test_gates_on_063_refuse_the_architecture():
    checks = _by_name(model_gates(_gate_settings(vllm_version="0.6.3"), qwen36_lock(), TWO_A100))
    arch = checks["model_architecture"]
    assert arch["ok"] is False and arch["severity"] == "error"
    assert "Qwen3_5ForConditionalGeneration" in arch["detail"] and "0.17.0" in arch["detail"]
    assert "vllm_version" in arch["fix"]


def test_gates_on_017_pass():
    gates = model_gates(_gate_settings(vllm_version="0.17.0"), qwen36_lock(), TWO_A100)
    checks = _by_name(gates)
    assert [c["name"] for c in gates["checks"]] == ["model_architecture", "context_length",
                                                     "capacity"]
    assert all(c["ok"] is True for c in gates["checks"])
    assert checks["context_length"]["detail"] == (
        "max_model_len 131072; the model's max_position_embeddings is 262144")
    assert gates["capacity"]["weights_source"] == "lock"
    assert gates["capacity"]["weights_bytes_per_gpu"] == 27_800_000_000
    assert gates["capacity"]["sequences"] == 10
    assert checks["capacity"]["detail"].startswith("10 sequence(s) of 131072 tokens fit")


def test_gates_use_the_installed_registry_when_given():
    settings = _gate_settings(vllm_version="0.17.0")
    arch = _by_name(model_gates(settings, qwen36_lock(), TWO_A100,
                                registry=["Qwen3_5ForConditionalGeneration"]))
    assert "its installed registry" in arch["model_architecture"]["detail"]
    missing = _by_name(model_gates(settings, qwen36_lock(), TWO_A100, registry=["Qwen2X"]))
    assert missing["model_architecture"]["ok"] is False


def test_gates_1m_context_exceeds_the_model_but_fits_the_gpus():
    checks = _by_name(model_gates(_gate_settings(vllm_version="0.17.0", max_model_len=1048576),
                                  qwen36_lock(), TWO_A100))
    context = checks["context_length"]
    assert context["ok"] is False and "262144" in context["detail"]
    assert context["fix"] == "lower max_model_len to 262144 or less"
    # 32 GiB of KV per GPU for one 1M-token sequence still fits in the 44.71 GiB left
    # after the weights and the reserve: only the model's own limit refuses it.
    assert checks["capacity"]["ok"] is True
    assert checks["capacity"]["detail"].startswith("1 sequence(s) of 1048576 tokens fit")


def test_gates_2m_context_does_not_fit():
    checks = _by_name(model_gates(_gate_settings(vllm_version="0.17.0", max_model_len=2097152),
                                  qwen36_lock(), TWO_A100))
    assert checks["context_length"]["ok"] is False
    capacity = checks["capacity"]
    assert capacity["ok"] is False
    assert "max_model_len 2097152 does not fit" in capacity["detail"]
    for number in ("budget 73.60 GiB (81920 MiB x 0.92)", "weights 25.89 GiB (lock)",
                   "= 44.71 GiB for the KV cache", "64.00 GiB KV"):
        assert number in capacity["detail"]
    assert capacity["fix"].startswith("lower max_model_len to 1462656 or less")


def test_gates_at_lower_utilization_refuse_1m():
    settings = _gate_settings(vllm_version="0.17.0", max_model_len=1048576,
                              gpu_memory_utilization=0.5)
    capacity = _by_name(model_gates(settings, qwen36_lock(), TWO_A100))["capacity"]
    assert capacity["ok"] is False
    assert "budget 40.00 GiB (81920 MiB x 0.5)" in capacity["detail"]
    assert "32.00 GiB KV" in capacity["detail"]


def test_gpu_memory_mib():
    settings = _gate_settings(tensor_parallel_size=2, min_gpu_memory_mib=40960)
    assert gpu_memory_mib({}, settings) == 40960
    assert gpu_memory_mib({"gpus": None}, settings) == 40960
    assert gpu_memory_mib(TWO_A100, settings) == 81920
    # Only the GPUs the server uses count: the first tensor_parallel_size of them.
    mixed = {"gpus": [{"memory_total_mib": 81920}, {"memory_total_mib": 81559},
                      {"memory_total_mib": 40960}]}
    assert gpu_memory_mib(mixed, settings) == 81559
    assert gpu_memory_mib({"gpus": [{"memory_total_mib": None}]}, settings) == 40960


def test_check_context_length_without_a_limit():
    check = check_context_length({"architectures": ["X"]}, _gate_settings())
    assert check["ok"] is None and check["severity"] == "warning"
    top = check_context_length({"max_position_embeddings": 4096}, _gate_settings())
    assert top["ok"] is False and "4096" in top["detail"]


def test_installed_registry():
    path = "/opt/vllm/envs/vllm-0.17.0-ec565792"
    environments = {"current": path, "uv": None, "conda": True, "envs": {path: {
        "marker": {"runtime": {"architectures": ["Qwen3_5ForConditionalGeneration"]}},
        "installed": {"vllm": "0.17.0"}}}}
    assert installed_registry(environments, path) == ["Qwen3_5ForConditionalGeneration"]
    assert installed_registry(environments, "/opt/vllm/envs/other") is None
    assert installed_registry({"envs": {path: {"marker": {"stack": "0.17.0"}}}}, path) is None
    assert installed_registry({"envs": {path: {"marker": None}}}, path) is None
    assert installed_registry({"current": None, "envs": {}, "uv": None, "conda": False},
                              path) is None


# --- the Hugging Face token ------------------------------------------------------------
def test_hf_token_from_setting_then_file_then_environment(tmp_path, monkeypatch):
    from deploys.locks import LockFileError, hf_token

    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    assert hf_token(validate({})) == "hf_from_env"
    secret = tmp_path / "token"
    secret.write_text("hf_from_file\n")
    assert hf_token(validate({"hf_token_file": str(secret)})) == "hf_from_file"
    assert hf_token(validate({"hf_token": "hf_inline", "hf_token_file": str(secret)})) == \
        "hf_inline"
    monkeypatch.delenv("HF_TOKEN")
    assert hf_token(validate({})) is None
    with pytest.raises(LockFileError, match="hf_token_file .*/missing: cannot be read"):
        hf_token(validate({"hf_token_file": str(tmp_path / "missing")}))
