"""The engine's nftables table (pyinfra_vllm/plans/engine_access.py): rendered for each
endpoint, then loaded into this machine's real kernel, in a network namespace of its own
(``unshare --net``), in front of real listeners of real users.

The loaded table is the file the unit loads before every start. Skipped, with the reason,
where this machine cannot load one: not root, or no nft (``make system-deps`` installs it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from facts.vllm_service import EngineFirewall
from pyinfra_vllm.core.settings import validate
from pyinfra_vllm.plans import engine_access
from pyinfra_vllm.plans.engine_access import loaded_digest, render_firewall
from tests.unit.impostor import SERVER as IMPOSTOR

KEYS = {"api_keys": ["k" * 40]}
NFT = shutil.which("nft") or (engine_access.NFT if Path(engine_access.NFT).exists() else None)
PORT = 18000


def tcp_loopback(**data):
    # vLLM 0.6.3's server has no --uds: the engine listens on TCP even on loopback.
    return validate({"vllm_version": "0.6.3", **KEYS, **data})


def beyond_loopback(**data):
    return validate({"vllm_version": "0.17.0", "nvidia_driver_branch": "570-server",
                     "vllm_listen_beyond_loopback": True,
                     "vllm_host": "10.0.0.5", **KEYS, **data})


def firewall(settings, user: str) -> str | None:
    """render_firewall for ``settings`` at the endpoint a run's context decides for them."""
    return render_firewall(settings, user, engine_access.endpoint(settings))


def test_an_engine_on_its_unix_socket_needs_no_firewall():
    settings = validate({"vllm_version": "0.17.0", "nvidia_driver_branch": "570-server", **KEYS})
    assert firewall(settings, "vllm") is None


def test_on_loopback_tcp_only_the_engine_answers_and_only_its_clients_connect():
    rules = firewall(tcp_loopback(vllm_port=8123), "vllm")
    assert rules is not None
    # From the port: the engine's user's packets (their connection marked), no other
    # SYN, the rest of a marked connection, resets; nothing else.
    assert [line.strip() for line in rules.splitlines() if line.startswith("\t\ttcp ")] == [
        'tcp sport 8123 meta skuid "vllm" ct mark set ct mark | 0x00100000 accept',
        "tcp sport 8123 tcp flags syn drop",
        "tcp sport 8123 ct mark & 0x00100000 == 0x00100000 accept",
        "tcp sport 8123 tcp flags rst accept",
        "tcp sport 8123 drop",
    ]
    assert ('\t\toif "lo" tcp dport 8123 meta skuid != { "root", "www-data", "vllm" } '
            "reject with tcp reset\n") in rules
    assert "chain input" not in rules  # on loopback no other machine reaches it
    # Replaced whole in one nft -f transaction: created if absent, deleted, defined.
    assert rules.index("table inet pyinfra_vllm_engine {}\n") < rules.index(
        "delete table inet pyinfra_vllm_engine\n") < rules.index("comment ")


def test_beyond_loopback_only_the_allowed_networks_reach_the_port():
    rules = firewall(beyond_loopback(vllm_engine_allow=["10.0.0.7", "fd00::9/64"]),
                            "vllm")
    assert rules is not None
    assert '\t\tiif != "lo" tcp dport 8000 ip saddr { 10.0.0.7/32 } accept\n' in rules
    assert '\t\tiif != "lo" tcp dport 8000 ip6 saddr { fd00::/64 } accept\n' in rules
    assert rules.endswith('\t\tiif != "lo" tcp dport 8000 drop\n\t}\n}\n')


def test_the_digest_follows_the_rules():
    one = firewall(beyond_loopback(vllm_engine_allow=["10.0.0.7"]), "vllm")
    same = firewall(beyond_loopback(vllm_engine_allow=["10.0.0.7"]), "vllm")
    other = firewall(beyond_loopback(vllm_engine_allow=["10.0.0.8"]), "vllm")
    assert one and same and other
    assert loaded_digest(one) == loaded_digest(same) != loaded_digest(other)
    assert len(loaded_digest(one)) == 16


def test_beyond_loopback_without_allowed_networks_is_refused():
    with pytest.raises(Exception) as error:
        validate({"vllm_listen_beyond_loopback": True, "vllm_host": "10.0.0.5", **KEYS})
    assert "vllm_engine_allow is empty" in str(error.value)


# --- the real kernel ---------------------------------------------------------------------
needs_nft = pytest.mark.skipif(
    os.geteuid() != 0 or NFT is None or shutil.which("unshare") is None,
    reason="loading a table needs root, nft (make system-deps) and unshare",
)
# Inside a fresh network namespace: lo up, the table loaded, one listener run as
# LISTENER, then one connection as each of root, www-data and nobody; each prints
# "<user> <curl's exit code> <HTTP status>". 7: refused at once; 28: no handshake.
SCRIPT = r"""
set -u
ip link set lo up
{nft} -f "$1"
{nft} -f "$1"
cd /
setpriv --reuid="$2" --regid="$(id -g "$2")" --clear-groups /usr/bin/python3 -m http.server {port} \
    --bind 127.0.0.1 >"$3" 2>&1 &
listener=$!
for _ in $(seq 50); do grep -q Serving "$3" 2>/dev/null && break; sleep 0.1; done
for user in root www-data nobody; do
    code=$(setpriv --reuid="$user" --regid="$(id -g "$user")" --clear-groups \
        curl -s -m 2 -o /dev/null -w '%{{http_code}}' http://127.0.0.1:{port}/)
    echo "$user $? $code"
done
{fact}
kill "$listener"
"""


def in_namespace(tmp_path: Path, script: str, *args: str) -> tuple[str, str]:
    """``script``'s output, run by sh in a network namespace of its own with the rendered
    table's file as ``$1`` and ``args`` after it; and the table."""
    rules = firewall(tcp_loopback(vllm_port=PORT), "daemon")
    assert rules is not None
    (tmp_path / "fw.nft").write_text(rules)
    out = subprocess.run(
        ["unshare", "--net", "sh", "-c", script, "sh", str(tmp_path / "fw.nft"), *args],
        capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    return out.stdout, rules


def run_in_namespace(tmp_path: Path, listener: str) -> tuple[list[str], str]:
    log = tmp_path / "listener.log"
    fact = EngineFirewall().command(str(NFT), engine_access.FIREWALL_TABLE,
                                    engine_access.FIREWALL_COMMENT).get_raw_value()
    out, rules = in_namespace(tmp_path, SCRIPT.format(nft=NFT, port=PORT, fact=fact),
                              listener, str(log))
    *answers, digest = out.splitlines()
    assert digest == loaded_digest(rules)
    return answers, log.read_text()


@needs_nft
def test_the_engines_user_serves_root_and_nginx_and_nobody_is_refused(tmp_path):
    # "daemon" stands for the engine's user: it owns the listener and its answers pass.
    answers, log = run_in_namespace(tmp_path, "daemon")
    assert answers == ["root 0 200", "www-data 0 200", "nobody 7 000"]
    assert log.count('"GET / HTTP/1.1" 200') == 2


@needs_nft
def test_another_user_on_the_engines_port_completes_no_handshake(tmp_path):
    # The engine down, nobody took its port: root (the audit) and nginx's workers reach
    # nothing, and the impostor receives no request (no key, no prompt).
    answers, log = run_in_namespace(tmp_path, "nobody")
    assert answers == ["root 28 000", "www-data 28 000", "nobody 7 000"]
    assert "GET" not in log


# The engine down, nobody binds its port with a backlog of 0: the kernel then answers its
# handshakes with SYN cookies, whose SYN-ACKs leave attached to no socket (Linux,
# net/ipv4/tcp_output.c, tcp_make_synack), so with no owner, and meta skuid matches only
# a packet with one (net/netfilter/nft_meta.c): "tcp sport PORT meta skuid != USER drop"
# let 9 of these 10 connections through, each with its key. Ten connections at once, as
# root and www-data; each prints "<user> <curl's exit code> <HTTP status>"; then the SYN
# cookies this namespace sent. nobody logs to /dev/fd/3, which root's shell opens.
COOKIES_SCRIPT = r"""
set -u
ip link set lo up
sysctl -qw net.ipv4.tcp_syncookies=1
{nft} -f "$1"
cd /
setpriv --reuid=nobody --regid="$(id -g nobody)" --clear-groups /usr/bin/python3 -c "$4" \
    /dev/fd/3 127.0.0.1 {port} 0 3>>"$2" >"$3" 2>/dev/null &
listener=$!
for _ in $(seq 50); do [ -s "$3" ] && break; sleep 0.1; done
pids=
for n in $(seq 10); do
    user=root; [ $((n % 2)) = 0 ] && user=www-data
    (code=$(setpriv --reuid="$user" --regid="$(id -g "$user")" --clear-groups \
        curl -s -m 3 -o /dev/null -w '%{{http_code}}' -H 'Authorization: Bearer {key}' \
        http://127.0.0.1:{port}/v1/models); echo "$user $? $code") &
    pids="$pids $!"
done
wait $pids
awk '/^TcpExt:/ {{ if (!names++) {{ split($0, name); next }}
    for (i = 2; i <= NF; i++) if (name[i] == "SyncookiesSent") print "syncookies", $i }}' \
    /proc/net/netstat
kill "$listener"
"""


@needs_nft
def test_a_listener_answering_with_syn_cookies_on_the_engine_s_port_gets_nothing(tmp_path):
    key = "sk-engine-own-" + "e" * 29
    seen = tmp_path / "seen"  # each request's Authorization, as nobody's listener got it
    seen.touch()
    seen.chmod(0o666)
    out, _ = in_namespace(tmp_path, COOKIES_SCRIPT.format(nft=NFT, port=PORT, key=key),
                          str(seen), str(tmp_path / "port"), IMPOSTOR)
    *answers, cookies = out.splitlines()
    # SYN cookies were in play: the attack's path, not a listener that never answered.
    assert cookies.startswith("syncookies ") and int(cookies.split()[1]) >= 5, out
    # No handshake completed (28: curl's timeout), no request and no key reached it.
    assert sorted(answers) == ["root 28 000"] * 5 + ["www-data 28 000"] * 5
    assert seen.read_text() == ""


# The engine's own traffic through the same table, as its user ("daemon"): HTTP/1.1 kept
# alive, connections it closes after each answer, and a large answer it closes at once
# to a slow reader, so that its last data and its FIN leave after close(), from a socket
# with no owner any more (the kernel orphans it), and the ACK of the client's FIN from its
# TIME_WAIT (the kernel's own socket, no owner either).
ENGINE = (
    "import http.server, socket, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    protocol_version = 'HTTP/1.1'\n"
    "    def do_GET(self):\n"
    "        body = b'x' * (1 << 20) if self.path == '/big' else b'ok'\n"
    "        if self.path == '/big':\n"
    "            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)\n"
    "        self.send_response(200)\n"
    "        self.send_header('Content-Length', str(len(body)))\n"
    "        self.end_headers()\n"
    "        self.wfile.write(body)\n"
    "    def log_message(self, *args): pass\n"
    "s = http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), H)\n"
    "print('serving', flush=True); s.serve_forever()\n"
)
# nginx's side (www-data): "kept <answers 200> <connections used>", "closed <answers 200>",
# "big <body bytes> <eof|the error>".
CLIENT = (
    "import http.client, socket, sys, time\n"
    "port = int(sys.argv[1])\n"
    "kept = http.client.HTTPConnection('127.0.0.1', port, timeout=5)\n"
    "statuses, ends = [], set()\n"
    "for _ in range(50):\n"
    "    kept.request('GET', '/kept'); answer = kept.getresponse(); answer.read()\n"
    "    statuses.append(answer.status); ends.add(kept.sock.getsockname())\n"
    "kept.close()\n"
    "print('kept', statuses.count(200), len(ends))\n"
    "closed = 0\n"
    "for _ in range(50):\n"
    "    one = http.client.HTTPConnection('127.0.0.1', port, timeout=5)\n"
    "    one.request('GET', '/closed', headers={'Connection': 'close'})\n"
    "    answer = one.getresponse(); answer.read(); one.close()\n"
    "    closed += answer.status == 200\n"
    "print('closed', closed)\n"
    "slow = socket.socket(); slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)\n"
    "slow.settimeout(5); slow.connect(('127.0.0.1', port))\n"
    "slow.sendall(b'GET /big HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n')\n"
    "data, end = b'', 'eof'\n"
    "while True:\n"
    "    try:\n"
    "        chunk = slow.recv(4096)\n"
    "    except OSError as error:\n"
    "        end = type(error).__name__; break\n"
    "    if not chunk: break\n"
    "    data += chunk; time.sleep(0.001)\n"
    "slow.close()\n"
    "print('big', len(data.partition(b'\\r\\n\\r\\n')[2]), end)\n"
)
ENGINE_SCRIPT = r"""
set -u
ip link set lo up
{nft} -f "$1"
cd /
setpriv --reuid=daemon --regid="$(id -g daemon)" --clear-groups /usr/bin/python3 -c "$2" \
    {port} >"$4" 2>&1 &
engine=$!
for _ in $(seq 50); do grep -q serving "$4" 2>/dev/null && break; sleep 0.1; done
setpriv --reuid=www-data --regid="$(id -g www-data)" --clear-groups /usr/bin/python3 -c "$3" {port}
sleep 0.5
echo "last-ack $(ss -Htan state last-ack | wc -l)"
kill "$engine"
"""


@needs_nft
def test_the_engine_s_own_connections_open_and_close_through_the_table(tmp_path):
    out, _ = in_namespace(tmp_path, ENGINE_SCRIPT.format(nft=NFT, port=PORT), ENGINE, CLIENT,
                          str(tmp_path / "engine.log"))
    assert out.splitlines() == [
        "kept 50 1",  # 50 answers over one kept-alive connection
        "closed 50",  # 50 connections the engine closed
        f"big {1 << 20} eof",  # all of it, and the FIN sent after close()
        "last-ack 0",  # every FIN the client sent was acknowledged
    ]
