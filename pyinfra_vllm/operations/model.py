"""The model's files, downloaded and verified against the lock on the host itself.

files/fetch_model.py does the work on the host (parallel, resumable, verified, written
under a temporary name and renamed only once verified). This operation decides from the
ModelFiles fact, without hashing anything, whether it has to run at all: every file of
the lock verified against this lock and unchanged (size, mtime) since means no command.
Files a deep check (facts.model.ModelContent) found changed under an unchanged size and
mtime are named to it with ``refetch``: it removes and fetches exactly those again.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from pyinfra import host
from pyinfra.api import FileUploadCommand, QuoteString, StringCommand, operation

from facts.model import ModelFiles, unverified
from facts.units import SystemdBooted, UnitState
from pyinfra_vllm.operations.util import jobs as job_units
from pyinfra_vllm.operations.util.uploads import (
    SECRET_DIR,
    env_file_text,
    private_upload,
    secret_file,
    sourced,
)
from pyinfra_vllm.plans.model import (
    TOOL_DIR,
)


def _downloader_argv(script: str, lock_file: str, dest: str, base_url: str, jobs: int,
                     connections: int, ca_bundle: str | None,
                     refetch: list[str]) -> list[str | QuoteString]:
    """The downloader's command line: no secret on it (the proxy and token go by file)."""
    argv: list[str | QuoteString] = [
        "python3", QuoteString(script), "--lock", QuoteString(lock_file), "--dest",
        QuoteString(dest), "--base-url", QuoteString(base_url), "--jobs", str(jobs),
        "--connections", str(connections)]
    if ca_bundle:
        argv += ["--ca-bundle", QuoteString(ca_bundle)]
    for path in refetch:
        argv += ["--refetch", QuoteString(path)]
    return argv


def _job_and_meter(dest: str, lock: dict) -> tuple[str, dict]:
    """The transient unit that downloads the lock's files into ``dest``, and what its
    watch measures: the bytes on disk against the lock's file sizes."""
    # One job per directory and commit, whatever it refetches: a re-run attaches to
    # it rather than starting a second download into the same files.
    unit = job_units.unit_name("model", dest, lock["commit"])
    meter = {"kind": "bytes", "path": dest,
             "sizes": {entry["path"]: entry["size"] for entry in lock["files"]}}
    return unit, meter


def _staged(downloader: str, script: str, lock: dict, lock_file: str,
            dest: str) -> Iterator[StringCommand | FileUploadCommand]:
    """The model directory made, the downloader uploaded to ``script`` and the lock to
    ``lock_file``."""
    yield StringCommand("install -d -m 700", QuoteString(f"{TOOL_DIR}/locks"), "&& mkdir -p",
                        QuoteString(dest))
    # Root runs both: through the private spool, never a /tmp name another user can take.
    yield from private_upload(downloader, script, mode="644")
    yield from private_upload((json.dumps(lock, indent=1) + "\n").encode(), lock_file)


def _job_started(unit: str, lock: dict, dest: str, argv: list[str | QuoteString],
                 proxy: str | None,
                 token: str | None) -> Iterator[StringCommand | FileUploadCommand]:
    """The download started as the transient unit ``unit``."""
    # The proxy (it may carry credentials) and the token (HF_TOKEN, which the
    # downloader reads when it has no --token-file) reach the job through its env
    # file, which it removes as it starts: never on its command line or the unit's.
    pairs = {"https_proxy": proxy, "http_proxy": proxy} if proxy else {}
    if token is not None:
        pairs["HF_TOKEN"] = token
    yield from job_units.start(
        unit, f"pyinfra-vllm: {lock['model_id']}@{lock['commit'][:12]} into {dest}",
        [(f"downloading and verifying {len(lock['files'])} files", StringCommand(*argv))],
        env_file_text(pairs),
    )


def _run_in_session(argv: list[str | QuoteString], proxy: str | None,
                    token: str | None) -> Iterator[StringCommand | FileUploadCommand]:
    """The download run in the SSH session (no systemd to run it as a job)."""
    # The proxy and the token reach the downloader through root-only files in
    # SECRET_DIR, never its command line; both go whatever the download does, and the
    # download's exit status is kept.
    secrets = []
    if proxy:
        env_path = f"{SECRET_DIR}/model-download.env"
        yield from secret_file(env_file_text({"https_proxy": proxy, "http_proxy": proxy}),
                               "model-download.env")
        argv = [*sourced(env_path), *argv]
        secrets.append(env_path)
    if token is not None:
        token_file = f"{SECRET_DIR}/hf_token"
        yield from secret_file((token + "\n").encode(), "hf_token")
        argv = [*argv, "--token-file", QuoteString(token_file)]
        secrets.append(token_file)
    if not secrets:
        yield StringCommand(*argv)
        return
    yield StringCommand(*argv, "; rc=$?; rm -f", *(QuoteString(path) for path in secrets),
                        "; exit $rc")


@operation()
def downloaded(lock: dict, dest: str, base_url: str, token: str | None = None,
               ca_bundle: str | None = None, proxy: str | None = None, jobs: int = 4,
               connections: int = 8, downloader: str = "files/fetch_model.py",
               refetch: list[str] | None = None):
    """
    Download the lock's files into ``dest`` and verify each against the lock.

    + lock: the lock (tools.model_lock), as a dict
    + dest: the model directory on the host
    + base_url: Hugging Face or a mirror with the same layout
    + token: bearer token for gated models; uploaded to a root-only tmpfs file for the
      download (pyinfra_vllm/operations/util/uploads.py) and removed after it, never on a command
      line
    + ca_bundle: CA bundle file on the host trusted for HTTPS
    + proxy: HTTP(S) proxy
    + jobs: files downloaded in parallel
    + connections: HTTP Range connections per file of at least 64 MiB
    + downloader: local path of files/fetch_model.py
    + refetch: files of the lock whose content is known not to match it (a deep check
      found them): removed and fetched again, whatever the verification record says

    Every file verified before and unchanged since: no command. Otherwise the downloader
    and the lock are uploaded and the downloader runs; it re-hashes only files whose
    size or mtime changed, and fails naming the file and both checksums when a file
    fails verification twice.

    Where systemd is the init (facts.units.SystemdBooted) the downloader runs as the
    transient unit ``pyinfra-vllm-model-<hash of dest and commit>``
    (pyinfra_vllm/operations/util/jobs.py), which a lost SSH session does not stop; the operation
    follows it, a progress line per host every few seconds (bytes on disk of the total, rate, ETA),
    and fails with its last journal lines when it fails. A run that finds that unit still running
    follows it instead of starting another. Without systemd it runs in the SSH session, and
    ``pyinfra -vvv`` shows its progress lines.
    """
    pending = unverified(host.get_fact(ModelFiles, path=dest), lock)
    refetch = sorted(refetch or [])
    if not pending and not refetch:
        host.noop(f"{len(lock['files'])} files of {lock['model_id']}@{lock['commit'][:12]} "
                  "verified and unchanged since")
        return
    name = lock["model_id"].replace("/", "--")
    script = f"{TOOL_DIR}/fetch_model.py"
    lock_file = f"{TOOL_DIR}/locks/{name}.json"
    argv = _downloader_argv(script, lock_file, dest, base_url, jobs, connections, ca_bundle,
                            refetch)
    detached = host.get_fact(SystemdBooted)
    if detached:
        unit, meter = _job_and_meter(dest, lock)
        if job_units.running(host.get_fact(UnitState, unit=unit)):
            yield job_units.watch(unit, "model", meter, attached=True)
            return
    yield from _staged(downloader, script, lock, lock_file, dest)
    if detached:
        yield from _job_started(unit, lock, dest, argv, proxy, token)
        yield job_units.watch(unit, "model", meter)
        return
    yield from _run_in_session(argv, proxy, token)
