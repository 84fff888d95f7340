"""The weights volume: XFS on a block device, in /etc/fstab by UUID, mounted with noatime.

A device is formatted only when a low-level probe finds nothing on it (no file system,
no partition table, no other signature) and the operator allowed it; a device that
carries anything else stops the host and is left untouched. The fstab is rewritten as a
whole into a temporary file next to /etc/fstab, checked with ``findmnt --verify``, and
only then moved over the old one, so a failed check never leaves a broken fstab.
"""

from __future__ import annotations

import uuid as uuid_module
from collections.abc import Generator, Iterator
from typing import Any

from pyinfra import host
from pyinfra.api import (
    FileUploadCommand,
    QuoteString,
    StringCommand,
    operation,
)
from pyinfra.operations import files

from facts.storage import FSTAB, BlockDevice, Fstab, MountPoint
from pyinfra_vllm.operations import gate
from pyinfra_vllm.operations.util.uploads import private_upload
from pyinfra_vllm.plans.model_volume import (
    describe_signature,
    fstab_with_entry,
    missing_options,
    render_fstab_line,
)


def _device_refusal(device: str, info: dict[str, Any], mkfs: bool, path: str) -> str | None:
    """Why the block device ``device`` (the BlockDevice fact ``info``) is neither to
    format nor to mount at ``path``, or None: its probe failed, it is empty and ``mkfs``
    is false, it carries anything but XFS with a UUID, or it is mounted somewhere else."""
    if info.get("probe_error") is not None:
        return (
            f"dev {device}: {info['probe_error']} (several or unreadable signatures); "
            "refusing to format or mount it; inspect it with `wipefs -n` and clean it "
            "up yourself"
        )
    if info.get("fstype") is None and info.get("pttype") is None:
        if not mkfs:
            return (
                f"dev {device} carries no file system; set model_volume_mkfs=true to let "
                "the deploy format it with XFS"
            )
    elif info.get("fstype") != "xfs":
        return (
            f"dev {device} carries {describe_signature(info)}; refusing to format; point "
            "model_volume_device at an empty device or remove the file system yourself"
        )
    elif not info.get("uuid"):
        return f"dev {device} carries XFS without a UUID; cannot write it into fstab"

    elsewhere = [where for where in info.get("mountpoints") or [] if where != path]
    if elsewhere:
        return (
            f"dev {device} is mounted at {', '.join(elsewhere)}, not at {path}; refusing "
            "to mount it twice or to move it; point model_volume_device at a spare disk, "
            f"or set model_dir to {elsewhere[0]}"
        )
    return None


def _device_spellings(device: str, info: dict[str, Any]) -> list[str]:
    """Every spelling of ``device`` an old fstab entry may use."""
    sources = [device]
    if info.get("path"):
        sources.append(info["path"])
    if info.get("uuid"):
        sources += [f"UUID={info['uuid']}", f"/dev/disk/by-uuid/{info['uuid']}"]
    return sources


def _fstab_refusal(
    device: str, path: str, fstab: list[dict[str, Any]], sources: list[str]
) -> str | None:
    """Why the fstab's line for ``device`` (any of its ``sources``) is not to be replaced,
    or None: it mounts the device somewhere other than ``path``."""
    mapped = [entry["file"] for entry in fstab
              if entry["spec"] in sources and entry["file"] not in (path, None)]
    if mapped:
        return (
            f"{FSTAB} mounts dev {device} at {', '.join(mapped)}, not at {path}; refusing "
            f"to replace that line; remove it yourself, or set model_dir to {mapped[0]}"
        )
    return None


def _mount_point_refusal(
    device: str, info: dict[str, Any], path: str, mount: dict[str, Any] | None
) -> str | None:
    """Why nothing is to be mounted at ``path`` (the MountPoint fact ``mount``), or None:
    it is a mount of another device."""
    if mount is not None and mount["source"] not in (device, info.get("path")):
        return (
            f"{path} is a mount of {mount['source']} ({mount['fstype']}), not of {device}; "
            "unmount it or choose another model_dir"
        )
    return None


def _facts_or_refusal(
    device: str, path: str, mkfs: bool
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None] | str:
    """The BlockDevice, Fstab and MountPoint facts ``mounted`` acts on, or why it refuses:
    each fact is read only once the ones before it passed their check."""
    info = host.get_fact(BlockDevice, device=device)
    if info is None:
        return (
            f"model_volume_device {device} is not a block device on this host; point "
            "model_volume_device at the disk for the weights, or set it to None"
        )
    refusal = _device_refusal(device, info, mkfs, path)
    if refusal is not None:
        return refusal
    fstab = host.get_fact(Fstab)
    refusal = _fstab_refusal(device, path, fstab, _device_spellings(device, info))
    if refusal is not None:
        return refusal
    mount = host.get_fact(MountPoint, path=path)
    refusal = _mount_point_refusal(device, info, path, mount)
    if refusal is not None:
        return refusal
    return info, fstab, mount


def _mkfs_command(device: str, fs_uuid: str) -> StringCommand:
    # No -f: mkfs.xfs itself refuses a device where it finds a signature.
    return StringCommand(
        "mkfs.xfs", "-q", "-m", QuoteString(f"uuid={fs_uuid}"), QuoteString(device)
    )


def _fstab_replaced(content: str) -> Iterator[StringCommand | FileUploadCommand]:
    """``content`` uploaded beside the fstab (0644 before a byte arrives), checked with
    ``findmnt --verify``, and only then moved over the old fstab, which is kept as a
    backup."""
    new = f"{FSTAB}.pyinfra-vllm.new"
    yield from private_upload(content.encode(), new, mode="644")
    yield StringCommand(
        "findmnt", "--verify", "--tab-file", QuoteString(new),
        "|| {", "rm", "-f", QuoteString(new), ";",
        "echo", QuoteString(
            f"the new fstab failed findmnt --verify (the lines above name the entry; "
            f"an existing one may be the cause); {FSTAB} is unchanged"
        ),
        ">&2 ; exit 1 ; }",
    )
    yield StringCommand(
        "! test -e", QuoteString(FSTAB), "||",
        "cp", "-p", QuoteString(FSTAB), QuoteString(f"{FSTAB}.pyinfra-vllm.bak"),
    )
    yield StringCommand("mv", "-f", QuoteString(new), QuoteString(FSTAB))


def _fstab_kept(
    fstab: list[dict[str, Any]], fs_uuid: str, path: str, options: list[str],
    sources: list[str],
) -> Generator[StringCommand | FileUploadCommand, None, bool]:
    """The fstab's line for the file system ``fs_uuid`` at ``path`` written, replacing any
    line for one of the device's ``sources``; returns whether the fstab changed."""
    wanted_line = render_fstab_line(fs_uuid, path, options)
    content, changed = fstab_with_entry(fstab, wanted_line, path, sources)
    if changed:
        yield from _fstab_replaced(content)
    return changed


def _mount_command(
    device: str, path: str, options: list[str], mount: dict[str, Any] | None
) -> StringCommand | None:
    """mount when nothing is mounted at ``path``, remount when the live mount lacks a
    wanted option, None when it is mounted as wanted."""
    if mount is None:
        option_args = ["-o", QuoteString(",".join(options))] if options else []
        return StringCommand(
            "mount", "-t", "xfs", *option_args, QuoteString(device), QuoteString(path)
        )
    if missing_options(options, mount["options"]):
        return StringCommand(
            "mount", "-o", QuoteString("remount," + ",".join(options)), QuoteString(path)
        )
    return None


@operation()
def mounted(
    device: str,
    path: str,
    options: list[str] | None = None,
    mkfs: bool = False,
    fs_uuid: str | None = None,
):
    """
    Ensure an XFS file system on ``device`` is in /etc/fstab by UUID and mounted at ``path``.

    + device: the block device, e.g. ``/dev/nvme1n1``
    + path: the mount point (created when missing)
    + options: mount options (default ``["noatime"]``); fstab gets them plus ``nofail``
    + mkfs: may ``mkfs.xfs`` run on a device that carries nothing at all?
    + fs_uuid: UUID given to a new file system (default: a random one)

    Refused (the host stops, nothing is changed): ``device`` is not a block device, the
    probe cannot tell what it carries, it carries anything but XFS (a file system, a
    partition table), it is empty and ``mkfs`` is false, it is mounted somewhere else or
    /etc/fstab mounts it somewhere else, or ``path`` is a mount of another device. Mounted as wanted and in fstab: no change. In fstab but not mounted: mount.
    Mounted with other options: remount.

    **Example:**

    .. code:: python

        model_volume.mounted(
            name="Weights volume",
            device="/dev/nvme1n1",
            path="/srv/models",
            options=["noatime"],
            mkfs=True,
        )
    """
    options = list(options) if options is not None else ["noatime"]
    facts = _facts_or_refusal(device, path, mkfs)
    if isinstance(facts, str):
        yield from gate.refuse._inner(reasons=[facts])
        return
    info, fstab, mount = facts

    # Past the checks, the device carries XFS or, mkfs allowed, nothing at all.
    new_uuid = None if info.get("fstype") == "xfs" else fs_uuid or str(uuid_module.uuid4())
    fs_uuid_now = new_uuid or info["uuid"]
    sources = _device_spellings(device, info)
    yield from files.directory._inner(path=path)
    if new_uuid is not None:
        yield _mkfs_command(device, new_uuid)
        sources.append(f"UUID={new_uuid}")
    changed = yield from _fstab_kept(fstab, fs_uuid_now, path, options, sources)

    mount_command = _mount_command(device, path, options, mount)
    if mount_command is not None:
        yield mount_command
    elif not changed:
        host.noop(f"{device} (XFS, UUID {fs_uuid_now}) is mounted at {path} and in {FSTAB}")
