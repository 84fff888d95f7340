"""What the gateway's nginx configuration should be: the site and the key map rendered
from settings, and the foreign servers on its ports (pure functions;
pyinfra_vllm/operations/gateway.py writes them)."""

from __future__ import annotations

import hashlib
import ipaddress
import math
import re
from typing import Any

from pyinfra.api import (
    OperationValueError,
)

from pyinfra_vllm.core.templating import render
from pyinfra_vllm.plans.engine_access import KEY_NGINX_PATH

# /run: a tmpfs, so a host rebooted while drained comes back serving. 0755: nginx's
# workers (www-data) test the flags. A directory of its own, holding the flags alone: the
# secrets' directory (/run/pyinfra-vllm, pyinfra_vllm/operations/util/uploads.py) is 0700, and a
# drain there made it listable, then the next secret upload made it 0700 again and hid the flag from
# the workers, so the host went on serving while it was restarted.
DRAIN_DIR = "/run/pyinfra-vllm-drain"
DRAIN_FLAG = f"{DRAIN_DIR}/draining"
# Leaving the load balancers' rotation before a drain (/health 503) while /v1 still serves:
# a rolling restart writes it drain_leave_s before the drain flag, so a balancer takes the
# host out while a request it cannot retry elsewhere (one larger than its buffer) is still
# served; removed with the drain flag (pyinfra_vllm/operations/util/rolling.py).
LEAVE_FLAG = f"{DRAIN_DIR}/leaving"
# Out of the load balancers' rotation (/health 503) while /v1 still serves: a host being
# tuned (python -m tools.tune), which benchmarks itself through its own gateway.
ROTATION_FLAG = f"{DRAIN_DIR}/out-of-rotation"

SITE_TEMPLATE = "nginx-vllm.conf.j2"
KEYS_TEMPLATE = "nginx-vllm-api-keys.conf.j2"

# Debian's /etc/nginx/nginx.conf includes conf.d/*.conf inside http {}: a file there is
# enabled by being there (no sites-enabled symlink to keep in step).
SITE_PATH = "/etc/nginx/conf.d/vllm.conf"
# Not under conf.d: it must be included once, by the site, and never by the glob.
KEYS_PATH = "/etc/nginx/vllm-api-keys.conf"
# Inside /etc/nginx so the swap is a rename on one file system; 0700 so candidate key
# files are unreadable to anyone but root whatever mode the upload creates them with.
STAGING_DIR = "/etc/nginx/.pyinfra-vllm-staging"
# The TLS certificate chain (0644) and its private key (0600, root: nginx's master reads
# it before it drops privileges), installed through the same checked swap as the site.
TLS_DIR = "/etc/nginx/vllm-tls"
TLS_CERT_PATH = f"{TLS_DIR}/cert.pem"
TLS_KEY_PATH = f"{TLS_DIR}/key.pem"
# In the staging directory: the strings nginx -t's output must never show (the keys).
REDACT_NAME = "redact.txt"

# Worst case bytes per token in a request body: JSON-escaped CJK text at 2 characters per
# token, each character escaped as \uXXXX (6 bytes). See pyinfra_vllm/core/settings.py.
WORST_BYTES_PER_TOKEN = 12
# Room for the request's JSON envelope (messages, roles, sampling parameters).
ENVELOPE_BYTES = 64 * 1024
MIB = 1024 * 1024

# Characters allowed in an API key: the map line is `"~^Bearer <key>\z" 1;` and nginx
# would read a quote, backslash, semicolon, brace, dollar or space in it as syntax.
# Of those, the ones PCRE reads as operators outside a character class.
_KEY_REGEX_META = re.compile(r"([.+])")


def body_limit_mib(max_model_len: int) -> int:
    """client_max_body_size, in whole MiB, for a prompt of ``max_model_len`` tokens."""
    return math.ceil((max_model_len * WORST_BYTES_PER_TOKEN + ENVELOPE_BYTES) / MIB)


def sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def key_regex(key: str) -> str:
    """The PCRE that matches exactly ``Authorization: Bearer <key>``.

    A plain string entry of an nginx map is compared case-insensitively (it is hashed like
    a host name), and one longer than map_hash_bucket_size makes ``nginx -t`` fail; a
    regular expression after ``~`` is case-sensitive and is not hashed. Anchored at both
    ends: ``\\z`` is the subject's very end (``$`` would also match before a final
    newline). ``.`` and ``+`` are escaped, the only PCRE operators in the key alphabet.
    """
    return "^Bearer " + _escape(key) + r"\z"


def _escape(key: str) -> str:
    return _KEY_REGEX_META.sub(r"\\\1", key)


def render_keys_map(keys: list[str]) -> str:
    """The secret file: the map from the Authorization header to ``$vllm_key_ok``.

    + keys: the validated settings' ``api_keys``: the API keys clients may send; none:
      every request is let through

    The keys are rendered as they are: the settings' rules
    (pyinfra_vllm/core/settings_checks_keys.py) refused, naming its position only, a key
    nginx would read as syntax and a repeated one before any host was touched. The
    Authorization header nginx sends the engine (``$vllm_upstream_authorization``, the
    engine's own key) is in a file made on the host (``engine_access.KEY_NGINX_PATH``).
    """
    return render(KEYS_TEMPLATE, patterns=[key_regex(key) for key in keys])


def redactions(secrets: list[str]) -> list[str]:
    """The strings nginx output is filtered of: each secret as written and as a regex."""
    found: list[str] = []
    for secret in secrets:
        for form in (secret, _escape(secret)):
            if form and form not in found:
                found.append(form)
    return found


def metrics_networks(cidrs: list[str]) -> list[str]:
    """``metrics_allow`` normalized for nginx allow lines (host bits cleared)."""
    networks = []
    for cidr in cidrs:
        try:
            networks.append(str(ipaddress.ip_network(cidr, strict=False)))
        except ValueError as exc:
            raise OperationValueError(f"metrics_allow: {cidr!r} is not a CIDR ({exc})") from None
    return networks


def _check_redirect(http_redirect_port: int | None, tls: bool, gateway_port: int) -> None:
    """The plain HTTP server that redirects to https: only with TLS, on a port of its own."""
    if http_redirect_port is not None and not tls:
        raise OperationValueError("http_redirect_port needs tls (a redirect to https)")
    if http_redirect_port == gateway_port:
        raise OperationValueError("http_redirect_port must differ from gateway_port")


def render_site(
    *,
    upstream: str,
    gateway_port: int,
    metrics_allow: list[str],
    body_mib: int,
    proxy_timeout_s: int,
    extra_directives: list[str] | tuple[str, ...] = (),
    keys_path: str = KEYS_PATH,
    engine_key_path: str = KEY_NGINX_PATH,
    tls: bool = False,
    http_redirect_port: int | None = None,
    tls_cert_path: str = TLS_CERT_PATH,
    tls_key_path: str = TLS_KEY_PATH,
    node_exporter_port: int | None = None,
    drain_flag: str = DRAIN_FLAG,
    leave_flag: str = LEAVE_FLAG,
    rotation_flag: str = ROTATION_FLAG,
    server_tokens_http: bool = True,
) -> str:
    """The site file (``conf.d/vllm.conf``): upstream, server, locations.

    + upstream: the engine, as nginx's ``server`` argument (``engine_access.Endpoint``:
      ``unix:/run/vllm-engine/engine.sock`` or ``127.0.0.1:8000``)
    + engine_key_path: the file that sets the engine's own Authorization

    + tls: the server speaks TLS on gateway_port with the files at tls_cert_path and
      tls_key_path; False keeps plain HTTP
    + http_redirect_port: with tls, a second, plain HTTP server on this port that answers
      every request with a 301 to https on gateway_port and serves nothing else
    + node_exporter_port: node_exporter's port on 127.0.0.1, served as /node-metrics to
      the metrics_allow networks; None serves no /node-metrics
    + drain_flag: while this file exists, /health and /v1 answer 503 (a rolling restart
      drains the host: pyinfra_vllm/operations/rolling.py)
    + leave_flag, rotation_flag: while either file exists, /health answers 503 and /v1
      serves (a rolling restart's leave before its drain; a host being tuned: tools/tune.py)
    + server_tokens_http: ``server_tokens off`` at http level, for every server of this
      nginx; False where another file sets server_tokens there (a second one fails nginx -t)
    """
    _check_redirect(http_redirect_port, tls, gateway_port)
    return render(
        SITE_TEMPLATE,
        upstream=upstream,
        engine_key_path=engine_key_path,
        gateway_port=gateway_port,
        metrics_allow=metrics_networks(metrics_allow),
        body_mib=body_mib,
        proxy_timeout_s=proxy_timeout_s,
        extra_directives=list(extra_directives),
        keys_path=keys_path,
        tls=tls,
        http_redirect_port=http_redirect_port,
        tls_cert_path=tls_cert_path,
        tls_key_path=tls_key_path,
        node_exporter_port=node_exporter_port,
        drain_flag=drain_flag,
        leave_flag=leave_flag,
        rotation_flag=rotation_flag,
        server_tokens_http=server_tokens_http,
    )


# --- foreign configuration -------------------------------------------------------------
# Where foreign nginx files are moved to: outside every include path, kept, never deleted.
DISABLED_DIR = "/var/lib/pyinfra-vllm/nginx-disabled"
# Debian's and Ubuntu's nginx package enables its welcome page with this symlink (to
# sites-available/default; nginx-common's postinst, on a first install only): port 80 on
# every address, its Server header with nginx's version. The suite owns nginx on a
# gateway host, so the site is foreign whatever port it listens on.
DEBIAN_DEFAULT_SITE = "/etc/nginx/sites-enabled/default"


def listen_port(args: str) -> int | None:
    """The TCP port of one ``listen`` directive's arguments (nginx docs, ngx_http_core_module
    "listen"): ``8001``, ``127.0.0.1:8001``, ``[::]:8001 ssl``, ``localhost`` (80); None
    for a UNIX socket."""
    address = args.split()[0] if args.split() else ""
    if address.startswith("unix:"):
        return None
    if address.startswith("["):
        _, _, rest = address.partition("]")
        port = rest[1:] if rest.startswith(":") else "80"
    elif ":" in address:
        port = address.rpartition(":")[2]
    elif address.isdigit():
        port = address
    else:
        port = "80"
    return int(port) if port.isdigit() else None


def server_ports(server: dict[str, Any]) -> list[int]:
    """The ports one server block (facts.nginx.NginxServers) listens on; no listen
    directive is port 80 (nginx's default)."""
    if not server["listen"]:
        return [80]
    return sorted({port for port in map(listen_port, server["listen"]) if port is not None})


def foreign_servers(found: dict[str, Any] | None, ports: list[int],
                    own_paths: tuple[str, ...] = (SITE_PATH,),
                    default_site: str = DEBIAN_DEFAULT_SITE) -> list[dict[str, Any]]:
    """The files other than the suite's own (``own_paths``) that hold a server block
    listening on one of ``ports`` (the gateway's), and ``default_site`` (Debian's default
    site) with every server it holds, on any port, from facts.nginx.NginxServers.

    Each: ``{"path", "symlink", "servers": [{"line", "listen", "server_name"}], "unsafe"}``;
    ``unsafe`` says why the file cannot be set aside whole (None when it can): it is
    nginx's main file, or it also holds servers on other ports.
    """
    found_files = (found or {}).get("files") or []
    taking: list[dict[str, Any]] = []
    for file in found_files:
        if file["path"] in own_paths:
            continue
        clashing = [s for s in file["servers"]
                    if file["path"] == default_site or set(server_ports(s)) & set(ports)]
        if not clashing:
            continue
        others = [s for s in file["servers"] if s not in clashing]
        unsafe = None
        if file.get("main"):
            unsafe = "it is nginx's main configuration file"
        elif others:
            unsafe = ("it also holds server(s) on other ports (line "
                      + ", ".join(str(s["line"]) for s in others) + ")")
        taking.append({
            "path": file["path"],
            "symlink": file["symlink"],
            "servers": [{"line": s["line"], "listen": s["listen"],
                         "server_name": s["server_name"]} for s in clashing],
            "unsafe": unsafe,
        })
    return taking


def foreign_paths(foreign: list[dict[str, Any]], nginx_installed: bool) -> list[str]:
    """The files to set aside: each of ``foreign`` (foreign_servers, none unsafe), or,
    where nginx is not installed yet (this run installs it), Debian's default site, which
    its package enables and no read of this run could see (set aside if it is there)."""
    if not nginx_installed:
        return [DEBIAN_DEFAULT_SITE]
    return [entry["path"] for entry in foreign]


def foreign_words(entry: dict[str, Any]) -> str:
    """One foreign file in a sentence: where and what it listens on."""
    servers = "; ".join(
        f"line {s['line']}: listen {', '.join(s['listen']) or '(none: port 80)'}"
        + (f" server_name {' '.join(s['server_name'])}" if s["server_name"] else "")
        for s in entry["servers"]
    )
    return f"{entry['path']}{' (symlink)' if entry['symlink'] else ''}: {servers}"


def http_server_tokens(found: dict[str, Any] | None,
                       own_paths: tuple[str, ...] = (SITE_PATH,)) -> tuple[bool, list[str]]:
    """Whether the site sets ``server_tokens off`` at http level, and why the host is
    refused ([] when it is not), from facts.nginx.NginxServers' ``server_tokens``.

    Another file's server_tokens at http level (nginx.conf's line uncommented) makes the
    site's a duplicate, which fails nginx -t: where it is ``off`` it does the site's work
    and the site leaves its own out; any other value shows nginx's version on every server
    but the gateway's, and is refused.
    """
    others = [entry for entry in (found or {}).get("server_tokens") or []
              if entry["path"] not in own_paths]
    refusals = [
        f"gateway: {entry['path']} line {entry['line']} sets server_tokens "
        f"{entry['value']!r} for every server of this nginx, which then shows its version "
        "in the Server header and on error pages; set it to off there or remove the line "
        "(the gateway's site sets it off for every server)"
        for entry in others if entry["value"] != "off"
    ]
    return not others, refusals
