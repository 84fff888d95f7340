"""Facts about the downloaded model: what files/fetch_model.py verified, and the files'
size and modification time now, read without hashing anything.
"""

from __future__ import annotations

import json
from typing import Any

from pyinfra.api import FactBase, QuoteString, StringCommand
from typing_extensions import override

# The downloader's own names for its record and its download area.
from pyinfra_vllm.model_files import INCOMING, VERIFIED_NAME


def mtime_ns(text: str) -> int:
    """find's ``%T@`` (``1700000000.1234567890``) as integer nanoseconds, exactly."""
    seconds, _, fraction = text.partition(".")
    return int(seconds) * 1_000_000_000 + int((fraction + "000000000")[:9])


class ModelFiles(FactBase[dict[str, Any] | None]):
    """
    Returns the model directory's verification record and its files' stat, or None when
    the directory does not exist:

    .. code:: python

        {
            "verified": {"config.json": {"size": 1234, "mtime_ns": 1700000000123456789,
                                         "algo": "git-blob-sha1", "digest": "..."}},
            "files": {"config.json": {"size": 1234, "mtime_ns": 1700000000123456789}},
        }

    ``files`` leaves out the record itself and the ``.incoming`` download area.
    """

    @override
    def command(self, path: str) -> StringCommand:
        quoted = QuoteString(path)
        return StringCommand(
            "test -d", quoted, "|| exit 0; echo '== verified'; cat",
            QuoteString(f"{path}/{VERIFIED_NAME}"), "2>/dev/null; echo; echo '== files';",
            "find", quoted, "-path", QuoteString(f"{path}/{INCOMING}"), "-prune -o -type f",
            "! -name", QuoteString(f"{VERIFIED_NAME}*"), "-printf '%s %T@ %P\\n'",
        )

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        if not output:
            return None
        section, record, files = None, [], {}
        for line in output:
            if line.strip() in ("== verified", "== files"):
                section = line.strip()[3:]
            elif section == "verified":
                record.append(line)
            elif section == "files" and line.strip():
                size, stamp, path = line.split(" ", 2)
                files[path] = {"size": int(size), "mtime_ns": mtime_ns(stamp)}
        try:
            verified = json.loads("\n".join(record) or "{}").get("files", {})
        except (ValueError, AttributeError):
            verified = {}  # an unreadable record means: verify everything again
        return {"verified": verified, "files": files}


def unverified(model_files: dict[str, Any] | None, lock: dict[str, Any]) -> list[str]:
    """The lock's files that are missing, changed, or not verified against this lock."""
    if model_files is None:
        return [entry["path"] for entry in lock["files"]]
    pending = []
    for entry in lock["files"]:
        record = model_files["verified"].get(entry["path"]) or {}
        now = model_files["files"].get(entry["path"])
        if (
            now is None
            or record.get("digest") != entry["digest"]
            or not record.get("size") == now["size"] == entry["size"]
            or record.get("mtime_ns") != now["mtime_ns"]
        ):
            pending.append(entry["path"])
    return pending
