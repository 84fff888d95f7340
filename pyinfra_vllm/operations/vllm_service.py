"""vLLM service: the systemd unit and its secret environment file, rendered from settings.

The unit runs ``python -m vllm.entrypoints.openai.api_server`` from the stack's Python
environment as the non-root ``vllm`` user, on loopback behind the gateway, with the GPU
guard (``files/gpu_guard.py``) as ``ExecStartPre`` and a readiness wait
(``files/wait_ready.py``) as ``ExecStartPost``, so the unit is "active" only once the
weights are loaded and ``TimeoutStartSec`` is the load's deadline. Every argument of the
command lines is quoted for systemd (``systemd_quote``). The flags come from settings
(``server_flags``) and are checked against the installed server's ``--help``
(``unknown_flags``) before the unit is written, so a flag the installed vLLM does not know
fails the deploy instead of crash-looping the service.

Secrets go to root-only 0600 files, never into the unit, which any user can read with
``systemctl cat``, nor onto the command line (``--api-key`` would show in ``ps``): the
engine's own key (VLLM_API_KEY, made on the host inside the restart's slot) goes to
``/etc/vllm/engine-key.env`` (pyinfra_vllm/plans/engine_access.py). The engine needs no
HF_TOKEN (its weights are local, HF_HUB_OFFLINE=1): ``/etc/vllm/vllm.env`` holds none.

The render helpers are pure, so unit tests call them without a pyinfra host; the
operations (below them) install nothing themselves: the deploy writes the files with
pyinfra's own operations, then ``restarted``/``running`` start the engine and report.
"""

from __future__ import annotations

from typing import Any

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, QuoteString, StringCommand, operation

from facts.bench import BenchRecord, parse_record
from facts.units import UnitActivation
from facts.vllm_service import EngineFirewall, EngineKey, EngineProcess
from pyinfra_vllm.core.host_text import printable
from pyinfra_vllm.operations.util import rolling as rolling_util
from pyinfra_vllm.operations.util.jobs import connector_arguments
from pyinfra_vllm.operations.util.uploads import SECRET_DIR, env_file_text, secret_file
from pyinfra_vllm.operations.util.vllm_service import (
    JOURNAL_LINES,
    canary_command,
    engine_key_command,
    failure_reason,
    gateway_reload_command,
    idle_command,
    limit_reset_then,
    not_reached_command,
    record_command,
    restart_command,
    rollback_command,
)
from pyinfra_vllm.plans import bench as bench_plan
from pyinfra_vllm.plans import engine_access
from pyinfra_vllm.plans.engine_access import KEY_READ
from pyinfra_vllm.plans.vllm_service import (
    ENGINE_PROCESS_READ,
    UNIT,
    difference_words,
    engine_differences,
)

# The canary's environment (its API key): uploaded root-only for the restart, removed by
# the canary as it reads it, and by the restart whatever happened.
CANARY_ENV_NAME = "bench/canary-env"
CANARY_ENV = f"{SECRET_DIR}/{CANARY_ENV_NAME}"


def _journal_on_failure(command: StringCommand) -> StringCommand:
    """``command``; when it fails, the unit's last journal lines on stderr (pyinfra prints
    a failed command's output) and the failure kept."""
    return StringCommand(
        command, "|| { rc=$?; journalctl -u", UNIT, "-n", str(JOURNAL_LINES),
        "--no-pager -o cat >&2; exit $rc; }",
    )


def _report_ready(state, host) -> bool:
    found = host.get_fact(UnitActivation, unit=UNIT) or {}
    seconds = found.get("start_to_active_s")
    host.log_styled(
        f"vLLM is {found.get('active')}: ready {seconds} s after its start (health, a "
        "one-token completion and the warm-ups answered)",
        fg="green" if found.get("active") == "active" else "yellow",
        log_func=logger.info,
    )
    return found.get("active") == "active"


def _roll(state, host, staged: list[list[str]], start: bool, serving: bool, batch: int,
          leave_s: int, grace_s: int, python: str, metrics_url: str, client: list[str],
          new_key: bool, canary: dict | None = None, env_link: dict | None = None) -> bool:
    pairs = [(path, digest) for path, digest in staged]
    arguments = connector_arguments(host)

    def run(command: StringCommand):
        return host.run_shell_command(command, print_output=state.print_output,
                                      print_input=state.print_input, **arguments)

    try:
        return _roll_host(state, host, run, pairs, start, serving, batch, leave_s, grace_s,
                          python, metrics_url, client, new_key, canary, env_link)
    finally:
        if canary:
            run(StringCommand("rm -f", QuoteString(CANARY_ENV)))


def _roll_host(state, host, run, pairs, start, serving, batch, leave_s, grace_s, python,
               metrics_url, client, new_key, canary, env_link) -> bool:
    """_roll's work for one host, in its slot (``run``: a command on the host)."""

    def work() -> str | None:
        if serving:
            ok, output = _drained(run, leave_s)
            if not ok:
                return "to drain: " + (" ".join(output.stderr_lines) or "touch failed")
            _, output = run(idle_command(python, metrics_url, grace_s, client))
            host.log_styled(f"drained: {' '.join(output.stdout_lines)}", log_func=logger.info)
        if new_key:
            ok, output = run(engine_key_command())
            if not ok:
                return "the engine's key: " + (" ".join(output.stderr_lines) or "not made")
        ok, output = run(restart_command(pairs, start, keep_previous=bool(canary)))
        if not ok:
            # Still drained (a failed engine serves nothing); rolling.not_draining puts
            # the host back once a later run has its engine running.
            return "readiness: " + failure_reason(output.stderr_lines)
        if new_key:
            # nginx sends the engine its new key before the host serves again.
            ok, output = run(gateway_reload_command())
            if not ok:
                return "nginx reload for the engine's new key: " + failure_reason(
                    output.stderr_lines)
        if serving:
            _rejoined(run, leave_s)
        if start:
            _report_ready(state, host)
        if canary:
            return _canary(host, run, canary, [path for path, _ in pairs], env_link, leave_s)
        return None

    outcome = rolling_util.rollout(state, batch, host.name).step(host.name, serving, work)
    if outcome is None:
        return True
    if outcome.startswith(rolling_util.STOPPED):
        # Not reached: the staged files go, the live unit and the engine stay as they are,
        # and the environment link the run moved points where the unit's engine runs from.
        run(not_reached_command([path for path, _ in pairs], env_link))
    host.log_styled(outcome, fg="red", log_func=logger.error)
    return False


def _drained(run, leave_s: int) -> tuple[bool, Any]:
    """The host out of the load balancers, ``leave_s`` waited, then draining
    (``rolling_util.drain_commands``), stopping at a command that fails: its (ok, output)."""
    for command in rolling_util.drain_commands(leave_s):
        ok, output = run(command)
        if not ok:
            break
    return ok, output


def _rejoined(run, leave_s: int) -> None:
    """The host serving again, and back in the load balancers' pools before its slot
    goes to the next host (``rolling_util.rejoin_commands``)."""
    for command in [rolling_util.undrain_command(), *rolling_util.rejoin_commands(leave_s)]:
        run(command)


def _canary(host, run, canary: dict, paths: list[str], env_link: dict | None,
            leave_s: int) -> str | None:
    """The restarted host benchmarked in its previous record's shape, through its
    gateway, its record's files kept first. Within the bound: the kept files dropped,
    None. Worse, not measured, or the record not kept: ``_rejected`` puts the host back
    as it was before the run and says why (the rollout stops)."""
    textfile = canary["textfile"]
    kept, output = run(record_command("keep", textfile))
    if not kept:
        why = ("its benchmark record could not be kept for a put back, so the canary did "
               "not run: " + failure_reason(output.stderr_lines))
        return _rejected(host, run, why, paths, env_link, None, leave_s)
    entry, worse = _measured(run, canary)
    if worse is not None or entry is None:
        return _rejected(host, run, str(worse), paths, env_link, textfile, leave_s)
    run(rolling_util.previous_dropped_command(paths))
    run(record_command("drop", textfile))
    # Goodput, or output tokens/s and TTFT p95 (printable: the records are the host's).
    host.log_styled(bench_plan.canary_words(canary["previous"], entry), fg="green",
                    log_func=logger.info)
    return None


def _measured(run, canary: dict) -> tuple[dict | None, str | None]:
    """The canary's record (None: its benchmark did not run) and why it is worse than
    the previous one beyond the bound (None: within it)."""
    ok, output = run(canary_command(canary, CANARY_ENV))
    lines = [line for line in output.stdout_lines if line.startswith("bench: {")]
    entry = parse_record(lines[-1].removeprefix("bench: ")) if ok and lines else None
    if entry is None:
        return None, "the canary's benchmark did not run: " + failure_reason(output.stderr_lines)
    return entry, bench_plan.regression(canary["previous"], entry, canary["bound"])


def _rejected(host, run, why: str, paths: list[str], env_link: dict | None,
              textfile: str | None, leave_s: int) -> str:
    """The host drained (out of the load balancers first, for ``leave_s``) and put back
    as it was before the run: the unit and environment file it ran with, the environment
    link (``env_link``), restarted on them until ready, and its benchmark record (its
    files were kept, with node_exporter's ``textfile``; None: not kept, the canary did not
    run); then serving again. The reason the rollout stops, naming what was rejected and
    what was put back."""
    what = _put_back_words(env_link, textfile is not None)
    host.log_styled(printable(f"canary: {why}: putting back {what}"), fg="red",
                    log_func=logger.error)
    _drained(run, leave_s)
    back, output = run(rollback_command(paths, env_link))
    record_failed = ""
    if textfile is not None:
        record_back, record_output = run(record_command("put-back", textfile))
        if not record_back:
            record_failed = ("; its benchmark record could not be put back: "
                             + failure_reason(record_output.stderr_lines))
    rejected = f"the canary: {why}"
    if not back:
        # Left drained: rolling.not_draining serves again once a run has it running.
        return printable(f"{rejected}; the put back ({what}) or the engine's restart on it "
                         f"failed: {failure_reason(output.stderr_lines)}{record_failed}")
    _rejoined(run, leave_s)
    if record_failed:
        return printable(f"{rejected}; put back and ready again but for its record"
                         f"{record_failed}")
    return printable(f"{rejected}; everything put back as it was before the run: {what}, "
                     "the engine ready again on them")


def _put_back_words(env_link: dict | None, record: bool) -> str:
    """What a rejected canary puts back, in words."""
    parts = ["its unit", "environment file"]
    if env_link is not None:
        before = env_link["before"]
        parts.append(f"{env_link['path']} -> {before}" if before is not None else
                     f"no {env_link['path']} (there was none)")
    if record:
        parts.append("benchmark record")
    return ", ".join(parts[:-1]) + " and " + parts[-1]


@operation(is_idempotent=False)
def restarted(start: bool = True, staged: dict[str, str] | None = None, batch: int = 1,
              leave_s: int = 0, grace_s: int = 0, python: str = "python3",
              metrics_url: str = "http://127.0.0.1:8000/metrics",
              client: list[str] | None = None, new_key: bool = False,
              canary: dict | None = None, env_link: dict | None = None):
    """
    Restart the engine after its unit or environment changed, rolling: at most ``batch``
    hosts of the run at once, each drained first, and none once a host failed readiness
    (pyinfra_vllm/operations/rolling.py). Use with ``_if=any_changed(...)``.

    + start: restart it (start it when stopped); False restarts it only if it runs
    + staged: ``{live path: sha256}`` of the files staged for this restart
      (``file_set.present(stage=True)``), moved into place inside the slot
    + batch: the run's rolling_batch (0: no limit)
    + leave_s: drain_leave_s, how long the host is out of the load balancers (/health 503)
      while /v1 still serves, before the drain
    + grace_s: drain_grace_s, the longest wait for in-flight requests
    + python: the interpreter that runs files/engine_idle.py (the environment's)
    + metrics_url: the engine's /metrics
    + client: how files/engine_idle.py reaches it (``--unix-socket PATH``, or nothing)
    + new_key: make the engine's own key first (its files missing or disagreeing), and
      reload nginx for it once the engine is ready, before the host serves again
    + canary: the canary's benchmark (``{"python", "args", "env", "stack", "textfile",
      "bound"}``: the client's interpreter, arguments without the shape, environment with
      the API key, the record's words, node_exporter's textfile, rollout_max_regression);
      None: no canary
    + env_link: the environment link this run moved, ``{"path", "before"}`` (its target
      before; None: there was none), put back where the rollout leaves the unit; None: not moved

    An engine that runs (``UnitActivation`` when the operation executes) takes a slot,
    leaves the load balancers (/health 503, /v1 served) for ``leave_s``, is drained (the
    gateway answers 503 on /v1 too), waits until no request is in flight or the grace
    ends, gets the staged files, restarts, and is put back once ready: ``systemctl
    restart`` returns when ExecStartPost's readiness wait (health, a one-token completion,
    the warm-ups) answered, its start limit reset first (as ``running``). One that does
    not run takes no slot and is not drained. A restart that fails prints the unit's
    journal lines since, stops the rollout with the last readiness line, and leaves the
    host drained; a host the rollout did not reach fails with "rollout stopped: host X
    failed readiness: ..." and keeps its unit and environment link.

    With ``canary``, a serving host that has a benchmark record (facts.bench.BenchRecord)
    is benchmarked in that record's shape once it serves again; a result worse than
    ``bound`` allows (goodput down where both records have it under the same latency
    targets, else output tokens/s down or TTFT p95 up; or a failed request) drains it,
    puts back its unit, environment file, environment link and record as they were,
    restarts it until ready and stops the rollout, naming both figures. No record: ungated.
    """
    found = host.get_fact(UnitActivation, unit=UNIT) or {}
    serving = found.get("active") == "active"
    previous = host.get_fact(BenchRecord, **bench_plan.RECORD_READ) if canary and serving and start else None
    gate = None
    if previous is not None and canary is not None:
        yield from secret_file(env_file_text(canary["env"]), CANARY_ENV_NAME)
        gate = {**{key: value for key, value in canary.items() if key != "env"},
                "previous": previous}
    yield FunctionCommand(_roll, (sorted([path, digest] for path, digest in (staged or {}).items()),
                                  start, serving, batch, leave_s, grace_s, python, metrics_url,
                                  list(client or []), new_key, gate, env_link), {})


@operation()
def running(start: bool = True):
    """
    Keep the engine enabled at boot and, with ``start``, running.

    + start: start it when it is not running; False only enables it

    Enabled (and running): no command. The start resets the unit's start limit first
    (a crash loop that hit it refuses starts for the rest of its interval); a start that
    fails prints the unit's last journal lines, where the GPU guard's one-line reason is.
    """
    found = host.get_fact(UnitActivation, unit=UNIT)
    if found is None:
        host.noop(f"{UNIT} is not installed")
        return
    changed = False
    if found["enabled"] != "enabled":
        yield StringCommand("systemctl enable", UNIT)
        changed = True
    if start and found["active"] != "active":
        yield _journal_on_failure(limit_reset_then("start"))
        yield FunctionCommand(_report_ready, (), {})
        changed = True
    if not changed:
        host.noop(f"{UNIT} is enabled" + (" and active" if start else ""))


def _report_hung(state, host, status: int) -> bool:
    host.log_styled(f"vLLM is active but did not answer /health within 5 s "
                    f"({'no answer' if status == 0 else f'HTTP {status}'}): restarted",
                    fg="yellow", log_func=logger.warning)
    return True


@operation()
def answering(active: bool = False, status: int | None = None):
    """
    Name an engine that is active yet does not answer ``/health`` (alive and hung: stopped
    with SIGSTOP, or wedged); ``restarted``, with this operation's result in its ``_if``,
    then restarts it and waits for its readiness again.

    + active: the unit is active (its readiness passed: a starting engine is not hung)
    + status: ``facts.vllm_service.EngineHealth`` (0: no answer within 5 s; None: no curl)
    """
    if not active or status in (200, None):
        host.noop("the engine answers /health" if active else f"{UNIT} is not active")
        return
    yield FunctionCommand(_report_hung, (status,), {})


@operation()
def engine_key():
    """
    Make the engine's own key where its files are missing or disagree (both from one
    value, a valid engine file kept; pyinfra_vllm/operations/util/vllm_service.py), and reload nginx
    for it where nginx runs. For the gateway stage, whose site includes nginx's file: the
    vllm_service stage makes the key inside the engine's restart instead. A new key
    (the engine's file lost) fails the host while the engine runs, since only its
    restart gives it the key: nginx keeps sending the one the engine knows.
    """
    if host.get_fact(EngineKey, **KEY_READ) is not None:
        host.noop("the engine's key is in place")
        return
    yield engine_key_command(refuse_while_running=True)
    yield gateway_reload_command()


@operation()
def engine_firewall(rules: str | None = None):
    """
    Keep the engine's nftables table loaded as its file says (the file written first,
    at ``engine_access.FIREWALL_PATH``), or, where the engine needs none (a Unix socket),
    no such table. The file is loaded whole in one transaction: the port is never open
    between the old rules and the new.

    + rules: ``engine_access.render_firewall``'s file, or None for no firewall
    """
    loaded = host.get_fact(EngineFirewall, **engine_access.FIREWALL_READ)
    nft = QuoteString(engine_access.NFT)
    if rules is None:
        if loaded is None:
            host.noop("the engine needs no firewall, and none is loaded")
            return
        yield StringCommand(nft, "delete table inet", QuoteString(engine_access.FIREWALL_TABLE))
        return
    if loaded == engine_access.loaded_digest(rules):
        host.noop("the engine's firewall is loaded")
        return
    yield StringCommand(nft, "-f", QuoteString(engine_access.FIREWALL_PATH))


@operation()
def flags_accepted(python: str, marker: str, flags: list[str]):
    """
    Stop before the unit is written when the installed server does not accept a flag.

    + python: the environment's interpreter
    + marker: the environment's marker file (its ``runtime.flags``: the server's --help)
    + flags: the server arguments the unit will pass

    For an environment built in this same run, whose flags were not known when the run
    was planned; otherwise the deploy checks them before adding any operation.
    """
    options = sorted({flag.split("=", 1)[0] for flag in flags if flag.startswith("--")})
    yield StringCommand(
        QuoteString(python), "-c", QuoteString(_FLAGS_CHECK), QuoteString(marker),
        *(QuoteString(option) for option in options),
    )


# Run by flags_accepted on the host: exit 1 naming the options the server lacks.
_FLAGS_CHECK = (
    "import json, sys; known = set(json.load(open(sys.argv[1]))['runtime']['flags']); "
    "bad = [f for f in sys.argv[2:] if f not in known]; "
    "bad and sys.exit('the installed vLLM server does not accept ' + ', '.join(bad) + "
    "': change the setting that adds it, or the stack (vllm_version)')"
)


def _report_stale(state, host, words: str) -> bool:
    host.log_styled(f"vLLM runs with another configuration than its unit: {words}; "
                    "restarting it", fg="yellow", log_func=logger.warning)
    return True


@operation()
def engine_current(expected: dict[str, Any]):
    """
    Find an engine that runs with another command line, environment or hardening than
    its unit and environment file give (a unit edited without a restart, a drop-in, a
    changed environment file): then log what differs. Use before ``restarted`` with
    ``_if=any_changed(..., this)``, which restarts it.

    + expected: ``engine_expected`` for the unit this run renders

    No engine running, or one that agrees: no command. Compared on the main process
    only (facts.vllm_service.EngineProcess); secrets by sha256, never shown; hardening
    by its ``/proc/PID/status`` lines (NoNewPrivs, Seccomp, the capability sets).
    """
    found = host.get_fact(EngineProcess, **ENGINE_PROCESS_READ)
    differences = engine_differences(found, expected)
    if differences is None:
        host.noop(f"{UNIT} has no running main process")
        return
    if not differences["argv"] and not differences["env"] and not differences["hardening"]:
        host.noop(f"{UNIT} runs with its unit's command line, environment and hardening")
        return
    yield FunctionCommand(_report_stale, (difference_words(differences),), {})
