"""The commands that put a path's owner, group and mode back (pyinfra_vllm/operations/access.py):
each checks, on the host, that the path is still of its kind and no link before it
changes anything."""

from __future__ import annotations

from pyinfra.api import QuoteString, StringCommand

from pyinfra_vllm.plans.access import KIND_WORDS

# test(1)'s operator for each kind a row may declare.
_KIND_TESTS = {"file": "-f", "directory": "-d", "socket": "-S"}


def _chmod(mode: int, path: str, chmod_as: str) -> list[str | QuoteString]:
    # Five digits: GNU chmod keeps a directory's set-group-ID bit for a shorter number
    # (chmod(1), "SETUID AND SETGID BITS"); 00750 clears it.
    words: list[str | QuoteString] = ["chmod", QuoteString(f"{mode:05o}"), "--",
                                      QuoteString(path)]
    if chmod_as != "root":
        return ["runuser -u", QuoteString(chmod_as), "--", *words]
    return words


def repair_command(path: str, wanted: dict[str, str], have: dict[str, str]) -> StringCommand:
    """The command that gives ``path`` its ``wanted`` owner, group and mode (a row's
    ``wanted()``), from what it ``have`` (facts.files.PathModes): the mode first narrowed
    to the bits both allow, then the owner, then the mode; only the steps it needs. On
    the host it first checks the path is still of its kind and no link."""
    want, now = int(wanted["mode"], 8), int(have["mode"], 8)
    owner = f"{wanted['owner']}:{wanted['group']}"
    steps: list[list[str | QuoteString]] = []
    if have["owner"] != wanted["owner"] or have["group"] != wanted["group"]:
        # Never more open than both, not even between the two changes: a new group gets
        # only the bits the old mode and the new one both give it. (A path whose mode
        # its directory's owner changes gets its owner first: that user could change
        # only its own.)
        if now & want != now and wanted["chmod_as"] == "root":
            steps.append(_chmod(now & want, path, wanted["chmod_as"]))
            now &= want
        steps.append(["chown -h", QuoteString(owner), "--", QuoteString(path)])
    if now != want:
        steps.append(_chmod(want, path, wanted["chmod_as"]))
    quoted = QuoteString(path)
    words: list[str | QuoteString] = []
    for step in steps:
        words += ["&&", *step]
    return StringCommand(
        "{ test", _KIND_TESTS[wanted["kind"]], quoted, "&& test ! -L", quoted, "||",
        "{ echo", QuoteString(f"{path} is no longer {KIND_WORDS[wanted['kind']]}: left as "
                              "it is"), ">&2; exit 1; }; }", *words,
    )
