"""Settings: defaults, every kind of refusal, and the message an operator reads."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pyinfra_vllm.core.settings import STAGES, Settings, SettingsError, allowed, validate

# A key of the allowed shape (tests only): 40 characters.
KEY = "sk-test-0123456789abcdefghijklmnopqrstuv"


def test_defaults_are_the_seed_recipe():
    # No key and no gateway_open: refused (tests/unit/test_settings_rejected.py).
    settings = validate({"gateway_open": True})
    assert settings.vllm_version == "0.6.3"
    assert settings.model_id == "Qwen/Qwen3.6-27B"
    assert settings.tensor_parallel_size == 2
    assert settings.max_model_len == 131072
    assert settings.gpu_memory_utilization == 0.92
    assert settings.block_size == 32
    assert settings.sysctl == {"vm.swappiness": 1, "net.core.somaxconn": 65535}
    assert settings.model_volume_mount_options == ["noatime"]
    assert settings.stack.min_driver == "530.30.02"
    assert settings.model_path == "/srv/models/Qwen/Qwen3.6-27B"
    assert settings.vllm_host == "127.0.0.1" and settings.vllm_host_url_part == "127.0.0.1"
    assert settings.metrics_allow == ["127.0.0.1/32"]
    assert Settings.model_fields["gateway_open"].default is False
    assert Settings.model_fields["vllm_listen_beyond_loopback"].default is False
    assert Settings.model_fields["nvidia_apt_repo_trusted"].default is False


def test_enforce_eager_defaults_by_device():
    # None in the model ("by device"); a bool once validated: graphs on cuda (vLLM's own
    # default, twice the output tokens/s: bench/gpu_engine.md), eager on cpu.
    assert Settings.model_fields["enforce_eager"].default is None
    assert validate({"gateway_open": True}).enforce_eager is False
    assert Settings(gateway_open=True).enforce_eager is False
    cpu = {"gateway_open": True, "vllm_device": "cpu", "vllm_version": "0.17.0"}
    assert validate(cpu).enforce_eager is True
    # null given (--data enforce_eager=null): by device again.
    assert validate({**cpu, "enforce_eager": None}).enforce_eager is True


@pytest.mark.parametrize(("data", "given"), [
    ({}, True), ({}, False),
    ({"vllm_device": "cpu", "vllm_version": "0.17.0"}, True),
    ({"vllm_version": "0.33.0", "nvidia_driver_branch": "580-server"}, True),
])
def test_enforce_eager_given_is_kept(data, given):
    assert validate({"gateway_open": True, **data, "enforce_eager": given}).enforce_eager \
        is given


def test_enforce_eager_false_on_cpu_is_refused():
    with pytest.raises(SettingsError) as refused:
        validate({"gateway_open": True, "vllm_device": "cpu", "vllm_version": "0.17.0",
                  "enforce_eager": False}, where="host cpu-1")
    assert str(refused.value).splitlines()[:2] == [
        "invalid settings for host cpu-1:",
        "  (settings): vllm_device cpu needs enforce_eager true: without it vLLM's CPU build "
        "compiles the model with torch inductor, which needs a C++ compiler on the host "
        "(this suite installs none)",
    ]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"block_size": 24}, "block_size = 24: Input should be 8, 16 or 32 (allowed: 8, 16, 32)"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size = 0:"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization = 1.5:"),
        ({"gpu_memory_utilization": 0}, "(allowed: > 0 and <= 1)"),
        ({"max_model_len": -1}, "max_model_len = -1: Input should be greater than or equal to 1"),
        ({"max_model_len": "128k"}, "max_model_len = '128k': Input should be a valid integer"),
        ({"dtype": "fp8"}, "allowed: auto, bfloat16, float16, half, float, float32"),
        (
            {"vllm_version": "9.9"},
            "vllm_version = '9.9': no stack is defined for it; allowed: 0.6.3, 0.17.0, 0.22.0, 0.32.0, "
            "0.33.0",
        ),
        ({"skip_stages": ["gatway"]}, "unknown stage ['gatway']"),
        ({"model_verify": "sha256"}, "model_verify = 'sha256': Input should be 'stat' or "
         "'deep' (allowed: stat, deep)"),
        ({"model_verify": "deep", "skip_stages": ["model"]},
         "model_verify deep re-hashes the model in the model stage, which skip_stages skips: "
         "remove model from skip_stages, or leave model_verify stat and model_repair false"),
        ({"model_repair": True, "skip_stages": ["model"]},
         "model_repair true re-hashes the model in the model stage, which skip_stages skips"),
        ({"python_env_verify": "deep", "skip_stages": ["python_env"]},
         "python_env_verify deep re-hashes the environment in the python_env stage, which "
         "skip_stages skips: remove python_env from skip_stages, or leave python_env_verify "
         "stat and python_env_repair false"),
        ({"python_env_repair": True, "skip_stages": ["python_env"]},
         "python_env_repair true re-hashes the environment in the python_env stage"),
        ({"model_volume_mount_options": ["noatime", "nobarrier"]}, "disables write barriers"),
        ({"model_volume_mount_options": ["barrier=0"]}, "['barrier=0'] disables write barriers"),
        ({"sysctl": {"vm swappiness": 1}}, "is not a sysctl key"),
        ({"model_dir": "relative/path"}, "model_dir = 'relative/path': not an absolute path"),
        ({"max_model_length": 4096}, "max_model_length: unknown setting; did you mean max_model_len?"),
        ({"max_num_seqs": 512, "max_num_batched_tokens": 256}, "must be >= max_num_seqs (512)"),
        (
            {"enable_chunked_prefill": False},
            "without enable_chunked_prefill, max_num_batched_tokens (4096) must be >= "
            "max_model_len (131072)",
        ),
    ],
)
def test_bad_values_are_refused_with_key_value_and_allowed(data, expected):
    with pytest.raises(SettingsError) as refused:
        validate(data, where="host gpu-1")
    message = str(refused.value)
    assert message.startswith("invalid settings for host gpu-1:")
    assert expected in message
    assert "docs/settings.md lists every key" in message


def test_every_problem_is_listed_at_once():
    with pytest.raises(SettingsError) as refused:
        validate({"block_size": 24, "tensor_parallel_size": 0, "gpu_memory_utilization": 1.5})
    lines = str(refused.value).splitlines()
    assert [line.split(" = ")[0].strip() for line in lines[1:4]] == [
        "tensor_parallel_size",
        "gpu_memory_utilization",
        "block_size",
    ]


def test_secrets_are_never_echoed():
    with pytest.raises(SettingsError) as refused:
        validate({"hf_token": ["hf_SECRETVALUE"], "api_keys": "sk-NOTALIST"})
    message = str(refused.value)
    assert "SECRETVALUE" not in message and "NOTALIST" not in message
    assert "hf_token = <secret>" in message


def test_secret_values_are_hidden_in_repr():
    settings = validate({"hf_token": "hf_abc123", "api_keys": [KEY]})
    assert "hf_abc123" not in repr(settings) and KEY not in repr(settings)
    assert settings.hf_token.get_secret_value() == "hf_abc123"


def test_connector_and_foreign_data_are_ignored():
    settings = validate({"ssh_user": "ubuntu", "_sudo": True, "rack": "r12",
                         "sandbox_scenario": "seed", "gateway_open": True})
    assert settings.tensor_parallel_size == 2


def test_settings_are_frozen():
    with pytest.raises(ValidationError):
        validate({"gateway_open": True}).block_size = 16  # type: ignore[misc]


def test_allowed_words():
    assert allowed("block_size") == "allowed: 8, 16, 32"
    assert allowed("vllm_port") == "allowed: >= 1 and <= 65535"
    assert allowed("model_id") is None


def test_every_stage_name_is_accepted_by_skip_stages():
    settings = validate({"skip_stages": list(STAGES), "gateway_open": True})
    assert settings.skip_stages == list(STAGES)


def test_every_setting_is_described():
    for name, field in Settings.model_fields.items():
        assert field.description and len(field.description) > 15, name


def test_the_sandbox_key_file_passes_the_settings(tmp_path):
    from sandbox.hosts import new_api_key

    path = new_api_key(tmp_path / "api-key")
    assert path.stat().st_mode & 0o777 == 0o600
    settings = validate({"api_keys_file": str(path)})
    (key,) = settings.api_keys
    assert len(key.get_secret_value()) == 48
    # A new key at every `up`.
    new_api_key(path)
    assert validate({"api_keys_file": str(path)}).api_keys[0] != key


def test_model_repair_implies_the_deep_check():
    assert validate({"gateway_open": True}).deep_model_check is False
    assert validate({"gateway_open": True, "model_verify": "deep"}).deep_model_check is True
    assert validate({"gateway_open": True, "model_repair": True}).deep_model_check is True
