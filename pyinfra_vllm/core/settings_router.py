"""The front door's settings: the router host's port, TLS, the trust it puts in the serving
hosts' gateways, its prefix affinity and its limits, and where a serving host's gateway is
reached (a section of pyinfra_vllm/core/settings.py's Settings, where they are validated).

A host is a router when the inventory puts it in the ``routers`` group (docs/router.md);
these settings are read there, apart from ``gateway_address``, which each serving host
gives the router.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from pyinfra_vllm.core import settings_checks_router
from pyinfra_vllm.core.settings_docs import SettingsSection


class RouterSettings(SettingsSection):
    """The front door: HAProxy on the hosts of the routers group, in front of the gateways."""

    # --- router (the front door) -------------------------------------------------------
    router_port: int = Field(default=8443, ge=1, le=65535)
    """Port the front door (HAProxy, on a host of the inventory's routers group) listens on
    for clients, with TLS (router_tls_cert and router_tls_key).
    """
    router_tls_cert: str | None = None
    """The front door's TLS certificate chain (PEM, the server's certificate first), a file on
    the operator's machine, installed as /etc/haproxy/vllm-router-tls/cert.pem. A router host
    needs it and router_tls_key: the front door never speaks plain HTTP to clients.
    """
    router_tls_key: str | None = None
    """The certificate's PEM private key, a file on the operator's machine only its owner may
    read (chmod 600); installed as /etc/haproxy/vllm-router-tls/cert.pem.key (0600, root),
    never printed.
    """
    router_gateway_ca: str | None = None
    """PEM certificates the front door trusts for the gateways' TLS (a private CA, or the
    gateways' own self-signed certificates), a file on the operator's machine. None: the
    gateway_tls_cert files of the serving hosts, each the trust for itself and the others
    (right for self-signed certificates; a certificate issued by a CA needs that CA here).
    """
    gateway_address: str | None = None
    """A serving host's setting: the name or address the front door reaches its gateway at
    (a DNS name is also checked against the gateway's certificate). None: the host's
    ssh_hostname, else its name in the inventory.
    """
    router_prefix_bytes: int = Field(default=2048, ge=64, le=65536)
    """Prefix affinity: the front door hashes this many first bytes of a request's body
    (HAProxy "balance hash req.body,bytes(0,N)", "hash-type consistent"), so requests whose
    bodies start alike, the same system prompt and history, land on the same host and reuse
    its prefix cache. Less than router_buffer_kib.
    """
    router_buffer_kib: int = Field(default=256, ge=16, le=4096)
    """HAProxy's tune.bufsize in KiB: a request retried on another host (a 503 or a failed
    connection) must fit in one buffer (HAProxy's retry-on), so a larger prompt is never
    retried. Each connection holds two: 256 KiB x 2 x router_max_connections 2000 is 1 GiB at
    worst.
    """
    router_max_connections: int = Field(default=2000, ge=10, le=100000)
    """HAProxy's maxconn: connections the front door holds at once; more wait in the
    kernel's queue.
    """
    router_check_interval_ms: int = Field(default=1000, ge=200, le=60000)
    """How often the front door asks each gateway's /health; two failures take a host out of
    the pool, two successes bring it back.
    """
    router_metrics_port: int = Field(default=8405, ge=1, le=65535)
    """Port of the front door's own metrics (HAProxy's Prometheus exporter, /metrics, with
    the same TLS), answered only to metrics_allow and prometheus_servers.
    """

    # --- rules of one setting (settings_checks_router says what each allows) ----------
    _gateway_address = field_validator("gateway_address")(
        settings_checks_router.gateway_address
    )
