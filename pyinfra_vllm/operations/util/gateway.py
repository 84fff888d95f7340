"""The gateway's scripts: a checked swap of nginx's files (nginx -t before reload), and
foreign files set aside the same way."""

from __future__ import annotations

import shlex

from pyinfra_vllm.plans.gateway import (
    KEYS_PATH,
)


def swap_script(
    files: list[tuple[str, str, str]],
    staging_dir: str,
    service: str,
    *,
    hide: list[str] | tuple[str, ...] = (),
    redact: str | None = None,
    check: str = "nginx -t",
) -> str:
    """One shell command: swap candidates in, ``nginx -t``, reload or roll back.

    ``files`` holds ``(candidate name in staging_dir, live path, octal mode)``. One command,
    not several, so the rollback runs even when the test fails (pyinfra stops an operation
    at its first failing command). Paths are quoted with shlex: they are parts of a script.

    + hide: fixed strings (the key file's path) whose lines of nginx -t's output are not
      shown when the test fails
    + redact: name, in staging_dir, of a file of fixed strings (the keys), one a line:
      lines that hold one, in any case, are not shown either; removed at the end
    + check: the fixed command that tests them (the router's: plans/router.py CHECK_COMMAND)

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
    report = f'echo "{check} rejected the new configuration; the previous files are back: $out" >&2'
    if hide or redact:
        patterns = " ".join(f"-e {q(text)}" for text in hide)
        if redact:
            patterns = f"{patterns} -f {q(f'{staging_dir}/{redact}')}".strip()
            cleanup.append(f"rm -f {q(f'{staging_dir}/{redact}')}")
        report = (
            f"""shown=$(printf '%s\\n' "$out" | grep -v -i -F {patterns}); """
            f"""hidden=$(printf '%s\\n' "$out" | grep -c -i -F {patterns}); """
            + (f"rm -f {q(f'{staging_dir}/{redact}')}; " if redact else "")
            + f'echo "{check} rejected the new configuration; the previous files are back: '
            '$shown" >&2; [ "$hidden" = 0 ] || echo "($hidden line(s) of its output not '
            'shown: they name the API key file or hold a key)" >&2'
        )
    lines.append(
        f"if out=$({check} 2>&1); then "
        # reload-or-restart reloads a running nginx (graceful: old workers finish their
        # streams) and starts a stopped one; it never restarts a running one.
        f"{'; '.join(cleanup)}; systemctl reload-or-restart {q(service)}; "
        f"else {'; '.join(restore)}; {report}; exit 1; fi"
    )
    return "; ".join(lines)


def disable_script(paths: list[str], disabled_dir: str, service: str,
                   hide: str = KEYS_PATH) -> str:
    """One shell command: set ``paths`` aside, ``nginx -t``, reload, or put them back.

    Each file there is moved under ``disabled_dir`` at its own path, a symlink as a symlink
    (what it points to stays); ``mv --backup=numbered`` keeps one set aside before. One
    that is not there is passed over (Debian's default site, where nginx's package is
    installed by the same run and may not have made it). One command, so the rollback,
    of the files it moved, runs when the test fails. A failed test's lines that name
    ``hide`` (the API key file, whose tokens nginx would quote) are not shown.
    """
    q = shlex.quote
    lines, restore = [], []
    for index, live in enumerate(paths):
        kept = f"{disabled_dir}{live}"
        lines.append(f"m{index}=0; if [ -e {q(live)} ] || [ -L {q(live)} ]; then "
                     f"install -d -m 700 {q(kept.rpartition('/')[0])} && "
                     f"mv --backup=numbered -f {q(live)} {q(kept)} && m{index}=1 || exit 1; fi")
        restore.append(f'[ "$m{index}" = 0 ] || mv -f {q(kept)} {q(live)}')
    lines.append(
        "if out=$(nginx -t 2>&1); then "
        f"systemctl try-reload-or-restart {q(service)}; "
        f"else {'; '.join(restore)}; "
        'echo "nginx -t failed without the foreign files; they are back:" >&2; '
        f"printf '%s\\n' \"$out\" | grep -v -F {q(hide)} >&2; exit 1; fi"
    )
    return "; ".join(lines)
