"""sandbox/relay.py on loopback: the delay it adds, its rate limit, and that delay alone
does not serialise throughput."""

from __future__ import annotations

import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sandbox.relay import CHUNK, Relay

ROOT = Path(__file__).resolve().parents[2]


def serve(handler) -> socket.socket:
    """A loopback server running ``handler(conn)`` per connection, in threads."""
    server = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=handler, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server


def echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)


def sink(conn: socket.socket) -> None:
    """Read to the end of the stream, then answer how many bytes came."""
    with conn:
        total = 0
        while data := conn.recv(1 << 20):
            total += len(data)
        conn.sendall(str(total).encode())


@pytest.fixture
def echo_server():
    server = serve(echo)
    yield server.getsockname()
    server.close()


@pytest.fixture
def sink_server():
    server = serve(sink)
    yield server.getsockname()
    server.close()


def send_through(port: int, size: int) -> float:
    """Seconds from the first byte sent to the sink's count of all ``size`` bytes."""
    block = b"\0" * (1 << 20)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        started = time.monotonic()
        sent = 0
        while sent < size:
            conn.sendall(block[:size - sent])
            sent += min(len(block), size - sent)
        conn.shutdown(socket.SHUT_WR)
        answer = conn.recv(64)
        elapsed = time.monotonic() - started
    assert int(answer) == size
    return elapsed


def test_round_trip_takes_the_configured_rtt(echo_server):
    with Relay(("127.0.0.1", 0), echo_server, rtt_ms=40) as relay, \
            socket.create_connection(("127.0.0.1", relay.port)) as conn:
        trips = []
        for _ in range(5):
            started = time.monotonic()
            conn.sendall(b"ping")
            assert conn.recv(16) == b"ping"
            trips.append((time.monotonic() - started) * 1000)
    assert min(trips) >= 40.0, trips
    assert statistics.median(trips) < 40.0 + 25.0, trips


def test_without_delay_the_round_trip_is_short(echo_server):
    with Relay(("127.0.0.1", 0), echo_server) as relay, \
            socket.create_connection(("127.0.0.1", relay.port)) as conn:
        started = time.monotonic()
        conn.sendall(b"ping")
        assert conn.recv(16) == b"ping"
        assert time.monotonic() - started < 0.02


def test_rate_limit_holds_bulk_throughput_to_the_link(sink_server):
    size = 4 * 2**20
    with Relay(("127.0.0.1", 0), sink_server, rtt_ms=10, rate_mbit=40) as relay:
        elapsed = send_through(relay.port, size)
    mbit = size * 8 / elapsed / 1e6
    assert 36.0 <= mbit <= 44.0, f"{mbit:.1f} Mbit/s through a 40 Mbit/s relay"


def test_delay_alone_does_not_cap_throughput_at_a_chunk_per_round_trip(sink_server):
    size, rtt = 32 * 2**20, 0.1
    with Relay(("127.0.0.1", 0), sink_server, rtt_ms=rtt * 1000) as relay:
        elapsed = send_through(relay.port, size)
    one_chunk_per_rtt = CHUNK / rtt  # bytes/s if each chunk waited out the delay in turn
    assert size / elapsed > 20 * one_chunk_per_rtt, f"{size / elapsed / 2**20:.1f} MiB/s"
    assert elapsed >= rtt  # and the delay is still there: at least one round trip


def test_cli_prints_where_it_listens_and_relays(echo_server):
    host, port = echo_server
    proc = subprocess.Popen([sys.executable, "-m", "sandbox.relay", "--listen", "127.0.0.1:0",
                             "--to", f"{host}:{port}", "--rtt-ms", "20", "--rate-mbit", "100"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        match = re.fullmatch(rf"relay 127\.0\.0\.1:(\d+) -> 127\.0\.0\.1:{port} rtt 20 ms, "
                             r"rate 100 Mbit/s", line)
        assert match, line
        with socket.create_connection(("127.0.0.1", int(match[1]))) as conn:
            conn.sendall(b"hello")
            assert conn.recv(16) == b"hello"
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_cli_refuses_a_bad_address():
    result = subprocess.run([sys.executable, "-m", "sandbox.relay", "--listen", "2222",
                             "--to", "127.0.0.1:22"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert "'2222' is not HOST:PORT" in result.stderr
