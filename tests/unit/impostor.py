"""A listener of another local user (``nobody``) on a free port: the impostor every client
of the engine must leave unasked. Needs root (setpriv).

``SERVER`` runs alone too: ``python3 -c SERVER SEEN ADDRESS [PORT [BACKLOG]]`` (a backlog
of 0 makes the kernel answer its handshakes with SYN cookies)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

SERVER = (
    "import http.server, socket, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        open(sys.argv[1], 'a').write(str(self.headers.get('Authorization')))\n"
    "        self.send_response(200); self.end_headers()\n"
    "    do_POST = do_GET\n"
    "class S(http.server.HTTPServer):\n"
    "    address_family = socket.AF_INET6 if ':' in sys.argv[2] else socket.AF_INET\n"
    "    request_queue_size = int(sys.argv[4]) if len(sys.argv) > 4 else 5\n"
    "s = S((sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0), H)\n"
    "print(s.server_address[1], flush=True); s.serve_forever()\n"
)


@contextlib.contextmanager
def impostor(seen: Path, address: str = "127.0.0.1") -> Iterator[int]:
    """``nobody``'s HTTP server on ``address``, logging every Authorization it receives
    to ``seen`` (made writable for it); yields its port."""
    seen.touch()
    os.chmod(seen, 0o666)
    # Opened here and handed over: nobody reopens it as /dev/fd/N, never by a path through
    # the test's directories, which are root's and 0700 (it could not write there, and
    # would log nothing whatever it received).
    fd = os.open(seen, os.O_WRONLY | os.O_APPEND)
    try:
        proc = subprocess.Popen(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
             "-c", SERVER, f"/dev/fd/{fd}", address], stdout=subprocess.PIPE, text=True,
            pass_fds=(fd,))
    finally:
        os.close(fd)
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
