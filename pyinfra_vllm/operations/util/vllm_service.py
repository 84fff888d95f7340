"""The commands the engine's operations run: restart it with its start limit reset, wait
until it is idle, and say why a restart failed."""

from __future__ import annotations

import json
import posixpath
from collections.abc import Sequence

from pyinfra.api import QuoteString, StringCommand

from pyinfra_vllm.operations.util import rolling as rolling_util
from pyinfra_vllm.operations.util.uploads import sourced
from pyinfra_vllm.plans import bench as bench_plan
from pyinfra_vllm.plans.engine_access import KEY_ENV_PATH, KEY_NGINX_PATH, KEY_RE
from pyinfra_vllm.plans.vllm_service import (
    IDLE_PATH,
    SERVICE,
    SERVICE_USER,
    UNIT,
)

JOURNAL_LINES = 15
REFUSED_WHILE_RUNNING = (
    "the engine's key file {env_path} is missing or holds no valid key while "
    f"{UNIT} runs: a new key would not reach the running engine, and nginx would send it "
    "a key it does not know. Nothing was changed: run the vllm_service stage "
    "(deploys/full.py), which makes the key inside the engine's restart")


def limit_reset_then(verb: str) -> StringCommand:
    """``systemctl VERB`` the engine, its start limit reset first (``systemctl
    reset-failed``, as systemd.unit(5) advises for a deliberate start). The reset's own
    failure is ignored: systemd refuses it for a unit it has not loaded yet (a first
    install, even after daemon-reload), which has no count to reset."""
    return StringCommand("{ systemctl reset-failed", UNIT, "2>/dev/null; systemctl", verb,
                         UNIT, "; }")


# The states in which ``systemctl try-restart`` restarts a unit: an engine that runs.
RUNNING_STATES = "active|activating|reloading"


def stop_as_started() -> StringCommand:
    """The engine stopped under the unit it was started with, before another replaces it
    (systemd stops a unit by the KillMode= and TimeoutStopSec= it has loaded at the stop):
    vLLM 0.17.0's API server, given SIGTERM alone as a 0.32.0 unit's KillMode=mixed says,
    waits for its engine core, which never got one, until TimeoutStopSec (seen); a 0.32.0
    engine stopped by a 0.17.0 unit's control-group would abort what it serves. Its state
    before, ``$was``, says whether it ran."""
    return StringCommand(
        "was=$(systemctl is-active", UNIT, '2>/dev/null || true) && { case "$was" in',
        RUNNING_STATES + ") systemctl stop", UNIT, ";; esac; }",
    )


def _restart(files: StringCommand, verb: StringCommand) -> StringCommand:
    """The engine stopped under its own unit (``stop_as_started``), ``files`` put in place,
    systemd reloaded, ``verb``; on failure, the lines the unit's processes logged since
    (their ``SyslogIdentifier``) on stderr and the failure kept."""
    return StringCommand(
        "since=$(date +%s) &&", stop_as_started(), "&&", files,
        "&& systemctl daemon-reload &&", verb,
        "|| { rc=$?; journalctl -u", UNIT, "-t", SERVICE, '--since "@$since" -n',
        str(JOURNAL_LINES), "--no-pager -o cat >&2; exit $rc; }",
    )


def restart_command(staged: Sequence[tuple[str, str]], start: bool,
                    keep_previous: bool = False) -> StringCommand:
    """The staged unit and environment file moved into place
    (``rolling_util.promote_command``, the files they replace kept with ``keep_previous``)
    inside ``_restart``, the engine started again (or, with ``start`` False, only if it
    ran)."""
    # Not started: a failed engine stays failed, for the audit to see; no reset there.
    verb = limit_reset_then("restart") if start else StringCommand(
        'case "$was" in', RUNNING_STATES + ") systemctl start", UNIT, ";; esac")
    return _restart(rolling_util.promote_command(staged, keep_previous), verb)


def rollback_command(paths: Sequence[str], env_link: dict | None = None) -> StringCommand:
    """The unit and environment file a canaried restart replaced put back
    (``rolling_util.restore_command``), and the environment link the run moved
    (``env_link``: ``{"path", "before"}``) pointed where it pointed before, inside
    ``_restart``: the engine started on them, and ready (the unit's readiness wait)."""
    return _restart(_with_link(rolling_util.restore_command(paths), env_link),
                    limit_reset_then("restart"))


def not_reached_command(paths: Sequence[str], env_link: dict | None = None) -> StringCommand:
    """A host the rollout did not reach: its staged files removed, and the environment
    link the run moved (``env_link``) where it pointed before, beside the unit it keeps."""
    return _with_link(rolling_util.discard_command(paths), env_link)


def _with_link(command: StringCommand, env_link: dict | None) -> StringCommand:
    if env_link is None:
        return command
    return StringCommand(command, "&&",
                         rolling_util.relink_command(env_link["path"], env_link["before"]))


def canary_command(canary: dict, env_path: str) -> StringCommand:
    """The canary's benchmark: files/bench_client.py in the previous record's shape, its
    API key from the env file ``env_path`` (removed as it is read, never on a command
    line)."""
    shape = canary["previous"]["shape"]
    return StringCommand(
        *sourced(env_path), "rm -f", QuoteString(env_path), "&&",
        "timeout", str(bench_plan.TIMEOUT_S), QuoteString(canary["python"]),
        QuoteString(bench_plan.HELPER_PATH), "--record", QuoteString(bench_plan.RECORD_DIR),
        "--textfile", QuoteString(canary["textfile"]), "--stack", QuoteString(canary["stack"]),
        "--shape", QuoteString(json.dumps(shape, sort_keys=True)), "--",
        *(QuoteString(arg) for arg in [*canary["args"], *bench_plan.shape_args(shape)]),
    )


def record_command(action: str, textfile: str) -> StringCommand:
    """The benchmark record's files around a canary (files/bench_client.py ``--previous``,
    the standard library only): ``keep`` them as they are before it runs, ``put-back``
    the kept ones (its own record set aside as canary-rejected.json), or ``drop`` them."""
    return StringCommand("python3", QuoteString(bench_plan.HELPER_PATH), "--previous", action,
                         "--record", QuoteString(bench_plan.RECORD_DIR),
                         "--textfile", QuoteString(textfile))


def idle_command(python: str, metrics_url: str, grace_s: int,
                 client: Sequence[str] = ()) -> StringCommand:
    """files/engine_idle.py: until no request is in flight, at most ``grace_s``;
    ``client``: how it reaches the engine (``engine_access.client_args``). It asks only
    a listener of the engine's user."""
    return StringCommand(QuoteString(python), QuoteString(IDLE_PATH), "--url",
                         QuoteString(metrics_url), "--grace", QuoteString(str(grace_s)),
                         "--user", QuoteString(SERVICE_USER),
                         *(QuoteString(arg) for arg in client))


def engine_key_command(env_path: str = KEY_ENV_PATH, nginx_path: str = KEY_NGINX_PATH,
                       refuse_while_running: bool = False) -> StringCommand:
    """The engine's own key, made on the host when its files are missing or disagree
    (pyinfra_vllm/plans/engine_access.py): both files written from one value, a valid
    engine file kept, so a lost nginx file comes back without a new key. The value stays
    in the shell (printf is a builtin: on no command line); umask 077: 0600 from the first
    byte. ``refuse_while_running``: a new key (no valid engine file) fails, changing
    nothing, while the engine's unit runs: that engine keeps the key it started with."""
    refusal = [] if not refuse_while_running else [
        '[ -n "$key" ] || case $(systemctl show -P ActiveState', UNIT,
        "2>/dev/null) in active|activating|reloading|deactivating)",
        "echo", QuoteString(REFUSED_WHILE_RUNNING.format(env_path=env_path)), ">&2;",
        "exit 1;; esac;",
    ]
    return StringCommand(
        "umask 077;",
        "key=$(sed -n \"s/^VLLM_API_KEY='\\(" + KEY_RE + "\\)'$/\\1/p\"", env_path,
        "2>/dev/null);",
        *refusal,
        '[ -n "$key" ] || key=$(head -c 32 /dev/urandom | base64 -w0 | tr "+/" "-_" | tr -d "=");',
        "for dir in", posixpath.dirname(env_path), posixpath.dirname(nginx_path),
        "; do [ -d $dir ] || install -d -m 0755 $dir; done;",
        "printf \"VLLM_API_KEY='%s'\\n\" \"$key\" >", f"{env_path}.new", "&&",
        "mv -f", f"{env_path}.new", env_path, "&&",
        "printf 'map \"\" $vllm_upstream_authorization {\\n    default \"Bearer %s\";\\n}\\n'",
        '"$key" >', f"{nginx_path}.new", "&&",
        "mv -f", f"{nginx_path}.new", nginx_path,
    )


def gateway_reload_command() -> StringCommand:
    """nginx reloaded for a new engine key, where it runs and its configuration passes
    ``nginx -t`` (a host whose gateway is not installed yet: nothing to do)."""
    return StringCommand(
        "if systemctl is-active -q nginx.service; then nginx -t -q && systemctl reload "
        "nginx.service; fi"
    )


def failure_reason(lines: Sequence[str]) -> str:
    """Why a restart failed, from the journal lines ``restart_command`` printed: the last
    readiness wait line (files/wait_ready.py, ``wait-ready: ...``), else the last line."""
    lines = [line.strip() for line in lines if line.strip()]
    ready = [line for line in lines if line.startswith("wait-ready:")]
    if ready:
        return ready[-1]
    if lines:
        return lines[-1]
    return f"{UNIT} did not become active (no line in its journal since the restart)"
