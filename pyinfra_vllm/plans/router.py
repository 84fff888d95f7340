"""What a router host (the fleet's front door) should look like: HAProxy's configuration
rendered from the inventory, the hashes of the client keys, the hardened unit's drop-in, the
trust for the gateways' certificates, and the router's own view of its pool read back.

A host of the inventory's ``routers`` group runs only the router stage; every other host
of the inventory is a serving host, and its gateway is a server of the front door's pool
(docs/router.md).
"""

from __future__ import annotations

import csv
import hashlib
import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from pyinfra_vllm.core.templating import render

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


# HAProxy's ``show stat`` CSV: the columns the pool's view reads.
_STAT_FIELDS = ("pxname", "svname", "status", "check_status", "check_code", "last_chk")


def pool_view(show_stat: str, backend: str = "vllm_gateways") -> list[dict[str, Any]]:
    """The router's view of its pool from ``show stat``'s CSV (its runtime API): each
    server of ``backend`` with ``in_pool`` (HAProxy's status UP, or going down but still
    taking requests: "UP 1/2"), the status as HAProxy says it, and why (the last check's
    status and code). A text that is not that CSV raises ValueError: never read as an
    empty, healthy pool."""
    lines = show_stat.lstrip().splitlines()
    if not lines or not lines[0].startswith("# pxname,svname,"):
        raise ValueError("not HAProxy's show stat output (no '# pxname,svname,' header)")
    rows = csv.DictReader([lines[0][2:], *lines[1:]])
    missing = [field for field in _STAT_FIELDS if field not in (rows.fieldnames or [])]
    if missing:
        raise ValueError(f"show stat output without the column(s) {', '.join(missing)}")
    view = []
    for row in rows:
        if row["pxname"] != backend or row["svname"] in ("FRONTEND", "BACKEND"):
            continue
        status = row["status"]
        why = " ".join(part for part in (row["check_status"], row["check_code"],
                                         row["last_chk"]) if part)
        view.append({"host": row["svname"], "in_pool": status.startswith("UP"),
                     "status": status, "why": why})
    return view
