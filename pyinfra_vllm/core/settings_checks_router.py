"""The rules of the front door's settings (pyinfra_vllm/core/settings_router.py): where a
gateway is reached, the router's TLS files, and the limits that must agree."""

from __future__ import annotations

import ipaddress
import re
import stat
from pathlib import Path

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


def pem_problem(name: str, path: str, marker: str, what: str, private: bool) -> str | None:
    """What is wrong with ``path`` (the setting ``name``): unreadable, no PEM ``what`` in it,
    or, where ``private``, readable by its group or others; None: nothing."""
    try:
        text = Path(path).read_text(encoding="ascii", errors="replace")
        mode = Path(path).stat().st_mode
    except OSError as exc:
        return f"{name} {path}: cannot be read ({exc.strerror}); name a file on this machine"
    if marker not in text:
        return f"{name} {path}: holds no PEM {what}; name the PEM file"
    if private and mode & 0o077:
        return (f"{name} {path}: mode {stat.S_IMODE(mode):04o} lets its group or others at "
                "the private key; chmod 600 it")
    return None


def router_files(cert: str | None, key: str | None,
                 gateway_ca: str | None) -> list[tuple[str, str]]:
    """router_tls_cert and router_tls_key: both or neither, readable PEM, the key private;
    router_gateway_ca a PEM certificate. Each problem under its key, a sentence naming it."""
    if (cert is None) != (key is None):
        missing = "router_tls_cert" if cert is None else "router_tls_key"
        return [(missing, f"{missing} is not set: router_tls_cert and router_tls_key go "
                          "together; set both or neither")]
    checks = [("router_gateway_ca", gateway_ca, "-----BEGIN CERTIFICATE-----", "certificate",
               False)]
    if cert is not None and key is not None:
        checks += [("router_tls_cert", cert, "-----BEGIN CERTIFICATE-----", "certificate", False),
                   ("router_tls_key", key, "PRIVATE KEY-----", "private key", True)]
    problems = []
    for name, path, marker, what, private in checks:
        problem = pem_problem(name, path, marker, what, private) if path else None
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
