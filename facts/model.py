"""Facts about the downloaded model: what files/fetch_model.py verified, and the files'
size and modification time now, read without hashing anything (ModelFiles); and, on
demand, every file re-hashed against the lock (ModelContent).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pyinfra.api import QuoteString, StringCommand
from typing_extensions import override

from facts.base import FactBase

# The names the model downloader (files/fetch_model.py) reserves inside a model's
# directory. files/fetch_model.py runs alone on the host and imports nothing of this
# repository, so it carries the same names; tests/unit/test_model.py holds them equal.
# The record of the files verified against the lock: path, size, mtime, checksum.
VERIFIED_NAME = ".verified.json"
# Where partial downloads wait, under their path in the lock plus ".part".
INCOMING = ".incoming"
# The lock file that keeps two downloads into one directory apart.
FETCH_LOCK = ".fetch.lock"


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


# The host script the ModelContent fact runs: read here, sent with the command (a fact
# cannot upload it first, and it must not depend on what an earlier run left).
VERIFY_SCRIPT = Path(__file__).resolve().parents[1] / "files" / "verify_model.py"
# What files/verify_model.py calls a file that does not match the lock.
CONTENT_PROBLEMS = ("mismatch", "size", "missing", "unreadable")


def lock_files(lock: dict[str, Any] | str) -> list[dict[str, Any]]:
    """The lock's files as the verifier reads them: a lock, or its file's path (the CLI)."""
    found = json.loads(Path(lock).read_text(encoding="utf-8")) if isinstance(lock, str) \
        else lock
    return [{key: entry[key] for key in ("path", "size", "algo", "digest")}
            for entry in found["files"]]


class ModelContent(FactBase[dict[str, Any] | None]):
    """
    Re-hashes every file of the model lock in the model directory (files/verify_model.py,
    in parallel, on the host) and returns the files whose content does not match the
    lock, whatever their size and mtime say. Reads the whole model: opt-in
    (``model_verify: deep``). None when the directory does not exist:

    .. code:: python

        {
            "files": 17, "bytes": 55600000000, "seconds": 61.2, "jobs": 16,
            "problems": {"model-00002-of-00015.safetensors": "mismatch",
                         "config.json": "missing"},
            "error": None,
        }

    ``problems`` maps a path of the lock to ``mismatch`` (same size, other checksum),
    ``size``, ``missing`` or ``unreadable``; ``error`` says why the check itself did
    not run (no python3 on the host, a bad lock), and the counts are then 0. From the
    command line, ``lock`` is the lock file's path.
    """

    @override
    def command(self, path: str, lock: dict[str, Any] | str) -> StringCommand:
        manifest = json.dumps(lock_files(lock), separators=(",", ":"))
        return StringCommand(
            "test -d", QuoteString(path), "|| exit 0;",
            "if ! command -v python3 >/dev/null 2>&1; then echo 'error\tno python3'; exit 0;",
            "fi; python3 -c", QuoteString(VERIFY_SCRIPT.read_text(encoding="utf-8")),
            "--dest", QuoteString(path), "--manifest", QuoteString(manifest),
            "2>&1; echo \"exit\t$?\"",
        )

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        if not output:
            return None
        found: dict[str, Any] = {"files": 0, "bytes": 0, "seconds": 0.0, "jobs": 0,
                                 "problems": {}, "error": None}
        summary, notes, code = False, [], None
        for line in output:
            word, _, rest = line.partition("\t")
            if word in CONTENT_PROBLEMS:
                found["problems"][rest.split("\t")[0]] = word
            elif word == "summary":
                try:
                    counts = json.loads(rest)
                except ValueError:
                    continue
                found.update({key: counts.get(key, 0) for key in ("files", "bytes",
                                                                  "seconds", "jobs")})
                summary = True
            elif word == "exit":
                code = rest.strip()
            elif word == "error":
                found["error"] = rest.strip()
            elif line.strip():
                notes.append(line.strip())
        if not summary and found["error"] is None:
            found["error"] = "; ".join(notes) or f"the verifier exited {code} without a summary"
        return found


def silently_changed(content: dict[str, Any] | None, model_files: dict[str, Any] | None,
                     lock: dict[str, Any]) -> list[str]:
    """Files whose content does not match the lock although the stat check trusts them
    (verified against this lock, size and mtime unchanged): only a deep check finds
    them, and only a refetch repairs them. The other bad files the stat check already
    fetches again."""
    if not content:
        return []
    pending = set(unverified(model_files, lock))
    return sorted(path for path in content["problems"] if path not in pending)
