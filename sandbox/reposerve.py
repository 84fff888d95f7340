"""Serve a directory read-only over HTTP on given addresses (the bare hosts' gateways).

Usage: python -m sandbox.reposerve DIR PORT ADDRESS...

Runs detached under sandbox.gpu; it binds only to host-side veth addresses of sandbox
namespaces, never to a public interface. Writes RUN_DIR/services/apt-repo.ready once listening.
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from sandbox.gpu import SERVICE_DIR


def main(directory: str, port: int, addresses: list[str]) -> int:
    handler = functools.partial(SimpleHTTPRequestHandler, directory=directory)
    servers = [ThreadingHTTPServer((address, port), handler) for address in addresses]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    Path(SERVICE_DIR / "apt-repo.ready").write_text("ok\n")
    print(f"serving {directory} on port {port} at {', '.join(addresses)}", flush=True)
    while not stop.wait(1.0):  # a timeout keeps the main thread responsive to SIGTERM
        pass
    for server in servers:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3:]))
