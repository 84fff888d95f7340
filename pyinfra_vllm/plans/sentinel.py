"""The sentinel: its units, its command line, and the verdict on the state it writes.

files/sentinel.py runs on the host under ``vllm-sentinel.service`` (templates/
vllm-sentinel.service.j2): a one-token completion to the engine every
sentinel_interval_s, the host out of the load balancers' rotation after
sentinel_failures failures in a row (the gateway's rotation flag, holding the word
``sentinel``), the engine restarted where sentinel_restart allows, back in rotation once
it answers. It runs as root without a single capability (CapabilityBoundingSet= empty):
root's uid owns the drain directory and the sentinel's state, the supplementary group
www-data (nginx's workers') lets it into the engine's socket directory (0750), and on TCP
the engine's firewall lets root connect. A restart is asked for, not made: the sentinel
writes RESTART_REQUEST and the path unit ``vllm-sentinel-restart.path`` starts
``vllm-sentinel-restart.service``, a oneshot that runs ``systemctl restart --no-block
vllm.service`` with systemd's own privileges (systemd lets a caller without
CAP_SYS_ADMIN restart nothing, root's uid or not), unless the suite's drain flag or leave
flag exists.

Pure functions of settings; pyinfra_vllm/stages/sentinel.py writes and starts them.
"""

from __future__ import annotations

import time
from typing import Any

from pyinfra_vllm.core.host_text import printable
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.core.templating import render
from pyinfra_vllm.plans import engine_access
from pyinfra_vllm.plans import vllm_service as vllm_service_plan
from pyinfra_vllm.plans.gateway import DRAIN_DIR, DRAIN_FLAG, LEAVE_FLAG, ROTATION_FLAG

UNIT = "vllm-sentinel.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
UNIT_TEMPLATE = "vllm-sentinel.service.j2"
RESTART_PATH_UNIT = "vllm-sentinel-restart.path"
RESTART_SERVICE = "vllm-sentinel-restart.service"
RESTART_PATH_UNIT_PATH = f"/etc/systemd/system/{RESTART_PATH_UNIT}"
RESTART_SERVICE_PATH = f"/etc/systemd/system/{RESTART_SERVICE}"
RESTART_PATH_TEMPLATE = "vllm-sentinel-restart.path.j2"
RESTART_SERVICE_TEMPLATE = "vllm-sentinel-restart.service.j2"
UNIT_PATHS = (UNIT_PATH, RESTART_PATH_UNIT_PATH, RESTART_SERVICE_PATH)

HELPER_PATH = f"{vllm_service_plan.HELPER_DIR}/sentinel.py"
# Its StateDirectory=: root's, 0755. The state holds nothing secret (states, counts,
# times, the reason of a failed completion, never the key): 0644, for the audit and
# anyone on the host.
STATE_DIR = "/var/lib/pyinfra-vllm-sentinel"
STATE_PATH = f"{STATE_DIR}/state.json"
RESTART_REQUEST = f"{STATE_DIR}/restart-request"
TEXTFILE_NAME = "pyinfra_vllm_sentinel.prom"
PYTHON = "/usr/bin/python3"
SYSTEMCTL = "/usr/bin/systemctl"
# The sentinel's own restarts within the engine unit's start-limit interval: its burst
# less one for systemd's Restart=on-failure retry and one for the deploy's own restart,
# so neither finds the unit refusing starts ("Start request repeated too quickly").
MAX_RESTARTS = vllm_service_plan.START_LIMIT_BURST - 2
RESTART_WINDOW_S = vllm_service_plan.START_LIMIT_INTERVAL_S
STATES = ("ok", "failing", "out-of-rotation", "restarting", "paused")
# facts.sentinel.SentinelState's arguments: the stage, the audit and the run's one read.
STATE_READ = {"state_path": STATE_PATH, "rotation_flag": ROTATION_FLAG}


def textfile(settings: Settings) -> str:
    return f"{settings.textfile_collector_dir}/{TEXTFILE_NAME}"


def sentinel_argv(settings: Settings, place: engine_access.Endpoint) -> list[str]:
    """files/sentinel.py's command line for ``settings``, reaching the engine at
    ``place``."""
    argv = [PYTHON, HELPER_PATH, "--url", place.url("/v1/completions"),
            *engine_access.client_args(place),
            "--engine-user", vllm_service_plan.SERVICE_USER,
            "--model", settings.model_name,
            "--interval", str(settings.sentinel_interval_s),
            "--timeout", str(settings.sentinel_timeout_s),
            "--failures", str(settings.sentinel_failures),
            "--max-restarts", str(MAX_RESTARTS), "--restart-window", str(RESTART_WINDOW_S),
            "--state", STATE_PATH, "--textfile", textfile(settings),
            "--drain-flag", DRAIN_FLAG, "--leave-flag", LEAVE_FLAG,
            "--rotation-flag", ROTATION_FLAG,
            "--restart-request", RESTART_REQUEST]
    if settings.sentinel_restart:
        argv.append("--restart")
    return argv


def render_units(settings: Settings, place: engine_access.Endpoint) -> dict[str, str]:
    """The sentinel's three unit files, by path."""
    return {
        UNIT_PATH: render(
            UNIT_TEMPLATE,
            exec_start=vllm_service_plan.exec_command(sentinel_argv(settings, place),
                                                      continued=True),
            key_env_path=engine_access.KEY_ENV_PATH,
            socket_group=engine_access.SOCKET_GROUP if place.socket else None,
            drain_dir=DRAIN_DIR,
            state_dir_name=STATE_DIR.removeprefix("/var/lib/"),
            textfile_dir=vllm_service_plan.systemd_plain(settings.textfile_collector_dir),
        ),
        RESTART_PATH_UNIT_PATH: render(RESTART_PATH_TEMPLATE, request=RESTART_REQUEST,
                                       service=RESTART_SERVICE),
        RESTART_SERVICE_PATH: render(RESTART_SERVICE_TEMPLATE, systemctl=SYSTEMCTL,
                                     drain_flag=DRAIN_FLAG, leave_flag=LEAVE_FLAG,
                                     engine=vllm_service_plan.UNIT),
    }


# --- the audit's verdict ------------------------------------------------------------------
def verdict(found: dict[str, Any] | None, enabled: bool) -> dict[str, Any]:
    """The sentinel's verdict for the audit from what facts.sentinel.SentinelState read
    (``found``): ``{"state", "ok", "reason", "events"}``. ``ok`` is False where the host
    is out of rotation by the sentinel (its flag is there), None where nothing is judged
    (the sentinel off or not yet written), True otherwise; a state that could not be read
    is "unknown", never "ok"."""
    if not enabled:
        return {"state": "off", "ok": None, "reason": "sentinel is off", "events": []}
    if found is None:
        return {"state": "absent", "ok": None,
                "reason": f"{STATE_PATH} is absent: the sentinel has not run", "events": []}
    if found.get("error"):
        return {"state": "unknown", "ok": None, "reason": found["error"], "events": []}
    state = found["state"]
    out = found.get("rotation") == "sentinel"
    return {"state": state, "ok": not out, "reason": found.get("reason", ""),
            "events": found.get("events") or [], "failures": found.get("failures"),
            "restarts": found.get("restarts"), "out_of_rotation": out}


def events_words(events: list[dict[str, Any]], last: int = 3) -> str:
    """The last ``last`` events, oldest first: ``2026-12-07T17:02:11Z ok -> failing``."""
    return "; ".join(
        f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(float(event.get('time', 0))))} "
        f"{event.get('from')} -> {event.get('to')}"
        for event in events[-last:])


def sentinel_words(entry: dict[str, Any]) -> str:
    """The host's sentinel (``entry["sentinel"]``, ``verdict``'s) in a few words: its
    state, why, and its last events (``printable``: the host wrote them)."""
    found = entry.get("sentinel") or {}
    words = f"{found.get('state', 'unknown')}: {found.get('reason') or '-'}"
    if found.get("out_of_rotation"):
        words += "; the host is out of rotation by the sentinel"
    if found.get("restarts"):
        words += f"; {found['restarts']} restart(s) asked for"
    if found.get("events"):
        words += f"; last events: {events_words(found['events'])}"
    return printable(words)


def refusal(host_name: str, found: dict[str, Any]) -> str:
    """The audit's line for a host its sentinel took out of rotation (``verdict``'s
    ``found``)."""
    return printable(
        f"sentinel: {host_name} is out of rotation by its sentinel ({found['state']}: "
        f"{found['reason']}); the gateway answers /health 503 until a completion answers "
        "again: journalctl -u vllm-sentinel -u vllm")
