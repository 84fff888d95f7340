"""Try the vLLM engine on this machine by hand, before provisioning it: exit 0 it served
and was measured.

    python -m tools.engine_trial INVENTORY --limit HOST --python ENV/bin/python
        [--model-dir DIR] [--devices 0,1] [--data KEY=VALUE ...] [--concurrency N]
        [--input-len N] [--output-len N] [--requests N] [--ready-timeout S]
        [--stop-timeout S] [--port N] [--marker FILE] [--load-format dummy]
        [--engine-arg=--OPTION[=VALUE] ...] [--engine-env NAME=VALUE ...]
        [--bench-runs N] [--state-dir DIR] [--record PATH] [--plan-only]

Run from the repository root, on the machine to try (a new server, or a new stack's
environment on one), as a user who can read the model; no systemd, nginx or SSH. The
inventory gives only the settings of its one host ``--limit`` names (group_data/ and
its host data, ``--data`` over them, as pyinfra merges them; a group or a glob of
several hosts, or none, is refused), validated as a run validates them: a bad value
stops the trial before anything starts, naming it. From them, the code that renders the
engine's unit (pyinfra_vllm/plans/engine_plan.py) renders the engine's command line and
environment, the readiness wait's arguments (the unit's ExecStartPost) and the benchmark
client's, in the settings' shape (``bench_*`` times ``bench_scale``; ``--concurrency``,
``--input-len``, ``--output-len`` and ``--requests`` replace their setting before the
scale, as in tools.bench). files/engine_trial.py runs that plan on this machine: it
checks the interpreter's vLLM is the settings' stack and the model's config.json (exit
2, nothing started), starts the engine in the foreground, waits for it with
files/wait_ready.py, sends one chat completion, runs files/bench_client.py (vLLM's own
benchmark client) against it, stops it (also on Ctrl-C) and prints the record as JSON
on stdout (``--record`` writes it too); its progress on stderr.

Unlike its unit, each said as the trial starts and kept in the record: it listens on a
free loopback TCP port (``--port`` for another), never beyond loopback (vLLM's client
reaches a server by URL only); its key is made for the trial and given to it in its
environment alone, never in argv or the output; it runs as the invoking user, without
systemd, so without the unit's hardening, GPU guard, firewall or restarts; its state
(HOME, HF_HOME), its compile cache (VLLM_CACHE_ROOT, TRITON_CACHE_DIR) and, on CPU, its
AMX permission are in the trial's own 0700 directory.

- ``--python``: the interpreter of the environment to try (``/opt/vllm/current/bin/python``
  on a provisioned host).
- ``--model-dir``: the model's own directory, the one holding its config.json and
  weights (the unit's ``--model``); default ``model_dir/model_id`` of the settings.
- ``--devices``: the GPUs (vllm_device cuda), as CUDA_VISIBLE_DEVICES numbers; default
  the first tensor_parallel_size. On CPU the workers' threads are bound as the unit binds
  them: vllm_cpu_threads_bind, else this machine's online CPUs and NUMA nodes (the read
  preflight makes: facts.cpu_host.CpuHostState).
- ``--marker``: the environment's marker (pyinfra-vllm-env.json, written by
  files/vllm_probe.py) whose recorded server options pick the flags' spelling, as the
  unit's are picked; default the one of ``--python``'s environment, where it has one;
  without one, the stack row's spellings (as a unit rendered before its environment).
- ``--ready-timeout`` (default vllm_start_timeout_s), ``--stop-timeout`` (default the
  unit's TimeoutStopSec: SIGKILL to the engine's process group after it).
- ``--load-format dummy``: random weights of the model's shapes (vLLM's own option):
  the engine, its memory and its speed tried before the weights are on the machine;
  the answers mean nothing.
- ``--engine-arg=--OPTION[=VALUE]`` and ``--engine-env NAME=VALUE``: an option or a
  variable the trial adds to the unit's (each said as it starts and in the record), for
  what a trial needs and a unit does not (a model directory without its processor files:
  ``--engine-arg=--limit-mm-per-prompt={"image":0,"video":0}``). One the unit sets from
  the settings is refused: change the setting (``--data``).
- ``--bench-runs N``: the benchmark N times against the one engine (default 1): the
  first warms it (Triton's kernels and the graphs' shapes are compiled on first use),
  the record keeps each run (``bench_runs``) and the last (``bench``).
- ``--state-dir DIR``: the engine's state directory (the unit's /var/lib/vllm: HOME,
  HF_HOME) and, in its ``compile-cache``, the environment's compile cache (the unit's
  ``/var/cache/vllm/<env>``: VLLM_CACHE_ROOT with torch.compile's artifacts,
  TRITON_CACHE_DIR) and the engine's key (``engine-key``, 0600; vLLM keys its compile
  cache on VLLM_API_KEY too), kept after the trial, so a
  second trial with it starts as a restarted unit does, from what the first compiled
  (vLLM keys its compile cache on, among others, VLLM_CONFIG_ROOT, which follows HOME:
  a fresh HOME each time compiles each time); made 0700, or one of this user's no one
  else may write.
- ``--plan-only``: print the plan for files/engine_trial.py and start nothing: for a
  machine without this repository's Python packages (copy files/ and the plan there,
  then ``python3 engine_trial.py --plan PLAN.json``; ``--data vllm_cpu_threads_bind``
  and ``--marker`` say what this machine cannot read of that one).

Exit status: 0 the engine served the completion and the benchmark with no failed request;
1 it did not become ready, a request failed, or it could not be stopped; 2 bad input
(usage, the host, a setting, the interpreter, the model, the port), nothing started.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from facts.cpu_host import CpuHostState
from facts.python_env import MARKER
from pyinfra_vllm.core.settings import Settings, SettingsError, validate
from pyinfra_vllm.plans import bench as bench_plan
from pyinfra_vllm.plans import engine_access
from pyinfra_vllm.plans import vllm_service as vllm_service_plan
from pyinfra_vllm.plans.engine_access import Endpoint
from pyinfra_vllm.plans.engine_plan import EnginePlan, engine_plan, ready_argv, stop_timeout_s
from pyinfra_vllm.plans.python_env import COMPILE_CACHE_ROOT, compile_cache
from tools import bench as bench_tool
from tools import scrape_config
from tools.tune import UsageError, resolve_host

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "files" / "engine_trial.py"
# What a machine needs of the suite to run a plan (--plan-only): the runner and the
# scripts beside it that it runs or imports.
RUNNER_FILES = ("engine_trial.py", "engine_client.py", "wait_ready.py", "bench_client.py",
                "vllm_probe.py", "amx_permission.py")
# Where the trial's engine listens: loopback only, whatever the settings say.
TRIAL_HOST = "127.0.0.1"
CHAT = {"prompt": "Hello! Who are you?", "max_tokens": 16}
# The benchmark client's environment from the settings, less the gateway's key and
# certificate: the trial's client talks to the engine itself, with the trial's key.
GATEWAY_ONLY_ENV = ("OPENAI_API_KEY", "SSL_CERT_FILE")
# A variable --engine-env may add.
ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}\n{self.format_usage().strip()}")


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of at least 1")
    return int(text)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = _Parser(prog="python -m tools.engine_trial", description=__doc__.splitlines()[0])
    parser.add_argument("inventory")
    parser.add_argument("--limit", required=True, metavar="HOST")
    parser.add_argument("--python", required=True, metavar="PATH")
    parser.add_argument("--model-dir", metavar="DIR")
    parser.add_argument("--devices", metavar="0,1")
    parser.add_argument("--data", action="append", default=[], metavar="KEY=VALUE")
    for option in bench_tool.SHAPE_OPTIONS:
        parser.add_argument(option, type=_at_least_one, metavar="N")
    parser.add_argument("--ready-timeout", type=_at_least_one, metavar="S")
    parser.add_argument("--stop-timeout", type=_at_least_one, metavar="S")
    parser.add_argument("--port", type=_at_least_one, metavar="N")
    parser.add_argument("--marker", metavar="FILE")
    parser.add_argument("--load-format", choices=["dummy"])
    parser.add_argument("--engine-arg", action="append", default=[], metavar="--OPTION[=VALUE]")
    parser.add_argument("--engine-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--bench-runs", type=_at_least_one, default=1, metavar="N")
    parser.add_argument("--state-dir", metavar="DIR")
    parser.add_argument("--record", metavar="PATH")
    parser.add_argument("--plan-only", action="store_true")
    return parser.parse_args(list(argv))


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``--data`` as pyinfra reads it, then the shape's options as their settings."""
    from pyinfra_cli.util import parse_cli_arg

    data: dict[str, Any] = {}
    for item in args.data:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--data {item!r} is not KEY=VALUE")
        data[key] = parse_cli_arg(value)
    for option, setting in bench_tool.SHAPE_OPTIONS.items():
        value = getattr(args, option.lstrip("-").replace("-", "_"))
        if value is not None:
            data[setting] = value
    return data


def host_settings(args: argparse.Namespace, port: int) -> tuple[str, Settings, Settings]:
    """(the host's name, its settings, the trial's): the trial's listen on loopback at
    ``port``, each validated whole (SettingsError names the host and the key)."""
    extra = overrides(args)
    try:
        name = resolve_host(args.inventory, args.limit, why="a trial runs one host's engine")
        data = dict(scrape_config.inventory_hosts(args.inventory, extra))[name]
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the inventory's own Python raised
        raise UsageError(f"{args.inventory}: pyinfra cannot read it as an inventory "
                         f"({type(exc).__name__}: {exc})") from None
    listen = {"vllm_host": TRIAL_HOST, "vllm_port": port, "vllm_listen_beyond_loopback": False}
    return (name, validate(data, where=f"host {name}"),
            validate({**data, **listen}, where=f"host {name} (listening as the trial)"))


def free_port() -> int:
    """A loopback port nothing listens on now (files/engine_trial.py checks it again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((TRIAL_HOST, 0))
        return int(probe.getsockname()[1])


def local_threads_bind(tp: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for this machine's online CPUs and NUMA nodes, read as
    preflight reads a host's (facts.cpu_host.CpuHostState), bound as the stage binds."""
    fact = CpuHostState()
    proc = subprocess.run(["sh", "-c", fact.command()], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    cpu = fact.process(proc.stdout.splitlines())
    return vllm_service_plan.cpu_threads_bind(cpu["cpus"], cpu["numa_nodes"], tp)


def placement(settings: Settings, devices: str | None) -> tuple[list[int] | None, str | None]:
    """(GPUs, CPU threads' binding) of the trial's engine, or UsageError."""
    tp = settings.tensor_parallel_size
    if settings.vllm_device == "cpu":
        if devices is not None:
            raise UsageError("--devices: GPUs, and vllm_device is cpu: the CPUs come from "
                             "vllm_cpu_threads_bind (--data), else this machine's")
        bind = settings.vllm_cpu_threads_bind or local_threads_bind(tp)
        if bind is None:
            raise UsageError(f"fewer online CPUs here than the {tp} CPU workers "
                             "(tensor_parallel_size): lower it or set vllm_cpu_threads_bind")
        return None, bind
    if devices is None:
        return None, None
    words = devices.split(",")
    if not all(word.isdigit() for word in words) or len(set(words)) != len(words):
        raise UsageError(f"--devices {devices}: GPU numbers, each once, joined by commas")
    if len(words) != tp:
        raise UsageError(f"--devices {devices}: {len(words)} GPU(s) for tensor_parallel_size "
                         f"{tp}: name {tp}")
    return [int(word) for word in words], None


def server_options(python: str, marker: str | None, settings: Settings
                   ) -> tuple[set[str] | None, str]:
    """The installed server's options from the environment's marker, as the stage takes
    them (None without one: the stack row's spellings), and where they came from."""
    path = Path(marker) if marker else Path(python).parent.parent / MARKER
    if marker is None and not path.is_file():
        return None, (f"its flags are spelled as the stack row says: {python}'s environment "
                      f"has no {MARKER} (files/vllm_probe.py's record of its server's options)")
    try:
        runtime = json.loads(path.read_text())["runtime"]
        flags, found = set(runtime["flags"]), (runtime.get("vllm_dist", "vllm"), runtime["vllm"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--marker {path}: not an environment's marker ({exc!r})") from None
    stack = settings.stack
    if found != (stack.dist, stack.vllm):
        raise UsageError(f"{path}: its environment has {found[0]} {found[1]}, the settings' "
                         f"stack is {stack.dist} {stack.vllm}: give --data vllm_version="
                         f"{found[1]} (and vllm_device), or the interpreter of that stack")
    return flags, f"its flags are spelled as {path} records its server's options, as the unit's"


def trial_engine(settings: Settings, args: argparse.Namespace, port: int
                 ) -> tuple[EnginePlan, str, tuple[list[str], list[tuple[str, str]]]]:
    """The trial's engine, rendered by engine_plan as the unit's is, on loopback at
    ``port``; where its flags' spelling came from; what the trial adds to it."""
    devices, threads_bind = placement(settings, args.devices)
    accepted, source = server_options(args.python, args.marker, settings)
    place = Endpoint(socket=None, address=engine_access.engine_address(TRIAL_HOST, port))
    plan = engine_plan(settings, python=args.python,
                       model_path=args.model_dir or settings.model_path, devices=devices,
                       accepted=accepted, threads_bind=threads_bind, place=place)
    unknown = vllm_service_plan.unknown_flags(plan.flags, accepted) if accepted else []
    if unknown:
        raise UsageError(f"the server of {args.python} does not accept {', '.join(unknown)}: "
                         "change the setting that adds it, or vllm_version")
    return plan, source, trial_additions(plan, args, accepted)


def trial_additions(plan: EnginePlan, args: argparse.Namespace,
                    accepted: set[str] | None) -> tuple[list[str], list[tuple[str, str]]]:
    """The options and variables the trial adds to the unit's engine (``--load-format``,
    ``--engine-arg``, ``--engine-env``), or UsageError: one the unit sets itself is
    refused (the trial would no longer be the unit's), as is an option the installed
    server does not list."""
    words = (["--load-format", args.load_format] if args.load_format else []) + args.engine_arg
    for word in words:
        if word.startswith("-") and not word.startswith("--"):
            raise UsageError(f"--engine-arg {word}: a long option (--name or --name=value)")
    names = [word.split("=", 1)[0] for word in words if word.startswith("--")]
    if words and not words[0].startswith("--"):
        raise UsageError(f"--engine-arg {words[0]}: an option first (--name or --name=value)")
    unit_names = {flag.split("=", 1)[0] for flag in plan.flags if flag.startswith("--")}
    taken = sorted(set(names) & unit_names)
    if taken:
        raise UsageError(f"--engine-arg {', '.join(taken)}: the unit sets it from the "
                         "settings: change the setting (--data) instead")
    unknown = vllm_service_plan.unknown_flags(names, accepted) if accepted else []
    if unknown:
        raise UsageError(f"--engine-arg: the server of {args.python} does not accept "
                         f"{', '.join(unknown)}")
    return words, trial_env(plan, args.engine_env)


def trial_env(plan: EnginePlan, items: list[str]) -> list[tuple[str, str]]:
    """``--engine-env`` as (name, value), or UsageError: a variable the unit sets is
    refused."""
    env: list[tuple[str, str]] = []
    unit_env = {name for name, _ in plan.environment} | {"VLLM_API_KEY", "PATH"}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not ENV_NAME.fullmatch(name) or "\n" in value:
            raise UsageError(f"--engine-env {item!r}: NAME=VALUE, NAME in capitals, digits "
                             "and _, the value on one line")
        if name in unit_env:
            raise UsageError(f"--engine-env {name}: the unit sets it itself")
        env.append((name, value))
    return env


def relocations(settings: Settings, python: str) -> list[dict[str, Any]]:
    """The unit's directories the trial has its own copy of: its state (the engine's
    user's, never written by a trial), the compile cache of ``python``'s environment (the
    engine user's too; kept in the state directory, where there is one) and, on CPU, the
    AMX permission's site directory."""
    moved: list[dict[str, Any]] = [
        {"unit": vllm_service_plan.STATE_DIR, "trial": "state"},
        {"unit": compile_cache(python), "trial": "compile-cache", "kept": True},
    ]
    if settings.vllm_device == "cpu":
        site = Path(vllm_service_plan.AMX_PERMISSION_PATH).name
        moved.append({"unit": vllm_service_plan.ENGINE_SITE_DIR, "trial": "engine-site",
                      "files": {site: "amx_permission.py"}})
    return moved


def home_words(state: str | None) -> str:
    """Where the trial's engine keeps its state, in words."""
    unit = (f"not in {vllm_service_plan.STATE_DIR} and {COMPILE_CACHE_ROOT} (the engine's "
            "user's)")
    if state is None:
        return f"HOME, HF_HOME and the compile cache are in the trial's directory, {unit}"
    return (f"HOME and HF_HOME are in {state} and the compile cache in {state}/compile-cache,"
            f" {unit}, kept after the trial (--state-dir) with the engine's key (its "
            "engine-key, 0600: vLLM's compile cache is keyed on it too): a later trial with "
            "it starts from what this one compiled")


def differences(plan: EnginePlan, unit: Settings, source: str, ready_s: int,
                stop_s: int, added: tuple[list[str], list[tuple[str, str]]] = ([], []),
                state: str | None = None) -> list[str]:
    """How the trial's engine differs from its unit's, in words."""
    listen = " ".join(engine_access.server_listen_flags(unit, engine_access.endpoint(unit)))
    words = [
        f"it listens on {plan.endpoint.address}, a free loopback port, not on the unit's "
        f"{listen}: vLLM's benchmark client reaches a server by URL only",
        "its key (VLLM_API_KEY) is made for this trial and given to it in its environment "
        f"alone; the unit's is in {engine_access.KEY_ENV_PATH}",
        "it runs in the foreground as the invoking user, in a process group of its own, "
        "without systemd: none of the unit's hardening (its user, NoNewPrivileges, "
        "ProtectSystem, the system-call filter, the device policy), no GPU guard, no "
        "firewall, no restart; its output goes to the trial's log, not the journal",
        home_words(state),
    ]
    if unit.vllm_device == "cpu":
        words.append("PYTHONPATH is the trial's copy of files/amx_permission.py, not "
                     f"{vllm_service_plan.ENGINE_SITE_DIR}")
    if added[0]:
        words.append(f"the trial adds the options {' '.join(added[0])}"
                     + (" (random weights of the model's shapes: its figures are not "
                        "the model's answers)" if "--load-format" in added[0] else ""))
    if added[1]:
        words.append("the trial adds to its environment "
                     + " ".join(f"{name}={value}" for name, value in added[1]))
    return [*words,
            f"it must be ready within {ready_s} s (the unit's TimeoutStartSec "
            f"{unit.vllm_start_timeout_s} s)",
            f"it is stopped with SIGTERM to its process group, SIGKILL after {stop_s} s",
            source]


def rendered(plan: EnginePlan, unit: Settings, args: argparse.Namespace, host: str,
             source: str, added: tuple[list[str], list[tuple[str, str]]],
             server: Sequence[str] | None = None) -> dict[str, Any]:
    """The plan files/engine_trial.py runs (its module docstring says what it does)."""
    settings = plan.settings
    ready_s = args.ready_timeout or settings.vllm_start_timeout_s
    stop_s = args.stop_timeout or stop_timeout_s(plan)
    url = plan.endpoint.url("")
    state = str(Path(args.state_dir).absolute()) if args.state_dir else None
    argv = plan.argv if server is None else [plan.python, *server, *plan.flags]
    return {
        "host": host, "python": plan.python, "argv": [*argv, *added[0]],
        "environment": [list(pair) for pair in [*plan.environment, *added[1]]],
        "state_dir": state, "bench_runs": args.bench_runs,
        "cwd": vllm_service_plan.STATE_DIR, "relocate": relocations(settings, plan.python),
        "model": settings.model_name, "model_path": plan.model_path, "url": url,
        # wait_ready.py's arguments, after the interpreter and the script's path.
        "ready": ready_argv(settings, plan.python, "wait_ready.py", plan.endpoint)[2:],
        "ready_timeout_s": ready_s,
        "chat": CHAT, "request_timeout_s": settings.vllm_warmup_timeout_s,
        "bench": bench_plan.client_args(settings, settings.bench_shape, base_url=url,
                                        tokenizer=plan.model_path),
        "bench_env": {name: value for name, value in bench_plan.client_env(settings).items()
                      if name not in GATEWAY_ONLY_ENV},
        "bench_timeout_s": bench_plan.TIMEOUT_S, "shape": settings.bench_shape,
        "stack": bench_plan.stack_words(settings),
        "vllm": {"dist": settings.stack.dist, "version": settings.stack.vllm},
        "device": {"kind": settings.vllm_device, "threads_bind": plan.threads_bind,
                   "gpus": None if settings.vllm_device == "cpu" else list(plan.devices)},
        "stop_timeout_s": stop_s,
        "differences": differences(plan, unit, source, ready_s, stop_s, added, state),
    }


def build(args: argparse.Namespace, server: Sequence[str] | None = None) -> dict[str, Any]:
    """The trial's plan for the command line ``args``; UsageError or SettingsError."""
    port = args.port or free_port()
    if port > 65535:
        raise UsageError(f"--port {port}: at most 65535")
    host, unit, trial = host_settings(args, port)
    plan, source, added = trial_engine(trial, args, port)
    return rendered(plan, unit, args, host, source, added, server)


def run_plan(plan: dict[str, Any], record: str | None) -> int:
    """files/engine_trial.py with ``plan`` on its stdin; its exit status. It shares the
    terminal's Ctrl-C (and stops its engine on it): this process waits for it; a SIGTERM
    or SIGHUP sent here is passed on."""
    command = [sys.executable, str(RUNNER), "--plan", "-",
               *(["--record", record] if record else [])]
    previous = {signum: signal.getsignal(signum)
                for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, text=True)
    # After the start: an ignored SIGINT would be the trial's too (inherited across exec).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda number, frame: proc.send_signal(number))
    try:
        if proc.stdin is None:  # stdin=PIPE: never None
            raise RuntimeError("the trial was started without its input pipe")
        proc.stdin.write(json.dumps(plan))
        proc.stdin.close()
        return proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run(argv: Sequence[str], *, server: Sequence[str] | None = None) -> int:
    """The command; its exit status.

    + server: for tests only: the words that take the place of ``-m
      vllm.entrypoints.openai.api_server`` in the engine's command line (the rest is the
      unit's), e.g. ``[".../files/openai_stub.py"]``, a stand-in that runs no model
    """
    try:
        args = parse_args(argv)
        plan = build(args, server)
    except (UsageError, SettingsError) as exc:
        print(f"engine-trial: {exc}", file=sys.stderr)
        return 2
    if args.plan_only:
        print(json.dumps(plan, indent=1, sort_keys=True))
        return 0
    return run_plan(plan, args.record)


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
