#!/usr/bin/env python3
"""Wait until the vLLM server answers: the unit's ``ExecStartPost``.

    python wait_ready.py --url http://127.0.0.1:8000/health [--interval 5] [--timeout S]

Polls ``--url`` until it answers 200 and exits 0 with one line on stdout,
``wait-ready: <url> answered 200 after N s``. vLLM 0.6.3's OpenAI server binds its port
only after the weights are loaded and the KV cache is allocated, so this is the moment
the service can take requests. Until then systemd keeps the unit "activating", and its
``TimeoutStartSec`` (vllm_start_timeout_s) is the deadline for the whole load; if the
server dies first, systemd stops this poller with it. ``--timeout`` (default: none, the
unit's deadline applies) gives up with one line on stderr and exit 1. Standard library
only.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request


def probe(url: str, timeout: float) -> int | None:
    """The HTTP status of one GET, or None when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wait_ready.py", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=None)
    args = parser.parse_args(argv)
    # Never go through a proxy for the engine on this host.
    urllib.request.install_opener(urllib.request.build_opener(urllib.request.ProxyHandler({})))
    start = time.monotonic()
    last = None
    while True:
        last = probe(args.url, timeout=max(args.interval, 1.0))
        waited = time.monotonic() - start
        if last == 200:
            print(f"wait-ready: {args.url} answered 200 after {waited:.0f} s", flush=True)
            return 0
        if args.timeout is not None and waited >= args.timeout:
            seen = "no answer" if last is None else f"HTTP {last}"
            print(f"wait-ready: {args.url} not ready after {waited:.0f} s ({seen})",
                  file=sys.stderr, flush=True)
            return 1
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
