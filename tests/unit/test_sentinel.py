"""The engine's sentinel: its decisions (files/sentinel.py ``step``, a pure function), its
units, the fact that reads its state, the audit's verdict on it, and the program itself
run against files/openai_stub.py, an engine whose /health answers while its completions
hang (``--stall-completions``).

The program asks ``systemctl show`` for the engine unit's state: where these tests run
there is no systemd, so a ``systemctl`` first on PATH answers what the test says (the
sandbox's end-to-end tests, tests/e2e/test_sentinel.py, run it under the real one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from facts.sentinel import SentinelState, parse_state
from pyinfra_vllm.core.settings import validate
from pyinfra_vllm.plans import engine_access, sentinel
from pyinfra_vllm.plans import vllm_service as vllm_service_plan

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "files"))
import sentinel as program  # noqa: E402  (files/sentinel.py, as the host runs it)

STUB = str(ROOT / "files" / "openai_stub.py")
SENTINEL = str(ROOT / "files" / "sentinel.py")
CONFIG = program.Config(interval_s=10, failures=3, restart=True, max_restarts=3,
                        restart_window_s=1800)
SERVING = program.Observation("active", False, None, True, 0.05)
FAILING = program.Observation("active", False, None, False, 2.0, "no answer within 2 s")


def run(memory: program.Memory, seen: program.Observation, now: float,
        config: program.Config = CONFIG) -> tuple[program.Memory, list[str]]:
    return program.step(memory, seen, now, config)


# --- the decisions ----------------------------------------------------------------------
def test_failures_below_the_threshold_only_count():
    memory, actions = run(program.Memory(), FAILING, 100.0)
    assert (memory.state, memory.failures, actions) == ("failing", 1, [])
    memory, actions = run(memory, FAILING, 110.0)
    assert (memory.state, memory.failures, actions) == ("failing", 2, [])


def test_the_threshold_takes_the_host_out_and_restarts_the_engine():
    memory = program.Memory(state="failing", failures=2)
    memory, actions = run(memory, FAILING, 100.0)
    assert actions == ["out", "restart"]
    assert (memory.state, memory.failures, memory.restarts) == ("restarting", 3, 1)
    assert memory.next_restart_at == 110.0  # the first wait: one interval
    assert memory.events[-1]["from"] == "failing" and memory.events[-1]["to"] == "restarting"


def test_a_timeout_on_an_engine_that_generates_is_busy_not_a_failure():
    """A completion queued behind a full batch times out on a working engine: its
    generated-tokens counter moved since the last round, so no failure is counted, nothing
    is restarted, and a host the sentinel took out comes back; a counter that did not move
    (a frozen engine core), or unread, counts as before."""
    memory = program.Memory(state="failing", failures=2, generated=1000.0)
    busy = program.Observation("active", False, "sentinel", False, 20.0, "no answer", 1480.0)
    after, actions = run(memory, busy, 100.0)
    assert (after.state, after.failures, actions, after.generated) == ("ok", 0, ["in"], 1480.0)
    assert "generated 480 token(s) since the last round: busy, not stuck" in after.reason
    for generated in (1000.0, None):
        stuck = program.Observation("active", False, None, False, 20.0, "no answer", generated)
        after, actions = run(memory, stuck, 100.0)
        assert (after.state, after.failures, actions) == ("restarting", 3, ["out", "restart"])
    # After an engine restart its counter starts again from 0: no progress, never negative.
    assert (program.progress(1000.0, 3.0), program.progress(None, 5.0)) == (0.0, 0.0)


def test_the_generated_tokens_are_read_from_the_engine_s_metrics(tmp_path):
    """files/sentinel.py's reading of vLLM's counter, every sample summed (one per engine
    and model label), against a stand-in for the engine's /metrics."""
    import http.server
    import threading

    text = ("# TYPE vllm:generation_tokens_total counter\n"
            'vllm:generation_tokens_total{engine="0",model_name="m"} 120.0\n'
            'vllm:generation_tokens_total{engine="1",model_name="m"} 30.0\n'
            "vllm:generation_tokens_created 1.7e9\n")

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = text.encode() if self.path == "/metrics" else b""
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/v1/completions"
        assert program.generated_tokens(url, None, 5) == 150.0
        text = "vllm:num_requests_running 0\n"
        assert program.generated_tokens(url, None, 5) is None
    finally:
        server.shutdown()


def test_without_restart_the_host_is_only_taken_out():
    config = program.Config(10, 3, False, 3, 1800)
    memory, actions = run(program.Memory(state="failing", failures=2), FAILING, 100.0, config)
    assert (memory.state, actions, memory.restarts) == ("out-of-rotation", ["out"], 0)
    assert "sentinel_restart is off" in memory.reason
    # Its own flag is placed once.
    seen = program.Observation("active", False, "sentinel", False, 2.0, "no answer")
    memory, actions = run(memory, seen, 110.0, config)
    assert (memory.state, actions) == ("out-of-rotation", [])


def test_restarts_back_off_doubling_and_stop_at_the_limit():
    out = program.Observation("active", False, "sentinel", False, 2.0, "no answer")
    memory, actions = run(program.Memory(state="failing", failures=2), FAILING, 0.0)
    asked = [0.0]
    for now in range(10, 400, 10):
        memory, actions = run(memory, out, float(now))
        if "restart" in actions:
            asked.append(float(now))
    # 10, then 20, then 40 s after the one before; then no more (3 within 1800 s).
    assert asked == [0.0, 10.0, 30.0]
    assert memory.restarts == 3 and memory.state == "out-of-rotation"
    assert "3 restart(s) within 1800 s already: no more" in memory.reason
    memory, actions = run(memory, out, 1810.0)  # the first left the window
    assert actions == ["restart"]


def test_the_backoff_is_capped():
    memory = program.Memory(state="out-of-rotation", failures=9, backoff_step=12)
    out = program.Observation("active", False, "sentinel", False, 2.0, "no answer")
    memory, actions = run(memory, out, 0.0)
    assert actions == ["restart"] and memory.next_restart_at == program.BACKOFF_CAP_S


def test_an_answer_brings_the_host_back_and_only_its_own_flag_is_removed():
    memory = program.Memory(state="restarting", failures=3, restarts=1, backoff_step=1,
                            next_restart_at=500.0)
    back = program.Observation("active", False, "sentinel", True, 0.07)
    memory, actions = run(memory, back, 120.0)
    assert (memory.state, memory.failures, memory.last_latency_s, actions) == (
        "ok", 0, 0.07, ["in"])
    assert (memory.backoff_step, memory.next_restart_at, memory.restarts) == (0, 0.0, 1)
    memory, actions = run(memory, SERVING, 130.0)
    assert actions == []


@pytest.mark.parametrize(("seen", "why"), [
    (program.Observation("active", True, None), "drain flag"),
    (program.Observation("active", False, "other"), "another owner's rotation flag"),
    (program.Observation("activating", False, None), "vllm.service is activating"),
    (program.Observation("deactivating", False, "sentinel"), "vllm.service is deactivating"),
    (program.Observation("inactive", False, None), "vllm.service is inactive"),
    (program.Observation("failed", False, None), "vllm.service is failed"),
    (program.Observation("", False, None), "cannot be read"),
])
def test_it_pauses_counting_nothing_restarting_nothing_moving_no_flag(seen, why):
    memory = program.Memory(state="failing", failures=2)
    after, actions = run(memory, seen, 100.0)
    assert (after.state, after.failures, after.restarts, actions) == ("paused", 2, 0, [])
    assert why in after.reason


def test_its_own_restart_is_restarting_not_a_pause():
    memory, _ = run(program.Memory(state="failing", failures=2), FAILING, 0.0)
    for unit in ("deactivating", "activating"):
        memory, actions = run(memory, program.Observation(unit, False, "sentinel"), 5.0)
        assert (memory.state, actions) == ("restarting", [])
    # Still failing before its backoff ended: still the restart under way.
    failing = program.Observation("active", False, "sentinel", False, 2.0, "no answer")
    memory, actions = run(memory, failing, 8.0)
    assert (memory.state, actions) == ("restarting", [])
    # The backoff runs from the end of the start: the first wait, one interval, after it.
    memory, _ = run(memory, program.Observation("activating", False, "sentinel"), 300.0)
    assert memory.next_restart_at == 310.0
    memory, actions = run(memory, failing, 305.0)
    assert (memory.state, actions) == ("restarting", [])
    memory, actions = run(memory, failing, 310.0)
    assert (memory.state, actions, memory.restarts) == ("restarting", ["restart"], 2)
    assert memory.next_restart_at == 330.0


def test_a_state_change_is_one_event_and_the_last_are_kept():
    memory = program.Memory()
    for at in range(30):
        memory, _ = run(memory, FAILING if at % 2 else SERVING, float(at),
                        program.Config(10, 5, False, 3, 1800))
    assert len(memory.events) == program.EVENTS_KEPT
    assert memory.events[-1] == {"time": 29.0, "from": "ok", "to": "failing",
                                 "reason": "1 failure(s) in a row: no answer within 2 s"}


def test_the_textfile_has_one_state_set_and_the_counts():
    memory = program.Memory(state="out-of-rotation", failures=4, restarts=2,
                            last_latency_s=0.25)
    text = program.textfile_text(memory, 1796648531.0)
    assert 'pyinfra_vllm_sentinel_state{state="out-of-rotation"} 1' in text
    assert 'pyinfra_vllm_sentinel_state{state="ok"} 0' in text
    assert sum(line.endswith(" 1") for line in text.splitlines()
               if line.startswith("pyinfra_vllm_sentinel_state{")) == 1
    assert "pyinfra_vllm_sentinel_consecutive_failures 4\n" in text
    assert "pyinfra_vllm_sentinel_restarts_total 2\n" in text
    assert "pyinfra_vllm_sentinel_last_latency_seconds 0.250\n" in text
    assert "pyinfra_vllm_sentinel_last_round_timestamp_seconds 1796648531\n" in text
    assert "pyinfra_vllm_sentinel_last_latency_seconds NaN\n" in program.textfile_text(
        program.Memory(), 0.0)


# --- settings and units -----------------------------------------------------------------
def test_the_sentinel_is_on_by_default():
    settings = validate({"gateway_open": True})
    assert (settings.sentinel, settings.sentinel_interval_s, settings.sentinel_timeout_s,
            settings.sentinel_failures, settings.sentinel_restart) == (True, 30, 20, 3, True)


def test_its_restarts_leave_the_engine_unit_a_start_for_systemd_and_the_deploy():
    assert sentinel.MAX_RESTARTS == vllm_service_plan.START_LIMIT_BURST - 2 == 3
    assert sentinel.RESTART_WINDOW_S == vllm_service_plan.START_LIMIT_INTERVAL_S


def _units(data):
    settings = validate({"gateway_open": True, **data})
    return settings, sentinel.render_units(settings, engine_access.endpoint(settings))


def test_the_unit_runs_without_capabilities_and_reads_the_key_from_the_engine_s_file():
    settings, units = _units({})
    unit = units[sentinel.UNIT_PATH]
    for line in ("User=root", "CapabilityBoundingSet=\n", "AmbientCapabilities=\n",
                 "NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateTmp=yes",
                 "ProtectHome=yes", "Restart=always",
                 "StateDirectory=pyinfra-vllm-sentinel",
                 f"EnvironmentFile=-{engine_access.KEY_ENV_PATH}",
                 "ReadWritePaths=-/run/pyinfra-vllm-drain -/var/lib/pyinfra-vllm-metrics",
                 "SystemCallFilter=~@clock @cpu-emulation @module @mount @obsolete @raw-io "
                 "@reboot @swap"):
        assert line in unit, line
    assert "VLLM_API_KEY" not in unit.split("ExecStart=", 1)[1].split("\n\n")[0]
    argv = sentinel.sentinel_argv(settings, engine_access.endpoint(settings))
    assert argv[argv.index("--interval") + 1] == "30"
    assert argv[argv.index("--failures") + 1] == "3"
    assert "--restart" in argv


def test_the_socket_group_only_where_the_engine_has_a_socket():
    settings, units = _units({})
    on_socket = engine_access.endpoint(settings).socket is not None
    assert ("SupplementaryGroups=www-data" in units[sentinel.UNIT_PATH]) == on_socket
    _, tcp = _units({"vllm_version": "0.6.3"})
    assert "SupplementaryGroups" not in tcp[sentinel.UNIT_PATH]
    assert '"--url" "http://127.0.0.1:8000/v1/completions"' in tcp[sentinel.UNIT_PATH]


def test_restart_off_leaves_the_flag_out_of_the_command_line():
    settings, units = _units({"sentinel_restart": False, "sentinel_interval_s": 60})
    argv = sentinel.sentinel_argv(settings, engine_access.endpoint(settings))
    assert "--restart" not in argv and argv[argv.index("--interval") + 1] == "60"


def test_the_restart_is_systemd_s_and_skipped_while_the_host_drains():
    _, units = _units({})
    path = units[sentinel.RESTART_PATH_UNIT_PATH]
    assert f"PathModified={sentinel.RESTART_REQUEST}" in path
    assert f"Unit={sentinel.RESTART_SERVICE}" in path
    service = units[sentinel.RESTART_SERVICE_PATH]
    assert [line for line in service.splitlines() if line.startswith("ExecCondition=")] == [
        "ExecCondition=/usr/bin/test ! -e /run/pyinfra-vllm-drain/draining",
        "ExecCondition=/usr/bin/test ! -e /run/pyinfra-vllm-drain/leaving"]
    # A stuck engine is killed first, every process of it (a frozen one too), then started:
    # no --shutdown-timeout spent on requests it will never serve.
    starts = [line for line in service.splitlines() if line.startswith("ExecStart=")]
    assert starts == ["ExecStart=-/usr/bin/systemctl kill --signal=SIGKILL vllm.service",
                      "ExecStart=/usr/bin/systemctl restart --no-block vllm.service"]


# --- the fact and the audit ---------------------------------------------------------------
STATE = {"state": "out-of-rotation", "reason": "3 failure(s) in a row: no answer",
         "failures": 3, "restarts": 0, "last_latency_s": None, "updated": 1796648531.0,
         "events": [{"time": 1796648500.0, "from": "ok", "to": "failing", "reason": "x"},
                    {"time": 1796648531.0, "from": "failing", "to": "out-of-rotation",
                     "reason": "3 failure(s) in a row: no answer"}]}
MARK = "--- rotation flag ---"


@pytest.mark.parametrize(("flag", "owner"), [
    (["--- absent ---"], None), (["sentinel"], "sentinel"), ([], "other"), (["tune"], "other"),
    (["--- unreadable ---"], "other")])
def test_the_fact_reads_the_state_and_the_flag_s_owner(flag, owner):
    found = parse_state([*json.dumps(STATE, indent=1).splitlines(), "", MARK, *flag])
    assert found is not None
    assert (found["state"], found["failures"], found["rotation"]) == (
        "out-of-rotation", 3, owner)
    assert len(found["events"]) == 2


@pytest.mark.parametrize(("lines", "error"), [
    (["--- unreadable ---", MARK, "--- absent ---"], "cannot be read"),
    (["{not json", MARK, "--- absent ---"], "is not JSON"),
    (['{"state": "fine"}', MARK, "--- absent ---"], "holds no known state"),
    ([], "was not read"),
])
def test_a_state_not_read_is_an_error_never_a_state(lines, error):
    found = parse_state(lines)
    assert found is not None and error in found["error"] and "state" not in found
    assert sentinel.verdict(found, True)["state"] == "unknown"
    assert sentinel.verdict(found, True)["ok"] is None


def test_no_state_file_is_absent():
    assert parse_state(["--- absent ---", MARK, "--- absent ---"]) is None
    assert sentinel.verdict(None, True)["state"] == "absent"
    assert sentinel.verdict(None, False)["state"] == "off"


def test_the_fact_s_command_reads_both_files_in_one_go():
    command = SentinelState().command(**sentinel.STATE_READ).get_raw_value()
    assert sentinel.STATE_PATH in command and "/run/pyinfra-vllm-drain/out-of-rotation" in command


def test_a_host_out_by_its_sentinel_is_refused_by_name_with_its_events():
    found = parse_state([*json.dumps(STATE).splitlines(), MARK, "sentinel"])
    judged = sentinel.verdict(found, True)
    assert (judged["ok"], judged["out_of_rotation"]) == (False, True)
    line = sentinel.refusal("gpu-a100-01", judged)
    assert line.startswith("sentinel: gpu-a100-01 is out of rotation by its sentinel "
                           "(out-of-rotation: 3 failure(s) in a row: no answer)")
    words = sentinel.sentinel_words({"sentinel": judged})
    assert words.endswith("last events: 2026-12-07T13:01:40Z ok -> failing; "
                          "2026-12-07T13:02:11Z failing -> out-of-rotation")
    # Another owner's flag (tools.tune's) is no refusal.
    other = sentinel.verdict({**found, "rotation": "other"}, True)
    assert other["ok"] is True


# --- the program, for real, against a stand-in engine --------------------------------------
def _systemctl(tmp_path: Path, state: str) -> dict[str, str]:
    """An environment whose ``systemctl show`` answers ``state`` (no systemd here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "systemctl"
    shim.write_text(f"#!/bin/sh\necho {state}\n")
    shim.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "VLLM_API_KEY": "k" * 43}


def _stub(tmp_path: Path, *extra: str) -> subprocess.Popen:
    sock = tmp_path / "engine.sock"
    if sock.exists():
        sock.unlink()
    proc = subprocess.Popen([sys.executable, STUB, "--uds", str(sock), *extra],
                            env={**os.environ, "VLLM_API_KEY": "k" * 43})
    deadline = time.monotonic() + 10
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def _sentinel(tmp_path: Path, env: dict[str, str], rounds: int, *extra: str
              ) -> subprocess.CompletedProcess:
    (tmp_path / "textfiles").mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, SENTINEL, "--url", "http://localhost/v1/completions",
         "--unix-socket", str(tmp_path / "engine.sock"), "--model", "stub",
         "--interval", "1", "--timeout", "0.5", "--failures", "2", "--max-restarts", "3",
         "--restart-window", "1800", "--state", str(tmp_path / "state.json"),
         "--textfile", str(tmp_path / "textfiles" / "pyinfra_vllm_sentinel.prom"),
         "--drain-flag", str(tmp_path / "draining"), "--leave-flag", str(tmp_path / "leaving"),
         "--rotation-flag", str(tmp_path / "out-of-rotation"),
         "--restart-request", str(tmp_path / "restart-request"), "--rounds", str(rounds),
         *extra],
        env=env, capture_output=True, text=True, timeout=60, check=True)


def _state(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "state.json").read_text())


def test_a_serving_engine_keeps_the_host_in(tmp_path):
    stub = _stub(tmp_path)
    try:
        _sentinel(tmp_path, _systemctl(tmp_path, "active"), 2, "--restart")
    finally:
        stub.kill()
    state = _state(tmp_path)
    assert (state["state"], state["failures"], state["restarts"]) == ("ok", 0, 0)
    assert 0 < state["last_latency_s"] < 0.5
    assert not (tmp_path / "out-of-rotation").exists()
    assert oct((tmp_path / "state.json").stat().st_mode & 0o777) == "0o644"
    text = (tmp_path / "textfiles" / "pyinfra_vllm_sentinel.prom").read_text()
    assert 'pyinfra_vllm_sentinel_state{state="ok"} 1' in text


def test_completions_that_hang_behind_a_healthy_health_take_the_host_out_and_back(tmp_path):
    env = _systemctl(tmp_path, "active")
    stub = _stub(tmp_path, "--stall-completions")
    try:
        done = _sentinel(tmp_path, env, 2, "--restart")
    finally:
        stub.kill()
    state = _state(tmp_path)
    assert state["state"] == "restarting" and state["restarts"] == 1
    assert (tmp_path / "out-of-rotation").read_text() == "sentinel\n"
    assert (tmp_path / "restart-request").exists()
    assert "sentinel: ok -> failing: 1 failure(s) in a row: no answer within 0.5 s" in done.stdout
    assert "sentinel: failing -> restarting: 2 failure(s) in a row" in done.stdout
    assert "k" * 43 not in done.stdout + done.stderr + json.dumps(state)
    # The engine serves again: a sentinel started afresh carries on from its state and
    # gives the host back.
    stub = _stub(tmp_path)
    try:
        done = _sentinel(tmp_path, env, 1, "--restart")
    finally:
        stub.kill()
    state = _state(tmp_path)
    assert (state["state"], state["failures"], state["restarts"]) == ("ok", 0, 1)
    assert not (tmp_path / "out-of-rotation").exists()
    assert "sentinel: restarting -> ok" in done.stdout
    assert [event["to"] for event in state["events"]] == ["failing", "restarting", "ok"]


def test_another_owner_s_flag_a_drain_and_a_leave_pause_it(tmp_path):
    env = _systemctl(tmp_path, "active")
    (tmp_path / "out-of-rotation").write_text("")  # tools.tune's: touched, empty
    stub = _stub(tmp_path, "--stall-completions")
    try:
        _sentinel(tmp_path, env, 3, "--restart")
        assert _state(tmp_path)["state"] == "paused"
        assert (tmp_path / "out-of-rotation").read_text() == ""
        (tmp_path / "out-of-rotation").unlink()
        # A rolling restart's leave (its drain and the engine's restart come next), then
        # its drain.
        for flag in ("leaving", "draining"):
            (tmp_path / flag).write_text("")
            _sentinel(tmp_path, env, 3, "--restart")
            state = _state(tmp_path)
            assert (state["state"], state["failures"], state["restarts"]) == ("paused", 0, 0)
            assert state["reason"] == ("the suite's drain flag or leave flag is set (a rolling "
                                       "restart)")
            (tmp_path / flag).unlink()
    finally:
        stub.kill()
    assert not (tmp_path / "out-of-rotation").exists()
    assert not (tmp_path / "restart-request").exists()


def test_an_engine_unit_starting_pauses_it(tmp_path):
    stub = _stub(tmp_path, "--stall-completions")
    try:
        _sentinel(tmp_path, _systemctl(tmp_path, "activating"), 3, "--restart")
    finally:
        stub.kill()
    assert _state(tmp_path)["state"] == "paused"
    assert not (tmp_path / "out-of-rotation").exists()


# --- the audit, planned as python -m tools.audit plans it -------------------------------
def test_the_audit_refuses_a_host_its_sentinel_took_out_and_only_that(monkeypatch, tmp_path):
    from tests.unit import test_stage_reads
    from tests.unit.converged_host import ConvergedHost

    files = test_stage_reads.operator_files.__wrapped__(tmp_path)
    data = test_stage_reads.scenario("cpu_tls", files)
    answer = ConvergedHost.value

    def out_of_rotation(self, fact, kwargs):
        found = answer(self, fact, kwargs)
        if fact is SentinelState:
            return {**found, "state": "out-of-rotation", "rotation": "sentinel",
                    "reason": "2 failure(s) in a row: no answer within 3 s"}
        return found

    planned = test_stage_reads.plan(monkeypatch, data, ["deploys/full.py", "deploys/audit.py"])
    assert planned.refused == []
    monkeypatch.setattr(ConvergedHost, "value", out_of_rotation)
    planned = test_stage_reads.plan(monkeypatch, data, ["deploys/full.py", "deploys/audit.py"])
    assert planned.refused == [
        "sentinel: gpu-a100-01.example.internal is out of rotation by its sentinel "
        "(out-of-rotation: 2 failure(s) in a row: no answer within 3 s); the gateway answers "
        "/health 503 until a completion answers again: journalctl -u vllm-sentinel -u vllm"]
    # The refusing operation changes the host in pyinfra's plan, as tools.audit requires
    # of a refused host (its plan and its report agree).
    assert "audit | Audit: host out of rotation by its sentinel" in planned.changes
    # The deploy itself goes on: only the audit refuses.
    assert test_stage_reads.plan(monkeypatch, data, ["deploys/full.py"]).refused == []
