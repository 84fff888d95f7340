"""The rules of the gateway's nginx site: the directives gateway_extra_directives may add,
each value by its shape, and the TLS files (the rules' conventions: settings_checks.py).
"""

from __future__ import annotations

import re
import stat
from pathlib import Path

# gateway_extra_directives: the only directives an item may name. Each sets a timeout, a
# buffer size, logging, compression or a header added to responses (nginx docs:
# ngx_http_core_module, ngx_http_proxy_module, ngx_http_log_module, ngx_http_gzip_module,
# ngx_http_headers_module), in nginx 1.18 (Ubuntu 22.04) and 1.22 (Debian 12) alike; none
# decides whether a request is let through, where it goes, what the engine is sent or which
# files nginx reads. A list of refusals is never complete: "set $vllm_key_ok 1;", or
# "satisfy any;" with "allow all;", each turns the key check off and passes nginx -t.
# The values too are an allow list, by shape (nginx docs of each directive; an argument
# may be quoted): a value that could carry a secret into a response or a log has no shape
# here. Not a variable ($: refused first), not a debug level of error_log (debug_http and
# the like write every request header, the client's Authorization and the engine's key,
# into a log file other users may read), not a log format but the gateway's own (nginx's
# "combined", access_log's default, writes the query string and the Referer), not a log
# file outside /var/log/nginx.
_TIME = r"(?:\d+(?:ms|[smhdwMy])?)+"
_SIZE = r"\d+[kKmMgG]?"
_LOG_TO = r"/var/log/nginx/[A-Za-z0-9_-][A-Za-z0-9._-]*|syslog:[A-Za-z0-9._:,=/\[\]-]+"
_LOG_TO_WORDS = "a file /var/log/nginx/NAME or syslog:server=..."
ERROR_LOG_LEVELS = ("info", "notice", "warn", "error", "crit", "alert", "emerg")
_ON_OFF = ("on|off", "on or off")
_TIME_ONE = (_TIME, "a time (75s, 1m, 500ms)")
_SIZE_ONE = (_SIZE, "a size (64k, 1m)")
_BUFFERS = (rf"\d+ {_SIZE}", "a number and a size (4 16k)")
# Each directive: (its arguments as a regular expression over them unquoted, joined by
# one space; the same in words, for the message).
GATEWAY_DIRECTIVE_VALUES: dict[str, tuple[str, str]] = {
    "access_log": (rf"off|(?:{_LOG_TO}) vllm_gateway(?: buffer={_SIZE}| gzip(?:=[1-9])?"
                   rf"| flush={_TIME})*",
                   f"off, or {_LOG_TO_WORDS} then the gateway's format vllm_gateway (nginx's "
                   "combined, the default, writes the query string and the Referer), then "
                   "buffer=, gzip or flush= if wanted"),
    "add_header": (r"[A-Za-z0-9-]+ \S.*",
                   "a header name (letters, digits and '-'), its value, then always if wanted"),
    "client_body_buffer_size": _SIZE_ONE,
    "client_body_timeout": _TIME_ONE,
    "client_header_buffer_size": _SIZE_ONE,
    "client_header_timeout": _TIME_ONE,
    "error_log": (rf"(?:{_LOG_TO}|stderr)(?: (?:{'|'.join(ERROR_LOG_LEVELS)}))?",
                  f"{_LOG_TO_WORDS} or stderr, then one level of "
                  f"{', '.join(ERROR_LOG_LEVELS)} if wanted"),
    "gzip": _ON_OFF,
    "gzip_buffers": _BUFFERS,
    "gzip_comp_level": ("[1-9]", "1 to 9"),
    "gzip_disable": (r"\S+(?: \S+)*", "regular expressions matched against User-Agent"),
    "gzip_http_version": (r"1\.0|1\.1", "1.0 or 1.1"),
    "gzip_min_length": _SIZE_ONE,
    "gzip_proxied": (r"(?:off|expired|no-cache|no-store|private|no_last_modified|no_etag"
                     r"|auth|any)(?: (?:off|expired|no-cache|no-store|private"
                     r"|no_last_modified|no_etag|auth|any))*",
                     "off, expired, no-cache, no-store, private, no_last_modified, no_etag, "
                     "auth or any"),
    "gzip_types": (r"(?:\*|[A-Za-z0-9.+-]+/[A-Za-z0-9.+*-]+)(?: (?:\*|[A-Za-z0-9.+-]+"
                   r"/[A-Za-z0-9.+*-]+))*", "MIME types (application/json) or *"),
    "gzip_vary": _ON_OFF,
    "keepalive_requests": (r"\d+", "a number"),
    "keepalive_timeout": (rf"{_TIME}(?: {_TIME})?", "a time, then a header time if wanted"),
    "large_client_header_buffers": _BUFFERS,
    "lingering_close": ("on|off|always", "on, off or always"),
    "lingering_time": _TIME_ONE,
    "lingering_timeout": _TIME_ONE,
    "log_not_found": _ON_OFF,
    "open_log_file_cache": (rf"off|max=\d+(?: inactive={_TIME}| min_uses=\d+| valid={_TIME})*",
                            "off, or max=N then inactive=, min_uses= or valid= if wanted"),
    "proxy_connect_timeout": _TIME_ONE,
    "reset_timedout_connection": _ON_OFF,
    "send_timeout": _TIME_ONE,
}
GATEWAY_DIRECTIVES = tuple(GATEWAY_DIRECTIVE_VALUES)
# Response headers the gateway's site adds itself: a second one would go out twice.
GATEWAY_HEADERS = ("X-Accel-Buffering", "Strict-Transport-Security")
# Directives the gateway's site sets from a setting: a second one in its server block
# fails nginx -t ("directive is duplicate").
DIRECTIVE_SETTINGS = {
    "client_max_body_size": "gateway_max_body_mib",
    "proxy_read_timeout": "gateway_proxy_timeout_s",
    "proxy_send_timeout": "gateway_proxy_timeout_s",
}


def _directive_problem(directive: str) -> str | None:
    """What keeps ``directive`` from being one simple nginx directive, or None."""
    text = directive.strip()
    if any(ord(char) < 32 and char != "\t" or ord(char) == 127 for char in directive):
        return "has a newline or another control character"
    if not text.endswith(";"):
        return "is not one nginx directive ending in ';'"
    if ";" in text[:-1]:
        return "holds more than one directive (a ';' before its end): give each its own item"
    blocked = sorted({char for char in text if char in "{}#"})
    if blocked:
        return (f"has {' and '.join(repr(c) for c in blocked)}: a block or comment could "
                "close the server block or hide the rest of the line")
    if "\\" in text or text.count('"') % 2 or text.count("'") % 2:
        return "has a backslash or an unbalanced quote"
    words = text[:-1].split()
    if not words:
        return "is not one nginx directive ending in ';'"
    return _directive_name_problem(words[0]) or _directive_value_problem(words)


def _directive_name_problem(name: str) -> str | None:
    """Why the directive ``name`` may not be added to the gateway, or None."""
    if name in GATEWAY_DIRECTIVES:
        return None
    if name in DIRECTIVE_SETTINGS:
        return (f"uses {name}, which the gateway sets itself: set {DIRECTIVE_SETTINGS[name]} "
                "instead (a second one fails nginx -t)")
    if name.startswith("ssl_"):
        return (f"uses {name}, which is refused: the gateway's TLS comes from "
                "gateway_tls_cert and gateway_tls_key")
    return (f"uses {name}, which is refused: an added directive may only set timeouts, "
            "buffer sizes, logging, compression or response headers; others could turn "
            "the key check off (set, satisfy, allow, auth_request), route around the key "
            "check (location, if, return, rewrite, proxy_pass), send the engine's key "
            "elsewhere (proxy_set_header) or load other files (include)")


def _directive_value_problem(words: list[str]) -> str | None:
    """Why the arguments of an allowed directive may not be added, or None."""
    if any("$" in word for word in words[1:]):
        return ("has '$': a variable can carry a secret out (add_header X "
                "$vllm_upstream_authorization sends the engine's key to every client); write "
                "the value itself")
    name, args = words[0], [word.strip("\"'") for word in words[1:]]
    debug = [arg for arg in args if arg == "debug" or arg.startswith("debug_")]
    if name == "error_log" and debug:
        return (f"logs at the debug level ({', '.join(debug)}), which writes every request "
                "header, the client's Authorization and the engine's own key too (Debian's "
                "nginx is built --with-debug), into a log file other users may read; use "
                "info or above")
    if name == "add_header" and args and args[0].lower() in map(str.lower, GATEWAY_HEADERS):
        return (f"adds {args[0]}, which the gateway's site adds itself (every response "
                "would carry it twice)")
    shape, in_words = GATEWAY_DIRECTIVE_VALUES[name]
    if not re.fullmatch(shape, " ".join(args)):
        return f"gives {name} {' '.join(args)!r}; {name} takes here: {in_words}"
    return None


def one_directive_each(value: list[str]) -> list[str]:
    for index, directive in enumerate(value):
        problem = _directive_problem(directive)
        if problem is not None:
            raise ValueError(
                f"gateway_extra_directives[{index}] {directive!r} {problem}; allowed: one "
                "simple directive per item ending in ';', e.g. \"add_header X-Served-By "
                f"gpu1;\", of these: {', '.join(GATEWAY_DIRECTIVES)}"
            )
    return value


def gateway_tls_files(cert: str | None, key: str | None, redirect_port: int | None,
                      gateway_port: int) -> None:
    """gateway_tls_cert and gateway_tls_key: both or neither, readable PEM, the key
    private; gateway_http_redirect_port only with them."""
    if (cert is None) != (key is None):
        raise ValueError("gateway_tls_cert and gateway_tls_key go together: set both or "
                         "neither")
    if redirect_port is not None:
        if cert is None:
            raise ValueError("gateway_http_redirect_port redirects to https: it needs "
                             "gateway_tls_cert and gateway_tls_key")
        if redirect_port == gateway_port:
            raise ValueError("gateway_http_redirect_port must differ from gateway_port")
    if cert is None or key is None:
        return
    for name, path, private in (("gateway_tls_cert", cert, False),
                                ("gateway_tls_key", key, True)):
        problem = pem_problem(name, path, private)
        if problem is not None:
            raise ValueError(problem)


def pem_problem(name: str, path: str, private: bool) -> str | None:
    """What is wrong with the PEM file ``path`` (the setting ``name``; the gateway's and
    the front door's TLS files alike): unreadable, no PEM certificate in it (where
    ``private``: no PEM private key), or, where ``private``, readable by its group or
    others; None: nothing."""
    marker, what = ("PRIVATE KEY-----", "private key") if private else (
        "-----BEGIN CERTIFICATE-----", "certificate")
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
