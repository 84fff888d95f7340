"""The commands the engine's operations run: restart it with its start limit reset, wait
until it is idle, and say why a restart failed."""

from __future__ import annotations

from collections.abc import Sequence

from pyinfra.api import QuoteString, StringCommand

from operations.util import rolling as rolling_util
from pyinfra_vllm.plans.vllm_service import (
    IDLE_PATH,
    SERVICE,
    UNIT,
)

JOURNAL_LINES = 15


def limit_reset_then(verb: str) -> StringCommand:
    """``systemctl VERB`` the engine, its start limit reset first (``systemctl
    reset-failed``, as systemd.unit(5) advises for a deliberate start). The reset's own
    failure is ignored: systemd refuses it for a unit it has not loaded yet (a first
    install, even after daemon-reload), which has no count to reset."""
    return StringCommand("{ systemctl reset-failed", UNIT, "2>/dev/null; systemctl", verb,
                         UNIT, "; }")


def restart_command(staged: Sequence[tuple[str, str]], start: bool) -> StringCommand:
    """The staged unit and environment file moved into place (``rolling_util.promote_command``),
    systemd reloaded, the engine restarted; on failure, the lines the unit's processes
    logged since (their ``SyslogIdentifier``) on stderr and the failure kept."""
    # try-restart leaves a failed engine failed, for the audit to see: no reset there.
    verb = limit_reset_then("restart") if start else StringCommand("systemctl try-restart", UNIT)
    return StringCommand(
        "since=$(date +%s) &&", rolling_util.promote_command(staged),
        "&& systemctl daemon-reload &&", verb,
        "|| { rc=$?; journalctl -u", UNIT, "-t", SERVICE, '--since "@$since" -n',
        str(JOURNAL_LINES), "--no-pager -o cat >&2; exit $rc; }",
    )


def idle_command(python: str, metrics_url: str, grace_s: int) -> StringCommand:
    """files/engine_idle.py: until no request is in flight, at most ``grace_s``."""
    return StringCommand(QuoteString(python), QuoteString(IDLE_PATH), "--url",
                         QuoteString(metrics_url), "--grace", QuoteString(str(grace_s)))


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
