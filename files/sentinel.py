#!/usr/bin/env python3
"""The engine's sentinel: a one-token completion every interval, the host out of rotation
after a run of failures, the engine restarted with a backoff, and back in once it serves.

    python3 sentinel.py --url http://localhost/v1/completions [--unix-socket PATH]
        --model NAME --interval 30 --timeout 10 --failures 3 [--restart]
        --max-restarts 3 --restart-window 1800 --state PATH [--textfile PATH]
        --drain-flag PATH --leave-flag PATH --rotation-flag PATH --restart-request PATH

Run by its own unit (templates/vllm-sentinel.service.j2), a loop that never ends. Each
round it reads the engine unit's state (``systemctl show``), the suite's drain and leave
flags and the rotation flag, then, unless it pauses, sends the engine a real ``max_tokens=1``
completion (``/health`` answers 200 while the engine core is frozen or wedged) with
``--timeout``. ``step`` is the whole decision, a pure function: after ``--failures``
failures in a row the host leaves the rotation (the rotation flag, holding the word
``sentinel``: nginx answers /health 503 while it exists, /v1 keeps serving) and, with
``--restart``, a restart of the engine is asked for (a write to ``--restart-request``,
which the path unit vllm-sentinel-restart.path turns into ``systemctl restart
--no-block vllm.service``: this process holds no capability and needs none), then again
after a backoff doubling from the interval (capped at BACKOFF_CAP_S), never more than
``--max-restarts`` within ``--restart-window`` (the engine unit's start limit, less the
starts kept for systemd's own retry and the deploy). Once a completion answers again the
host returns to rotation (only a flag holding ``sentinel`` is ever removed).

It pauses (no failure counted, no restart, no flag change) while the drain flag or the
leave flag exists (a rolling restart, pyinfra_vllm/operations/rolling.py: the leave flag
comes first, the engine's restart soon after), while the engine's unit is not
active (starting, reloading, stopping, stopped or failed: a deploy's restart, or an
operator's stop), while another owner's rotation flag exists (python -m tools.tune's,
empty) and while the unit's state cannot be read.

Each change of state is one line on stdout (the journal); the state, the failures in a
row, the last latency, the restarts and the last events are written after every round,
atomically, to ``--state`` (JSON, 0644: nothing secret) and to ``--textfile`` (node
exporter's textfile collector, pyinfra_vllm_sentinel_* gauges). The engine's key comes
from ``VLLM_API_KEY`` (the unit's EnvironmentFile, read by systemd): never in argv or a
line. Standard library only; engine_client.py beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import subprocess
import sys
import time
import urllib.parse
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from engine_client import foreign_listener, request

STATES = ("ok", "failing", "out-of-rotation", "restarting", "paused")
# What the sentinel writes in the rotation flag: a flag holding anything else (tools.tune
# touches an empty one) is another owner's and is never removed.
OWNER = "sentinel"
# The longest wait between two restarts.
BACKOFF_CAP_S = 600
# Events kept in the state file.
EVENTS_KEPT = 20
UNIT = "vllm.service"
# vLLM's counter of the tokens it generated (every stack's metrics have it).
GENERATED = "vllm:generation_tokens_total"


@dataclass(frozen=True)
class Config:
    """The sentinel's settings (its command line)."""

    interval_s: float
    failures: int
    restart: bool
    max_restarts: int
    restart_window_s: float


@dataclass(frozen=True)
class Observation:
    """One round's reading of the host: the engine unit's ActiveState ("" when unknown),
    the drain flag, the rotation flag's owner (None: no flag; "sentinel"; "other"), and the
    probe (None when not sent: paused)."""

    unit: str
    draining: bool
    rotation: str | None
    probe_ok: bool | None = None
    latency_s: float | None = None
    reason: str = ""
    # The engine's vllm:generation_tokens_total after the probe (None: unread).
    generated: float | None = None


@dataclass(frozen=True)
class Memory:
    """What the sentinel carries from one round to the next (and writes as its state)."""

    state: str = "ok"
    failures: int = 0
    last_latency_s: float | None = None
    restarts: int = 0
    restart_times: tuple[float, ...] = ()
    next_restart_at: float = 0.0
    backoff_step: int = 0
    reason: str = ""
    events: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    # The engine's generated tokens as the last round read them (None: unread).
    generated: float | None = None


def pause_reason(unit: str, draining: bool, rotation: str | None) -> str | None:
    """Why the sentinel leaves the host alone this round, or None."""
    if draining:
        return "the suite's drain flag or leave flag is set (a rolling restart)"
    if rotation == "other":
        return "another owner's rotation flag is set (python -m tools.tune)"
    if not unit:
        return f"the state of {UNIT} cannot be read"
    if unit != "active":
        return f"{UNIT} is {unit}"
    return None


def restarts_in_window(memory: Memory, now: float, config: Config) -> int:
    return sum(1 for at in memory.restart_times if now - at < config.restart_window_s)


def step(memory: Memory, seen: Observation, now: float,
         config: Config) -> tuple[Memory, list[str]]:
    """The next memory and the actions of one round: "out" (place the sentinel's rotation
    flag), "in" (remove it), "restart" (ask for the engine's restart)."""
    pause = pause_reason(seen.unit, seen.draining, seen.rotation)
    if pause is not None:
        # The engine starting or stopping after a restart the sentinel asked for is that
        # restart, not a pause.
        if memory.state == "restarting" and seen.unit in ("activating", "deactivating",
                                                          "reloading"):
            # The backoff runs from the end of the engine's start, however long it took.
            wait = _backoff_s(memory.backoff_step - 1, config)
            memory = replace(memory, next_restart_at=max(memory.next_restart_at, now + wait))
            return _moved(memory, "restarting", f"{UNIT} is {seen.unit}", now), []
        return _moved(memory, "paused", pause, now), []
    busy = progress(memory.generated, seen.generated)
    memory = replace(memory, generated=seen.generated)
    if seen.probe_ok or busy:
        actions = ["in"] if seen.rotation == OWNER else []
        reason = (f"{seen.reason}, but the engine generated {busy:g} token(s) since the last "
                  "round: busy, not stuck" if busy and not seen.probe_ok
                  else "a one-token completion answered")
        latency = seen.latency_s if seen.probe_ok else memory.last_latency_s
        return _moved(replace(memory, failures=0, last_latency_s=latency,
                              backoff_step=0, next_restart_at=0.0),
                      "ok", reason, now), actions
    memory = replace(memory, failures=memory.failures + 1)
    reason = f"{memory.failures} failure(s) in a row: {seen.reason}"
    if memory.failures < config.failures:
        return _moved(memory, "failing", reason, now), []
    actions = [] if seen.rotation == OWNER else ["out"]
    if not config.restart:
        return _moved(memory, "out-of-rotation", reason + "; sentinel_restart is off",
                      now), actions
    if restarts_in_window(memory, now, config) >= config.max_restarts:
        return _moved(memory, "out-of-rotation",
                      f"{reason}; {config.max_restarts} restart(s) within "
                      f"{config.restart_window_s:.0f} s already: no more", now), actions
    if now < memory.next_restart_at:
        # A restart asked for is "restarting" until it answers or its backoff ends.
        state = "restarting" if memory.state == "restarting" else "out-of-rotation"
        return _moved(memory, state,
                      f"{reason}; next restart in {memory.next_restart_at - now:.0f} s",
                      now), actions
    wait = _backoff_s(memory.backoff_step, config)
    memory = replace(memory, restarts=memory.restarts + 1,
                     restart_times=(*memory.restart_times, now)[-config.max_restarts:],
                     next_restart_at=now + wait, backoff_step=memory.backoff_step + 1)
    return _moved(memory, "restarting", reason + f"; restart {memory.restarts} asked for",
                  now), [*actions, "restart"]


def progress(before: float | None, after: float | None) -> float:
    """Tokens the engine generated between two rounds' readings (0: none, or unknown). A
    completion that timed out on an engine that generates is a busy engine, whose
    requests wait behind its batch, not a stuck one: restarting it would drop them all."""
    if before is None or after is None or after <= before:
        return 0.0
    return after - before


def _backoff_s(step: int, config: Config) -> float:
    """The wait after the restart of backoff ``step`` (0: the first): the interval,
    doubled at each step, at most BACKOFF_CAP_S."""
    return min(config.interval_s * 2 ** max(step, 0), BACKOFF_CAP_S)


def _moved(memory: Memory, state: str, reason: str, now: float) -> Memory:
    """``memory`` in ``state``; a change of state is one more event (the last kept)."""
    if state == memory.state:
        return replace(memory, reason=reason)
    event = {"time": round(now, 3), "from": memory.state, "to": state, "reason": reason}
    events = (*memory.events, event)[-EVENTS_KEPT:]
    return replace(memory, state=state, reason=reason, events=events)


# --- the host ---------------------------------------------------------------------------
def unit_state() -> str:
    """The engine unit's ActiveState, or "" when systemctl could not say."""
    try:
        proc = subprocess.run(["systemctl", "show", UNIT, "--property=ActiveState", "--value"],
                              capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def rotation_owner(path: str) -> str | None:
    """None when there is no rotation flag, "sentinel" when it holds OWNER, else "other"
    (an unreadable flag is another owner's: never removed)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as flag:
            return OWNER if flag.read().strip() == OWNER else "other"
    except FileNotFoundError:
        return None
    except OSError:
        return "other"


def probe(url: str, unix_socket: str | None, model: str,
          timeout: float) -> tuple[bool, float, str]:
    """One ``max_tokens=1`` completion: (answered with a choice, seconds, why not). The
    caller checked the listener is the engine's user's: no one else gets the key."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1,
                       "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"}
    key = os.environ.get("VLLM_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    start = time.monotonic()
    status, data = request(url, unix_socket, timeout, body, headers)
    took = time.monotonic() - start
    if status != 200:
        what = "no answer" if status is None else f"HTTP {status}"
        return False, took, f"{what} within {timeout:g} s ({_short(data)})"
    try:
        if json.loads(data).get("choices"):
            return True, took, ""
    except (ValueError, AttributeError):
        pass
    return False, took, "an answer without choices"


def generated_tokens(url: str, unix_socket: str | None, timeout: float) -> float | None:
    """The sum of the engine's ``vllm:generation_tokens_total`` samples on its /metrics
    (None: no answer, or no such metric)."""
    metrics = urllib.parse.urlsplit(url)._replace(path="/metrics", query="").geturl()
    status, data = request(metrics, unix_socket, timeout)
    if status != 200:
        return None
    total, found = 0.0, False
    for line in data.decode("utf-8", "replace").splitlines():
        if line.startswith(GENERATED + " ") or line.startswith(GENERATED + "{"):
            try:
                total += float(line.rsplit(" ", 1)[1])
                found = True
            except ValueError:
                return None
    return total if found else None


def _short(data: bytes) -> str:
    return data[:200].decode("utf-8", "replace").replace("\n", " ").strip() or "empty"


def write_atomic(path: str, text: str) -> None:
    """``text`` in ``path`` by a rename (readers never see half a file), mode 0644."""
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as out:
        out.write(text)
    os.chmod(temporary, 0o644)
    os.replace(temporary, path)


def state_record(memory: Memory, now: float) -> dict[str, Any]:
    """The state file's content: the memory (a restarted sentinel carries on from it, its
    restarts within the window counted) and when it was written."""
    record = asdict(memory)
    record["restart_times"] = list(memory.restart_times)
    record["events"] = list(memory.events)
    record["updated"] = round(now, 3)
    return record


def load_memory(path: str) -> Memory:
    """The memory an earlier run of the sentinel wrote to ``path``; a fresh one where there
    is none or it cannot be read."""
    try:
        with open(path, encoding="utf-8") as state:
            record = json.load(state)
        return Memory(state=str(record["state"]), failures=int(record["failures"]),
                      last_latency_s=record.get("last_latency_s"),
                      restarts=int(record["restarts"]),
                      restart_times=tuple(float(at) for at in record["restart_times"]),
                      next_restart_at=float(record["next_restart_at"]),
                      backoff_step=int(record["backoff_step"]),
                      reason=str(record.get("reason", "")),
                      events=tuple(record.get("events") or ()),
                      generated=(float(record["generated"])
                                 if isinstance(record.get("generated"), (int, float))
                                 else None))
    except (OSError, ValueError, KeyError, TypeError):
        return Memory()


def textfile_text(memory: Memory, now: float) -> str:
    """The sentinel's gauges, as node_exporter's textfile collector reads them."""
    lines = ["# Written by pyinfra-vllm's sentinel (files/sentinel.py) every round.",
             "# HELP pyinfra_vllm_sentinel_state The sentinel's state: 1 for the current.",
             "# TYPE pyinfra_vllm_sentinel_state gauge"]
    lines += [f'pyinfra_vllm_sentinel_state{{state="{name}"}} {int(name == memory.state)}'
              for name in STATES]
    latency = "NaN" if memory.last_latency_s is None else f"{memory.last_latency_s:.3f}"
    for name, kind, words, value in (
        ("consecutive_failures", "gauge", "Failed one-token completions in a row.",
         memory.failures),
        ("last_latency_seconds", "gauge", "Seconds the last answered completion took.",
         latency),
        ("restarts_total", "counter", "Engine restarts the sentinel asked for.",
         memory.restarts),
        ("last_round_timestamp_seconds", "gauge", "When the sentinel last looked.",
         f"{now:.0f}"),
    ):
        lines += [f"# HELP pyinfra_vllm_sentinel_{name} {words}",
                  f"# TYPE pyinfra_vllm_sentinel_{name} {kind}",
                  f"pyinfra_vllm_sentinel_{name} {value}"]
    return "\n".join(lines) + "\n"


def apply(actions: list[str], args: argparse.Namespace) -> None:
    for action in actions:
        if action == "out":
            write_atomic(args.rotation_flag, OWNER + "\n")
        elif action == "in" and rotation_owner(args.rotation_flag) == OWNER:
            os.unlink(args.rotation_flag)
        elif action == "restart":
            write_atomic(args.restart_request, f"{time.time():.0f}\n")


def observe(args: argparse.Namespace) -> Observation:
    unit = unit_state()
    draining = os.path.exists(args.drain_flag) or os.path.exists(args.leave_flag)
    rotation = rotation_owner(args.rotation_flag)
    if pause_reason(unit, draining, rotation) is not None:
        return Observation(unit, draining, rotation)
    uid = os.getuid() if args.engine_user is None else pwd.getpwnam(args.engine_user).pw_uid
    # Only a listener of the engine's user is asked: no one else gets the key.
    foreign = foreign_listener(args.url, args.unix_socket, uid)
    if foreign is not None:
        return Observation(unit, draining, rotation, False, 0.0, foreign)
    ok, took, reason = probe(args.url, args.unix_socket, args.model, args.timeout)
    generated = generated_tokens(args.url, args.unix_socket, args.timeout)
    return Observation(unit, draining, rotation, ok, took, reason, generated)


def round_once(memory: Memory, args: argparse.Namespace, config: Config) -> Memory:
    """One round: look, decide, act, record."""
    seen = observe(args)
    now = time.time()
    after, actions = step(memory, seen, now, config)
    apply(actions, args)
    if after.state != memory.state:
        print(f"sentinel: {memory.state} -> {after.state}: {after.reason}", flush=True)
    write_atomic(args.state, json.dumps(state_record(after, now), indent=1) + "\n")
    if args.textfile and os.path.isdir(os.path.dirname(args.textfile)):
        write_atomic(args.textfile, textfile_text(after, now))
    return after


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sentinel.py", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the engine's /v1/completions")
    parser.add_argument("--unix-socket", help="reach the engine through this socket")
    parser.add_argument("--engine-user", help="the user the listener must be (default: this one)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--interval", type=float, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--failures", type=int, required=True)
    parser.add_argument("--restart", action="store_true")
    parser.add_argument("--max-restarts", type=int, required=True)
    parser.add_argument("--restart-window", type=float, required=True)
    parser.add_argument("--state", required=True)
    parser.add_argument("--textfile")
    parser.add_argument("--drain-flag", required=True)
    parser.add_argument("--leave-flag", required=True)
    parser.add_argument("--rotation-flag", required=True)
    parser.add_argument("--restart-request", required=True)
    parser.add_argument("--rounds", type=int, help="stop after this many rounds (tests)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    config = Config(args.interval, args.failures, args.restart, args.max_restarts,
                    args.restart_window)
    memory = load_memory(args.state)
    print(f"sentinel: watching {args.unix_socket or args.url} every {args.interval:g} s "
          f"(timeout {args.timeout:g} s, out after {args.failures} failure(s), restart "
          f"{'on' if args.restart else 'off'})", flush=True)
    rounds = 0
    while args.rounds is None or rounds < args.rounds:
        start = time.monotonic()
        try:
            memory = round_once(memory, args, config)
        except OSError as exc:
            # A flag, the state or the textfile that cannot be written: said, and the next
            # round tries again (the state on disk, and the alerts, then age).
            print(f"sentinel: this round's files could not be written: {exc}", flush=True)
        rounds += 1
        if args.rounds is None or rounds < args.rounds:
            time.sleep(max(0.0, args.interval - (time.monotonic() - start)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
