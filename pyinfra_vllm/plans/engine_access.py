"""How the engine is reached, and by whom only.

On loopback, a stack whose server takes ``--uds`` listens on a Unix socket in
``/run/vllm-engine``: a directory of the engine's user, group nginx's workers, mode 0750.
No other local user can connect to the engine, nor create a socket in its place while it
is down (a TCP port is anyone's to bind once its owner let go of it). A stack without
``--uds`` (vLLM 0.6.3), and an engine that listens beyond loopback, use TCP; every client
the suite runs (the readiness wait, the idle check, the audit) then first checks that the
listener belongs to the engine's user, and the firewall below lets no other listener
complete a handshake.

The engine demands a key of its own, one per host: made on the host from 32 random bytes
(pyinfra_vllm/operations/util/vllm_service.py ``engine_key_command``), never a client's key, never
on the operator's machine, in two root-only files, the engine's (``KEY_ENV_PATH``) and the one nginx
sends it from (``KEY_NGINX_PATH``). vLLM checks it only on paths that start with ``/v1``, and nginx
sends it there only (templates/nginx-vllm.conf.j2, location /v1/).
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.core.templating import render

SOCKET_DIR = "/run/vllm-engine"
SOCKET_PATH = f"{SOCKET_DIR}/engine.sock"
# nginx's workers' group on Debian and Ubuntu (base-passwd's www-data, the nginx
# package's "user www-data;"): the only group that may enter SOCKET_DIR.
SOCKET_GROUP = "www-data"

# The engine's key: VLLM_API_KEY='<43 characters>' for the unit's EnvironmentFile, and
# the map nginx's site sends it from, both root's, 0600.
KEY_ENV_PATH = "/etc/vllm/engine-key.env"
KEY_NGINX_PATH = "/etc/nginx/vllm-engine-key.conf"
# base64url of 32 random bytes, without padding (a sed pattern).
KEY_RE = "[A-Za-z0-9_-]\\{43\\}"
# facts.vllm_service.EngineKey's arguments: the stages that need the key read the same.
KEY_READ = {"env_path": KEY_ENV_PATH, "nginx_path": KEY_NGINX_PATH}


@dataclass(frozen=True)
class Endpoint:
    """Where clients on the host reach the engine."""

    # The Unix socket's path, or None for TCP.
    socket: str | None
    # host:port (TCP), or "localhost" (a Unix socket: the Host header clients send).
    address: str

    def url(self, path: str) -> str:
        """An http URL for ``path``; with ``socket``, the transport is the socket."""
        return f"http://{self.address}{path}"

    @property
    def nginx_server(self) -> str:
        """The upstream's ``server`` argument."""
        return f"unix:{self.socket}" if self.socket else self.address

    @property
    def port(self) -> int | None:
        return None if self.socket else int(self.address.rsplit(":", 1)[1])


def endpoint(settings: Settings) -> Endpoint:
    """The engine's endpoint for ``settings``: the Unix socket where its stack has one and
    it listens on loopback, else ``engine_address``. A run decides it once per host, as
    its context is made (pyinfra_vllm/run/context.py ``HostContext.endpoint``), and hands
    it to every stage and every stage's reads; the functions below take it as ``place``
    and never compute it again. Only callers without a run (tests, tools) call this
    themselves."""
    if settings.stack.unix_socket and not listens_beyond_loopback(settings.vllm_host):
        return Endpoint(socket=SOCKET_PATH, address="localhost")
    return Endpoint(socket=None, address=engine_address(settings.vllm_host, settings.vllm_port))


def engine_address(host: str, port: int) -> str:
    """``host:port`` where a client on the host reaches the engine listening on ``host``:
    an IPv6 address in brackets, a wildcard bind (every address) reached on loopback."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a host name
    return f"{host}:{port}"


def listens_beyond_loopback(address: str) -> bool:
    """Is the engine's listen address reachable from other machines? Only a loopback
    address (127.0.0.0/8, ::1) or "localhost" is not; a wildcard, any other address or a
    host name is."""
    if address == "localhost":
        return False
    try:
        return not ipaddress.ip_address(address).is_loopback
    except ValueError:
        return True  # a host name: it may resolve to anything


def listens_as_settings(argv: list[str], settings: Settings, place: Endpoint) -> bool:
    """Does a running engine's command line (``EngineProcess`` argv) hold the listen
    options the settings give (``server_listen_flags``)? ``place``: the endpoint the
    run's context decided for the host (HostContext.endpoint)."""
    listen = server_listen_flags(settings, place)
    return any(argv[at:at + len(listen)] == listen for at in range(len(argv)))


def server_options(argv: Sequence[str]) -> tuple[list[str], dict[str, list[str]]]:
    """A server command line read: (the words before the first option, {option: its
    values}); ``--x=y`` is ``--x`` with the value ``y``."""
    head: list[str] = []
    options: dict[str, list[str]] = {}
    current: list[str] | None = None
    for word in argv:
        if word.startswith("--"):
            name, sep, value = word.partition("=")
            current = options.setdefault(name, [])
            if sep:
                current.append(value)
        elif current is None:
            head.append(word)
        else:
            current.append(word)
    return head, options


def running_endpoint(argv: list[str]) -> Endpoint | None:
    """Where the engine running with ``argv`` (``EngineProcess``) is reached: its
    ``--uds``, or its ``--host`` and ``--port``; None when its command line has neither."""
    _, options = server_options(argv)
    socket, address, port = (options[flag][-1] if options.get(flag) else None
                             for flag in ("--uds", "--host", "--port"))
    if socket:
        return Endpoint(socket=socket, address="localhost")
    if address is None or port is None or not port.isdigit():
        return None
    return Endpoint(socket=None, address=engine_address(address, int(port)))


def server_listen_flags(settings: Settings, place: Endpoint) -> list[str]:
    """The server's listen options: ``--uds`` or ``--host`` and ``--port``. ``place``:
    the endpoint the run's context decided for the host (HostContext.endpoint)."""
    if place.socket:
        return ["--uds", place.socket]
    return ["--host", settings.vllm_host, "--port", str(settings.vllm_port)]


def client_args(place: Endpoint) -> list[str]:
    """The arguments files/wait_ready.py and files/engine_idle.py reach it with."""
    return ["--unix-socket", place.socket] if place.socket else []


# --- the engine's firewall, wherever it listens on TCP ------------------------------------
# On TCP (a stack without --uds, or an engine beyond loopback) a port is anyone's to bind
# once the engine let go of it, and anyone's to connect to. An nftables table of the
# suite's own, loaded as root before every start of the engine (the unit's ExecStartPre)
# and by the deploy wherever the loaded one differs, closes both by socket owner: only
# the engine's user answers from the port (another user's listener gets no handshake
# done: nginx, the readiness wait and the audit reach it not at all), only root, nginx's
# workers and the engine's user connect to it on the host, and beyond loopback only the
# machines of vllm_engine_allow. nftables' meta skuid (nft(8), "META EXPRESSIONS") is the
# owner of the packet's socket; a listener's SYN-ACK carries the listener's. A packet
# with no socket, or one its process closed, has no owner and matches neither "skuid X"
# nor "skuid != X" (net/netfilter/nft_meta.c, nft_meta_get_eval_skugid): a SYN cookie's
# SYN-ACK (net/ipv4/tcp_output.c, tcp_make_synack: attached to no socket; a listener whose
# backlog is full, or 0, answers with cookies), the kernel's resets and TIME_WAIT ACKs,
# and whatever a socket sends after close(). So the table accepts from the port what the
# engine's user's sockets send, drops every other SYN, accepts the rest of a connection
# whose SYN-ACK was the engine's (a conntrack mark, FIREWALL_MARK, set by that SYN-ACK)
# and resets, and drops everything else. Not "ct state established": a SYN cookie's
# SYN-ACK is the first answer of its connection, established for conntrack. The ct
# expressions make the kernel track the host's connections (nf_conntrack) while the
# table is loaded.
FIREWALL_PATH = "/etc/vllm/engine-firewall.nft"
FIREWALL_TABLE = "pyinfra_vllm_engine"
FIREWALL_TEMPLATE = "vllm-engine-firewall.nft.j2"
NFT = "/usr/sbin/nft"
# The table's comment: "pyinfra-vllm <digest>", how facts.vllm_service.EngineFirewall
# tells the loaded rules from the file's.
FIREWALL_COMMENT = "pyinfra-vllm"
# Who may connect to the engine on the host: root (the audit), nginx's workers (the
# gateway) and the engine's user (the readiness wait, the idle check).
FIREWALL_CLIENTS = ("root", SOCKET_GROUP)
# The conntrack mark bit of the engine's connections (one bit: other rules' marks are
# left as they are).
FIREWALL_MARK = 0x00100000
# facts.vllm_service.EngineFirewall's arguments.
FIREWALL_READ = {"nft": NFT, "table": FIREWALL_TABLE, "comment": FIREWALL_COMMENT}


def render_firewall(settings: Settings, user: str, place: Endpoint) -> str | None:
    """The engine's nftables file for ``settings``, or None where it listens on a Unix
    socket (the socket's directory keeps everyone else out: no firewall is needed).

    + settings: a validated ``pyinfra_vllm.core.settings.Settings``
    + user: the engine's user (the only owner its port may answer from)
    + place: the endpoint the run's context decided for the host (HostContext.endpoint; a
      caller without a run: ``endpoint(settings)``)
    """
    if place.socket:
        return None
    beyond = listens_beyond_loopback(settings.vllm_host)
    allow = [ipaddress.ip_network(net) for net in settings.vllm_engine_allow] if beyond else []
    values = {
        "table": FIREWALL_TABLE,
        "port": place.port,
        "user": user,
        "mark": f"{FIREWALL_MARK:#010x}",
        "clients": [*FIREWALL_CLIENTS, user],
        "beyond": beyond,
        "allow4": [str(net) for net in allow if net.version == 4],
        "allow6": [str(net) for net in allow if net.version == 6],
    }
    rules = render(FIREWALL_TEMPLATE, comment="", **values)
    return render(FIREWALL_TEMPLATE, comment=f"{FIREWALL_COMMENT} {firewall_digest(rules)}",
                  **values)


def firewall_digest(rules: str) -> str:
    """The first 16 hex digits of the sha256 of the rules (the file without its digest)."""
    return hashlib.sha256(rules.encode()).hexdigest()[:16]


def loaded_digest(firewall: str) -> str:
    """The digest the table of ``firewall`` (``render_firewall``'s file) carries when
    loaded: what facts.vllm_service.EngineFirewall reads back."""
    marker = f'comment "{FIREWALL_COMMENT} '
    return firewall.split(marker, 1)[1].split('"', 1)[0]
