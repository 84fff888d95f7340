"""Facts about plain files, read for many paths in one command."""

from __future__ import annotations

from typing import Any

from pyinfra.api import QuoteString, StringCommand
from typing_extensions import override

from facts.base import FactBase


class FileDigests(FactBase[dict[str, dict[str, str] | None]]):
    """
    Returns each path's sha256, octal mode and owner, or None for a path that is no
    file (one command for any number of paths):

    .. code:: python

        {"/etc/vllm/vllm.env": {"sha256": "9f86...", "mode": "600", "owner": "root:root"},
         "/x": None}
    """

    @override
    def command(self, paths: list[str]) -> StringCommand:
        return StringCommand(
            "for p in", *(QuoteString(path) for path in paths), "; do",
            'if [ -f "$p" ]; then printf "%s %s %s %s\\n" "$(stat -c %a "$p")"',
            '"$(stat -c %U:%G "$p")" "$(sha256sum < "$p" | cut -c1-64)" "$p";',
            'else printf "%s %s %s %s\\n" - - - "$p";',
            "fi; done",
        )

    @override
    def process(self, output: list[str]) -> dict[str, dict[str, str] | None]:
        found: dict[str, dict[str, str] | None] = {}
        for line in output:
            mode, owner, digest, path = line.split(" ", 3)
            found[path] = (
                None if mode == "-" else {"sha256": digest, "mode": mode, "owner": owner}
            )
        return found


class SecretFileLines(FactBase[list[tuple[str | None, str]] | None]):
    """
    Returns, for a file that holds secrets, each line's variable name (the ``NAME`` of a
    ``NAME=value`` line, else None) and the sha256 of the whole line; None for a path that
    is no file. The values themselves never leave the host, so the output (printed by
    ``pyinfra -vvv``) shows none: ``--diff`` masks them and tells changed lines from
    unchanged ones by digest.

    .. code:: python

        [("VLLM_API_KEY", "5e88..."), (None, "e3b0...")]
    """

    @override
    def command(self, path: str) -> StringCommand:
        return StringCommand(
            "if [ -f", QuoteString(path), "]; then echo +;",
            # The last line counts without its final newline too, as Python's split does.
            'while IFS= read -r l || [ -n "$l" ]; do',
            'case "$l" in [A-Za-z_]*=*) n="${l%%=*}";',
            'case "$n" in *[!A-Za-z0-9_]*) n=-;; esac;; *) n=-;; esac;',
            """printf '%s %s\\n' "$n" "$(printf '%s' "$l" | sha256sum | cut -c1-64)";""",
            "done <", QuoteString(path), "; else echo -; fi",
        )

    @override
    def process(self, output: list[str]) -> list[tuple[str | None, str]] | None:
        if not output or output[0] != "+":
            return None
        lines: list[tuple[str | None, str]] = []
        for line in output[1:]:
            name, digest = line.split(" ", 1)
            lines.append((None if name == "-" else name, digest))
        return lines


class PathTypes(FactBase[dict[str, str | None]]):
    """
    Returns what each path is: "link" (a symbolic link, even a dangling one), "directory",
    "file" or "other", or None for a path that does not exist (one command for any number
    of paths):

    .. code:: python

        {"/etc/nginx/conf.d/vllm.conf": "file", "/opt/vllm": "directory", "/x": None}
    """

    @override
    def command(self, paths: list[str]) -> StringCommand:
        return StringCommand(
            "for p in", *(QuoteString(path) for path in paths), "; do",
            'if [ -L "$p" ]; then t=link; elif [ -d "$p" ]; then t=directory;',
            'elif [ -f "$p" ]; then t=file; elif [ -e "$p" ]; then t=other; else t=-; fi;',
            'printf "%s %s\\n" "$t" "$p"; done',
        )

    @override
    def process(self, output: list[str]) -> dict[str, str | None]:
        found: dict[str, str | None] = {}
        for line in output:
            kind, path = line.split(" ", 1)
            found[path] = None if kind == "-" else kind
        return found


# stat's %f is st_mode in hex: its file type bits (S_IFMT, inode(7)) name the kind.
_STAT_KINDS = {0o100000: "file", 0o040000: "directory", 0o120000: "link", 0o140000: "socket"}


class PathModes(FactBase[dict[str, dict[str, str] | None]]):
    """
    Returns each path's owner, group, octal mode and kind, read by ``stat`` on the path
    itself (a symbolic link is reported as one, never followed), or None for a path that
    does not exist (one command for any number of paths):

    .. code:: python

        {"/etc/vllm/engine-key.env": {"owner": "root", "group": "root", "mode": "600",
                                      "kind": "file"},
         "/run/vllm-engine": {"owner": "vllm", "group": "www-data", "mode": "750",
                              "kind": "directory"},
         "/x": None}

    ``kind`` is "file", "directory", "link", "socket" or "other" (a fifo, a device), and
    "unknown" for a path that exists but could not be read (owner, group and mode then
    empty): never taken for absent.
    """

    @override
    def command(self, paths: list[str]) -> StringCommand:
        return StringCommand(
            "for p in", *(QuoteString(path) for path in paths), "; do",
            "if s=$(stat -c '%f %U %G' -- \"$p\" 2>/dev/null); then",
            'printf "%s %s\\n" "$s" "$p";',
            'elif [ -e "$p" ] || [ -L "$p" ]; then printf "%s %s\\n" "? ? ?" "$p";',
            'else printf "%s %s\\n" "- - -" "$p"; fi; done',
        )

    @override
    def process(self, output: list[str]) -> dict[str, dict[str, str] | None]:
        found: dict[str, dict[str, str] | None] = {}
        for line in output:
            raw, owner, group, path = line.split(" ", 3)
            if raw == "-":
                found[path] = None
            elif raw == "?":
                found[path] = {"owner": "", "group": "", "mode": "", "kind": "unknown"}
            else:
                mode = int(raw, 16)
                found[path] = {"owner": owner, "group": group, "mode": f"{mode & 0o7777:o}",
                               "kind": _STAT_KINDS.get(mode & 0o170000, "other")}
        return found


class PathComponents(FactBase[list[dict[str, Any]]]):
    """
    Returns each directory of an absolute path from ``/`` down, and the path itself: what
    it is ("directory", "link" (a symbolic link, not followed), "other", or None where it
    does not exist), its owner's uid and name and its octal mode, special bits included
    (None each for a missing one). What decides whether another account could steer a
    write there: pyinfra_vllm/plans/metrics.py ``textfile_dir_problem``.

    .. code:: python

        [{"path": "/", "kind": "directory", "uid": 0, "owner": "root", "mode": "755"},
         {"path": "/var/lib/prometheus", "kind": "directory", "uid": 112,
          "owner": "prometheus", "mode": "755"},
         {"path": "/var/lib/prometheus/x", "kind": None, "uid": None, "owner": None,
          "mode": None}]
    """

    @override
    def command(self, path: str) -> StringCommand:
        parts = [part for part in path.split("/") if part]
        components = ["/", *("/" + "/".join(parts[:end]) for end in range(1, len(parts) + 1))]
        return StringCommand(
            "for p in", *(QuoteString(component) for component in components), "; do",
            'if [ -L "$p" ]; then t=link; elif [ -d "$p" ]; then t=directory;',
            'elif [ -e "$p" ]; then t=other; else t=-; fi;',
            'if [ "$t" = - ]; then printf "%s - - - %s\\n" "$t" "$p";',
            # stat without -L: a link's own owner and mode, never its target's.
            'else printf "%s %s %s\\n" "$t" "$(stat -c "%u %U %a" "$p")" "$p"; fi; done',
        )

    @override
    def process(self, output: list[str]) -> list[dict[str, Any]]:
        found = []
        for line in output:
            kind, uid, owner, mode, path = line.split(" ", 4)
            present = kind != "-"
            found.append({"path": path, "kind": kind if present else None,
                          "uid": int(uid) if present else None,
                          "owner": owner if present else None,
                          "mode": mode if present else None})
        return found
