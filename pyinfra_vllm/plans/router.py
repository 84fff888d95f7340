"""What a router host (the fleet's front door) should look like: HAProxy's configuration
rendered from the inventory, the hashes of the client keys, the hardened unit's drop-in, the
trust for the gateways' certificates, and the router's own view of its pool read back.

A host of the inventory's ``routers`` group runs only the router stage; every other host
of the inventory is a serving host, and its gateway is a server of the front door's pool
(docs/router.md).
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from facts.router import pool_view as pool_view  # the pool read back (RouterPool)
from pyinfra_vllm.core.templating import render
from pyinfra_vllm.plans.gateway import sha1

# The inventory group whose hosts are front doors, not serving hosts.
ROUTERS_GROUP = "routers"

CONFIG_TEMPLATE = "haproxy-vllm-router.cfg.j2"
DROPIN_TEMPLATE = "haproxy-vllm-router.service.conf.j2"
# The front door's configuration: Debian's /etc/haproxy/haproxy.cfg stays the package's.
CONFIG_PATH = "/etc/haproxy/vllm-router.cfg"
# The sha256 of each accepted "Bearer <key>" header, one a line: root, 0600.
KEYS_PATH = "/etc/haproxy/vllm-router-keys.lst"
TLS_DIR = "/etc/haproxy/vllm-router-tls"
TLS_CERT_PATH = f"{TLS_DIR}/cert.pem"
# HAProxy loads "<crt>.key" as the certificate's key (ssl-load-extra-files' default).
TLS_KEY_PATH = f"{TLS_CERT_PATH}.key"
GATEWAY_CA_PATH = f"{TLS_DIR}/gateways-ca.pem"
STAGING_DIR = "/etc/haproxy/.pyinfra-vllm-staging"
DROPIN_PATH = "/etc/systemd/system/haproxy.service.d/pyinfra-vllm.conf"
STATS_SOCKET = "/run/haproxy/vllm-router.sock"
SERVICE = "haproxy"
UNIT = f"{SERVICE}.service"
# What tests a candidate configuration before it goes live (the files it names too).
CHECK_COMMAND = f"haproxy -c -f {CONFIG_PATH}"
# Attempts on other hosts after the first fails (HAProxy's retries, with redispatch).
RETRIES = 2

# HAProxy's server names: letters, digits and _.:- (an inventory name qualifies as is).
SERVER_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@dataclass(frozen=True)
class Backend:
    """One serving host's gateway, as the front door reaches it."""

    name: str  # the host's name in the inventory, HAProxy's server name
    address: str  # a DNS name or an IP address (settings_checks_router.gateway_address)
    port: int

    @property
    def server_address(self) -> str:
        """The address as HAProxy's server line takes it (an IPv6 one with ``ipv6@``)."""
        try:
            if ipaddress.ip_address(self.address).version == 6:
                return f"ipv6@{self.address}"
        except ValueError:
            pass
        return self.address

    @property
    def tls_name(self) -> str | None:
        """The name sent as SNI and checked against the gateway's certificate: a DNS
        address; None for an IP address (the trust is then router_gateway_ca's alone)."""
        try:
            ipaddress.ip_address(self.address)
            return None
        except ValueError:
            return self.address


def backend_of(name: str, gateway_address: str | None, ssh_hostname: str | None,
               gateway_port: int) -> Backend:
    """A serving host's gateway: at ``gateway_address``, else its ssh_hostname, else its
    inventory ``name``."""
    return Backend(name=name, address=gateway_address or ssh_hostname or name,
                   port=gateway_port)


def pool_problems(router: str, backends: list[Backend], plain: list[str],
                  tls: bool) -> list[str]:
    """Why the router host ``router`` cannot be set up, each a sentence: no serving host,
    a gateway without TLS (``plain``: their names), the front door without TLS, a host name
    HAProxy cannot take."""
    problems = []
    if not backends:
        problems.append(f"router {router}: the inventory has no serving host (a host outside "
                        f"the {ROUTERS_GROUP} group) for the front door to send requests to")
    for name in plain:
        problems.append(f"router {router}: the gateway of {name} has no TLS "
                        "(gateway_tls_cert, gateway_tls_key): the front door sends client "
                        "keys only over TLS; set them for that host")
    if not tls:
        problems.append(f"router {router}: router_tls_cert and router_tls_key are not set: "
                        "the front door serves clients only over TLS; set both")
    for backend in backends:
        if not SERVER_NAME.fullmatch(backend.name):
            problems.append(f"router {router}: the host name {backend.name!r} is not one "
                            "HAProxy takes as a server name (letters, digits and _.:-, at "
                            "most 64); rename the host in the inventory")
    return problems


def key_hashes(keys: list[str]) -> str:
    """The key list's text: the sha256 of ``Bearer <key>`` of each key, in upper-case hex
    (HAProxy's ``hex`` converter), one a line. A key never leaves the operator's machine
    for the router host, only its hash."""
    return "".join(
        hashlib.sha256(f"Bearer {key}".encode()).hexdigest().upper() + "\n" for key in keys
    )


def gateway_trust(router_gateway_ca: str | None, gateway_certs: list[str]) -> str:
    """The PEM text the front door verifies the gateways' certificates with:
    router_gateway_ca's, else every serving host's gateway_tls_cert once, in order."""
    if router_gateway_ca is not None:
        return router_gateway_ca
    return "".join(text if text.endswith("\n") else text + "\n"
                   for text in dict.fromkeys(gateway_certs))


def render_config(*, backends: list[Backend], router_port: int, metrics_port: int,
                  metrics_allow: list[str], key_check: bool, prefix_bytes: int,
                  buffer_kib: int, max_connections: int, check_interval_ms: int,
                  proxy_timeout_s: int, bind_address: str = "") -> str:
    """HAProxy's configuration of the front door (templates/haproxy-vllm-router.cfg.j2)."""
    return render(
        CONFIG_TEMPLATE,
        backends=backends, router_port=router_port, metrics_port=metrics_port,
        metrics_allow=metrics_allow, key_check=key_check, prefix_bytes=prefix_bytes,
        buffer_bytes=buffer_kib * 1024, max_connections=max_connections,
        check_interval_ms=check_interval_ms, proxy_timeout_s=proxy_timeout_s,
        bind_address=bind_address, stats_socket=STATS_SOCKET, keys_path=KEYS_PATH,
        tls_cert_path=TLS_CERT_PATH, gateway_ca_path=GATEWAY_CA_PATH, retries=RETRIES,
    )


def render_dropin() -> str:
    """The haproxy unit's drop-in: the front door's configuration, hardened."""
    return render(DROPIN_TEMPLATE, config_path=CONFIG_PATH)


# --- the audit's view of a router host --------------------------------------------------
# facts.router.RouterPool's arguments.
POOL_READ = {"socket": STATS_SOCKET}
# What each of the front door's files is, in the audit's words.
FILE_WORDS = {
    CONFIG_PATH: "HAProxy's configuration",
    KEYS_PATH: "the key hashes",
    TLS_CERT_PATH: "the front door's certificate",
    TLS_KEY_PATH: "the front door's TLS key",
    GATEWAY_CA_PATH: "the gateways' trust",
    DROPIN_PATH: "haproxy's drop-in",
}


def verdict(pool: dict[str, Any] | None, activation: dict[str, Any] | None) -> dict[str, Any]:
    """The front door's verdict for the audit: ``{"state", "ok", "reason", "servers"}``
    from HAProxy's unit (facts.units.UnitActivation, ``activation``) and its pool
    (facts.router.RouterPool, ``pool``). ``ok`` is False where HAProxy is not active, its
    pool cannot be read ("unknown": never an empty, healthy pool) or no serving host is
    in it ("empty"); True otherwise, ``reason`` naming each host out of the pool."""
    servers = list((pool or {}).get("servers") or [])
    active = (activation or {}).get("active")
    if active != "active":
        return {"state": "inactive", "ok": False, "servers": servers,
                "reason": f"{UNIT} is {active or 'not installed'}"}
    if pool is None or pool.get("error"):
        why = (pool or {}).get("error") or (f"no stats socket at {STATS_SOCKET}: HAProxy "
                                            "does not run the front door's configuration")
        return {"state": "unknown", "ok": False, "servers": [], "reason": why}
    inside = [server for server in servers if server["in_pool"]]
    out = "; ".join(f"{server['host']} out ({server_words(server)})"
                    for server in servers if not server["in_pool"])
    if not inside:
        return {"state": "empty", "ok": False, "servers": servers,
                "reason": "no serving host in the pool" + (f": {out}" if out else "")}
    return {"state": "ok", "ok": True, "servers": servers,
            "reason": f"{len(inside)} of {len(servers)} serving host(s) in the pool"
                      + (f"; {out}" if out else "")}


def server_words(server: dict[str, Any]) -> str:
    """One server of the pool (pool_view's) as HAProxy says it: ``DOWN L7STS 503``."""
    return " ".join(part for part in (server["status"], server["why"]) if part)


def refusal(host_name: str, judged: dict[str, Any]) -> str:
    """The audit's line for a front door that cannot serve (``verdict``'s ``judged``)."""
    return (f"router: {host_name}: the front door cannot serve ({judged['state']}: "
            f"{judged['reason']}): journalctl -u {UNIT}; each gateway's /health")


def file_findings(wanted: dict[str, str], live_sha1: dict[str, str | None]) -> list[str]:
    """The audit's words for each of the front door's files (``wanted``: the router
    stage's, ``{path: content}``) whose live sha1 (``live_sha1``, pyinfra's Sha1File) is
    not its content's: changed by hand, or missing; the next run puts it back."""
    lines = []
    for path, content in wanted.items():
        have = live_sha1.get(path)
        what = FILE_WORDS.get(path, "a file of the front door")
        if have is None:
            lines.append(f"router: {path} ({what}) is missing: the next run writes it")
        elif have != sha1(content):
            lines.append(f"router: {path} ({what}) is not what the router stage writes "
                         "(changed by hand): the next run puts it back")
    return lines
