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


def test_an_engine_on_its_unix_socket_needs_no_firewall():
    settings = validate({"vllm_version": "0.17.0", "nvidia_driver_branch": "570-server", **KEYS})
    assert render_firewall(settings, "vllm") is None


def test_on_loopback_tcp_only_the_engine_answers_and_only_its_clients_connect():
    rules = render_firewall(tcp_loopback(vllm_port=8123), "vllm")
    assert rules is not None
    assert '\t\ttcp sport 8123 meta skuid != "vllm" drop\n' in rules
    assert ('\t\toif "lo" tcp dport 8123 meta skuid != { "root", "www-data", "vllm" } '
            "reject with tcp reset\n") in rules
    assert "chain input" not in rules  # on loopback no other machine reaches it
    # Replaced whole in one nft -f transaction: created if absent, deleted, defined.
    assert rules.index("table inet pyinfra_vllm_engine {}\n") < rules.index(
        "delete table inet pyinfra_vllm_engine\n") < rules.index("comment ")


def test_beyond_loopback_only_the_allowed_networks_reach_the_port():
    rules = render_firewall(beyond_loopback(vllm_engine_allow=["10.0.0.7", "fd00::9/64"]),
                            "vllm")
    assert rules is not None
    assert '\t\tiif != "lo" tcp dport 8000 ip saddr { 10.0.0.7/32 } accept\n' in rules
    assert '\t\tiif != "lo" tcp dport 8000 ip6 saddr { fd00::/64 } accept\n' in rules
    assert rules.endswith('\t\tiif != "lo" tcp dport 8000 drop\n\t}\n}\n')


def test_the_digest_follows_the_rules():
    one = render_firewall(beyond_loopback(vllm_engine_allow=["10.0.0.7"]), "vllm")
    same = render_firewall(beyond_loopback(vllm_engine_allow=["10.0.0.7"]), "vllm")
    other = render_firewall(beyond_loopback(vllm_engine_allow=["10.0.0.8"]), "vllm")
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


def run_in_namespace(tmp_path: Path, listener: str) -> tuple[list[str], str]:
    rules = render_firewall(tcp_loopback(vllm_port=PORT), "daemon")
    assert rules is not None
    (tmp_path / "fw.nft").write_text(rules)
    log = tmp_path / "listener.log"
    fact = EngineFirewall().command(str(NFT), engine_access.FIREWALL_TABLE,
                                    engine_access.FIREWALL_COMMENT).get_raw_value()
    script = SCRIPT.format(nft=NFT, port=PORT, fact=fact)
    out = subprocess.run(
        ["unshare", "--net", "sh", "-c", script, "sh", str(tmp_path / "fw.nft"), listener,
         str(log)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    *answers, digest = out.stdout.splitlines()
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
