"""An HTTP proxy that demands a password: what an operator's corporate proxy looks like to
the suite's downloads (the environment's packages, the installers, the model's files).

    with Proxy(("10.213.1.1", 0), user="sbx", password=PASSWORD) as proxy:
        http_proxy = f"http://sbx:{PASSWORD}@10.213.1.1:{proxy.port}"

It tunnels ``CONNECT host:port`` (how pip, uv, curl and urllib reach an https URL through a
proxy) for a request whose ``Proxy-Authorization: Basic`` carries the user and password,
and answers 407 to any other; a request for a plain http URL gets 501 (nothing the suite
fetches goes over plain http through it). It logs nothing and keeps no credential it was
sent: ``stats`` counts the tunnels it opened, by target, and the requests it refused.
Runs its own event loop in a thread (sandbox/relay.py's LoopServer).
"""

from __future__ import annotations

import asyncio
import base64
import hmac
from collections import Counter

from sandbox.relay import Direction, LoopServer

HEAD_MAX = 64 * 1024


class Proxy(LoopServer):
    """Listen on ``listen``; tunnel CONNECT for ``user``:``password`` only."""

    def __init__(self, listen: tuple[str, int], user: str, password: str) -> None:
        super().__init__()
        self.listen = listen
        credentials = base64.b64encode(f"{user}:{password}".encode()).decode()
        self._expected = f"Basic {credentials}".encode()
        self.tunnels: Counter[str] = Counter()
        self.refused = 0

    def _authorized(self, headers: list[str]) -> bool:
        for line in headers:
            name, _, value = line.partition(":")
            if name.strip().lower() == "proxy-authorization":
                return hmac.compare_digest(value.strip().encode(), self._expected)
        return False

    async def _tunnel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The upstream connection of an authorized CONNECT, or None once answered."""
        try:
            head = (await reader.readuntil(b"\r\n\r\n"))[:HEAD_MAX].decode("latin-1")
            request, *headers = head.split("\r\n")
            method, target, _version = request.split(" ", 2)
        except (ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            return None
        if not self._authorized(headers):
            self.refused += 1
            writer.write(b"HTTP/1.1 407 Proxy Authentication Required\r\n"
                         b'Proxy-Authenticate: Basic realm="sandbox"\r\n'
                         b"Content-Length: 0\r\nConnection: close\r\n\r\n")
            return None
        host, _, port = target.rpartition(":")
        if method != "CONNECT" or not port.isdigit():
            writer.write(b"HTTP/1.1 501 Not Implemented\r\nContent-Length: 0\r\n"
                         b"Connection: close\r\n\r\n")
            return None
        try:
            upstream = await asyncio.open_connection(host.strip("[]"), int(port))
        except OSError:
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            return None
        self.tunnels[target] += 1
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        return upstream

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream = None
        try:
            upstream = await self._tunnel(reader, writer)
            if upstream is not None:
                await asyncio.gather(Direction(reader, upstream[1], 0.0, None).run(),
                                     Direction(upstream[0], writer, 0.0, None).run(),
                                     return_exceptions=True)
            else:
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass  # a reset, or stop()
        finally:
            if upstream is not None:
                upstream[1].close()
            writer.close()

    async def _start(self) -> None:
        self.server = await asyncio.start_server(self._handle, *self.listen)
