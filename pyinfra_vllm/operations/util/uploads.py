"""Uploads no other local user can read, not even for a moment, under sudo as well.

pyinfra's SSH connector uploads a file for a ``_sudo`` operation in two steps: SFTP to
``/tmp/pyinfra-<sha1>`` as the login user, with the mode sshd's umask gives (normally
0644: any local user can read it meanwhile, and it stays there if the copy fails), then
``cp`` under sudo to the destination (pyinfra 3.10, ``connectors/ssh.py`` ``put_file``).
``cp`` onto a new file gives it the temporary file's mode, readable by all until a later
``chmod``. And the sha1 is of the destination: any local user can compute the name
and create it first, so that root copies their file (a script root then runs), or,
with ``fs.protected_regular=1``, the upload fails on every run. Every file the suite
uploads, secret or not, therefore goes through ``private_upload``
(tests/unit/test_uploads.py).

``private_upload`` closes these gaps: the SFTP step lands in a directory only the login
user can enter (under ``/run``, which only root can write, so nobody can plant it), and
the destination exists with its final mode before a byte is copied into it. Logged in
as root, pyinfra writes the destination directly, which exists with its mode already.
"""

from __future__ import annotations

import hashlib
import posixpath
import shlex
from collections.abc import Iterator
from io import BytesIO

from pyinfra.api import FileUploadCommand, QuoteString, StringCommand

# UPLOAD_ROOT: root-owned, traversable, not listable; each upload gets a 0700 directory
# of the login user inside it. SECRET_DIR: the secrets' spool, below. Both are in the
# access table, whose owner and mode the stages keep (pyinfra_vllm/plans/access.py).
from pyinfra_vllm.plans.access import SECRET_DIR, UPLOAD_ROOT


def spool_dir(dest: str) -> str:
    """The login user's private directory for the upload to ``dest``."""
    return f"{UPLOAD_ROOT}/{hashlib.sha1(dest.encode()).hexdigest()[:16]}"


def private_upload(data: bytes | str, dest: str, mode: str = "600", owner: str = "root:root",
                   parent_mode: str | None = None, private_from: str | None = None,
                   ) -> Iterator[StringCommand | FileUploadCommand]:
    """
    The commands that put ``data`` at ``dest`` without it ever being readable by another
    local user. ``dest``'s parent directories are created (0755) when missing.

    + data: the file's content, from memory (it never touches the operator's disk); or a
      ``str``, the local file that pyinfra reads as it uploads (a script or lock of the
      repository, never a secret)
    + dest: the file on the host; replaced whole
    + mode: its octal mode, set before any content arrives
    + owner: its ``user:group``
    + parent_mode: the mode of ``dest``'s directory, made root's with it; None: created
      0755 only when missing
    + private_from: with ``parent_mode``, a directory above ``dest``'s: it and every
      directory between get ``parent_mode`` too (``install -d`` alone would make them
      0755)
    """
    spool = spool_dir(dest)
    parent = posixpath.dirname(dest)
    chain = [parent]
    while private_from and chain[0] != private_from and chain[0].startswith(f"{private_from}/"):
        chain.insert(0, posixpath.dirname(chain[0]))
    yield StringCommand(
        "install -d -m 711 -o root -g root", UPLOAD_ROOT,
        # SUDO_USER is the login user under sudo; logged in as root, root itself.
        '&& install -d -m 700 -o "${SUDO_USER:-$(id -un)}"', QuoteString(spool),
        *(["&& mkdir -p", QuoteString(parent)] if parent_mode is None else
          ["&& install -d -m", QuoteString(parent_mode), "-o root -g root",
           *(QuoteString(path) for path in chain)]),
        "&& install -m", QuoteString(mode), "/dev/null", QuoteString(dest),
        "&& chown", QuoteString(owner), QuoteString(dest),
    )
    source = data if isinstance(data, str) else BytesIO(data)
    yield FileUploadCommand(source, dest, remote_temp_filename=f"{spool}/upload")
    yield StringCommand("rm -rf", QuoteString(spool))


def secret_file(data: bytes, name: str) -> Iterator[StringCommand | FileUploadCommand]:
    """
    The commands that put ``data`` in ``SECRET_DIR/name`` (root, 0600) for a command that
    follows; that command removes it when it is done.

    + data: the secret, from memory
    + name: the file's name in ``SECRET_DIR``, or its path below it (``jobs/<unit>/env``):
      ``SECRET_DIR`` and every directory down to the file's root's and 0700
    """
    yield from private_upload(data, f"{SECRET_DIR}/{name}", parent_mode="700",
                              private_from=SECRET_DIR)


def env_file_text(pairs: dict[str, str]) -> bytes:
    """``KEY='value'`` lines a POSIX shell reads with ``set -a; . FILE``."""
    return "".join(f"{key}={shlex.quote(value)}\n" for key, value in pairs.items()).encode()


def sourced(path: str) -> list[str | QuoteString]:
    """The start of a command that runs with the variables of the env file ``path``
    exported, so none of them is on a command line (``ps``, ``pyinfra -vv``)."""
    return ["set -a && .", QuoteString(path), "&& set +a &&"]
