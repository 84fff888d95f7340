"""Pin a Hugging Face model to one commit, with every file's size and checksum.

    python -m tools.model_lock MODEL_ID [--revision main] [--base-url https://huggingface.co]
        [--out locks/<id>.json] [--token-file F] [--ca-bundle PEM] [--exclude GLOB ...]

Runs on the operator's machine. It asks the Hub (or a mirror with the same API)
``GET {base}/api/models/{id}/revision/{rev}?blobs=true`` and writes a lock file that
``files/fetch_model.py`` downloads and verifies on the servers. The token comes from
``--token-file`` or ``HF_TOKEN``, is sent as ``Authorization: Bearer``, and is never
printed or written.

Checksums: LFS files carry ``lfs.sha256``, the sha256 of their content (the Hub names
LFS blobs by it). Small files are plain git blobs and the Hub reports only their git
blob id (``blobId``: sha1 over ``"blob <size>\\0" + content``), so that is what the lock
records for them ("git-blob-sha1"); the downloader computes the same.

The lock also carries ``config``: the model's config.json, fetched at the locked commit
and checked against its lock entry, so the compatibility gate and the capacity planner
judge the model on the operator's machine before any host changes.

Lock format (``lock_version`` 1)::

    {"lock_version": 1, "model_id": "Qwen/Qwen3.6-27B", "revision": "main",
     "commit": "<40 hex>", "base_url": "https://huggingface.co", "created": "<UTC ISO>",
     "total_size": 55600000000, "config": {"architectures": [...], ...},
     "files": [{"path": "config.json", "size": 1234, "algo": "git-blob-sha1",
                "digest": "<40 hex>", "lfs": false}, ...]}
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import hashlib
import json
import os
import re
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from pyinfra_vllm.core.locks import LOCK_VERSION, default_out
from pyinfra_vllm.core.model_files import unsafe_model_path

_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class LockError(Exception):
    """The API answer cannot be turned into a lock; the message says why."""


def api_url(base_url: str, model_id: str, revision: str) -> str:
    """The model-info URL; a revision like refs/pr/1 is one path segment, so quoted."""
    rev = urllib.parse.quote(revision, safe="")
    return f"{base_url.rstrip('/')}/api/models/{model_id}/revision/{rev}?blobs=true"


def fetch_api(base_url: str, model_id: str, revision: str, token: str | None = None,
              ca_bundle: str | None = None, timeout: float = 30.0) -> dict[str, Any]:
    """GET the model info with blobs; errors name the URL and status, never the token."""
    url = api_url(base_url, model_id, revision)
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if token:
        request.add_unredirected_header("Authorization", f"Bearer {token}")
    context = ssl.create_default_context(cafile=ca_bundle)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        hint = {401: "the repo is gated or private: set HF_TOKEN or --token-file",
                403: "the token has no access to this repo (accept its licence on the Hub)",
                404: "no such model or revision"}.get(exc.code, "")
        raise LockError(f"GET {url}: HTTP {exc.code} {exc.reason}"
                        + (f" ({hint})" if hint else "")) from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise LockError(f"GET {url}: {exc}") from exc


def file_entry(sibling: dict[str, Any]) -> dict[str, Any]:
    """One lock entry from one ``siblings`` item of a blobs=true answer."""
    path = sibling.get("rfilename")
    if not path:
        raise LockError(f"sibling without rfilename: {sibling}")
    problem = unsafe_model_path(path)
    if problem is not None:
        raise LockError(f"{path!r}: {problem}; refusing to lock it")
    lfs = sibling.get("lfs")
    if lfs:
        digest = str(lfs.get("sha256") or lfs.get("oid") or "")
        size = lfs.get("size", sibling.get("size"))
        if not _HEX64.match(digest) or not isinstance(size, int):
            raise LockError(f"{path}: LFS entry without a sha256 and size: {lfs}")
        return {"path": path, "size": size, "algo": "sha256", "digest": digest, "lfs": True}
    blob = str(sibling.get("blobId") or "")
    size = sibling.get("size")
    if not _HEX40.match(blob) or not isinstance(size, int):
        raise LockError(f"{path}: no blobId/size in the answer; the server did not honour "
                        "blobs=true")
    return {"path": path, "size": size, "algo": "git-blob-sha1", "digest": blob, "lfs": False}


def build_lock(api: dict[str, Any], *, model_id: str, revision: str, base_url: str,
               exclude: list[str] | None = None, now: str | None = None) -> dict[str, Any]:
    """Turn a model-info answer into a lock dict (see the module docstring)."""
    commit = str(api.get("sha") or "")
    if not _HEX40.match(commit):
        raise LockError(f"answer has no 40-hex commit sha (got {commit!r})")
    siblings = api.get("siblings")
    if not isinstance(siblings, list) or not siblings:
        raise LockError("answer lists no files (siblings)")
    files = [
        file_entry(s)
        for s in siblings
        if not any(fnmatch.fnmatch(str(s.get("rfilename")), g) for g in exclude or [])
    ]
    files.sort(key=lambda f: f["path"])
    created = now or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "lock_version": LOCK_VERSION,
        "model_id": model_id,
        "revision": revision,
        "commit": commit,
        "base_url": base_url.rstrip("/"),
        "created": created,
        "total_size": sum(f["size"] for f in files),
        "files": files,
    }


def git_blob_sha1(data: bytes) -> str:
    """The git blob id of ``data``: what the Hub reports for a small file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def fetch_config(lock: dict[str, Any], token: str | None = None,
                 ca_bundle: str | None = None, timeout: float = 30.0) -> dict[str, Any]:
    """config.json at the locked commit, verified against its entry in the lock."""
    entry = next((f for f in lock["files"] if f["path"] == "config.json"), None)
    if entry is None:
        raise LockError(f"{lock['model_id']} has no config.json: not a transformers model")
    url = (f"{lock['base_url']}/{lock['model_id']}/resolve/{lock['commit']}/config.json")
    request = urllib.request.Request(url)
    if token:
        request.add_unredirected_header("Authorization", f"Bearer {token}")
    context = ssl.create_default_context(cafile=ca_bundle)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            data = response.read()
    except (urllib.error.URLError, OSError) as exc:
        raise LockError(f"GET {url}: {exc}") from exc
    digest = (hashlib.sha256(data).hexdigest() if entry["algo"] == "sha256"
              else git_blob_sha1(data))
    if len(data) != entry["size"] or digest != entry["digest"]:
        raise LockError(f"GET {url}: {len(data)} bytes with {entry['algo']} {digest}, the "
                        f"lock says {entry['size']} bytes, {entry['digest']}")
    try:
        return json.loads(data)
    except ValueError as exc:
        raise LockError(f"GET {url}: not JSON: {exc}") from exc


def write_lock(lock: dict[str, Any], out: Path) -> None:
    """Write atomically, so a half-written lock never exists."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(lock, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, out)


def read_token(token_file: str | None) -> str | None:
    if token_file:
        return Path(token_file).read_text(encoding="utf-8").strip() or None
    return os.environ.get("HF_TOKEN") or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.model_lock", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_id")
    parser.add_argument("--revision", default="main", help="branch, tag or commit")
    parser.add_argument("--base-url", default="https://huggingface.co")
    parser.add_argument("--out", type=Path, help="lock file (default locks/<org>--<name>.json)")
    parser.add_argument("--token-file", help="file holding the token (else HF_TOKEN)")
    parser.add_argument("--ca-bundle", help="PEM file of CAs to trust")
    parser.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                        help="leave files matching GLOB out of the lock (repeatable)")
    args = parser.parse_args(argv)
    try:
        api = fetch_api(args.base_url, args.model_id, args.revision,
                        read_token(args.token_file), args.ca_bundle)
        lock = build_lock(api, model_id=args.model_id, revision=args.revision,
                          base_url=args.base_url, exclude=args.exclude)
        lock["config"] = fetch_config(lock, read_token(args.token_file), args.ca_bundle)
    except (LockError, OSError) as exc:
        print(f"model_lock: {exc}", file=sys.stderr)
        return 1
    out = args.out or default_out(args.model_id)
    write_lock(lock, out)
    print(f"{out}: {args.model_id}@{args.revision} = {lock['commit']}, "
          f"{len(lock['files'])} files, {lock['total_size']} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
