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
every value masked (pyinfra_vllm/operations/util/file_diff.py).

The pure helpers (rendering, the body-size arithmetic) are here too, so unit tests can call
them without a pyinfra host.
"""

from __future__ import annotations

from collections.abc import Iterator

from pyinfra import host, state
from pyinfra.api import (
    FileUploadCommand,
    OperationValueError,
    QuoteString,
    StringCommand,
    operation,
)
from pyinfra.facts.files import Sha1File

from pyinfra_vllm.operations.util import file_diff
from pyinfra_vllm.operations.util.gateway import (
    disable_script,
    swap_script,
)
from pyinfra_vllm.operations.util.uploads import private_upload
from pyinfra_vllm.plans import access
from pyinfra_vllm.plans.gateway import (
    DISABLED_DIR,
    KEYS_PATH,
    REDACT_NAME,
    SITE_PATH,
    STAGING_DIR,
    redactions,
    sha1,
)


def _wanted_files(
    site_path: str, site_content: str, keys_path: str, keys_content: str,
    extra_files: dict[str, tuple[str, str]] | None,
) -> list[tuple[str, str, str, str]]:
    """Every file of the site as ``(candidate name in the staging directory, live path,
    content, octal mode)``: the site, the key file, then ``extra_files``, each named by
    its base name, which neither another file nor the redaction list may have."""
    wanted = [
        ("site.conf", site_path, site_content, "644"),
        ("api-keys.conf", keys_path, keys_content, access.mode(KEYS_PATH)),
    ]
    taken = {name for name, *_ in wanted} | {REDACT_NAME}
    for live, (content, mode) in (extra_files or {}).items():
        name = live.rsplit("/", 1)[-1]
        if name in taken or not name:
            raise OperationValueError(f"extra_files: {live}: its name {name!r} is taken")
        taken.add(name)
        wanted.append((name, live, content, mode))
    return wanted


def _changed_files(
    wanted: list[tuple[str, str, str, str]],
) -> tuple[list[tuple[str, str, str, str]], dict[str, str | None]]:
    """The files of ``wanted`` (``_wanted_files``) whose content's sha1 is not the live
    file's, and each live file's sha1 (None: no such file)."""
    live_sums = {live: host.get_fact(Sha1File, path=live) for _n, live, _c, _m in wanted}
    changed = [
        (name, live, content, mode)
        for name, live, content, mode in wanted
        if live_sums[live] != sha1(content)
    ]
    return changed, live_sums


def _swapped_in(
    changed: list[tuple[str, str, str, str]], site_path: str, keys_path: str,
    staging_dir: str, service: str, secrets: list[str] | None, check: str,
) -> Iterator[StringCommand | FileUploadCommand]:
    """The changed files uploaded into ``staging_dir``, then swapped in by the one command
    that tests them with ``nginx -t`` and reloads nginx or rolls back."""
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
            hide=[keys_path], redact=REDACT_NAME if redact else None, check=check,
        )
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
    check: str = "nginx -t",
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
    + check: the command that tests the files once swapped in: ``nginx -t``; the router
      stage's ``haproxy -c -f <its configuration>`` (the same checked swap for HAProxy)

    Each file is compared by sha1 with what is live. Changed files are uploaded into
    ``staging_dir``, renamed over the live ones, and ``nginx -t`` is run: if it passes,
    nginx is reloaded; if not, the previous files are put back and the operation fails with
    nginx's message. Nothing changed: no command. A secret file whose content is right but
    whose mode or owner was changed is not this operation's: pyinfra_vllm/operations/access.py
    closes it again, without a reload (the access table, pyinfra_vllm/plans/access.py).

    **Example:**

    .. code:: python

        gateway.site(
            name="Gateway: nginx site",
            site_content=render_site(...),
            keys_content=render_keys_map(["sk-..."]),
            secrets=["sk-..."],
        )
    """
    wanted = _wanted_files(site_path, site_content, keys_path, keys_content, extra_files)
    changed, live_sums = _changed_files(wanted)
    # --diff: before the first command (pyinfra's change detection stops there); the key
    # file and a "600" file are masked (pyinfra_vllm/operations/util/file_diff.py).
    file_diff.show_changes(state, host, [
        (live, content.encode(), mode == "600", live_sums[live] is not None)
        for _name, live, content, mode in changed
    ])

    if changed:
        yield from _swapped_in(changed, site_path, keys_path, staging_dir, service, secrets,
                               check)
    else:
        host.noop("nginx site and API keys are up to date")


@operation()
def foreign_disabled(paths: list[str], disabled_dir: str = DISABLED_DIR,
                     service: str = "nginx"):
    """
    Take foreign nginx files (servers on the gateway's ports, Debian's default site) out
    of nginx's configuration, tested by ``nginx -t`` before nginx reloads.

    + paths: the files to set aside (``foreign_servers`` of facts.nginx.NginxServers,
      without the unsafe ones; Debian's default site where nginx is installed by this run)
    + disabled_dir: where they are kept, each at its own path below it
    + service: the systemd unit reloaded (only if it runs) after the test passed

    Each file is moved, a symlink as a symlink (its target stays), never deleted; one
    that is not there is passed over. If ``nginx -t`` fails without them, the moved ones
    are put back and the operation fails with nginx's message. No file: no command.
    """
    if not paths:
        host.noop("no foreign nginx server on the gateway's port")
        return
    yield StringCommand(disable_script(paths, disabled_dir, service))
