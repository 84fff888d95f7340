"""Pure helpers of the vLLM service: flags, systemd quoting, the unit and its env file."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys

import pytest
from pyinfra.api import OperationValueError

from files.vllm_probe import server_flags as help_server_flags
from pyinfra_vllm.core.settings import Settings, validate
from pyinfra_vllm.plans.engine_access import (
    KEY_ENV_PATH,
    SOCKET_DIR,
    SOCKET_PATH,
    endpoint,
    listens_beyond_loopback,
)
from pyinfra_vllm.plans.engine_plan import engine_expected, engine_plan, render_unit
from pyinfra_vllm.plans.vllm_service import (
    environment_pairs,
    render_env,
    server_flags,
    shm_problem,
    systemd_quote,
    unknown_flags,
)

PYTHON = "/opt/vllm/envs/vllm-0.6.3/bin/python"
CACHE = "/var/cache/vllm/vllm-0.6.3"
MODEL = "/srv/models/Qwen/Qwen3.6-27B"
# `systemd-analyze security --offline=true` on the default unit, systemd 252 (Debian 12).
EXPOSURE = "1.9"

DEFAULT_EXEC_START = (
    f'"{PYTHON}" "-m" "vllm.entrypoints.openai.api_server" '
    f'"--model" "{MODEL}" "--served-model-name" "Qwen/Qwen3.6-27B" '
    '"--host" "127.0.0.1" "--port" "8000" "--tensor-parallel-size" "2" "--dtype" "bfloat16" '
    '"--max-model-len" "131072" "--gpu-memory-utilization" "0.92" "--block-size" "32" '
    '"--max-num-seqs" "256" "--max-num-batched-tokens" "4096" "--enable-chunked-prefill" '
    # enforce_eager resolves to false on cuda, and 0.6.3's --enforce-eager has no "off"
    # spelling (a plain switch): nothing.
    '"--seed" "42" "--disable-log-requests"'
)

# Options of vLLM 0.6.3's OpenAI server that the defaults use (its --help names them).
HELP_063 = """
usage: api_server.py [-h] [--host HOST] [--port PORT] [--model MODEL]
  --served-model-name SERVED_MODEL_NAME [SERVED_MODEL_NAME ...]
  --tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp TENSOR_PARALLEL_SIZE
  --dtype {auto,half,float16,bfloat16,float,float32}
  --max-model-len MAX_MODEL_LEN  --gpu-memory-utilization GPU_MEMORY_UTILIZATION
  --block-size {8,16,32}  --max-num-seqs MAX_NUM_SEQS
  --max-num-batched-tokens MAX_NUM_BATCHED_TOKENS
  --enable-chunked-prefill [ENABLE_CHUNKED_PREFILL]  --enforce-eager
  --enable-prefix-caching  --seed SEED  --disable-custom-all-reduce
  --disable-log-requests  --api-key API_KEY
"""


def unit(settings: Settings | None = None, systemd_version: int = 249, **kwargs) -> str:
    settings = settings or Settings(gateway_open=True)
    engine = engine_plan(settings, python=kwargs.pop("python", PYTHON),
                         model_path=kwargs.pop("model_path", MODEL), place=endpoint(settings),
                         **kwargs)
    return render_unit(engine, systemd_version=systemd_version)


def directives(text: str) -> list[tuple[str, str]]:
    """(key, value) of every directive, continuation lines joined as systemd does."""
    logical, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith(("#", ";"))):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    return [tuple(item.split("=", 1)) for item in logical if "=" in item and
            not item.startswith("[")]


def values(text: str, key: str) -> list[str]:
    return [re.sub(r"\s+", " ", value) for k, value in directives(text) if k == key]


def systemd_words(line: str) -> list[str]:
    """Split a command line of double-quoted words the way systemd does (our subset)."""
    words = []
    for match in re.finditer(r'"((?:[^"\\]|\\.)*)"', line):
        word = re.sub(r"\\(.)", r"\1", match.group(1))
        words.append(word.replace("%%", "%").replace("$$", "$"))
    return words


def test_exec_start_for_the_default_settings():
    assert values(unit(), "ExecStart") == [DEFAULT_EXEC_START]


def test_guard_ready_and_environment_lines():
    text = unit()
    assert values(text, "ExecStartPre") == [
        # 0.6.3 listens on TCP: its firewall before it binds the port.
        "+/usr/sbin/nft -f /etc/vllm/engine-firewall.nft",
        "-+/usr/bin/nvidia-modprobe -u -c=0",
        f'"{PYTHON}" "/usr/local/lib/pyinfra-vllm/gpu_guard.py" "--expect-gpus" "2" '
        '"--devices" "0,1" "--require-nvlink"',
    ]
    assert values(text, "ExecStartPost") == [
        f'"{PYTHON}" "/usr/local/lib/pyinfra-vllm/wait_ready.py" '
        '"--url" "http://127.0.0.1:8000/health" "--model" "Qwen/Qwen3.6-27B" '
        '"--warmups" "3" "--request-timeout" "300"'
    ]
    env = values(text, "Environment")
    for wanted in ('"CUDA_VISIBLE_DEVICES=0,1"', '"CUDA_DEVICE_ORDER=PCI_BUS_ID"',
                   '"HOME=/var/lib/vllm"', '"HF_HUB_OFFLINE=1"',
                   f'"VLLM_CACHE_ROOT={CACHE}/vllm"', f'"TRITON_CACHE_DIR={CACHE}/triton"',
                   '"HF_HOME=/var/lib/vllm/cache/huggingface"'):
        assert wanted in env
    assert not any("NCCL_P2P_LEVEL" in line for line in env)
    assert values(text, "EnvironmentFile") == ["/etc/vllm/vllm.env", KEY_ENV_PATH]
    assert values(text, "User") == ["vllm"] and values(text, "Group") == ["vllm"]
    assert values(text, "TimeoutStartSec") == ["1800"]
    assert values(text, "TimeoutStopSec") == ["120"]
    assert values(text, "KillMode") == ["control-group"]


def test_what_the_engine_compiles_is_kept_in_its_environment_and_writable_there_alone():
    """The compile cache is a directory of the engine's user inside its environment: kept
    across restarts, new with a new stack's environment, pruned with its environment."""
    text = unit()
    assert (values(text, "CacheDirectory"), values(text, "CacheDirectoryMode")) == (
        ["vllm/vllm-0.6.3"], ["0700"])
    assert values(text, "ReadWritePaths") == ["/var/lib/vllm"]
    other = unit(python="/opt/vllm/envs/vllm-0.33.0-1a2b3c4d/bin/python")
    assert values(other, "CacheDirectory") == ["vllm/vllm-0.33.0-1a2b3c4d"]
    cpu = dict(environment_pairs(validate({"vllm_device": "cpu", "vllm_version": "0.32.0",
                                           "gateway_open": True}),
                                 PYTHON, [], "0|1"))
    assert (cpu["VLLM_CACHE_ROOT"], "TRITON_CACHE_DIR" in cpu) == (f"{CACHE}/vllm", False)


def test_workaround_switches_and_pcie_and_devices():
    settings = validate({"gateway_open": True, "nccl_p2p_level": "NVL", "disable_custom_all_reduce": True,
                         "allow_pcie_tensor_parallel": True})
    text = unit(settings, devices=[2, 3])
    assert '"NCCL_P2P_LEVEL=NVL"' in values(text, "Environment")
    assert '"CUDA_VISIBLE_DEVICES=2,3"' in values(text, "Environment")
    assert values(text, "ExecStart")[0].endswith('"--disable-custom-all-reduce" '
                                                 '"--disable-log-requests"')
    guard = values(text, "ExecStartPre")[-1]
    assert '"--devices" "2,3"' in guard and "--require-nvlink" not in guard
    with pytest.raises(OperationValueError, match="tensor_parallel_size 2"):
        unit(devices=[0])


def test_restart_steps_only_where_systemd_has_them():
    assert values(unit(), "StartLimitBurst") == ["5"]
    assert values(unit(systemd_version=252), "RestartSteps") == []
    assert values(unit(systemd_version=254), "RestartSteps") == ["5"]


def test_no_secret_in_the_unit():
    text = unit(validate({"hf_token": "hf_secret-in-unit-0001", "gateway_open": True}))
    assert "hf_secret" not in text and "HF_TOKEN=" not in text


@pytest.mark.parametrize(
    ("word", "quoted"),
    [
        ("plain", '"plain"'),
        ("two words", '"two words"'),
        ("50%", '"50%%"'),
        ("$HOME", '"$$HOME"'),
        ('say "hi"', '"say \\"hi\\""'),
        ("back\\slash", '"back\\\\slash"'),
    ],
)
def test_systemd_quote(word, quoted):
    assert systemd_quote(word) == quoted
    assert systemd_words(quoted) == [word]


def test_quoting_of_a_value_with_spaces_percent_and_dollar_in_the_unit():
    # The settings refuse such a name (tests/unit/test_settings_rejected.py); the unit
    # quotes whatever it is given all the same.
    settings = Settings.model_construct(served_model_name='my model 100% $cost "q"')
    exec_start = values(unit(settings), "ExecStart")[0]
    assert '"--served-model-name" "my model 100%% $$cost \\"q\\""' in exec_start
    argv = systemd_words(exec_start)
    assert argv[argv.index("--served-model-name") + 1] == 'my model 100% $cost "q"'
    # Environment= expands specifiers but not variables: % doubled, $ kept.
    assert systemd_quote("A=5% $x", exec_line=False) == '"A=5%% $x"'
    # Description= carries the name too: its % is doubled.
    assert "Description=vLLM OpenAI-compatible server (my model 100%% $cost" in unit(settings)


def test_control_characters_and_unsafe_paths_are_refused():
    with pytest.raises(OperationValueError, match="control character"):
        systemd_quote("a\nb")
    with pytest.raises(OperationValueError, match="no spaces"):
        unit(model_path="/srv/my models/x")


def test_server_flags_choose_spellings_from_the_installed_help():
    accepted_063 = set(help_server_flags(HELP_063))
    default = Settings(gateway_open=True)
    assert unknown_flags(server_flags(default, MODEL, place=endpoint(default)),
                         accepted_063) == []
    off = validate({"enable_chunked_prefill": False, "max_num_batched_tokens": 131072, "gateway_open": True})
    # 0.6.3's StoreBoolean takes a value: off must be said, as the flag's value.
    flags = server_flags(off, MODEL, accepted_063, place=endpoint(off))
    assert "--enable-chunked-prefill=false" in flags
    assert unknown_flags(flags, accepted_063) == []
    # A newer server with BooleanOptionalAction lists --no-...: that spelling is used.
    newer = accepted_063 | {"--no-enable-chunked-prefill", "--no-enable-prefix-caching"}
    newer -= {"--disable-log-requests"}
    flags = server_flags(off, MODEL, newer, place=endpoint(off))
    assert "--no-enable-chunked-prefill" in flags and "--no-enable-prefix-caching" in flags
    assert "--disable-log-requests" not in flags
    assert unknown_flags(flags, newer) == []


def test_unknown_flags():
    accepted = set(help_server_flags(HELP_063))
    assert "--enable-chunked-prefill" in accepted and "--no-enable-chunked-prefill" not in accepted
    assert unknown_flags(["--model", "/m", "--rope-theta", "1e6", "--seed", "1"], accepted) == [
        "--rope-theta"
    ]
    # --no-X is an option of its own: known only if the server lists it.
    assert unknown_flags(["--no-enable-chunked-prefill"], accepted) == [
        "--no-enable-chunked-prefill"
    ]
    assert unknown_flags(["--no-enable-chunked-prefill"],
                         accepted | {"--no-enable-chunked-prefill"}) == []
    # --name=value is checked by name; each unknown option once.
    assert unknown_flags(["--enable-chunked-prefill=false", "--x=1", "--x=2"], accepted) == ["--x"]


def test_env_file_without_and_with_secrets():
    empty = render_env()
    assert [line for line in empty.splitlines() if not line.startswith("#")] == []
    assert "No secrets configured." in empty
    text = render_env(hf_token="hf_abc123")
    assert "HF_TOKEN='hf_abc123'\n" in text
    # The engine's own key is made on the host, in a file of its own.
    assert "VLLM_API_KEY" not in text
    with pytest.raises(OperationValueError) as raised:
        render_env(hf_token="it's")
    assert "HF_TOKEN" in str(raised.value) and "it's" not in str(raised.value)


@pytest.mark.parametrize(("address", "beyond"), [
    ("127.0.0.1", False), ("127.0.1.1", False), ("::1", False), ("localhost", False),
    ("0.0.0.0", True), ("::", True), ("10.0.0.5", True), ("fd00::5", True),
    ("gpu-1.internal", True),
])
def test_listens_beyond_loopback(address, beyond):
    assert listens_beyond_loopback(address) is beyond


def beyond_loopback(**data):
    # vllm_listen_beyond_loopback: the settings' own consent to a non-loopback vllm_host
    # (where settings know it; ignored where they do not).
    return validate({"vllm_listen_beyond_loopback": True, "vllm_engine_allow": ["10.0.0.7"],
                     **data})


def test_the_engine_never_gets_a_client_key_only_its_own_file():
    keys = ["sk-first-" + "1" * 32, "sk-second-" + "2" * 32]
    for settings in (validate({"api_keys": keys}),
                     beyond_loopback(vllm_host="10.0.0.5", api_keys=keys)):
        engine = engine_plan(settings, python=PYTHON, model_path=MODEL, place=endpoint(settings))
        text = render_unit(engine)
        assert not any(key in text for key in keys) and "--api-key" not in text
        assert f"EnvironmentFile={KEY_ENV_PATH}\n" in text
        assert engine_expected(engine)["secret_sha256"] == {}
        assert engine_expected(engine, key_sha256="ab")["secret_sha256"] == {"VLLM_API_KEY": "ab"}


def test_a_stack_with_a_unix_socket_serves_on_it_in_a_directory_for_nginx_alone():
    settings = validate({"vllm_version": "0.17.0", "gateway_open": True,
                         "nvidia_driver_branch": "570-server"})
    text = unit(settings)
    assert f'"--uds" "{SOCKET_PATH}"' in text
    assert '"--host"' not in text and '"--port"' not in text
    assert (f"ExecStartPre=+/usr/bin/install -d -o vllm -g www-data -m 0750 {SOCKET_DIR}\n"
            f"ExecStartPre=+/usr/bin/rm -f {SOCKET_PATH}\n"
            f"ExecStopPost=+/usr/bin/rm -f {SOCKET_PATH}\n") in text
    assert f"ReadWritePaths=/var/lib/vllm -{SOCKET_DIR}\n" in text
    # The readiness wait reaches it through the socket.
    assert f'"--url" "http://localhost/health" "--unix-socket" "{SOCKET_PATH}"' in text
    # Beyond loopback it is TCP, as on a stack without --uds (0.6.3).
    for tcp in (beyond_loopback(vllm_version="0.17.0", vllm_host="10.0.0.5",
                                nvidia_driver_branch="570-server",
                                api_keys=["sk-first-" + "1" * 32]),
                validate({"gateway_open": True})):
        text = unit(tcp)
        assert '"--uds"' not in text and SOCKET_DIR not in text
        assert '"--host"' in text and '"--port" "8000"' in text


def test_unit_parses_as_ini_with_the_expected_sections():
    parser = configparser.ConfigParser(strict=False, interpolation=None,
                                       comment_prefixes=("#", ";"))
    parser.optionxform = str  # keys are case-sensitive in systemd
    # configparser has no backslash continuation: join lines as systemd does first.
    parser.read_string("\n".join(f"{k}={v}" if v is not None else k for k, v in
                                 _sections_and_directives(unit())))
    assert parser.sections() == ["Unit", "Service", "Install"]
    assert parser["Service"]["Type"] == "exec"
    assert parser["Service"]["ProtectSystem"] == "strict"
    assert parser["Service"]["ReadWritePaths"] == "/var/lib/vllm"
    assert parser["Service"]["CapabilityBoundingSet"] == ""
    assert parser["Service"]["DeviceAllow"] == "char-nvidia* rw"
    assert "PrivateDevices" not in parser["Service"]
    assert "MemoryDenyWriteExecute" not in parser["Service"]
    assert parser["Unit"]["RequiresMountsFor"] == MODEL
    assert parser["Install"]["WantedBy"] == "multi-user.target"


def _sections_and_directives(text: str):
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("["):
            yield line, None
        else:
            yield tuple(line.split("=", 1))


def test_shm_check():
    assert shm_problem(64 * 1024 * 1024, 1024).startswith("/dev/shm is 64 MiB, below")
    assert shm_problem(None, 1024).startswith("/dev/shm is not mounted")
    assert shm_problem(64 * 1024**3, 1024) is None


SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_security_exposure(tmp_path):
    path = tmp_path / "vllm.service"
    path.write_text(unit())
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "security", "--offline=true", "--no-pager", str(path)],
        capture_output=True, text=True, timeout=120,
    )
    # Offline analysis parses the file: a key this systemd does not know is reported.
    assert "Unknown key" not in result.stderr, result.stderr
    match = re.search(r"Overall exposure level for vllm\.service: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert match.group(1) == EXPOSURE, result.stdout


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify(tmp_path):
    # verify needs the executables to exist: this interpreter stands in for the env's.
    path = tmp_path / "vllm.service"
    path.write_text(unit(python=sys.executable))
    result = subprocess.run([SYSTEMD_ANALYZE, "verify", str(path)],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    output = result.stdout + result.stderr
    if result.returncode != 0 and "vllm.service" not in output:
        pytest.skip(f"systemd-analyze verify cannot run here: {output.strip()[:200]}")
    assert (result.returncode, output) == (0, "")


def test_default_unit_file_is_valid_for_old_systemd_by_construction():
    # Directives newer than systemd 249 must not appear in the default unit.
    keys = {key for key, _value in directives(unit())}
    assert not keys & {"RestartSteps", "RestartMaxDelaySec", "MemoryKSM", "PrivatePIDs"}
    assert values(unit(), "ProtectControlGroups") == ["yes"]  # not 257's private/strict


def test_request_logging_flag_follows_the_stack_before_the_server_is_known():
    # An environment built in this run: its --help is not known when the unit is planned.
    old = validate({"gateway_open": True})
    new = validate({"gateway_open": True, "vllm_version": "0.17.0",
                    "nvidia_driver_branch": "570-server"})
    assert "--disable-log-requests" in server_flags(old, MODEL, place=endpoint(old))
    assert not any("log-requests" in flag
                   for flag in server_flags(new, MODEL, place=endpoint(new)))
    # Known: the installed server decides.
    assert "--disable-log-requests" not in server_flags(old, MODEL, {"--model"},
                                                        place=endpoint(old))


@pytest.mark.parametrize(("data", "eager_flags"), [
    # cuda: enforce_eager resolves to false (CUDA graphs and torch.compile). 0.6.3's
    # --enforce-eager is a plain switch: "off" is saying nothing.
    ({}, []),
    # Newer servers (the stack row's spelling, before the server is known): --no-X.
    ({"vllm_version": "0.17.0", "nvidia_driver_branch": "570-server"},
     ["--no-enforce-eager"]),
    ({"vllm_version": "0.33.0", "nvidia_driver_branch": "580-server"},
     ["--no-enforce-eager"]),
    # Given: kept, on cuda too.
    ({"enforce_eager": True}, ["--enforce-eager"]),
    # cpu: true, what its build needs.
    ({"vllm_device": "cpu", "vllm_version": "0.17.0"}, ["--enforce-eager"]),
])
def test_enforce_eager_flag_follows_the_device(data, eager_flags):
    settings = validate({"gateway_open": True, **data})
    flags = server_flags(settings, MODEL, place=endpoint(settings))
    assert [flag for flag in flags if "enforce-eager" in flag] == eager_flags


def test_a_server_with_shutdown_timeout_serves_its_requests_out_on_a_stop():
    # vLLM 0.33.0 has --shutdown-timeout: the unit asks vllm_shutdown_timeout_s of it, and
    # systemd waits that much longer before its SIGKILL; 0.6.3 aborts on SIGTERM.
    new = validate({"gateway_open": True, "vllm_version": "0.33.0",
                    "nvidia_driver_branch": "580-server", "vllm_shutdown_timeout_s": 45})
    flags = server_flags(new, MODEL, place=endpoint(new))
    assert flags[flags.index("--shutdown-timeout") + 1] == "45"
    assert values(unit(new), "TimeoutStopSec") == ["165"]
    # SIGTERM to the API server alone: a TP worker given SIGTERM exits at once.
    assert values(unit(new), "KillMode") == ["mixed"]
    old = Settings(gateway_open=True)
    assert "--shutdown-timeout" not in server_flags(old, MODEL, place=endpoint(old))
    assert values(unit(old), "TimeoutStopSec") == ["120"]
    assert values(unit(old), "KillMode") == ["control-group"]
    # Known: the installed server decides, whatever the row says.
    assert "--shutdown-timeout" not in server_flags(new, MODEL, {"--model"},
                                                    place=endpoint(new))
    assert values(unit(new, accepted={"--model"}), "TimeoutStopSec") == ["120"]
    assert "--shutdown-timeout" in server_flags(old, MODEL, {"--shutdown-timeout"},
                                                place=endpoint(old))
