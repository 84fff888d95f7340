"""The rules of the settings: what each value may be, and what settings must agree.

pyinfra_vllm/core/settings.py declares the settings; its validators call these plain
functions. A rule of one setting takes the value (and, where it reads another setting
or its own name, pydantic's ``ValidationInfo``), returns the value as kept, and raises
ValueError with a message naming what is allowed; pydantic reports it under the key. A
rule across settings takes the values it compares.
"""

from __future__ import annotations

import ipaddress
import os
import posixpath
import re
import stat
import urllib.parse
from collections.abc import Collection
from pathlib import Path

from pydantic import SecretStr, ValidationError, ValidationInfo
from pydantic_core import InitErrorDetails, PydanticCustomError

from pyinfra_vllm.core.model_files import INCOMING, VERIFIED_NAME
from pyinfra_vllm.core.secret_files import mask_credentials, private_file_problem, read_key_lines
from pyinfra_vllm.core.stacks import CPU_STACKS, STACKS, StackRow, releases, stack_for

# Mount options that disable write barriers: ext4's barrier=0/nobarrier lose data on
# power failure, and XFS removed nobarrier in Linux 4.19 (mount fails).
BARRIER_DISABLING_OPTIONS = ("nobarrier", "barrier=0")

# An API key: long enough that it cannot be guessed (32 characters of base64 are 192
# bits), and only characters nginx reads as part of a word in the key map's line
# `"Bearer <key>" 1;` (a quote, backslash, semicolon, brace or space would be syntax).
API_KEY_MIN_LENGTH = 32
# What a key may hold: a token from secrets.token_urlsafe, a base64 key, an OpenAI-style
# "sk-..." key. No quote, blank or "$": the key sits in nginx config and an env file.
API_KEY_ALPHABET = "letters, digits and _.~+/=:-"
API_KEY_CHARS = re.compile(r"[A-Za-z0-9_.~+/=:-]+")

# The deploy runs as root and takes model_dir, python_env_root and textfile_collector_dir
# as its own: it creates, chowns and mounts over them and writes there, and
# deploys/remove.py deletes what it wrote there. Three rules keep them where nothing else
# lives. (1) Never in a system directory, nor anywhere below one: there the suite's files
# would mix with the distribution's or the kernel's, be emptied at boot, or sit where
# another user may write (a home, /tmp) and could swap a part of the path for a symbolic
# link that steers what root writes and deletes. Each names what it holds, for the message.
_DISTRIBUTION = ("the distribution's programs, libraries and configuration, which its "
                 "packages own and replace")
_HOMES = ("the users' homes: the user who owns a directory of the path could swap a part "
          "of it for a symbolic link and steer what root writes and deletes")
SYSTEM_TREES = {
    **dict.fromkeys(("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                     "/boot", "/snap"), _DISTRIBUTION),
    "/dev": "the device files, a kernel file system",
    **dict.fromkeys(("/run", "/var/run", "/var/lock"), "runtime state, emptied at every boot"),
    **dict.fromkeys(("/tmp", "/var/tmp"), "scratch space every user may write: another "
                     "user could put a symbolic link where root writes"),
    **dict.fromkeys(("/var/log", "/var/cache", "/var/spool", "/var/mail", "/var/backups",
                     "/var/lib/dpkg", "/var/lib/apt", "/var/lib/systemd"),
                    "the system's logs, caches and package state"),
    **dict.fromkeys(("/home", "/root"), _HOMES),
}
# (2) Never one of the suite's own directories (fixed names: pyinfra_vllm/plans and
# operations/util name them, tests/unit/test_settings_paths.py holds the lists equal), nor
# below or above one: the setting's files and the suite's would mix.
SUITE_DIRS = {
    "/var/lib/pyinfra-vllm": "the suite's tools, keys and what it set aside",
    "/var/lib/vllm": "the engine's state, the vllm account's home",
    "/usr/local/lib/pyinfra-vllm": "the engine's helpers",
    "/etc/vllm": "the engine's environment file",
    "/run/pyinfra-vllm": "the suite's secrets and jobs",
    "/run/pyinfra-vllm-upload": "the suite's upload spool",
    "/run/pyinfra-vllm-drain": "the gateway's drain flag",
}
# (3) Never a directory that holds others' directories side by side, nor one holding a
# system or suite directory (/, /var, /var/lib): only a directory of its own below it,
# e.g. /srv/models or /opt/vllm. And the three settings apart from each other
# (``dirs_apart``).
SHARED_DIRS = frozenset({"/", "/opt", "/srv", "/var", "/var/lib", "/var/opt", "/var/local",
                         "/mnt", "/media"})
# The settings those rules are for, in the order ``dirs_apart`` names them.
OWN_DIR_SETTINGS = ("model_dir", "python_env_root", "textfile_collector_dir")
# Kernel file systems: nothing of ours lives there.
VIRTUAL_FS_DIRS = ("/proc", "/sys")
PATH_CHARS = re.compile(r"[A-Za-z0-9_./-]+")

# sysctl keys as sysctl.d(5) writes them: net.ipv4.tcp_rmem, kernel.pid_max,
# net.ipv4.conf.all.rp_filter; "*" is systemd-sysctl's glob (net.ipv4.conf.*.rp_filter).
SYSCTL_KEY = re.compile(r"[a-z0-9_]+(\.[a-z0-9_*-]+)+")
# Integers separated by single spaces or tabs: 1, -1, "4096 87380 6291456".
# Words of letters, digits and _.:/- (bbr, fq_codel, 4096) separated by single spaces or
# tabs: what sysctl.d values are, and nothing a sysctl.d line or a shell reads otherwise.
SYSCTL_VALUE = re.compile(r"[A-Za-z0-9_.:/-]+([ \t][A-Za-z0-9_.:/-]+)*")
# One mount option: a name, optionally =value; options are list items, never "a,b".
MOUNT_OPTION = re.compile(r"[a-z0-9_]+(=[A-Za-z0-9_.:/-]+)?")

# A DNS host name (RFC 1123 labels): what a Prometheus target's host part may be.
HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")

# A Hugging Face repo id: org/name, each of letters, digits and _.- (Hugging Face's own
# rule; a part never starts with "." or "-", so no ".." and no hidden name).
MODEL_ID = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?")
SERVED_MODEL_NAME = re.compile(r"[A-Za-z0-9._/:-]+")
# A branch, tag or commit: main, v1.0, refs/pr/1, a 40-hex commit.
MODEL_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]*")

# The characters a URL setting may hold: RFC 3986's, less those a shell, an env file or a
# config file reads as syntax ($ ; ' " ` \\ and whitespace); percent-encode them instead.
URL_CHARS = re.compile(r"[A-Za-z0-9._~:/?#\[\]@!&()*+,=%-]+")

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
# apt source options that turn off the signature check.
INSECURE_APT_OPTIONS = ("trusted=yes", "allow-insecure=yes", "allow-weak=yes",
                        "allow-downgrade-to-insecure=yes")
APT_LINE = re.compile(r"deb\s+(\[(?P<options>[^\]]*)\]\s+)?(?P<uri>\S+)\s+\S+(\s+\S+)*")
# An example of each path setting, for the messages.
PATH_EXAMPLES = {
    "model_dir": "/srv/models",
    "python_env_root": "/opt/vllm",
    "textfile_collector_dir": "/var/lib/pyinfra-vllm-metrics",
    "pip_ca_bundle": "/etc/ssl/certs/ca-certificates.crt",
}


# The error type of a rule across settings: its message is a whole sentence that names
# its keys (and values, where not secret), printed as it is.
RULE_ERROR = "settings_rule"


def _key_problems(keys: list[tuple[str, str]]) -> list[str]:
    """What is wrong with API keys, each named by ``where`` (its position), never by value."""
    problems = []
    first_seen: dict[str, tuple[str, str]] = {}
    for where, key in keys:
        if len(key) < API_KEY_MIN_LENGTH:
            problems.append(
                f"{where} is shorter than {API_KEY_MIN_LENGTH} characters, short enough to "
                "be guessed: use a random key, e.g. `openssl rand -base64 36`"
            )
        if not API_KEY_CHARS.fullmatch(key):
            problems.append(
                f"{where} has characters other than {API_KEY_ALPHABET} (nginx "
                "would read a quote, space, ';' or brace in it as syntax)"
            )
        if key.lower() in first_seen:
            earlier, earlier_key = first_seen[key.lower()]
            same = "repeats" if key == earlier_key else "differs only in letter case from"
            problems.append(f"{where} {same} {earlier}: keep one of them")
        else:
            first_seen[key.lower()] = (where, key)
    return problems


def _url_problem(value: str) -> str | None:
    """What keeps ``value`` from being an http(s) URL here; the value itself is never in it."""
    scheme, _, rest = value.partition("://")
    if not rest:
        return "not a URL: write it as http(s)://HOST[:PORT]/PATH"
    if scheme not in ("http", "https"):
        return f"its scheme is {scheme[:10]!r}; allowed: http or https"
    if not URL_CHARS.fullmatch(rest):
        return ("has a character a URL here cannot carry (whitespace, a quote, $, ;, \\, ` "
                "or a control character): percent-encode it")
    try:
        parsed = urllib.parse.urlsplit(value)
        parsed.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        return "not a URL: its host or port cannot be read; write it as http(s)://HOST[:PORT]/PATH"
    if not parsed.hostname:
        return "has no host: write it as http(s)://HOST[:PORT]/PATH"
    return None


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


def _file_remedy(problem: str, holding: str) -> str:
    """A secret file's problem with what to do (the mode problem names its chmod)."""
    if "chmod" in problem:
        return problem
    return f"{problem}: point it at a file holding {holding}, mode 0600 (chmod 600 FILE)"


def token_source(hf_token: SecretStr | None, hf_token_file: str | None) -> str | None:
    """Where the Hugging Face token comes from (as pyinfra_vllm.core.locks.hf_token reads it)."""
    if hf_token is not None and hf_token.get_secret_value():
        return "hf_token"
    if hf_token_file:
        return "hf_token_file"
    if os.environ.get("HF_TOKEN"):
        return "HF_TOKEN in the environment"
    return None


# --- rules of one setting --------------------------------------------------------------
def known_stack(value: str) -> str:
    # A release with a row for either device; the pair with vllm_device is checked after.
    if value not in STACKS and value not in CPU_STACKS:
        raise ValueError(f"no stack is defined for it; allowed: {releases(STACKS, CPU_STACKS)}")
    return value


def known_stages(value: list[str], stages: Collection[str]) -> list[str]:
    unknown = [stage for stage in value if stage not in stages]
    if unknown:
        raise ValueError(f"unknown stage {unknown}; allowed: {', '.join(stages)}")
    return value


def model_id(value: str) -> str:
    parts = value.split("/")
    reserved = [part for part in parts if part in (INCOMING, VERIFIED_NAME)]
    if reserved:
        raise ValueError(
            f"{reserved[0]} is a name the model downloader keeps for itself beside the "
            "files (pyinfra_vllm/core/model_files.py); use the model's Hugging Face id, "
            "e.g. Qwen/Qwen3.6-27B"
        )
    if not MODEL_ID.fullmatch(value) or any(part[0] in ".-" for part in parts):
        raise ValueError(
            "not a Hugging Face model id: org/name (or name), each part of letters, "
            "digits and _.-, not starting with '.' or '-' (no '..'); e.g. "
            "Qwen/Qwen3.6-27B"
        )
    return value


def served_name(value: str | None) -> str | None:
    if value is not None and (not SERVED_MODEL_NAME.fullmatch(value) or value[0] == "-"):
        raise ValueError(
            "has a space or a character other than letters, digits and ._/:-, or starts "
            "with '-': it goes into the engine's command line and the unit file; e.g. "
            "qwen3.6-27b"
        )
    return value


def revision(value: str) -> str:
    if not MODEL_REVISION.fullmatch(value) or ".." in value or "//" in value:
        raise ValueError(
            "not a branch, tag or commit: letters, digits and _./-, starting with a "
            "letter, digit or _, no '..' (e.g. main, v1.0, refs/pr/1 or a commit hash)"
        )
    return value


def engine_address(value: str, info: ValidationInfo) -> str:
    """vllm_host; reads vllm_listen_beyond_loopback, declared before it."""
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        address = None
    if address is None or "%" in value:
        raise ValueError(
            "not an IP address literal: the engine listens on an address such as "
            "127.0.0.1 or ::1 (no host name, brackets, scope id or port; the port is "
            "vllm_port)"
        )
    if str(address) != value:
        raise ValueError(f"write the address as {address}")
    if not address.is_loopback and not info.data.get("vllm_listen_beyond_loopback"):
        raise ValueError(
            "not a loopback address: the engine would be reachable from the network "
            "around the gateway and its key check (0.0.0.0 and :: are every "
            "interface); keep 127.0.0.1 or ::1, or set vllm_listen_beyond_loopback=true "
            "and an API key, which the engine then requires"
        )
    return value


def api_keys(value: list[SecretStr]) -> list[SecretStr]:
    problems = _key_problems(
        [(f"api_keys[{index}]", key.get_secret_value()) for index, key in enumerate(value)]
    )
    if problems:
        raise ValueError("; ".join(problems))
    return value


def api_keys_file(value: str | None) -> str | None:
    if value is None:
        return value
    problem = private_file_problem(value)
    if problem is not None:
        raise ValueError(_file_remedy(problem, "one API key per line"))
    try:
        keys = read_key_lines(value)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot be read as text ({type(exc).__name__}): write one "
                         "API key per line") from None
    if not keys:
        raise ValueError("holds no key (only blank lines or # comments): write one API "
                         "key per line, or remove api_keys_file")
    problems = _key_problems([(f"line {number}", key) for number, key in keys])
    if problems:
        raise ValueError("; ".join(problems))
    return value


def token_chars(value: SecretStr | None) -> SecretStr | None:
    token = value.get_secret_value() if value is not None else ""
    if token and not API_KEY_CHARS.fullmatch(token):
        raise ValueError(
            f"has characters other than {API_KEY_ALPHABET} (a Hugging Face "
            "token is hf_ and letters); it is written into an environment file"
        )
    return value


def token_file(value: str | None) -> str | None:
    if value is not None:
        problem = private_file_problem(value)
        if problem is not None:
            raise ValueError(_file_remedy(problem, "the Hugging Face token"))
    return value


def host_path(value: str | None, info: ValidationInfo) -> str | None:
    """A path on the host (PATH_EXAMPLES names the settings); all but pip_ca_bundle are
    directories the deploy takes as its own."""
    if value is None:
        return value
    example = PATH_EXAMPLES[str(info.field_name)]
    system = info.field_name != "pip_ca_bundle"
    if not value.startswith("/"):
        raise ValueError(f"not an absolute path; e.g. {example}")
    if not PATH_CHARS.fullmatch(value):
        raise ValueError(
            "has characters other than letters, digits and _./- (it is written into "
            f"unit files, config files and commands); e.g. {example}"
        )
    if posixpath.normpath(value) != value or "//" in value:
        raise ValueError(
            "not a normalized path: no '.' or '..' part, no '//', no trailing '/'; "
            f"e.g. {example}"
        )
    if any(within(value, fs) for fs in VIRTUAL_FS_DIRS):
        raise ValueError(f"is on a kernel file system (/proc, /sys); e.g. {example}")
    if system:
        problem = _own_dir_problem(value)
        if problem is not None:
            raise ValueError(f"{problem}, e.g. {example}")
    return value


def within(path: str, parent: str) -> bool:
    """Is ``path`` ``parent`` or below it (both normalized, absolute)?"""
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _own_dir_problem(value: str) -> str | None:
    """Why ``value`` cannot be a directory the deploy takes as its own (SYSTEM_TREES,
    SUITE_DIRS, SHARED_DIRS), ending in what to do but the example; None: it can."""
    for suite_dir, holds in SUITE_DIRS.items():
        if within(value, suite_dir):
            where = "is" if value == suite_dir else "is inside"
            return (f"{where} {suite_dir}, the suite's own directory ({holds}): this "
                    "setting's files and the suite's would mix, and deploys/remove.py "
                    "removes the suite's there; use a directory of its own apart from it")
    for tree, holds in SYSTEM_TREES.items():
        if within(value, tree):
            where = "is" if value == tree else "is inside"
            return (f"{where} {tree}, {holds}; the deploy, as root, creates, chowns and "
                    "mounts over this directory and writes there, so none is taken in the "
                    "system's directories (/etc, /usr, /run, /var/log ...), the homes "
                    "(/home, /root) or /tmp: use a directory of its own outside them")
    holds_one = any(within(path, value) for path in (*SUITE_DIRS, *SYSTEM_TREES))
    if value in SHARED_DIRS or holds_one:
        return ("is / or a system directory, which the deploy would take over (create, "
                "mount over, chown) along with the others' directories in it; use a "
                "directory of its own below it")
    return None


def dirs_apart(dirs: dict[str, str]) -> list[tuple[str, str]]:
    """OWN_DIR_SETTINGS, each with its value: none the same as another, inside one or
    holding one. Each problem as (key, sentence naming both keys and values), under the
    later key of the pair."""
    problems = []
    names = [name for name in OWN_DIR_SETTINGS if name in dirs]
    for index, later in enumerate(names):
        for earlier in names[:index]:
            inner, outer = dirs[later], dirs[earlier]
            if inner == outer:
                relation = f"is {earlier} too"
            elif within(inner, outer):
                relation = f"is inside {earlier} = {outer!r}"
            elif within(outer, inner):
                relation = f"holds {earlier} = {outer!r}"
            else:
                continue
            problems.append((later, (
                f"{later} = {inner!r} {relation}: model_dir, python_env_root and "
                "textfile_collector_dir must each be a directory of its own, none inside "
                "another (the model volume mounts over model_dir, and deploys/remove.py "
                "takes the suite's files out of each: one's would be taken for the "
                f"other's); move {later} apart, e.g. model_dir /srv/models, python_env_root "
                "/opt/vllm, textfile_collector_dir /var/lib/pyinfra-vllm-metrics"
            )))
            break
    return problems


def device_path(value: str | None) -> str | None:
    if value is not None and (posixpath.normpath(value) != value or "//" in value):
        raise ValueError("not a normalized device path (no '.' or '..' part, no '//'); "
                         "e.g. /dev/nvme1n1")
    return value


def url(value: str | None) -> str | None:
    if value is not None:
        problem = _url_problem(value)
        if problem is not None:
            raise ValueError(problem)
    return value


def no_credentials(value: str) -> str:
    """model_base_url: no user, password or token before its host. The URL is an argument
    of the downloader on the host, where ``ps`` shows it to every user, and in its
    messages; and urllib cannot use a URL's credentials anyway. (pip_index_url and
    http_proxy may carry them: they reach the host in a root-only environment file.)"""
    # The authority as a person reads it, up to the first "/": an "@" after a "?" or "#"
    # there is still a credential to the one who wrote it, whatever urllib makes of it.
    authority = value.partition("://")[2].partition("/")[0]
    if "@" in authority:
        raise ValueError(
            "has credentials in it (user:password@ or token@ before the host): the "
            "downloader would show them on its command line, which ps lists to every user "
            "of the host, and in its messages, and cannot use them (urllib reads them as "
            "part of the host name); allowed: http(s)://HOST[:PORT]/PATH without them. "
            "Remove them from the URL, and give a Hugging Face token as hf_token_file (a "
            "file, chmod 600), hf_token or HF_TOKEN on the operator's machine: it is sent "
            "as a bearer token, over https only"
        )
    return value


def apt_source(value: str | None, info: ValidationInfo) -> str | None:
    """nvidia_apt_repo; reads nvidia_apt_repo_trusted, declared before it."""
    if value is None:
        return value
    trusted = bool(info.data.get("nvidia_apt_repo_trusted"))
    signed_example = ('"deb [signed-by=/usr/share/keyrings/KEY.gpg] https://HOST/PATH '
                      'SUITE COMPONENT"')
    if any(ord(char) < 32 or ord(char) == 127 for char in value):
        raise ValueError("has a newline or another control character: give one line")
    text = value.strip()
    if text.startswith(("http://", "https://")):
        problem = _url_problem(text)
        if problem is not None:
            raise ValueError(problem)
        if not trusted:
            raise ValueError(
                'a bare URL is written as "deb [trusted=yes] URL ./", a repository apt '
                "does not verify, and unsigned packages run their scripts as root: give "
                f"a source with a keyring and an https URL, {signed_example}, or set "
                "nvidia_apt_repo_trusted=true for a repository you control"
            )
        return value
    line = APT_LINE.fullmatch(text)
    if line is None:
        raise ValueError(f"not an apt source: give a one-line source, {signed_example}, "
                         "or (with nvidia_apt_repo_trusted=true) a repository URL")
    if trusted:
        return value
    options = (line.group("options") or "").split()
    problems = []
    if not any(option.startswith("signed-by=") and len(option) > 10 for option in options):
        problems.append("it names no keyring (signed-by=)")
    if not line.group("uri").startswith("https://"):
        problems.append("its URL is not https")
    insecure = [option for option in options if option in INSECURE_APT_OPTIONS]
    if insecure:
        problems.append(f"it turns verification off ({', '.join(insecure)})")
    if problems:
        raise ValueError(
            "; ".join(problems) + ": unsigned or unverified packages run their scripts "
            f"as root; write {signed_example}, or set nvidia_apt_repo_trusted=true for "
            "a repository you control"
        )
    return value


# What to write instead of every address, in the allow lists' messages.
_NAME_THEM = ("the list is there to name the few machines let in: name their networks, "
              "e.g. [\"10.20.0.5/32\"] or [\"10.20.0.0/24\"]")


def networks(value: list[str], info: ValidationInfo) -> list[str]:
    """Networks for nginx's allow (and the engine's firewall), host bits cleared; never
    every address, nor the unspecified address."""
    cleared = []
    name = info.field_name
    for index, entry in enumerate(value):
        if "%" in entry:
            raise ValueError(f"{name}[{index}] {entry!r} has an IPv6 scope id "
                             "(%): nginx's allow takes a network without one")
        try:
            network = ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise ValueError(
                f"{name}[{index}] {entry!r} is not an IPv4 or IPv6 network; "
                "allowed: an address or CIDR such as 10.20.0.0/16, 127.0.0.1 or ::1/128"
            ) from None
        if network.prefixlen == network.max_prefixlen and network.network_address.is_unspecified:
            raise ValueError(
                f"{name}[{index}] {entry!r} is the unspecified address: a listening "
                f"socket reads it as every address, an allow list as no machine; {_NAME_THEM}"
            )
        cleared.append(str(network))
    covered = whole_address_spaces(cleared)
    if covered:
        raise ValueError(f"{name} lets in {covered}; {_NAME_THEM}")
    return cleared



def whole_address_spaces(cleared: list[str]) -> str | None:
    """Which whole address space networks (host bits cleared) cover, alone ("0.0.0.0/0")
    or together ("0.0.0.0/1" and "128.0.0.0/1"), in words: "every IPv4 address
    (0.0.0.0/0)"; None when they leave machines out, as an allow list must."""
    networks = [ipaddress.ip_network(entry) for entry in cleared]
    v4 = [net for net in networks if isinstance(net, ipaddress.IPv4Network)]
    v6 = [net for net in networks if isinstance(net, ipaddress.IPv6Network)]
    found = []
    if list(ipaddress.collapse_addresses(v4)) == [ipaddress.IPv4Network("0.0.0.0/0")]:
        found.append("every IPv4 address (0.0.0.0/0)")
    if list(ipaddress.collapse_addresses(v6)) == [ipaddress.IPv6Network("::/0")]:
        found.append("every IPv6 address (::/0)")
    return " and ".join(found) or None


def reachable_address(value: str | None) -> str | None:
    if value is None:
        return value
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if not HOST_NAME.fullmatch(value):
            raise ValueError(
                "not a host name or IP address literal: letters, digits, '-' and '.' "
                "(e.g. gpu-a100-01.example.internal) or an address such as 10.20.0.7 "
                "or fd00::7; no scheme, port, path or brackets (the port is "
                "gateway_port)"
            ) from None
    if "%" in value:
        raise ValueError("has an IPv6 scope id (%), which means nothing to another host")
    return value


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


def no_barrier_off(value: list[str]) -> list[str]:
    malformed = [opt for opt in value if not MOUNT_OPTION.fullmatch(opt)]
    if malformed:
        raise ValueError(
            f"{malformed} is not one mount option each: a lowercase name, optionally "
            "=value of letters, digits and _.:/- (no comma, space or newline); give "
            'each option as its own item, e.g. ["noatime", "nodev"]'
        )
    refused = [opt for opt in value if opt in BARRIER_DISABLING_OPTIONS]
    if refused:
        raise ValueError(
            f"{refused} disables write barriers and risks the volume on power loss "
            "(XFS removed nobarrier in Linux 4.19); use noatime alone"
        )
    return value


def sysctl_keys(value: dict[str, int | str]) -> dict[str, int | str]:
    for key, setting in value.items():
        if not SYSCTL_KEY.fullmatch(key):
            raise ValueError(
                f"{key!r} is not a sysctl key like vm.swappiness or "
                "net.ipv4.conf.all.rp_filter: lowercase dotted names of letters, digits "
                "and _- ('*' as a glob), no '=', '/' or space"
            )
        if isinstance(setting, str) and not SYSCTL_VALUE.fullmatch(setting):
            raise ValueError(
                f"the value of {key} is not words of letters, digits and _.:/- separated "
                'by single spaces (e.g. 1, bbr or "4096 87380 6291456"); no ";", quote '
                "or newline"
            )
    return value


# --- rules across settings -------------------------------------------------------------
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
    for name, path, marker, what in (
        ("gateway_tls_cert", cert, "-----BEGIN CERTIFICATE-----", "certificate"),
        ("gateway_tls_key", key, "PRIVATE KEY-----", "private key"),
    ):
        try:
            text = Path(path).read_text(encoding="ascii", errors="replace")
            mode = Path(path).stat().st_mode
        except OSError as exc:
            raise ValueError(f"{name} {path}: cannot be read ({exc.strerror})") from None
        if marker not in text:
            raise ValueError(f"{name} {path}: holds no PEM {what}")
        if name == "gateway_tls_key" and mode & 0o077:
            raise ValueError(
                f"gateway_tls_key {path}: mode {stat.S_IMODE(mode):04o} lets its group or "
                "others at the private key; chmod 600 it"
            )


def scheduler_limits(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                     block_size: int, enable_chunked_prefill: bool) -> None:
    # The same rules vLLM's SchedulerConfig enforces at start-up, checked here so a
    # bad combination fails in seconds instead of crash-looping the service.
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
            f"max_num_seqs ({max_num_seqs})"
        )
    if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"without enable_chunked_prefill, max_num_batched_tokens "
            f"({max_num_batched_tokens}) must be >= max_model_len ({max_model_len})"
        )
    if max_model_len < block_size:
        raise ValueError(
            f"max_model_len ({max_model_len}) must be >= block_size ({block_size})"
        )


def bench_fits(shape: dict[str, int], max_model_len: int) -> None:
    # A request longer than the engine's context is refused by vLLM: every request of
    # the benchmark would fail.
    if shape["input_len"] + shape["output_len"] > max_model_len:
        raise ValueError(
            f"the benchmark's requests ({shape['input_len']} prompt + {shape['output_len']} "
            f"output tokens, bench_input_len and bench_output_len times bench_scale) must fit "
            f"in max_model_len ({max_model_len}): lower them or bench_scale"
        )


def device_has_stack(vllm_version: str, vllm_device: str, enforce_eager: bool) -> None:
    if stack_for(vllm_version, vllm_device) is None:
        rows = releases(CPU_STACKS if vllm_device == "cpu" else STACKS)
        raise ValueError(
            f"vllm_version {vllm_version} has no {vllm_device} stack "
            f"(pyinfra_vllm/core/stacks.py); {vllm_device} stacks: {rows}"
        )
    if vllm_device == "cpu" and not enforce_eager:
        raise ValueError(
            "vllm_device cpu needs enforce_eager true: without it vLLM's CPU build "
            "compiles the model with torch inductor, which needs a C++ compiler on the "
            "host (this suite installs none)"
        )


def deep_check_has_a_model(deep_model_check: bool, model_repair: bool,
                           skip_stages: list[str]) -> None:
    # The deep check runs in the model stage: with the stage skipped it would silently
    # check nothing, and an audit asked for it would report a host as sound.
    if deep_model_check and "model" in skip_stages:
        asked = "model_repair true" if model_repair else "model_verify deep"
        raise ValueError(
            f"{asked} re-hashes the model in the model stage, which skip_stages skips: "
            "remove model from skip_stages, or leave model_verify stat and model_repair "
            "false"
        )


def deep_check_has_an_environment(deep_env_check: bool, python_env_repair: bool,
                                  skip_stages: list[str]) -> None:
    # The environment's deep check refuses or repairs in the python_env stage: with the
    # stage skipped, a host whose files changed would pass an audit asked for it.
    if deep_env_check and "python_env" in skip_stages:
        asked = "python_env_repair true" if python_env_repair else "python_env_verify deep"
        raise ValueError(
            f"{asked} re-hashes the environment in the python_env stage, which skip_stages "
            "skips: remove python_env from skip_stages, or leave python_env_verify stat "
            "and python_env_repair false"
        )


def driver_branch_serves_stack(nvidia_driver_branch: str, stack: StackRow,
                               vllm_version: str) -> None:
    # The driver stage installs this branch; a branch older than the stack's minimum
    # would install a driver the stack's CUDA build cannot use.
    minimum = stack.min_driver or ""  # every CUDA row names one (StackRow refuses none)
    needed = int(minimum.split(".")[0])
    if int(nvidia_driver_branch[:3]) < needed:
        raise ValueError(
            f"nvidia_driver_branch {nvidia_driver_branch} is older than driver "
            f"{minimum}, the minimum of the vLLM {vllm_version} stack (CUDA "
            f"{stack.cuda}): set nvidia_driver_branch to {needed}-server or newer"
        )


def file_keys(inline_keys: list[SecretStr], api_keys_file: str | None,
              ) -> tuple[list[tuple[int, str]], list[tuple[str, str]]]:
    """The keys of api_keys_file as (line, key), and the problems of the file beside
    api_keys: unreadable, or a key that api_keys holds already."""
    problems: list[tuple[str, str]] = []
    from_file: list[tuple[int, str]] = []
    if api_keys_file is None:
        return from_file, problems
    try:
        from_file = read_key_lines(api_keys_file)
    except (OSError, ValueError):
        problems.append(("api_keys_file", f"api_keys_file = {api_keys_file!r} "
                         "cannot be read: write one API key per line, chmod 600"))
    first_seen = {key.get_secret_value().lower(): f"api_keys[{index}]"
                  for index, key in enumerate(inline_keys)}
    for number, key in from_file:
        if key.lower() in first_seen:
            problems.append((
                "api_keys_file",
                f"api_keys_file = {api_keys_file!r}: line {number} repeats "
                f"{first_seen[key.lower()]} (or differs from it only in letter "
                "case): keep the key in one place",
            ))
    return from_file, problems


def exposure_problems(*, has_keys: bool, gateway_open: bool,
                      vllm_listen_beyond_loopback: bool, engine_allow: list[str],
                      token_from: str | None, model_base_url: str,
                      metrics_networks: list[str]) -> list[tuple[str, str]]:
    """Who may reach the gateway and the engine, and where a token may travel: each
    problem as (key, sentence naming its keys); no key or token is ever in it."""
    problems = []
    if not has_keys and not gateway_open:
        problems.append((
            "api_keys",
            "api_keys is empty: the gateway would serve /v1/ to anyone; set api_keys or "
            "api_keys_file, or gateway_open=true to serve without a key",
        ))
    if has_keys and gateway_open:
        problems.append((
            "gateway_open",
            "gateway_open = True, yet api_keys or api_keys_file set keys: an open "
            "gateway with keys is a contradiction; remove gateway_open (the keys are "
            "then required) or the keys",
        ))
    if vllm_listen_beyond_loopback and not has_keys:
        problems.append((
            "vllm_listen_beyond_loopback",
            "vllm_listen_beyond_loopback = True needs an API key: an engine reachable "
            "beyond loopback is for a gateway that checks client keys; set api_keys or "
            "api_keys_file, or remove "
            "vllm_listen_beyond_loopback and keep vllm_host on 127.0.0.1",
        ))
    if vllm_listen_beyond_loopback and not engine_allow:
        problems.append((
            "vllm_engine_allow",
            "vllm_engine_allow is empty, yet vllm_listen_beyond_loopback = True: the "
            "engine's port is open to the machines of vllm_engine_allow only (its key "
            "guards /v1 alone); name the networks of the machines that reach it, e.g. "
            "[\"10.20.0.5/32\"], or remove vllm_listen_beyond_loopback",
        ))
    covered = whole_address_spaces(metrics_networks)
    if covered:
        problems.append((
            "prometheus_servers",
            f"prometheus_servers, added to metrics_allow, lets in {covered}: the gateway's "
            f"/metrics and /node-metrics would answer every machine; {_NAME_THEM}",
        ))
    if token_from is not None and not model_base_url.startswith("https://"):
        problems.append((
            "model_base_url",
            f"model_base_url = {mask_credentials(model_base_url)!r} is plain http, "
            f"and the Hugging Face token ({token_from}) would travel with every download: "
            "use an https URL, or no token (hf_token, hf_token_file, HF_TOKEN) for a "
            "mirror that needs none",
        ))
    return problems


def rule_errors(problems: list[tuple[str, str]]) -> ValidationError:
    """Problems of rules across settings as one ValidationError, each under its key with
    its sentence as the message (RULE_ERROR)."""
    return ValidationError.from_exception_data(
        "Settings",
        [
            InitErrorDetails(
                type=PydanticCustomError(RULE_ERROR, "{sentence}", {"sentence": text}),
                loc=(key,),
                input=key,
            )
            for key, text in problems
        ],
    )
