"""A TCP relay that adds latency and, optionally, a rate limit: a slow link on loopback.

    python3 -m sandbox.relay --listen 127.0.0.1:2222 --to 10.213.1.2:22 --rtt-ms 20 \
        [--rate-mbit 100]

Every connection accepted on ``--listen`` is forwarded to ``--to``. Each direction
delays what it carries by half the round trip: a chunk read at time t is written at
t + rtt/2, from a queue of timestamped chunks, so the delay is added once per chunk and
many chunks are in flight at once (throughput is not one chunk per round trip, as it
would be if each read waited out the delay before the next). With ``--rate-mbit`` each
direction is also a link of that rate shared by all connections: a token bucket admits
the bytes before they are queued, so a sender faster than the link is held back by TCP
itself, as behind a real bottleneck. The kernel's netem qdisc does this more exactly,
but it is not available everywhere (``tc qdisc ... netem`` answers "Specified qdisc kind
is unknown" on kernels built without it); this needs only Python's standard library.

The first line on stdout is ``relay HOST:PORT -> HOST:PORT rtt N ms[, rate N Mbit/s]``
(with ``--listen HOST:0`` it names the port the kernel chose). SIGTERM or SIGINT stops
it. Tests use ``Relay`` directly: ``with Relay(("127.0.0.1", 0), target, rtt_ms=20) as
relay: relay.port``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
import time
from typing import Self

CHUNK = 64 * 1024  # one read from a socket
QUEUED_MAX = 64 * 2**20  # bytes in flight per direction and connection before reads pause
BURST_SECONDS = 0.002  # a token bucket holds this much of its rate (at least one chunk)


class TokenBucket:
    """``rate`` bytes per second on average, shared by every connection of a direction."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.burst = max(CHUNK, rate * BURST_SECONDS)
        self.tokens = self.burst
        self.stamp = time.monotonic()
        self.lock = asyncio.Lock()

    async def take(self, size: int) -> None:
        # Held while in debt, so concurrent senders queue up in turn, like one wire.
        async with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= size
            if self.tokens < 0:
                await asyncio.sleep(-self.tokens / self.rate)


class Direction:
    """One way of one connection: read, admit (rate), stamp, and write once due."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 delay: float, bucket: TokenBucket | None) -> None:
        self.reader, self.writer = reader, writer
        self.delay, self.bucket = delay, bucket
        self.queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        self.queued = 0
        self.room = asyncio.Event()
        self.room.set()

    async def pull(self) -> None:
        while True:
            await self.room.wait()
            data = await self.reader.read(CHUNK)
            if data and self.bucket is not None:
                await self.bucket.take(len(data))
            self.queue.put_nowait((time.monotonic() + self.delay, data))
            if not data:  # end of stream: delivered, delayed like the bytes before it
                return
            self.queued += len(data)
            if self.queued >= QUEUED_MAX:
                self.room.clear()

    async def push(self) -> None:
        while True:
            due, data = await self.queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if self.writer.can_write_eof():
                    self.writer.write_eof()
                return
            self.writer.write(data)
            await self.writer.drain()
            self.queued -= len(data)
            if self.queued < QUEUED_MAX:
                self.room.set()

    async def run(self) -> None:
        try:
            await asyncio.gather(self.pull(), self.push())
        except BaseException:
            # A reset on either side ends this direction and closes the other's socket;
            # a plain end of stream only half-closes it (write_eof), as TCP would.
            self.writer.close()
            raise


class LoopServer:
    """An asyncio server on its own event loop in a thread: ``_start`` makes
    ``self.server``; ``stop()`` closes it and every connection it handles."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.server: asyncio.base_events.Server | None = None
        self.thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self.server is None:
            raise RuntimeError("start() it first")
        return int(self.server.sockets[0].getsockname()[1])

    async def _start(self) -> None:
        raise NotImplementedError

    def start(self) -> Self:
        self.loop.run_until_complete(self._start())
        self.thread = threading.Thread(target=self.loop.run_forever,
                                       name=type(self).__name__.lower(), daemon=True)
        self.thread.start()
        return self

    async def _shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        """Close the listener and every connection, then the loop."""
        if self.thread is not None:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.thread = None
        self.loop.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Relay(LoopServer):
    """Listen on ``listen``, forward to ``target``, ``rtt_ms`` of round trip added, and
    ``rate_mbit`` (None: unlimited) per direction. Runs its own event loop in a thread."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], rtt_ms: float = 0.0,
                 rate_mbit: float | None = None) -> None:
        super().__init__()
        self.listen, self.target = listen, target
        self.delay = rtt_ms / 2000.0
        self.rtt_ms, self.rate_mbit = rtt_ms, rate_mbit
        self.buckets: tuple[TokenBucket | None, TokenBucket | None] = (None, None)

    def describe(self) -> str:
        rate = f", rate {self.rate_mbit:g} Mbit/s" if self.rate_mbit else ""
        return (f"relay {self.listen[0]}:{self.port} -> {self.target[0]}:{self.target[1]} "
                f"rtt {self.rtt_ms:g} ms{rate}")

    async def _handle(self, client_reader: asyncio.StreamReader,
                      client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        up, down = self.buckets
        try:
            # A reset ends a direction with OSError; it is the link going down, not a fault
            # of the relay, so it is returned and dropped rather than raised.
            await asyncio.gather(
                Direction(client_reader, server_writer, self.delay, up).run(),
                Direction(server_reader, client_writer, self.delay, down).run(),
                return_exceptions=True)
        except asyncio.CancelledError:
            # stop(): end quietly (asyncio's stream callback on Python 3.11 reports a
            # handler task that ends cancelled as an error).
            pass
        finally:
            for writer in (client_writer, server_writer):
                writer.close()

    async def _start(self) -> None:
        if self.rate_mbit:
            rate = self.rate_mbit * 1e6 / 8
            self.buckets = (TokenBucket(rate), TokenBucket(rate))
        self.server = await asyncio.start_server(self._handle, *self.listen)


def address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as a tuple."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m sandbox.relay",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=address, required=True, help="HOST:PORT to accept on")
    parser.add_argument("--to", type=address, required=True, help="HOST:PORT to forward to")
    parser.add_argument("--rtt-ms", type=float, default=0.0,
                        help="round trip added, ms (half each way)")
    parser.add_argument("--rate-mbit", type=float, default=None,
                        help="rate limit per direction, Mbit/s (default: none)")
    args = parser.parse_args(argv)
    if args.rtt_ms < 0 or (args.rate_mbit is not None and args.rate_mbit <= 0):
        parser.error("--rtt-ms must be >= 0 and --rate-mbit > 0")
    relay = Relay(args.listen, args.to, args.rtt_ms, args.rate_mbit).start()
    print(relay.describe(), flush=True)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    relay.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
