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
every value masked (operations/util/file_diff.py).

The pure helpers (rendering, the body-size arithmetic) are here too, so unit tests can call
them without a pyinfra host.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from typing import Any

from pyinfra import host, state
from pyinfra.api import (
    FileUploadCommand,
    OperationValueError,
    QuoteString,
    StringCommand,
    operation,
)
from pyinfra.facts.files import File, Sha1File

from operations.util import file_diff
from operations.util.uploads import private_upload
from pyinfra_vllm.plans.gateway import (
    DISABLED_DIR,
    KEYS_PATH,
    REDACT_NAME,
    SITE_PATH,
    STAGING_DIR,
    redactions,
    sha1,
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


def _wanted_files(
    site_path: str, site_content: str, keys_path: str, keys_content: str,
    extra_files: dict[str, tuple[str, str]] | None,
) -> list[tuple[str, str, str, str]]:
    """Every file of the site as ``(candidate name in the staging directory, live path,
    content, octal mode)``: the site, the key file, then ``extra_files``, each named by
    its base name, which neither another file nor the redaction list may have."""
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
    return wanted


def _drifted_secrets(
    wanted: list[tuple[str, str, str, str]], changed: list[tuple[str, str, str, str]]
) -> list[tuple[str, str]]:
    """``(live path, mode)`` of each secret file ("600") whose content is right but whose
    mode or owner is not."""
    drifted = []
    for name, live, content, mode in wanted:
        if mode != "600" or (name, live, content, mode) in changed:
            continue
        # pyinfra types it as its FileDict, False for a directory, None when missing.
        found: Any = host.get_fact(File, path=live)
        if _drifted(found or {}, mode):
            drifted.append((live, mode))
    return drifted


def _swapped_in(
    changed: list[tuple[str, str, str, str]], site_path: str, keys_path: str,
    staging_dir: str, service: str, secrets: list[str] | None,
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
            hide=[keys_path], redact=REDACT_NAME if redact else None,
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
    wanted = _wanted_files(site_path, site_content, keys_path, keys_content, extra_files)
    live_sums = {live: host.get_fact(Sha1File, path=live) for _n, live, _c, _m in wanted}
    changed = [
        (name, live, content, mode)
        for name, live, content, mode in wanted
        if live_sums[live] != sha1(content)
    ]
    # --diff: before the first command (pyinfra's change detection stops there); the key
    # file and a "600" file are masked (operations/util/file_diff.py).
    if changed and file_diff.wanted(state):
        for _name, live, content, mode in changed:
            file_diff.show(host, live, content.encode(), secret=mode == "600",
                           exists=live_sums[live] is not None)

    drifted = _drifted_secrets(wanted, changed)
    for live, mode in drifted:
        # Content unchanged, so nginx needs no reload: only close the file again.
        yield StringCommand("chown", "root:root", QuoteString(live))
        yield StringCommand("chmod", mode, QuoteString(live))

    if changed:
        yield from _swapped_in(changed, site_path, keys_path, staging_dir, service, secrets)

    if not changed and not drifted:
        host.noop("nginx site and API keys are up to date")


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
