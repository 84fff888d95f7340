#!/usr/bin/env python3
"""Wait until the vLLM server answers: the unit's ``ExecStartPost``.

    python wait_ready.py --url http://127.0.0.1:8000/health [--unix-socket PATH]
        [--interval 1] [--timeout S] [--model NAME [--warmups 3] [--request-timeout 300]]

Polls ``--url`` until it answers 200 and exits 0 with one line on stdout,
``wait-ready: <url> answered 200 after N s``. vLLM 0.6.3's OpenAI server binds its port
only after the weights are loaded and the KV cache is allocated, so this is the moment
the service can take requests. Until then systemd keeps the unit "activating", and its
``TimeoutStartSec`` (vllm_start_timeout_s) is the deadline for the whole load. A server
that dies first does not end this poller (systemd 252 keeps the unit "activating" with
ExecStartPost still running, until that deadline): so it watches the main process,
``$MAINPID`` (which systemd sets for ExecStartPost, systemd.exec(5)), and gives up as soon
as it is gone, exit 1 with one line on stderr. ``--timeout`` (default: none, the unit's
deadline applies) gives up too. Standard library only.

With ``--model``, readiness also means serving: a one-token completion on
``/v1/completions`` must answer 200 with a choice (exit 1 otherwise: ``/health`` alone
passes while a broken tokenizer or chat template fails every request), then
``--warmups`` one-token completions warm the kernels (the seed's warm-up; bounded in
number and by ``--request-timeout`` each; a failed warm-up is reported, not fatal).
An engine that demands a key (``VLLM_API_KEY`` in the unit's environment file, which
systemd gives ExecStartPost too) gets it as ``Authorization: Bearer``.

Only the engine is asked: a listener another user owns (a TCP port taken while the
engine was down) is never sent a request, so it never gets the key nor passes for the
engine (one line on stderr says whose it is; the wait goes on). With ``--unix-socket``
the engine is reached through its socket, and once this wait (the engine's own user)
finds it owns the socket it makes it connectable for the socket directory's group,
nginx's workers: the directory (0750) keeps everyone else out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from engine_client import foreign_listener, request


def complete(base: str, unix_socket: str | None, model: str, prompt: str,
             timeout: float) -> tuple[int | None, str]:
    """One ``max_tokens=1`` completion: (HTTP status or None, a short reason)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1,
                       "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"}
    key = os.environ.get("VLLM_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    status, data = request(f"{base}/v1/completions", unix_socket, timeout, body, headers)
    if status != 200:
        return status, data[:300].decode("utf-8", "replace").strip()
    try:
        if not json.loads(data).get("choices"):
            return None, "no choices in the answer"
    except (ValueError, AttributeError) as exc:
        return None, str(exc)
    return status, "ok"


def serve_checks(base: str, unix_socket: str | None, model: str, warmups: int,
                 timeout: float) -> int:
    start = time.monotonic()
    status, reason = complete(base, unix_socket, model, "Hello", timeout)
    if status != 200:
        print(f"wait-ready: the first one-token completion failed ({status}: {reason})",
              file=sys.stderr, flush=True)
        return 1
    first = time.monotonic() - start
    failed = 0
    for _ in range(warmups):
        status, _ = complete(base, unix_socket, model, "Warm up. " * 256, timeout)
        failed += status != 200
    print(f"wait-ready: first completion in {first:.1f} s; {warmups} warm-up(s) in "
          f"{time.monotonic() - start - first:.1f} s" + (f", {failed} failed" if failed else ""),
          flush=True)
    return 0


def main_pid_gone(pid: int | None) -> bool:
    """Whether the unit's main process has exited (False when not known)."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, as another user
    return False


def ask_engine(url: str, unix_socket: str | None, timeout: float, told: set[str]) -> int | None:
    """The status of one GET of ``url`` from the engine; None when nothing answered or
    the listener is not the engine's (said once on stderr: ``told``)."""
    foreign = foreign_listener(url, unix_socket, os.getuid())
    if foreign is not None:
        if foreign not in told:
            told.add(foreign)
            print(f"wait-ready: {foreign}: not asked", file=sys.stderr, flush=True)
        return None
    if unix_socket and os.path.exists(unix_socket):
        try:
            os.chmod(unix_socket, 0o666)
        except OSError:
            pass  # not there any more: the next poll sees it
    return request(url, unix_socket, timeout)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wait_ready.py", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--unix-socket", help="reach the engine through this socket")
    # 1 s: an engine that answers is seen within a second (at 5 s each start waited 2.5 s
    # more on average); one local GET a second is nothing to the engine.
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--model", help="served model name: also require a completion")
    parser.add_argument("--warmups", type=int, default=3)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    main_pid = int(os.environ["MAINPID"]) if os.environ.get("MAINPID", "").isdigit() else None
    start = time.monotonic()
    last = None
    told: set[str] = set()
    while True:
        last = ask_engine(args.url, args.unix_socket, max(args.interval, 1.0), told)
        waited = time.monotonic() - start
        if last == 200:
            print(f"wait-ready: {args.url} answered 200 after {waited:.0f} s", flush=True)
            if args.model is None:
                return 0
            base = args.url.rsplit("/", 1)[0]
            return serve_checks(base, args.unix_socket, args.model, args.warmups,
                                args.request_timeout)
        if main_pid_gone(main_pid):
            print(f"wait-ready: the engine (PID {main_pid}) exited after {waited:.0f} s, "
                  f"before {args.url} answered 200: its journal says why",
                  file=sys.stderr, flush=True)
            return 1
        if args.timeout is not None and waited >= args.timeout:
            seen = "no answer" if last is None else f"HTTP {last}"
            print(f"wait-ready: {args.url} not ready after {waited:.0f} s ({seen})",
                  file=sys.stderr, flush=True)
            return 1
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
