"""Long jobs (the model download, the environment build) as transient systemd units that
outlive the operator's SSH session, and the watch that follows them.

A job is a shell script the operation writes on the host and hands to ``systemd-run
--unit=NAME --collect``: systemd runs it as a service of its own, outside the SSH
session, so a dropped connection, a closed laptop or a killed pyinfra leaves it running
(systemd-run(1): without ``--wait``/``--pty`` it returns once the unit started). The
operation then watches it from a FunctionCommand: it polls the unit and the job's
progress (each poll waiting on the host, a few seconds at most, for the unit to end)
and logs a line per host at normal verbosity; the unit's end
decides the operation's result, a failure with the unit's last journal lines.

A re-run that finds the unit still active attaches to it (watches it) instead of
starting a second one; a job that ended while nobody watched left its work behind (the
model verified, the environment's marker), which the operation's own check finds.

Per job, under ``JOB_ROOT/<unit>/`` (tmpfs, root only):

    run.sh     the job; ``run.sh finished`` is its ExecStopPost
    env        the job's variables (index URL, proxy, token): read and removed by the
               job as it starts, never on a command line (``systemctl show`` prints
               ExecStart to any user)
    progress   the step the job is at
    result     ``success exited 0`` / ``exit-code exited N``, written by the job as it
               exits; by ExecStopPost (``$SERVICE_RESULT $EXIT_CODE $EXIT_STATUS``)
               when the job could not (killed)
               (systemd.exec(5), "Environment Variables Set or Propagated by the Service
               Manager"): the outcome survives the unit, which --collect unloads at once
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from paramiko import SSHException
from pyinfra import logger
from pyinfra.api import FileUploadCommand, FunctionCommand, QuoteString, StringCommand
from pyinfra.api.arguments import CONNECTOR_ARGUMENT_KEYS

from facts.units import UNIT_STATE_PROPERTIES, parse_unit_state
from pyinfra_vllm.operations.util.uploads import private_upload, secret_file
from pyinfra_vllm.plans.access import JOB_ROOT

# How long one poll waits on the host for the unit to end (it answers as soon as it
# does: a job is seen over within WAIT_STEP_S, not a poll interval, after its end), and
# how often the watch logs a progress line.
POLL_S = 5.0
WAIT_STEP_S = 0.2
REPORT_S = 15.0
# The unit's journal lines a failed job prints.
JOURNAL_LINES = 20
# ActiveState values of a unit whose job has not ended (deactivating: ExecStopPost runs).
RUNNING = ("active", "activating", "deactivating", "reloading")
_MARK = "@@pyinfra-vllm"


def unit_name(what: str, *identity: str) -> str:
    """``pyinfra-vllm-<what>-<12 hex>``: the same job (the same ``identity``: what it
    produces, never a secret) always gets the same unit, which is how a re-run finds it."""
    digest = hashlib.sha256("\0".join(identity).encode()).hexdigest()[:12]
    return f"pyinfra-vllm-{what}-{digest}"


def job_dir(unit: str) -> str:
    return f"{JOB_ROOT}/{unit}"


def running(state: dict[str, Any] | None) -> bool:
    """Is the unit (facts.units.UnitState) still at its job?"""
    return state is not None and state.get("active") in RUNNING


def job_script(unit: str, description: str, steps: list[tuple[str, StringCommand]]) -> bytes:
    """The job: the env file's variables exported (the file removed at once), then each
    step, its words in the progress file; the first step that fails ends the job with
    its exit status, which the job records itself as it exits. ``finished`` (the unit's
    ExecStopPost) takes away an env file the job never read and records a result the job
    could not (killed), from the variables systemd gives it."""
    base = job_dir(unit)
    record = ('> "$dir/result.new" && mv -f "$dir/result.new" "$dir/result"')
    lines = [
        "#!/bin/sh",
        f"# {unit}: {description}",
        "# Started by systemd-run (operations/util/jobs.py); 'finished' is its ExecStopPost.",
        f"dir={base}",
        'if [ "${1:-}" = finished ]; then',
        '    rm -f "$dir/env"',
        '    [ -e "$dir/result" ] || { printf \'%s %s %s\\n\' "${SERVICE_RESULT:-}" '
        '"${EXIT_CODE:-}" "${EXIT_STATUS:-}" ' + record + "; }",
        "    exit 0",
        "fi",
        # The job's own record: an ExecStopPost can fail to start (seen: status
        # 219/CGROUP in a container under load), and the result must not depend on it.
        "trap 'status=$?; if [ $status -eq 0 ]; then r=success; else r=exit-code; fi; "
        'printf "%s exited %s\\n" "$r" "$status" ' + record.replace("'", "") + "' EXIT",
        'if [ -e "$dir/env" ]; then set -a; . "$dir/env"; set +a; rm -f "$dir/env"; fi',
    ]
    for number, (words, command) in enumerate(steps, start=1):
        progress = QuoteString(f"{number}/{len(steps)} {words}")
        lines.append(StringCommand("printf '%s\\n'", progress, '> "$dir/progress"; echo',
                                   QuoteString(f"== {number}/{len(steps)} {words}"))
                     .get_raw_value())
        # `|| exit`, not `set -e`: set -e ignores a failure inside an && list.
        lines.append(f"{{ {command.get_raw_value()} ; }} || exit $?")
    return ("\n".join(lines) + "\n").encode()


def start(unit: str, description: str, steps: list[tuple[str, StringCommand]],
          env: bytes, payload: list[tuple[str | bytes, str]] | None = None,
          ) -> Iterator[StringCommand | FileUploadCommand]:
    """
    The commands that start the job ``unit`` (a previous run's files and failed unit
    cleared first).

    + unit: ``unit_name(...)``
    + description: the unit's Description (no secret: ``systemctl status`` shows it)
    + steps: (words for the progress line, command), run in order
    + env: the env file's text (``pyinfra_vllm.operations.util.uploads.env_file_text``): it
      holds the secrets, uploaded root-only and removed by the job as it starts
    + payload: (local file or content, name in the job's directory) the steps read;
      root's alone (0600), like the rest of the directory
    """
    base = job_dir(unit)
    script = f"{base}/run.sh"
    # A job that just ended is still loaded while its ExecStopPost runs, and systemd-run
    # refuses a unit name that is loaded ("Unit ... was already loaded"): up to 30 s for
    # systemd to collect it (--collect) before its files go and the new one starts.
    yield StringCommand("systemctl reset-failed", QuoteString(unit), "2>/dev/null;",
                        "n=0; while [ \"$(systemctl show -p LoadState --value",
                        QuoteString(unit), "2>/dev/null)\" = loaded ] && [ $n -lt 300 ];",
                        "do sleep 0.1; n=$((n + 1)); done;",
                        "rm -rf", QuoteString(base))
    yield from secret_file(env, f"jobs/{unit}/env")
    yield from private_upload(job_script(unit, description, steps), script, mode="700")
    for source, name in payload or []:
        yield from private_upload(source, f"{base}/{name}")
    yield StringCommand(
        "systemd-run", QuoteString(f"--unit={unit}"), "--collect --quiet",
        QuoteString(f"--description={description}"),
        # exec: systemd-run fails when the script cannot even start. User=root: systemd
        # then sets HOME and USER (systemd.exec(5)), as sudo does, for pip's and uv's caches.
        "--property=Type=exec --property=User=root",
        # A stop (systemctl stop) ends every process of the job: no orphaned pip.
        "--property=KillMode=control-group", "--property=TimeoutStopSec=30",
        # "-": a failure of this clean-up (or of its start) is not the job's.
        QuoteString(f"--property=ExecStopPost=-/bin/sh {script} finished"),
        "-- /bin/sh", QuoteString(script),
    )


def watch(unit: str, label: str, meter: dict[str, Any], attached: bool | None = False,
          ) -> FunctionCommand:
    """The command that follows ``unit`` to its end, logging ``label: <progress>``.

    + attached: the unit was started by an earlier run (said so in the first line); None:
      by this run or an earlier one, an earlier operation having started it if need be

    + meter: what progress is: ``{"kind": "bytes", "path": DIR, "sizes": {file: size}}``
      (the files' bytes on disk, final or partial, of their total) or ``{"kind":
      "steps", "path": DIR}`` (the job's step and the size of DIR)
    """
    return FunctionCommand(follow_job, (), {"unit": unit, "label": label, "meter": meter,
                                            "attached": attached})


# --- progress -------------------------------------------------------------------------
def human_bytes(count: float) -> str:
    """Decimal units, as disk and network speeds are given: ``12.4 GB``, ``410 MB``."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{int(count)} B"


def human_seconds(seconds: float) -> str:
    """``1m45s``, ``2h03m``, ``40s``."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def bytes_on_disk(lines: list[str], sizes: dict[str, int]) -> int:
    """The bytes of the lock's files under the model directory (``find -printf '%s
    %P'`` lines): a file's final size, else its partial download's
    (``.incoming/<file>.part``, files/fetch_model.py), never more than the lock's size."""
    found: dict[str, int] = {}
    for line in lines:
        size, _, path = line.strip().partition(" ")
        if size.isdigit():
            found[path] = int(size)
    return sum(min(found.get(path, found.get(f".incoming/{path}.part", 0)), size)
               for path, size in sizes.items())


@dataclass
class Meter:
    """Turns successive progress readings into lines; remembers the last reading for
    the rate."""

    meter: dict[str, Any]
    last: tuple[float, int] | None = field(default=None)

    def line(self, progress: list[str], now: float) -> str:
        if self.meter["kind"] == "bytes":
            return self._bytes(progress, now)
        return self._steps(progress)

    def _bytes(self, progress: list[str], now: float) -> str:
        total = sum(self.meter["sizes"].values())
        done = bytes_on_disk(progress, self.meter["sizes"])
        words = f"{human_bytes(done)} of {human_bytes(total)}"
        if self.last is not None and now > self.last[0]:
            rate = (done - self.last[1]) / (now - self.last[0])
            if rate > 0:
                words += (f", {human_bytes(rate)}/s, "
                          f"ETA {human_seconds(max(total - done, 0) / rate)}")
            elif done >= total:
                words += ", verifying"
            else:
                words += f", no new bytes in {human_seconds(now - self.last[0])}"
        self.last = (now, done)
        return words

    def _steps(self, progress: list[str]) -> str:
        step = next((line[5:].strip() for line in progress if line.startswith("step ")), "")
        size = next((line[5:].strip() for line in progress if line.startswith("size ")), "")
        words = step or "starting"
        if size.isdigit():
            words += f", {human_bytes(int(size))} in {self.meter['path']}"
        return words


def progress_command(meter: dict[str, Any], unit: str) -> StringCommand:
    """What the watch runs on the host for the progress lines of ``meter``."""
    path = QuoteString(meter["path"])
    if meter["kind"] == "bytes":
        return StringCommand("find", path, "-type f -printf '%s %P\\n' 2>/dev/null")
    return StringCommand(
        "sed 's/^/step /'", QuoteString(f"{job_dir(unit)}/progress"), "2>/dev/null;",
        "printf 'size '; du -sb", path, "2>/dev/null | cut -f1; echo",
    )


# --- the watch ------------------------------------------------------------------------
@dataclass
class Reading:
    """One poll: the unit (facts.units.UnitState, None once collected), the progress
    lines, the job's result line (None until ExecStopPost wrote it)."""

    state: dict[str, Any] | None
    progress: list[str]
    result: str | None


def outcome(reading: Reading) -> tuple[bool, str]:
    """A finished job's success and its words, from its result line (else the unit)."""
    if reading.result:
        service, code, status = (reading.result.split() + ["", "", ""])[:3]
        if service == "success":
            return True, "finished"
        return False, f"failed ({service}: {code} {status})"
    state = reading.state or {}
    if state.get("result") == "success" and state.get("active") == "inactive":
        return True, "finished"
    if state:
        return False, f"failed ({state.get('result')}: status {state.get('status')})"
    return False, "ended without a result (stopped before it recorded one?)"


def follow(read: Callable[[], Reading], report: Callable[[str], None], meter: Meter,
           sleep: Callable[[float], Any] = time.sleep,
           clock: Callable[[], float] = time.monotonic,
           poll_s: float = POLL_S, report_s: float = REPORT_S) -> tuple[bool, str]:
    """Poll the job until its unit is no longer running, reporting a progress line
    every ``report_s``; return its outcome (``outcome``)."""
    reported: float | None = None
    while True:
        reading = read()
        if not running(reading.state):
            return outcome(reading)
        now = clock()
        if reported is None or now - reported >= report_s:
            report(meter.line(reading.progress, now))
            reported = now
        sleep(poll_s)


def split_reading(lines: list[str]) -> Reading:
    """The watch command's output (``poll_command``) as a Reading."""
    parts: dict[str, list[str]] = {"state": [], "progress": [], "result": []}
    current = "state"
    for line in lines:
        if line.startswith(_MARK + " "):
            current = line.split()[1]
            continue
        parts.setdefault(current, []).append(line)
    result = " ".join(" ".join(parts["result"]).split())
    return Reading(parse_unit_state(parts["state"]), parts["progress"], result or None)


def poll_command(unit: str, meter: dict[str, Any], wait_s: float = POLL_S) -> StringCommand:
    """One round trip: at most ``wait_s`` waiting for the unit to end (no wait once it
    has), then the unit's state, the progress lines, the result line."""
    steps = max(0, round(wait_s / WAIT_STEP_S))
    return StringCommand(
        f"n=0; while [ $n -lt {steps} ] && case $(systemctl show --property=ActiveState "
        "--value --", QuoteString(unit), f"2>/dev/null) in {'|'.join(RUNNING)}) true;; "
        f"*) false;; esac; do sleep {WAIT_STEP_S:g}; n=$((n+1)); done;",
        f"systemctl show --property={UNIT_STATE_PROPERTIES} --", QuoteString(unit),
        f"2>/dev/null; echo '{_MARK} progress';", progress_command(meter, unit),
        f"; echo '{_MARK} result'; cat", QuoteString(f"{job_dir(unit)}/result"),
        "2>/dev/null; true",
    )


def connector_arguments(host) -> dict[str, Any]:
    """The running operation's own connector arguments (``_sudo``, ``_su_user``, ``_env``
    ...) for the commands a FunctionCommand runs: pyinfra gives them to the operation's
    StringCommands only. pyinfra sets ``host.current_op_global_arguments`` while the
    operation's generator runs, which is when its FunctionCommands run
    (pyinfra/api/operation.py)."""
    return {key: value for key, value in (host.current_op_global_arguments or {}).items()
            if key in CONNECTOR_ARGUMENT_KEYS}


def _run(state, host, command: StringCommand) -> list[str]:
    ok, output = host.run_shell_command(command, **connector_arguments(host))
    if not ok:
        raise OSError(f"{command.get_masked_value()} failed")
    return list(output.stdout_lines)


def follow_job(state, host, unit: str, label: str, meter: dict[str, Any],
               attached: bool | None = False) -> bool:
    """The FunctionCommand: follow ``unit`` to its end; a failure logs its last journal
    lines. A lost connection fails the operation; the job runs on."""
    command = poll_command(unit, meter)
    if attached is None:
        first = f"following {unit}; it runs on if this run stops: run again to attach"
    elif attached:
        first = f"attached to {unit}, started by an earlier run"
    else:
        first = f"started {unit}; it runs on if this run stops: run again to attach"
    host.log(f"{label}: {first}")
    try:
        # No sleep between polls here: each poll waits on the host (poll_command).
        ok, words = follow(lambda: split_reading(_run(state, host, command)),
                           lambda line: host.log(f"{label}: {line}"), Meter(meter),
                           poll_s=0)
    except (OSError, SSHException) as exc:
        host.log_styled(f"{label}: lost {unit} ({exc}); it runs on on the host: run "
                        "again to attach", fg="red", log_func=logger.error)
        return False
    journal: list[str] = []
    if not ok:
        journal = _run(state, host, StringCommand(
            "journalctl -u", QuoteString(unit), "-n", str(JOURNAL_LINES),
            "-o cat --no-pager 2>/dev/null; true"))
    _run(state, host, StringCommand("rm -rf", QuoteString(job_dir(unit))))
    if ok:
        host.log_styled(f"{label}: {unit} {words}", fg="green", log_func=logger.info)
        return True
    host.log_styled(f"{label}: {unit} {words}; its last journal lines:", fg="red",
                    log_func=logger.error)
    for line in journal:
        host.log(f"  {line}", log_func=logger.error)
    return False
