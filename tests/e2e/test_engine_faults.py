"""The real engine under faults and local attackers, on a converged, serving host
(test_integrity.py's, taken over as it is; booted and converged when run alone).

Faults, each followed by the next run and the audit:

- its main process SIGKILLed: systemd restarts it (Restart=on-failure), it is ready again,
  the next run changes nothing and the audit exits 0;
- stopped with SIGSTOP (alive, answering nothing): the audit reports it not answering
  (exit 1), the next run restarts it and waits for its readiness.

Another local user (``nobody``) can neither connect to the engine nor take its address:
the engine listens on a Unix socket in /run/vllm-engine (the engine's user's, group
www-data, 0750). While the engine is stopped, a server ``nobody`` starts on the engine's
old TCP port receives no key from the readiness wait, which never passes for it.

The engine's key made world-readable and its socket directory opened by hand: the audit
names both, the next run closes them without restarting the engine.

The unit's hardening is read back from the running process (/proc/PID/status), and tried
from inside its mount namespace as its user: a write outside ReadWritePaths fails. A long
streamed generation through nginx delivers its first token well before its last. The
engine's key file lost: the gateway stage alone refuses to make a key the running engine
would not know; the whole run makes it inside the engine's restart.

Last, the engine moved to TCP beyond loopback (as on a stack without --uds): its nftables
table lets nobody connect, drops the machines outside vllm_engine_allow, and lets no
handshake of a listener ``nobody`` starts on its address complete, not even one with a
backlog of 0, which answers with SYN cookies; vLLM's own key guards /v1 only. The host stays so for test_remove.py, whose first run moves it back.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request

import pytest

from pyinfra_vllm.plans.engine_access import KEY_ENV_PATH, KEY_NGINX_PATH
from tests.e2e.conftest import SERVED_SEED, booted
from tests.e2e.test_integrity import (
    DATA,
    INSTALL_TIMEOUT,
    KEY,
    OP_RESTART,
    OP_RUNNING,
    audit,
    changed,
    converged_again,
    found_lines,
    repair,
    run,
    run_with,
)
from tests.e2e.watch import as_nobody

pytestmark = pytest.mark.e2e

SOCKET = "/run/vllm-engine/engine.sock"
READY = "/usr/local/lib/pyinfra-vllm/wait_ready.py"
MODEL = "sandbox/tiny-qwen2"
OP_ANSWERING = "full | vllm_service | vLLM service: the active engine answers /health"


@pytest.fixture(scope="module")
def served():
    """One seed host, converged with the engine started: (sandbox, host). Taken over
    from test_integrity.py when it ran before, else booted; left up for test_remove.py."""
    with booted(["seed"], take_over=SERVED_SEED, leave_up_for=SERVED_SEED,
                own_caches=True) as sandbox:
        proc, data = run(sandbox, timeout=INSTALL_TIMEOUT)
        if data is None or proc.returncode != 0:
            pytest.fail(f"first run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        yield sandbox, sandbox.hosts[0]


def main_pid(sandbox, host) -> str:
    pid = sandbox.ssh(host, "systemctl show vllm -p MainPID --value").stdout.strip()
    assert pid.isdigit() and pid != "0", f"the engine has no main process: {pid!r}"
    return pid


def any_main_pid(sandbox, host) -> str:
    return sandbox.ssh(host, "systemctl show vllm -p MainPID --value").stdout.strip()


def active_again(sandbox, host, old_pid: str, timeout: float = 300) -> str:
    """The engine's new main process, once the unit is active (ready) again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        active = sandbox.ssh(host, "systemctl show vllm -p ActiveState --value").stdout.strip()
        pid = any_main_pid(sandbox, host)
        state = f"{active} {pid}"
        if active == "active" and pid not in ("0", old_pid):
            return pid
        time.sleep(3)
    raise AssertionError(f"vllm not active again within {timeout} s: {state!r}")


def start_impostor(sandbox, host, address: str, backlog: int = 5) -> None:
    """A server run as nobody on ``address``:8000 (unit ``impostor``) that logs every
    Authorization it receives to /tmp/impostor.log; ``backlog``: its listen() backlog (0:
    the kernel answers every handshake with a SYN cookie)."""
    impostor = ("import http.server\n"
                "class H(http.server.BaseHTTPRequestHandler):\n"
                "    def do_GET(self):\n"
                "        open('/tmp/impostor.log', 'a').write(str(self.headers.get('Authorization')))\n"
                "        self.send_response(200); self.end_headers()\n"
                "    do_POST = do_GET\n"
                "class S(http.server.HTTPServer):\n"
                f"    request_queue_size = {backlog}\n"
                f"S(('{address}', 8000), H).serve_forever()\n")
    encoded = base64.b64encode(impostor.encode()).decode()
    sandbox.ssh(host, f"echo {encoded} | base64 -d > /tmp/impostor.py && touch /tmp/impostor.log"
                      " && chmod 666 /tmp/impostor.log")
    sandbox.ssh(host, "systemd-run --unit impostor -p User=nobody python3 /tmp/impostor.py "
                      "&& sleep 2")


def test_another_user_cannot_connect_to_the_engine_nor_take_its_address(served):
    sandbox, host = served
    assert sandbox.ssh(host, "stat -c '%a %U %G' /run/vllm-engine").stdout.split() == [
        "750", "vllm", "www-data"]
    # Root (the audit) reaches it; nothing listens on the old TCP port.
    assert sandbox.ssh(host, f"curl -s -o /dev/null -w '%{{http_code}}' --unix-socket {SOCKET} "
                             "http://localhost/health").stdout == "200"
    assert sandbox.ssh(host, "ss -Hltn 'sport = :8000'").stdout.strip() == ""
    # curl says only "Couldn't connect" (exit 7) for a socket it may not reach.
    connect = as_nobody(sandbox, host, f"curl -sS --unix-socket {SOCKET} http://localhost/health"
                                       "; echo rc=$?")
    assert "rc=7" in connect.stdout, connect
    listing = as_nobody(sandbox, host, "ls /run/vllm-engine 2>&1; echo rc=$?")
    assert "Permission denied" in listing.stdout and "rc=2" in listing.stdout
    bind = as_nobody(sandbox, host, "python3 -c \"import socket; s = socket.socket(socket.AF_UNIX); "
                                    f"s.bind('{SOCKET}.x')\" 2>&1; echo rc=$?")
    assert "PermissionError" in bind.stdout and "rc=1" in bind.stdout


def test_an_impostor_while_the_engine_is_stopped_gets_no_key_and_no_readiness(served):
    sandbox, host = served
    sandbox.ssh(host, "systemctl stop vllm")
    try:
        _impostor_gets_nothing(sandbox, host)
        assert repair(sandbox) == {OP_RUNNING}
    finally:
        sandbox.ssh(host, "systemctl is-active -q vllm || systemctl start vllm", check=False,
                    timeout=600)
    converged_again(sandbox)


def _impostor_gets_nothing(sandbox, host) -> None:
    # Stopped: its socket is gone, and nobody cannot put one in its place.
    assert sandbox.ssh(host, f"test -e {SOCKET} || echo gone").stdout.strip() == "gone"
    bind = as_nobody(sandbox, host, "python3 -c \"import socket; s = socket.socket(socket.AF_UNIX); "
                                    f"s.bind('{SOCKET}')\" 2>&1; echo rc=$?")
    assert "PermissionError" in bind.stdout and "rc=1" in bind.stdout
    # nobody takes the TCP port an engine without a socket would use, and logs every
    # Authorization it receives.
    start_impostor(sandbox, host, "127.0.0.1")
    try:
        # The readiness wait, as the engine's user with the engine's key, pointed at it.
        ready = sandbox.ssh(host, "set -a; . /etc/vllm/engine-key.env; set +a; "
                                  "runuser -u vllm -- /opt/vllm/current/bin/python "
                                  f"{READY} --url http://127.0.0.1:8000/health --model {MODEL} "
                                  "--interval 0.5 --timeout 3; echo rc=$?", check=False)
        assert "is held by uid 65534, not the engine's" in ready.stderr, ready.stderr
        assert "rc=1" in ready.stdout
        # nginx goes to the socket, never to the impostor's port.
        status = sandbox.ssh(host, "curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: "
                                   f"Bearer {KEY}' http://127.0.0.1:8001/v1/models").stdout
        assert status == "502"
        assert sandbox.ssh(host, "cat /tmp/impostor.log").stdout == ""
    finally:
        sandbox.ssh(host, "systemctl stop impostor; rm -f /tmp/impostor.py /tmp/impostor.log",
                    check=False)


def test_a_sigkilled_engine_is_restarted_by_systemd_and_the_next_run_changes_nothing(served):
    sandbox, host = served
    pid = main_pid(sandbox, host)
    sandbox.ssh(host, f"kill -KILL {pid}")
    new = active_again(sandbox, host, pid)
    assert new != pid
    assert sandbox.ssh(host, f"curl -s -o /dev/null -w '%{{http_code}}' --unix-socket {SOCKET} "
                             "http://localhost/health").stdout == "200"
    converged_again(sandbox)


def test_a_stopped_engine_is_reported_not_answering_and_restarted(served):
    sandbox, host = served
    pid = main_pid(sandbox, host)
    sandbox.ssh(host, f"kill -STOP {pid}")
    try:
        proc = audit(sandbox)
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "not answering" in proc.stdout + proc.stderr
        assert "did not answer 200 within 5 s" in proc.stdout + proc.stderr
        assert repair(sandbox) == {OP_ANSWERING, OP_RESTART}
    finally:
        sandbox.ssh(host, f"kill -CONT {pid}", check=False)
    assert main_pid(sandbox, host) != pid
    converged_again(sandbox)


def test_the_unit_s_hardening_holds_in_the_running_engine(served):
    sandbox, host = served
    pid = main_pid(sandbox, host)
    status = dict(line.split(":", 1) for line in sandbox.ssh(
        host, f"grep -E '^(NoNewPrivs|Seccomp|CapEff|CapBnd|CapAmb):' /proc/{pid}/status"
    ).stdout.splitlines())
    status = {key: value.strip() for key, value in status.items()}
    assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"
    for caps in ("CapEff", "CapBnd", "CapAmb"):
        assert int(status[caps], 16) == 0, (caps, status[caps])
    # In its mount namespace, as its user: ProtectSystem=strict, ReadWritePaths its state.
    inside = f"nsenter -t {pid} -m -S $(id -u vllm) -G $(id -g vllm) --"
    outside = sandbox.ssh(host, f"{inside} touch /usr/local/lib/x 2>&1; echo rc=$?",
                          check=False).stdout
    assert "Read-only file system" in outside and "rc=1" in outside
    assert sandbox.ssh(host, f"{inside} sh -c 'touch /var/lib/vllm/x && rm /var/lib/vllm/x' "
                             "&& echo ok").stdout.strip() == "ok"
    home = sandbox.ssh(host, f"{inside} ls /home /root 2>&1; echo rc=$?", check=False).stdout
    assert "rc=0" not in home
    # Its compile cache: a directory of its environment's name, the engine user's alone
    # (systemd's CacheDirectory=), writable there; the directory above it root's.
    cache = sandbox.ssh(host, f"tr '\\0' '\\n' < /proc/{pid}/environ | "
                              "sed -n 's/^VLLM_CACHE_ROOT=//p'").stdout.strip()
    env = sandbox.ssh(host, "readlink /opt/vllm/current").stdout.strip().rsplit("/", 1)[1]
    assert cache == f"/var/cache/vllm/{env}/vllm"
    assert sandbox.ssh(host, f"stat -c '%U %a' /var/cache/vllm /var/cache/vllm/{env}"
                       ).stdout.split("\n")[:2] == ["root 755", "vllm 700"]
    assert sandbox.ssh(host, f"{inside} sh -c 'touch /var/cache/vllm/{env}/x && "
                             f"rm /var/cache/vllm/{env}/x' && echo ok").stdout.strip() == "ok"


def test_a_long_stream_through_nginx_delivers_its_first_token_well_before_its_last(served):
    sandbox, host = served
    probe = (
        "import http.client, json, sys, time\n"
        "conn = http.client.HTTPConnection('127.0.0.1', 8001, timeout=300)\n"
        f"body = json.dumps({{'model': '{MODEL}', 'prompt': 'Count:', 'max_tokens': 512,\n"
        "                    'temperature': 0, 'ignore_eos': True, 'stream': True})\n"
        "start = time.monotonic()\n"
        f"conn.request('POST', '/v1/completions', body, {{'Authorization': 'Bearer {KEY}',\n"
        "             'Content-Type': 'application/json'})\n"
        "resp = conn.getresponse(); times = []\n"
        "for line in resp:\n"
        "    if line.startswith(b'data:') and b'[DONE]' not in line:\n"
        "        times.append(time.monotonic() - start)\n"
        "print(json.dumps({'status': resp.status, 'events': len(times), 'first': times[0],\n"
        "                  'last': times[-1]}))\n")
    encoded = base64.b64encode(probe.encode()).decode()
    out = sandbox.ssh(host, f"echo {encoded} | base64 -d > /root/stream_probe.py && "
                            "python3 /root/stream_probe.py").stdout
    result = json.loads(out)
    print("\nstream through nginx:", result)
    assert result["status"] == 200 and result["events"] >= 500
    # Unbuffered: the first token arrives in under a quarter of the stream's time.
    assert result["first"] / result["last"] < 0.25, result


def through_nginx(sandbox, host) -> str:
    return sandbox.ssh(host, "curl -s -o /dev/null -w '%{http_code}' -H "
                             f"'Authorization: Bearer {KEY}' http://127.0.0.1:8001/v1/models"
                       ).stdout


def test_a_lost_engine_key_is_made_only_in_the_engine_s_restart(served):
    """The engine's key file deleted by hand: the gateway stage alone refuses to make a key
    the running engine would not know (nginx keeps the one it knows, still serving); the
    whole run makes it inside the engine's restart."""
    sandbox, host = served
    pid = main_pid(sandbox, host)
    nginx_key = sandbox.ssh(host, f"sha256sum {KEY_NGINX_PATH}").stdout.split()[0]
    sandbox.ssh(host, f"rm {KEY_ENV_PATH}")
    gateway = sandbox.pyinfra("--json", *DATA, "deploys/gateway.py", timeout=300)
    assert gateway.returncode != 0
    assert f"{KEY_ENV_PATH} is missing or holds no valid key while vllm.service runs" in \
        gateway.stderr, gateway.stderr[-3000:]
    assert sandbox.ssh(host, f"sha256sum {KEY_NGINX_PATH}").stdout.split()[0] == nginx_key
    assert sandbox.ssh(host, f"test -e {KEY_ENV_PATH} || echo gone").stdout.strip() == "gone"
    assert through_nginx(sandbox, host) == "200"
    assert main_pid(sandbox, host) == pid

    assert OP_RESTART in repair(sandbox)
    assert main_pid(sandbox, host) != pid
    assert sandbox.ssh(host, f"sha256sum {KEY_NGINX_PATH}").stdout.split()[0] != nginx_key
    assert sandbox.ssh(host, f"stat -c '%a %U' {KEY_ENV_PATH} {KEY_NGINX_PATH}"
                       ).stdout.split() == ["600", "root", "600", "root"]
    assert through_nginx(sandbox, host) == "200"
    converged_again(sandbox)


OP_ACCESS = ("full | vllm_service | vLLM service: owner and mode of its key, environment "
             "file, socket and spools")
SOCKET_DIR = "/run/vllm-engine"


def test_opened_key_and_socket_directory_are_named_and_closed_without_a_restart(served):
    """The engine's key made world-readable and its socket directory opened to every local
    user, by hand: the audit names both (exit 1), the next run closes both again without
    restarting the engine, and the run after changes nothing."""
    sandbox, host = served
    pid = main_pid(sandbox, host)
    sandbox.ssh(host, f"chmod 0644 {KEY_ENV_PATH} && chmod 0777 {SOCKET_DIR}")
    try:
        # Open indeed: nobody can read the key (never printed) and reach the engine.
        opened = as_nobody(sandbox, host, f"test -r {KEY_ENV_PATH} && echo key-readable; "
                                          f"curl -s -o /dev/null -w '%{{http_code}}' "
                                          f"--unix-socket {SOCKET} http://localhost/health")
        assert opened.stdout.split() == ["key-readable", "200"], opened

        proc = audit(sandbox)
        assert proc.returncode == 1, proc.stderr[-3000:]
        found = " ".join(found_lines(proc))
        assert f"access: {KEY_ENV_PATH} is root:root 0644, should be root:root 0600" in found
        assert (f"access: {SOCKET_DIR} is vllm:www-data 0777, should be vllm:www-data 0750"
                in found), found
        assert [line for line in proc.stderr.splitlines() if "would change" in line] == [
            f"drift: host {host.name}: 1 operation(s) would change: vLLM service: owner and "
            "mode of its key, environment file, socket and spools [vllm_service]"]

        assert repair(sandbox) == {OP_ACCESS}
        assert sandbox.ssh(host, f"stat -c '%a %U %G' {KEY_ENV_PATH} {SOCKET_DIR}"
                           ).stdout.split() == ["600", "root", "root", "750", "vllm", "www-data"]
        assert main_pid(sandbox, host) == pid  # repaired without a restart
    finally:
        # Never left open for the modules after this one, whatever failed above.
        sandbox.ssh(host, f"chmod 0600 {KEY_ENV_PATH}; chmod 0750 {SOCKET_DIR}", check=False)
    closed = as_nobody(sandbox, host, f"test -r {KEY_ENV_PATH} || echo key-closed; "
                                      f"curl -sS --unix-socket {SOCKET} http://localhost/health"
                                      "; echo rc=$?", check=False)
    assert "key-closed" in closed.stdout and "rc=7" in closed.stdout, closed
    assert through_nginx(sandbox, host) == "200"
    converged_again(sandbox)


# --- on TCP (a stack without --uds, or beyond loopback): the engine's firewall ----------
OP_FIREWALL_FILE = "full | vllm_service | vLLM service: engine firewall file"
OP_FIREWALL = "full | vllm_service | vLLM service: engine firewall loaded"
OP_NFTABLES = "full | vllm_service | vLLM service: nftables installed"


def on_tcp(host, allow: str) -> list[str]:
    """The settings of an engine beyond loopback, on the host's own address, reachable
    from the machines of ``allow`` only."""
    return ["vllm_listen_beyond_loopback=true", f"vllm_host={host.address}",
            f'vllm_engine_allow=["{allow}"]']


def from_this_machine(url: str) -> str:
    """``url`` fetched from the machine the tests run on (another machine, for the
    host): the HTTP status, or "no answer" within 3 s."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with direct.open(url, timeout=3) as resp:
            return str(resp.status)
    except urllib.error.HTTPError as error:
        return str(error.code)
    except (TimeoutError, urllib.error.URLError) as error:
        return f"no answer ({error})"


def test_on_tcp_the_firewall_keeps_other_users_and_machines_off_the_engine(served):
    sandbox, host = served
    engine = f"http://{host.address}:8000"
    elsewhere = "10.213.1.254/32"  # not the machine the tests run on
    proc, data = run_with(sandbox, *on_tcp(host, elsewhere), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {OP_NFTABLES, OP_FIREWALL_FILE, OP_FIREWALL, OP_RESTART} <= changed(data)
    uid = sandbox.ssh(host, "id -u vllm").stdout.strip()
    table = sandbox.ssh(host, "nft list table inet pyinfra_vllm_engine").stdout
    # From the port: the engine's user's packets (their connection marked), no other SYN.
    assert f"tcp sport 8000 meta skuid {uid} ct mark set ct mark | 0x00100000 accept" in table
    assert "tcp sport 8000 tcp flags syn drop" in table
    # nginx's workers, root and the engine's user reach it; nobody is refused at once.
    status = sandbox.ssh(host, "curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: "
                               f"Bearer {KEY}' http://127.0.0.1:8001/v1/models").stdout
    assert status == "200"
    assert sandbox.ssh(host, f"curl -s -o /dev/null -w '%{{http_code}}' {engine}/health"
                       ).stdout == "200"
    refused = as_nobody(sandbox, host, f"curl -sS -m 3 {engine}/health; echo rc=$?")
    assert "rc=7" in refused.stdout, refused
    # Another machine, outside vllm_engine_allow: its connection is dropped.
    assert from_this_machine(f"{engine}/health").startswith("no answer")

    # This machine allowed: only the firewall changes, the engine keeps running.
    pid = main_pid(sandbox, host)
    allowed = on_tcp(host, f"{host.gateway}/32")
    proc, data = run_with(sandbox, *allowed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert changed(data) == {OP_FIREWALL_FILE, OP_FIREWALL}
    assert main_pid(sandbox, host) == pid
    # What vLLM's key covers: /v1 only; /health and /metrics answer whoever reaches it.
    assert from_this_machine(f"{engine}/v1/models") == "401"
    assert from_this_machine(f"{engine}/health") == "200"
    assert from_this_machine(f"{engine}/metrics") == "200"

    _tcp_impostor_gets_nothing(sandbox, host, engine)
    sandbox.ssh(host, "systemctl start vllm", timeout=600)
    _firewall_drift_repaired(sandbox, host, allowed)


def _tcp_impostor_gets_nothing(sandbox, host, engine: str) -> None:
    # The engine stopped, nobody takes its address and logs what it receives.
    sandbox.ssh(host, "systemctl stop vllm")
    start_impostor(sandbox, host, host.address)
    try:
        assert sandbox.ssh(host, "ss -Hltn 'sport = :8000' | wc -l").stdout.strip() == "1"
        # Its handshake never completes: not for root, nginx, nor another machine.
        timed_out = sandbox.ssh(host, f"curl -s -m 3 -H 'Authorization: Bearer x' {engine}/health;"
                                      " echo rc=$?", check=False).stdout
        assert "rc=28" in timed_out
        gateway = sandbox.ssh(host, "curl -s -m 5 -o /dev/null -w '%{http_code}' -H "
                                    f"'Authorization: Bearer {KEY}' "
                                    "http://127.0.0.1:8001/v1/models", check=False).stdout
        assert gateway == "000"
        assert from_this_machine(f"{engine}/health").startswith("no answer")
        ready = sandbox.ssh(host, "set -a; . /etc/vllm/engine-key.env; set +a; "
                                  "runuser -u vllm -- /opt/vllm/current/bin/python "
                                  f"{READY} --url {engine}/health --model {MODEL} "
                                  "--interval 0.5 --timeout 3; echo rc=$?", check=False)
        assert "is held by uid 65534, not the engine's" in ready.stderr, ready.stderr
        assert sandbox.ssh(host, "cat /tmp/impostor.log").stdout == ""
    finally:
        sandbox.ssh(host, "systemctl stop impostor; rm -f /tmp/impostor.py /tmp/impostor.log",
                    check=False)


def syncookies_sent(sandbox, host) -> int:
    """The host's TcpExtSyncookiesSent: SYN cookies its network namespace has sent."""
    out = sandbox.ssh(host, "awk '/^TcpExt:/ { if (!names++) { split($0, name); next } "
                            'for (i = 2; i <= NF; i++) if (name[i] == "SyncookiesSent") '
                            "print $i }' /proc/net/netstat").stdout
    return int(out.strip())


def test_on_tcp_a_listener_answering_with_syn_cookies_gets_no_request_and_no_key(served):
    # The engine stopped, nobody takes its port with a backlog of 0: the kernel answers
    # every handshake with a SYN cookie, whose SYN-ACK has no socket, so no owner for the
    # table's meta skuid. None completes: no request, no key, from root, nginx (the
    # engine's own key, on /v1) or another machine.
    sandbox, host = served
    engine = f"http://{host.address}:8000"
    allowed = on_tcp(host, f"{host.gateway}/32")
    proc, _ = run_with(sandbox, *allowed)  # as the test before left it: nothing to change
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sandbox.ssh(host, "sysctl -n net.ipv4.tcp_syncookies").stdout.strip() == "1"
    sandbox.ssh(host, "systemctl stop vllm")
    start_impostor(sandbox, host, host.address, backlog=0)
    try:
        assert sandbox.ssh(host, "ss -Hltn 'sport = :8000' | wc -l").stdout.strip() == "1"
        before = syncookies_sent(sandbox, host)
        ten = "for n in $(seq 10); do {} & done; wait"
        direct = sandbox.ssh(host, ten.format(
            "curl -s -m 3 -o /dev/null -w '%{http_code}\\n' -H 'Authorization: Bearer x' "
            f"{engine}/v1/models"), check=False).stdout.split()
        assert direct == ["000"] * 10
        gateway = sandbox.ssh(host, ten.format(
            "curl -s -m 5 -o /dev/null -w '%{http_code}\\n' -H "
            f"'Authorization: Bearer {KEY}' http://127.0.0.1:8001/v1/models"),
            check=False).stdout.split()
        assert gateway == ["000"] * 10
        for _ in range(3):
            assert from_this_machine(f"{engine}/v1/models").startswith("no answer")
        # The attack's path: SYN cookies were sent, and none of them opened a connection.
        assert syncookies_sent(sandbox, host) - before >= 5
        assert sandbox.ssh(host, "cat /tmp/impostor.log").stdout == ""
    finally:
        sandbox.ssh(host, "systemctl stop impostor; rm -f /tmp/impostor.py /tmp/impostor.log",
                    check=False)
    # The engine back on its port, through the same table: served again.
    sandbox.ssh(host, "systemctl start vllm", timeout=600)
    for _ in range(5):
        status = sandbox.ssh(host, "curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: "
                                   f"Bearer {KEY}' http://127.0.0.1:8001/v1/models").stdout
        assert status == "200"


def _firewall_drift_repaired(sandbox, host, data: list[str]) -> None:
    # The table flushed by hand: the audit names it, the next run loads it, nothing else.
    sandbox.ssh(host, "nft delete table inet pyinfra_vllm_engine")
    args = [arg for pair in data for arg in ("--data", pair)]
    proc = audit(sandbox, *args)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "engine firewall loaded" in proc.stdout + proc.stderr
    proc, result = run_with(sandbox, *data)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert changed(result) == {OP_FIREWALL}
    proc, result = run_with(sandbox, *data)
    assert result["results"]["totals"]["success"] == 0, changed(result)
    assert audit(sandbox, *args).returncode == 0
