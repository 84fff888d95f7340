"""nginx site: replace a live configuration only with one ``nginx -t`` accepts, then reload.

``files.template`` would write the live file first and leave a broken nginx behind if the
test after it failed, and its ``--diff`` prints file contents (API keys included). This
operation compares sha1 sums itself, uploads candidates from memory into a root-only
staging directory (nothing is printed but paths), swaps them in by rename, runs
``nginx -t``, and puts the previous files back when the test fails. nginx is reloaded only
when a file changed and the test passed; an unchanged site yields no command at all.

The pure helpers (rendering, the body-size arithmetic) are here too, so unit tests can call
them without a pyinfra host.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import re
import shlex
from io import StringIO
from typing import Any

from pyinfra import host
from pyinfra.api import (
    FileUploadCommand,
    OperationValueError,
    QuoteString,
    StringCommand,
    operation,
)
from pyinfra.facts.files import File, Sha1File

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

# Worst case bytes per token in a request body: JSON-escaped CJK text at 2 characters per
# token, each character escaped as \uXXXX (6 bytes). See pyinfra_vllm/settings.py.
WORST_BYTES_PER_TOKEN = 12
# Room for the request's JSON envelope (messages, roles, sampling parameters).
ENVELOPE_BYTES = 64 * 1024
MIB = 1024 * 1024

# Characters allowed in an API key: the map line is `"Bearer <key>" 1;` and nginx would
# read a quote, backslash, semicolon, brace or space in it as syntax.
_KEY_RE = re.compile(r"^[A-Za-z0-9._~+/=:-]+$")


def body_limit_mib(max_model_len: int) -> int:
    """client_max_body_size, in whole MiB, for a prompt of ``max_model_len`` tokens."""
    return math.ceil((max_model_len * WORST_BYTES_PER_TOKEN + ENVELOPE_BYTES) / MIB)


def sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def render_keys_map(keys: list[str]) -> str:
    """The map from the Authorization header to ``$vllm_key_ok``; no keys: every request ok.

    A bad key is named by its position only: its value is never printed.
    """
    for index, key in enumerate(keys):
        if not _KEY_RE.match(key):
            raise OperationValueError(
                f"api_keys[{index}] has characters other than letters, digits and ._~+/=:-"
            )
    return render(KEYS_TEMPLATE, keys=list(keys))


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
) -> str:
    """The site file (``conf.d/vllm.conf``): upstream, server, locations."""
    return render(
        SITE_TEMPLATE,
        vllm_host=vllm_host,
        vllm_port=vllm_port,
        gateway_port=gateway_port,
        metrics_allow=metrics_networks(metrics_allow),
        body_mib=body_mib,
        proxy_timeout_s=proxy_timeout_s,
        extra_directives=list(extra_directives),
        keys_path=keys_path,
    )


def swap_script(files: list[tuple[str, str, str]], staging_dir: str, service: str) -> str:
    """One shell command: swap candidates in, ``nginx -t``, reload or roll back.

    ``files`` holds ``(candidate name in staging_dir, live path, octal mode)``. One command,
    not several, so the rollback runs even when the test fails (pyinfra stops an operation
    at its first failing command). Paths are quoted with shlex: they are parts of a script.
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
    lines.append(
        "if out=$(nginx -t 2>&1); then "
        # reload-or-restart reloads a running nginx (graceful: old workers finish their
        # streams) and starts a stopped one; it never restarts a running one.
        f"{'; '.join(cleanup)}; systemctl reload-or-restart {q(service)}; "
        f"else {'; '.join(restore)}; "
        "echo \"nginx -t rejected the new configuration; the previous files are back: $out\" >&2; "
        "exit 1; fi"
    )
    return "; ".join(lines)


@operation()
def site(
    site_content: str,
    keys_content: str,
    site_path: str = SITE_PATH,
    keys_path: str = KEYS_PATH,
    staging_dir: str = STAGING_DIR,
    service: str = "nginx",
):
    """
    Install an nginx site and its API-key file, tested by ``nginx -t`` before it goes live.

    + site_content: the site file's text (an http-level include: upstream, server blocks)
    + keys_content: the API-key map's text (secret: uploaded from memory, never printed)
    + site_path: live site file, mode 0644
    + keys_path: live key file, mode 0600, owned by root (nginx's master reads it as root)
    + staging_dir: root-only directory for candidate files, on the same file system
    + service: the systemd unit reloaded after a change

    Each file is compared by sha1 with what is live. Changed files are uploaded into
    ``staging_dir``, renamed over the live ones, and ``nginx -t`` is run: if it passes,
    nginx is reloaded; if not, the previous files are put back and the operation fails with
    nginx's message. A key file whose content is right but whose mode or owner drifted is
    fixed without a reload. Nothing changed: no command.

    **Example:**

    .. code:: python

        gateway.site(
            name="Gateway: nginx site",
            site_content=render_site(...),
            keys_content=render_keys_map(["sk-..."]),
        )
    """
    wanted = [
        ("site.conf", site_path, site_content, "644"),
        ("api-keys.conf", keys_path, keys_content, "600"),
    ]
    changed = [
        (name, live, content, mode)
        for name, live, content, mode in wanted
        if host.get_fact(Sha1File, path=live) != sha1(content)
    ]

    if changed:
        yield StringCommand("install", "-d", "-m", "700", "-o", "root", "-g", "root",
                            QuoteString(staging_dir))
        for name, _live, content, _mode in changed:
            # From memory: the content never exists on this machine's disk nor in output.
            yield FileUploadCommand(StringIO(content), f"{staging_dir}/{name}")
        yield StringCommand(
            swap_script([(n, live, mode) for n, live, _c, mode in changed], staging_dir, service)
        )
        return

    keys_file: dict[str, Any] = host.get_fact(File, path=keys_path) or {}  # type: ignore[arg-type]  # pyinfra types it as its FileDict
    if keys_file.get("mode") != 600 or keys_file.get("user") != "root" or (
        keys_file.get("group") != "root"
    ):
        # Content unchanged, so nginx needs no reload: only close the file again.
        yield StringCommand("chown", "root:root", QuoteString(keys_path))
        yield StringCommand("chmod", "600", QuoteString(keys_path))
        return

    host.noop("nginx site and API keys are up to date")
