"""nginx site: replace a live configuration only with one ``nginx -t`` accepts, then reload.

``files.template`` would write the live file first and leave a broken nginx behind if the
test after it failed, and its ``--diff`` prints file contents (API keys included). This
operation compares sha1 sums itself, uploads candidates from memory into a root-only
staging directory (no command carries a content), swaps them in by rename, runs
``nginx -t``, and puts the previous files back when the test fails. nginx is reloaded only
when a file changed and the test passed; an unchanged site yields no command at all. The
TLS certificate and key ride the same swap (``extra_files``), and a failed test's output
is printed without the lines that name the key file or hold a key (``secrets``). With
``--diff`` a file that would change gets its diff, the key file's and the TLS key's with
every value masked (operations/file_diff.py).

The pure helpers (rendering, the body-size arithmetic) are here too, so unit tests can call
them without a pyinfra host.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import re
import shlex
from typing import Any

from pyinfra import host, state
from pyinfra.api import (
    OperationValueError,
    QuoteString,
    StringCommand,
    operation,
)
from pyinfra.facts.files import File, Sha1File

from operations import file_diff
from operations.rolling import DRAIN_FLAG
from operations.uploads import private_upload
from operations.vllm_service import engine_address
from pyinfra_vllm.settings import API_KEY_ALPHABET, API_KEY_CHARS
from pyinfra_vllm.templating import render

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
# token, each character escaped as \uXXXX (6 bytes). See pyinfra_vllm/settings.py.
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


def check_keys(keys: list[str]) -> None:
    """Refuse a key nginx would read as syntax, and a repeated key; by position only."""
    seen: dict[str, int] = {}
    for index, key in enumerate(keys):
        if not API_KEY_CHARS.fullmatch(key):
            raise OperationValueError(
                f"api_keys[{index}] has characters other than {API_KEY_ALPHABET}"
            )
        if key in seen:
            raise OperationValueError(f"api_keys[{index}] repeats api_keys[{seen[key]}]")
        seen[key] = index


def render_keys_map(keys: list[str], upstream_key: str | None = None) -> str:
    """The secret file: the map from the Authorization header to ``$vllm_key_ok``, and the
    Authorization header nginx sends the engine (``$vllm_upstream_authorization``).

    + keys: the API keys clients may send; none: every request is let through
    + upstream_key: the key the engine itself demands (VLLM_API_KEY, when it listens beyond
      loopback), sent as ``Bearer <key>``; None sends the engine no Authorization at all

    A bad key is named by its position only: its value is never printed.
    """
    check_keys(keys)
    if upstream_key is not None and not API_KEY_CHARS.fullmatch(upstream_key):
        raise OperationValueError(
            f"the engine's key has characters other than {API_KEY_ALPHABET}"
        )
    return render(
        KEYS_TEMPLATE,
        patterns=[key_regex(key) for key in keys],
        upstream_key=upstream_key,
    )


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


def render_site(
    *,
    vllm_host: str,
    vllm_port: int,
    gateway_port: int,
    metrics_allow: list[str],
    body_mib: int,
    proxy_timeout_s: int,
    extra_directives: list[str] | tuple[str, ...] = (),
    keys_path: str = KEYS_PATH,
    tls: bool = False,
    http_redirect_port: int | None = None,
    tls_cert_path: str = TLS_CERT_PATH,
    tls_key_path: str = TLS_KEY_PATH,
    node_exporter_port: int | None = None,
    drain_flag: str = DRAIN_FLAG,
) -> str:
    """The site file (``conf.d/vllm.conf``): upstream, server, locations.

    + tls: the server speaks TLS on gateway_port with the files at tls_cert_path and
      tls_key_path; False keeps plain HTTP
    + http_redirect_port: with tls, a second, plain HTTP server on this port that answers
      every request with a 301 to https on gateway_port and serves nothing else
    + node_exporter_port: node_exporter's port on 127.0.0.1, served as /node-metrics to
      the metrics_allow networks; None serves no /node-metrics
    + drain_flag: while this file exists, /health and /v1 answer 503 (a rolling restart
      drains the host: operations/rolling.py)
    """
    if http_redirect_port is not None and not tls:
        raise OperationValueError("http_redirect_port needs tls (a redirect to https)")
    if http_redirect_port == gateway_port:
        raise OperationValueError("http_redirect_port must differ from gateway_port")
    return render(
        SITE_TEMPLATE,
        upstream=engine_address(vllm_host, vllm_port),
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
    )


def swap_script(
    files: list[tuple[str, str, str]],
    staging_dir: str,
    service: str,
    *,
    hide: list[str] | tuple[str, ...] = (),
    redact: str | None = None,
) -> str:
    """One shell command: swap candidates in, ``nginx -t``, reload or roll back.

    ``files`` holds ``(candidate name in staging_dir, live path, octal mode)``. One command,
    not several, so the rollback runs even when the test fails (pyinfra stops an operation
    at its first failing command). Paths are quoted with shlex: they are parts of a script.

    + hide: fixed strings (the key file's path) whose lines of nginx -t's output are not
      shown when the test fails
    + redact: name, in staging_dir, of a file of fixed strings (the keys), one a line:
      lines that hold one, in any case, are not shown either; removed at the end

    nginx's messages quote the tokens it cannot read, and a string map entry that conflicts
    is quoted in lower case: a failed test's output is filtered before it is printed, and
    says how many lines it left out.
    """
    q = shlex.quote
    lines = []
    restore = []
    cleanup = []
    for name, live, mode in files:
        new, bak = q(f"{staging_dir}/{name}"), q(f"{staging_dir}/{name}.bak")
        lines.append(f"chown root:root {new} && chmod {mode} {new} || exit 1")
        # A hard link keeps the previous file's inode; the rename below is atomic.
        lines.append(f"if [ -e {q(live)} ]; then ln -f {q(live)} {bak} || exit 1; else rm -f {bak}; fi")
        restore.append(f"if [ -e {bak} ]; then mv -f {bak} {q(live)}; else rm -f {q(live)}; fi")
        cleanup.append(f"rm -f {bak}")
    for name, live, _mode in files:
        lines.append(f"mv -f {q(f'{staging_dir}/{name}')} {q(live)} || exit 1")
    report = 'echo "nginx -t rejected the new configuration; the previous files are back: $out" >&2'
    if hide or redact:
        patterns = " ".join(f"-e {q(text)}" for text in hide)
        if redact:
            patterns = f"{patterns} -f {q(f'{staging_dir}/{redact}')}".strip()
            cleanup.append(f"rm -f {q(f'{staging_dir}/{redact}')}")
        report = (
            f"""shown=$(printf '%s\\n' "$out" | grep -v -i -F {patterns}); """
            f"""hidden=$(printf '%s\\n' "$out" | grep -c -i -F {patterns}); """
            + (f"rm -f {q(f'{staging_dir}/{redact}')}; " if redact else "")
            + 'echo "nginx -t rejected the new configuration; the previous files are back: '
            '$shown" >&2; [ "$hidden" = 0 ] || echo "($hidden line(s) of its output not '
            'shown: they name the API key file or hold a key)" >&2'
        )
    lines.append(
        "if out=$(nginx -t 2>&1); then "
        # reload-or-restart reloads a running nginx (graceful: old workers finish their
        # streams) and starts a stopped one; it never restarts a running one.
        f"{'; '.join(cleanup)}; systemctl reload-or-restart {q(service)}; "
        f"else {'; '.join(restore)}; {report}; exit 1; fi"
    )
    return "; ".join(lines)


def _drifted(file: dict[str, Any], mode: str) -> bool:
    """A live file's mode or owner (the File fact) is not ``mode``, root:root."""
    return file.get("mode") != int(mode) or file.get("user") != "root" or (
        file.get("group") != "root"
    )


@operation()
def site(
    site_content: str,
    keys_content: str,
    site_path: str = SITE_PATH,
    keys_path: str = KEYS_PATH,
    staging_dir: str = STAGING_DIR,
    service: str = "nginx",
    extra_files: dict[str, tuple[str, str]] | None = None,
    secrets: list[str] | None = None,
):
    """
    Install an nginx site and its API-key file, tested by ``nginx -t`` before it goes live.

    + site_content: the site file's text (an http-level include: upstream, server blocks)
    + keys_content: the API-key map's text (secret: uploaded from memory, never printed)
    + site_path: live site file, mode 0644
    + keys_path: live key file, mode 0600, owned by root (nginx's master reads it as root)
    + staging_dir: root-only directory for candidate files, on the same file system
    + service: the systemd unit reloaded after a change
    + extra_files: more files the site needs, ``{live path: (content, octal mode)}`` (the TLS
      certificate "644" and private key "600"); swapped and tested with the site, their
      directory made (0755) when missing. A "600" file is a secret like the key file.
    + secrets: strings nginx -t's output must never show (the API keys): a failed test's
      output is printed without the lines holding one, or naming keys_path

    Each file is compared by sha1 with what is live. Changed files are uploaded into
    ``staging_dir``, renamed over the live ones, and ``nginx -t`` is run: if it passes,
    nginx is reloaded; if not, the previous files are put back and the operation fails with
    nginx's message. A secret file (mode 600) whose content is right but whose mode or owner
    drifted is closed again, without a reload. Nothing changed: no command.

    **Example:**

    .. code:: python

        gateway.site(
            name="Gateway: nginx site",
            site_content=render_site(...),
            keys_content=render_keys_map(["sk-..."]),
            secrets=["sk-..."],
        )
    """
    wanted = [
        ("site.conf", site_path, site_content, "644"),
        ("api-keys.conf", keys_path, keys_content, "600"),
    ]
    taken = {name for name, *_ in wanted} | {REDACT_NAME}
    for live, (content, mode) in (extra_files or {}).items():
        name = live.rsplit("/", 1)[-1]
        if name in taken or not name:
            raise OperationValueError(f"extra_files: {live}: its name {name!r} is taken")
        taken.add(name)
        wanted.append((name, live, content, mode))
    live_sums = {live: host.get_fact(Sha1File, path=live) for _n, live, _c, _m in wanted}
    changed = [
        (name, live, content, mode)
        for name, live, content, mode in wanted
        if live_sums[live] != sha1(content)
    ]
    # --diff: before the first command (pyinfra's change detection stops there); the key
    # file and a "600" file are masked (operations/file_diff.py).
    if changed and file_diff.wanted(state):
        for _name, live, content, mode in changed:
            file_diff.show(host, live, content.encode(), secret=mode == "600",
                           exists=live_sums[live] is not None)

    did_something = False
    for name, live, content, mode in wanted:
        if mode != "600" or (name, live, content, mode) in changed:
            continue
        # pyinfra types it as its FileDict, False for a directory, None when missing.
        found: Any = host.get_fact(File, path=live)
        if _drifted(found or {}, mode):
            # Content unchanged, so nginx needs no reload: only close the file again.
            yield StringCommand("chown", "root:root", QuoteString(live))
            yield StringCommand("chmod", mode, QuoteString(live))
            did_something = True

    if changed:
        yield StringCommand("install", "-d", "-m", "700", "-o", "root", "-g", "root",
                            QuoteString(staging_dir))
        parents = sorted({live.rsplit("/", 1)[0] for _n, live, _c, _m in changed
                          if live not in (site_path, keys_path)})
        for parent in parents:
            yield StringCommand("install", "-d", "-m", "755", "-o", "root", "-g", "root",
                                QuoteString(parent))
        for name, _live, content, _mode in changed:
            # From memory: the content never exists on this machine's disk nor in output,
            # and on the host no other user can read it, not even during the upload.
            yield from private_upload(content.encode(), f"{staging_dir}/{name}")
        redact = redactions(list(secrets or []))
        if redact:
            yield from private_upload("".join(f"{text}\n" for text in redact).encode(),
                                      f"{staging_dir}/{REDACT_NAME}")
        yield StringCommand(
            swap_script(
                [(n, live, mode) for n, live, _c, mode in changed], staging_dir, service,
                hide=[keys_path], redact=REDACT_NAME if redact else None,
            )
        )
        did_something = True

    if not did_something:
        host.noop("nginx site and API keys are up to date")


# --- foreign configuration -------------------------------------------------------------
# Where foreign nginx files are moved to: outside every include path, kept, never deleted.
DISABLED_DIR = "/var/lib/pyinfra-vllm/nginx-disabled"


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
                    own_paths: tuple[str, ...] = (SITE_PATH,)) -> list[dict[str, Any]]:
    """The files other than the suite's own (``own_paths``) that hold a server block
    listening on one of ``ports`` (the gateway's), from facts.nginx.NginxServers.

    Each: ``{"path", "symlink", "servers": [{"line", "listen", "server_name"}], "unsafe"}``;
    ``unsafe`` says why the file cannot be set aside whole (None when it can): it is
    nginx's main file, or it also holds servers on other ports.
    """
    found_files = (found or {}).get("files") or []
    taking: list[dict[str, Any]] = []
    for file in found_files:
        if file["path"] in own_paths:
            continue
        clashing = [s for s in file["servers"] if set(server_ports(s)) & set(ports)]
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


def foreign_words(entry: dict[str, Any]) -> str:
    """One foreign file in a sentence: where and what it listens on."""
    servers = "; ".join(
        f"line {s['line']}: listen {', '.join(s['listen']) or '(none: port 80)'}"
        + (f" server_name {' '.join(s['server_name'])}" if s["server_name"] else "")
        for s in entry["servers"]
    )
    return f"{entry['path']}{' (symlink)' if entry['symlink'] else ''}: {servers}"


def disable_script(files: list[dict[str, Any]], disabled_dir: str, service: str,
                   hide: str = KEYS_PATH) -> str:
    """One shell command: set ``files`` aside, ``nginx -t``, reload, or put them back.

    A symlink is removed (what it points to stays); a regular file is moved under
    ``disabled_dir`` at its own path (``mv --backup=numbered`` keeps one set aside
    before). One command, so the rollback runs when the test fails. A failed test's
    lines that name ``hide`` (the API key file, whose tokens nginx would quote) are not
    shown.
    """
    q = shlex.quote
    lines, restore = [], []
    for index, file in enumerate(files):
        live = file["path"]
        if file["symlink"]:
            lines.append(f"t{index}=$(readlink {q(live)}) && rm -f {q(live)} || exit 1")
            restore.append(f'ln -sfn "$t{index}" {q(live)}')
        else:
            kept = f"{disabled_dir}{live}"
            lines.append(f"install -d -m 700 {q(kept.rpartition('/')[0])} && "
                         f"mv --backup=numbered -f {q(live)} {q(kept)} || exit 1")
            restore.append(f"mv -f {q(kept)} {q(live)}")
    lines.append(
        "if out=$(nginx -t 2>&1); then "
        f"systemctl try-reload-or-restart {q(service)}; "
        f"else {'; '.join(restore)}; "
        'echo "nginx -t failed without the foreign files; they are back:" >&2; '
        f"printf '%s\\n' \"$out\" | grep -v -F {q(hide)} >&2; exit 1; fi"
    )
    return "; ".join(lines)


@operation()
def foreign_disabled(files: list[dict[str, Any]], disabled_dir: str = DISABLED_DIR,
                     service: str = "nginx"):
    """
    Take foreign nginx files that listen on the gateway's port out of nginx's
    configuration, tested by ``nginx -t`` before nginx reloads.

    + files: the files to set aside (``foreign_servers`` of facts.nginx.NginxServers,
      without the unsafe ones): ``[{"path", "symlink"}, ...]``
    + disabled_dir: where regular files are kept, at their own path below it
    + service: the systemd unit reloaded (only if it runs) after the test passed

    A symlink is removed (its target stays); a regular file is moved, never deleted. If
    ``nginx -t`` fails without them, they are put back and the operation fails with
    nginx's message. No file: no command.
    """
    if not files:
        host.noop("no foreign nginx server on the gateway's port")
        return
    yield StringCommand(disable_script(files, disabled_dir, service))
