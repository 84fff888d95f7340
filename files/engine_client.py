"""How the suite's helpers on the host talk to the engine: HTTP over TCP or over the
engine's Unix socket, never through a proxy, and only to a listener the engine's user
owns. Imported by wait_ready.py, engine_idle.py and bench_client.py (which checks the
gateway's listener, root's, the same way) from the directory they are in. Standard
library only.
"""

from __future__ import annotations

import http.client
import os
import socket
import urllib.parse


class _UnixConnection(http.client.HTTPConnection):
    """An HTTP connection over a Unix socket (the URL's host is only the Host header)."""

    def __init__(self, path: str, host: str, timeout: float) -> None:
        super().__init__(host, timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def request(url: str, unix_socket: str | None, timeout: float, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int | None, bytes]:
    """(HTTP status, body) of one GET (POST with ``body``), or (None, the reason) when
    nothing answered."""
    parts = urllib.parse.urlsplit(url)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    try:
        if unix_socket:
            conn: http.client.HTTPConnection = _UnixConnection(
                unix_socket, parts.hostname or "localhost", timeout)
        else:
            conn = http.client.HTTPConnection(parts.hostname or "localhost",
                                              parts.port or 80, timeout=timeout)
        try:
            conn.request("POST" if body is not None else "GET", path or "/", body,
                         headers or {})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()
    except (OSError, http.client.HTTPException) as exc:
        return None, str(exc).encode()


def listener_uids(url: str, unix_socket: str | None) -> set[int] | None:
    """The uids that own the engine's listener: the socket file's owner, or every uid
    with a TCP socket listening on the URL's port (/proc/net/tcp and tcp6: state 0A, the
    port in hex, the uid in column 8). Empty when nothing listens; None when neither
    table could be read (who listens is unknown)."""
    if unix_socket:
        try:
            return {os.stat(unix_socket).st_uid}
        except OSError:
            return set()
    port = f":{urllib.parse.urlsplit(url).port or 80:04X}"
    uids: set[int] = set()
    read = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as rows:
                for row in list(rows)[1:]:
                    fields = row.split()
                    if len(fields) > 7 and fields[3] == "0A" and fields[1].endswith(port):
                        uids.add(int(fields[7]))
            read = True
        except OSError:
            continue  # tcp6 is absent where IPv6 is off
    return uids if read else None


def foreign_listener(url: str, unix_socket: str | None, uid: int,
                     owner: str = "the engine's") -> str | None:
    """Why the listener is not ``owner``'s (``uid``'s), or None when it is or nothing
    listens: a client sends its key to no one else. Unknown owners are not ``uid``."""
    where = unix_socket or url
    found = listener_uids(url, unix_socket)
    if found is None:
        return (f"who holds {where} is unknown (/proc/net/tcp and /proc/net/tcp6 cannot "
                "be read)")
    others = sorted(found - {uid})
    if not others:
        return None
    return f"{where} is held by uid {', '.join(map(str, others))}, not {owner} ({uid})"
