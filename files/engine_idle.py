#!/usr/bin/env python3
"""Wait until a drained vLLM engine has no request left, or the grace period ends.

    python engine_idle.py --url http://127.0.0.1:8000/metrics --grace 120 --user vllm
        [--interval 1] [--unix-socket PATH]

Reads the engine's Prometheus metrics every ``--interval`` seconds and adds up every
sample of ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` (one per
model and engine). Exits 0 with one line on stdout, ``engine-idle: ...``, when the sum
is 0, when ``--grace`` seconds have passed (the restart then cuts off what still runs:
the line says how many), or at once when the metrics cannot be read (no engine answers:
nothing to wait for). Only the engine is asked: a listener another user than ``--user``
(the engine's) holds is not, and counts as unreadable (``engine_client.foreign_listener``).
Never fails: the rolling restart goes on either way. Standard library only.
"""

from __future__ import annotations

import argparse
import pwd
import re
import sys
import time

from engine_client import foreign_listener, request

METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
# A sample line: name, optional {labels}, value (Prometheus text format 0.0.4).
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


def in_flight(text: str) -> int | None:
    """Requests running or waiting, from the metrics text; None when it has neither
    metric (not a vLLM engine's)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match["name"] not in METRICS:
            continue
        try:
            total += float(match["value"])
        except ValueError:
            continue
        seen = True
    return round(total) if seen else None


def read(url: str, unix_socket: str | None, timeout: float,
         uid: int) -> tuple[int | None, str]:
    """(requests in flight or None, why None), from the engine (``uid``'s listener) only."""
    foreign = foreign_listener(url, unix_socket, uid)
    if foreign is not None:
        return None, f"{foreign}: not asked"
    status, body = request(url, unix_socket, timeout)
    text = body.decode("utf-8", "replace")
    if status is None:
        return None, text
    if status != 200:
        return None, f"HTTP {status}"
    count = in_flight(text)
    return count, "" if count is not None else "no vllm:num_requests_* metric"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--grace", type=float, required=True)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--unix-socket", help="reach the engine through this socket")
    parser.add_argument("--user", required=True,
                        help="the engine's user: a listener of anyone else is not asked")
    args = parser.parse_args(argv)
    try:
        uid = pwd.getpwnam(args.user).pw_uid
    except KeyError:
        print(f"engine-idle: no user {args.user!r} on this host: not asking, not waiting",
              flush=True)
        return 0

    start = time.monotonic()
    while True:
        count, why = read(args.url, args.unix_socket, max(args.interval, 2.0), uid)
        waited = time.monotonic() - start
        if count is None:
            print(f"engine-idle: {args.url} unreadable ({why}): not waiting", flush=True)
            return 0
        if count == 0:
            print(f"engine-idle: no request in flight after {waited:.0f} s", flush=True)
            return 0
        if waited >= args.grace:
            print(f"engine-idle: {count} request(s) still in flight after the {args.grace:.0f} s "
                  "grace: the restart cuts them off", flush=True)
            return 0
        time.sleep(min(args.interval, max(args.grace - waited, 0.05)))


if __name__ == "__main__":
    sys.exit(main())
