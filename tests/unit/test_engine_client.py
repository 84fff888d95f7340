"""files/engine_client.py: who holds the engine's listener, and what a client does when
that cannot be read (the kernel's TCP tables closed to it: a hardened /proc, a
container without them). The tables are refused through ``open`` of the module alone;
every other file opens as usual."""

from __future__ import annotations

import builtins
import errno

import pytest

from files import engine_client

URL = "http://127.0.0.1:8000/health"
REAL_OPEN = builtins.open


def closed(*tables: str):
    """``open`` that refuses the named /proc/net tables, as a kernel that hides them does."""

    def refusing(path, *args, **kwargs):
        if str(path) in tables:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return REAL_OPEN(path, *args, **kwargs)

    return refusing


def test_who_listens_is_unknown_when_neither_table_can_be_read(monkeypatch):
    monkeypatch.setattr(builtins, "open", closed("/proc/net/tcp", "/proc/net/tcp6"))
    assert engine_client.listener_uids(URL, None) is None
    # Unknown is never taken for "nobody else": the client sends nothing.
    assert engine_client.foreign_listener(URL, None, uid=0) == (
        f"who holds {URL} is unknown (/proc/net/tcp and /proc/net/tcp6 cannot be read)")


@pytest.mark.parametrize("missing", ["/proc/net/tcp6", "/proc/net/tcp"])
def test_one_table_is_enough_to_know(monkeypatch, missing):
    # tcp6 is absent where IPv6 is off: the other table still says who listens.
    monkeypatch.setattr(builtins, "open", closed(missing))
    assert engine_client.listener_uids(URL, None) is not None


def test_a_socket_file_s_owner_holds_it_and_a_missing_one_is_nobody(tmp_path):
    held = tmp_path / "engine.sock"
    held.write_bytes(b"")
    assert engine_client.listener_uids(URL, str(held)) == {held.stat().st_uid}
    assert engine_client.listener_uids(URL, str(tmp_path / "gone.sock")) == set()
    assert engine_client.foreign_listener(URL, str(held), uid=held.stat().st_uid) is None
    assert engine_client.foreign_listener(URL, str(held), uid=held.stat().st_uid + 1) == (
        f"{held} is held by uid {held.stat().st_uid}, not the engine's "
        f"({held.stat().st_uid + 1})")
