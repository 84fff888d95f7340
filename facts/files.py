"""Facts about plain files, read for many paths in one command."""

from __future__ import annotations

from pyinfra.api import FactBase, QuoteString, StringCommand
from typing_extensions import override


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
