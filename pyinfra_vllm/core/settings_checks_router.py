"""The rules of the front door's settings (pyinfra_vllm/core/settings_router.py): where a
gateway is reached, the router's TLS files, and the limits that must agree.

The TLS files' PEM check is the gateway's (settings_checks_gateway.pem_problem). The serving
hosts' drain_leave_s against the front door's health checks is a rule across hosts, which
the router stage asks (``leave_problems``)."""

from __future__ import annotations

import ipaddress
import math
import re

from pyinfra_vllm.core.settings_checks_gateway import pem_problem

# A DNS name as HAProxy's server line and a certificate's name check take it: labels of
# letters, digits and -, joined by dots.
DNS_NAME = re.compile(r"(?=.{1,253}\Z)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)"
                      r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def gateway_address(value: str | None) -> str | None:
    # The address is written into HAProxy's server line: a space or a quote would add
    # words of its own to the front door's configuration.
    if value is None:
        return value
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    if not DNS_NAME.fullmatch(value):
        raise ValueError(f"{value!r} is neither an IP address nor a DNS name (letters, digits, "
                         "- and dots, e.g. gpu-a100-01.example.internal)")
    return value


def router_files(cert: str | None, key: str | None,
                 gateway_ca: str | None) -> list[tuple[str, str]]:
    """router_tls_cert and router_tls_key: both or neither, readable PEM, the key private;
    router_gateway_ca a PEM certificate. Each problem under its key, a sentence naming it."""
    if (cert is None) != (key is None):
        missing = "router_tls_cert" if cert is None else "router_tls_key"
        return [(missing, f"{missing} is not set: router_tls_cert and router_tls_key go "
                          "together; set both or neither")]
    checks = [("router_gateway_ca", gateway_ca, False), ("router_tls_cert", cert, False),
              ("router_tls_key", key, True)]
    problems = []
    for name, path, private in checks:
        problem = pem_problem(name, path, private) if path else None
        if problem is not None:
            problems.append((name, problem))
    return problems


def router_limits(prefix_bytes: int, buffer_kib: int, router_port: int,
                  metrics_port: int) -> list[tuple[str, str]]:
    """The prefix hashed fits in the buffer HAProxy holds the body in; the two ports apart."""
    problems = []
    if prefix_bytes >= buffer_kib * 1024:
        problems.append(("router_prefix_bytes",
                         f"router_prefix_bytes ({prefix_bytes}) must be less than "
                         f"router_buffer_kib ({buffer_kib}) x 1024: HAProxy hashes only the "
                         "body it holds in its buffer; lower router_prefix_bytes or raise "
                         "router_buffer_kib"))
    if router_port == metrics_port:
        problems.append(("router_metrics_port",
                         f"router_metrics_port ({metrics_port}) must differ from router_port: "
                         "clients must not reach the front door's metrics; choose another "
                         "port"))
    return problems


def leave_problems(router: str, leaves: dict[str, int], check_interval_ms: int) -> list[str]:
    """The serving hosts whose rolling restart refuses requests before the front door
    ``router`` can have taken them out: ``leaves`` is each one's drain_leave_s by name,
    shorter than two failed health checks (router_check_interval_ms x 2). A rule across
    hosts (one host's settings do not say whether the inventory has a front door): the
    router stage asks it. Each problem a sentence naming the host."""
    needed = math.ceil(2 * check_interval_ms / 1000)
    return [f"router {router}: drain_leave_s of {name} is {leave_s} s, shorter than the front "
            f"door's two failed health checks (router_check_interval_ms {check_interval_ms} "
            "x 2) that take a host out: a request larger than router_buffer_kib sent to it "
            "then gets its drain's 503; set drain_leave_s to at least "
            f"{needed} for that host (a second more for margin) or lower "
            "router_check_interval_ms"
            for name, leave_s in leaves.items() if leave_s * 1000 < 2 * check_interval_ms]
