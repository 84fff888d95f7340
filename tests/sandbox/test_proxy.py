"""sandbox/proxy.py: the password-demanding proxy the secrets test installs through, with
real sockets on loopback."""

from __future__ import annotations

import base64
import socket

from sandbox.proxy import Proxy
from tests.sandbox.test_relay import echo_server  # noqa: F401 (a fixture)


def ask(port: int, request: bytes) -> tuple[bytes, socket.socket]:
    conn = socket.create_connection(("127.0.0.1", port), timeout=5)
    conn.sendall(request)
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = conn.recv(4096)
        if not chunk:
            break
        head += chunk
    return head, conn


def connect(target: tuple[str, int], credentials: str | None) -> bytes:
    auth = (b"Proxy-Authorization: Basic " + base64.b64encode(credentials.encode()) + b"\r\n"
            if credentials else b"")
    host, port = target
    return f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n".encode() + auth + b"\r\n"


def test_a_connect_with_the_password_is_tunnelled(echo_server):  # noqa: F811
    with Proxy(("127.0.0.1", 0), user="sbx", password="pw-1") as proxy:
        head, conn = ask(proxy.port, connect(echo_server, "sbx:pw-1"))
        with conn:
            assert head == b"HTTP/1.1 200 Connection established\r\n\r\n"
            conn.sendall(b"through")
            assert conn.recv(64) == b"through"
        assert proxy.tunnels == {f"127.0.0.1:{echo_server[1]}": 1}
        assert proxy.refused == 0


def test_a_wrong_or_missing_password_gets_407_and_a_plain_url_501(echo_server):  # noqa: F811
    with Proxy(("127.0.0.1", 0), user="sbx", password="pw-1") as proxy:
        for credentials in ("sbx:wrong", None):
            head, conn = ask(proxy.port, connect(echo_server, credentials))
            conn.close()
            assert head.startswith(b"HTTP/1.1 407 Proxy Authentication Required\r\n")
        auth = base64.b64encode(b"sbx:pw-1")
        head, conn = ask(proxy.port, b"GET http://127.0.0.1/ HTTP/1.1\r\n"
                                     b"Proxy-Authorization: Basic " + auth + b"\r\n\r\n")
        conn.close()
        assert head.startswith(b"HTTP/1.1 501 Not Implemented\r\n")
        assert proxy.refused == 2 and not proxy.tunnels
