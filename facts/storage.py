"""Facts about block devices, mounts and /etc/fstab, for the model volume.

Each command exits 0 when the thing it reads is absent (a missing device, nothing
mounted, no fstab), so a fact never fails a host during prepare (pyinfra 3 fails a host whose fact
command exits non-zero while it prepares: pyinfra issue 1104).
"""

from __future__ import annotations

from typing import Any

from pyinfra.api import QuoteString, StringCommand
from typing_extensions import override

from facts.base import FactBase

FSTAB = "/etc/fstab"


def parse_blkid_export(output: list[str]) -> dict[str, Any] | None:
    """Lines of the BlockDevice command -> the device's signatures, or None if absent."""
    if not output or output[0].strip() != "BLOCK_DEVICE":
        return None
    values: dict[str, str] = {}
    mountpoints: list[str] = []
    for line in output[1:]:
        key, sep, value = line.strip().partition("=")
        if key == "MOUNTED_AT" and sep:
            mountpoints.append(_unescape(value))
        elif sep:
            values[key] = value
    status = values.get("BLKID_EXIT")
    return {
        "path": values.get("REALPATH"),
        "fstype": values.get("TYPE"),
        "uuid": values.get("UUID"),
        "pttype": values.get("PTTYPE"),
        "usage": values.get("USAGE"),
        # blkid -p exits 2 when it finds nothing; anything else but 0 means it could
        # not tell (8: ambivalent, several signatures; 4: cannot open).
        "probe_error": None if status in (None, "0", "2") else f"blkid -p exited {status}",
        # Where the device is mounted now (any number of places; [] when nowhere).
        "mountpoints": mountpoints,
    }


class BlockDevice(FactBase[dict[str, Any] | None]):
    """
    Returns what a low-level probe (``blkid -p``, the superblocks themselves, no cache)
    finds on a block device, or None when the path is not a block device:

    .. code:: python

        {"path": "/dev/loop3", "fstype": "ext4", "uuid": "0b6d...", "pttype": None,
         "usage": "filesystem", "probe_error": None, "mountpoints": ["/data"]}

    All None (but ``path``): the device carries no file system and no partition table.
    """

    @override
    def command(self, device: str) -> StringCommand:
        dev = QuoteString(device)
        return StringCommand(
            "! test -b", dev, "|| {",
            "echo BLOCK_DEVICE;",
            "echo REALPATH=$(readlink -f", dev, ");",
            # findmnt exits 1 when the device is mounted nowhere: the last echo's 0 stands.
            "findmnt -rn -o TARGET --source", dev, "| sed 's/^/MOUNTED_AT=/';",
            "blkid -p -o export", dev, "; echo BLKID_EXIT=$?; }",
        )

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        return parse_blkid_export(output)


def _unescape(value: str) -> str:
    # findmnt -r and fstab escape blanks and backslashes as \x20 / \040 style sequences.
    return (
        value.replace("\\x20", " ").replace("\\040", " ").replace("\\x09", "\t")
        .replace("\\011", "\t").replace("\\x5c", "\\").replace("\\134", "\\")
    )


class MountPoint(FactBase[dict[str, Any] | None]):
    """
    Returns what is mounted at a path (the top mount when several are stacked), or None:

    .. code:: python

        {"source": "/dev/loop3", "fstype": "xfs",
         "options": ["rw", "noatime", "attr2", "inode64", "logbufs=8", "noquota"]}
    """

    @override
    def command(self, path: str) -> StringCommand:
        # findmnt exits 1 when nothing is mounted there: not an error for this fact.
        return StringCommand(
            "findmnt -rn -o SOURCE,FSTYPE,OPTIONS --mountpoint",
            QuoteString(path),
            "|| test $? -eq 1",
        )

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        lines = [line.split() for line in output if line.strip()]
        if not lines or len(lines[-1]) < 3:
            return None
        source, fstype, options = lines[-1][:3]
        return {
            "source": _unescape(source),
            "fstype": fstype,
            "options": options.split(","),
        }


def parse_fstab(lines: list[str]) -> list[dict[str, Any]]:
    """fstab lines -> ``[{"line", "spec", "file", "vfstype", "mntops"}]``; comments and
    blank lines are kept with ``spec`` None so a rewrite preserves them."""
    entries = []
    for line in lines:
        text = line.rstrip("\n")
        fields = text.split()
        if not fields or fields[0].startswith("#") or len(fields) < 2:
            entries.append({"line": text, "spec": None, "file": None, "vfstype": None,
                            "mntops": None})
            continue
        entries.append(
            {
                "line": text,
                "spec": _unescape(fields[0]),
                "file": _unescape(fields[1]),
                "vfstype": fields[2] if len(fields) > 2 else None,
                "mntops": fields[3] if len(fields) > 3 else None,
            }
        )
    return entries


class Fstab(FactBase[list[dict[str, Any]]]):
    """
    Returns the lines of ``/etc/fstab`` parsed (``[]`` when there is no fstab):

    .. code:: python

        [{"line": "UUID=... /srv/models xfs noatime,nofail 0 0", "spec": "UUID=...",
          "file": "/srv/models", "vfstype": "xfs", "mntops": "noatime,nofail"}]
    """

    @override
    def command(self, path: str = FSTAB) -> StringCommand:
        return StringCommand("! test -e", QuoteString(path), "|| cat", QuoteString(path))

    @override
    @staticmethod
    def default() -> list[dict[str, Any]]:
        return []

    @override
    def process(self, output: list[str]) -> list[dict[str, Any]]:
        return parse_fstab(output)


class FilesystemSize(FactBase[int | None]):
    """
    Returns the size in bytes of the file system mounted at ``path`` (``df``), or None
    when nothing is there.
    """

    @override
    def command(self, path: str) -> StringCommand:
        return StringCommand("df -B1 --output=size", QuoteString(path), "2>/dev/null || true")

    @override
    def process(self, output: list[str]) -> int | None:
        numbers = [line.strip() for line in output if line.strip().isdigit()]
        return int(numbers[-1]) if numbers else None


class FilesystemFree(FactBase[dict[str, Any] | None]):
    """
    Returns the space free for use (``df`` Avail: what an unprivileged user may still
    write, the root-reserved blocks left out) on the file system that holds ``path``, read
    at ``path`` or, where it does not exist yet, at its nearest existing parent (the
    file system a directory made there lands on), or None when ``df`` gave no number:

    .. code:: python

        {"path": "/opt", "free": 53687091200}
    """

    @override
    def command(self, path: str) -> StringCommand:
        # dirname ends at "/", which exists; a link is followed, as a write through it is.
        return StringCommand(
            "p=" + "$(printf %s", QuoteString(path), ");",
            'while [ ! -e "$p" ] && [ "$p" != / ]; do p=$(dirname "$p"); done;',
            'printf "AT=%s\\n" "$p"; df -B1 --output=avail "$p" 2>/dev/null || true',
        )

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        found = [line[len("AT="):] for line in output if line.startswith("AT=")]
        numbers = [line.strip() for line in output if line.strip().isdigit()]
        if not found or not numbers:
            return None
        return {"path": found[-1], "free": int(numbers[-1])}
