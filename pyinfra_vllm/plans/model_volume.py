"""What the model volume's fstab line should be, and what a device already holds (pure
functions; pyinfra_vllm/operations/model_volume.py formats and mounts it)."""

from __future__ import annotations

from typing import Any

from pyinfra.api import (
    OperationValueError,
)

# Options that only mean something to mount(8) or at boot, never shown by the kernel.
FSTAB_ONLY_OPTIONS = ("nofail", "defaults", "auto", "noauto", "_netdev")


def fstab_options(options: list[str]) -> str:
    """The fstab option field: the mount options plus ``nofail`` (a missing disk must not
    drop the host into emergency mode at boot)."""
    opts = [opt for opt in options if opt]
    if "nofail" not in opts:
        opts.append("nofail")
    return ",".join(opts)


def render_fstab_line(fs_uuid: str, path: str, options: list[str]) -> str:
    """``UUID=<uuid> <path> xfs <options>,nofail 0 0``."""
    if any(char.isspace() for char in path):
        raise OperationValueError(f"{path!r}: a mount point with blanks is not supported")
    return f"UUID={fs_uuid} {path} xfs {fstab_options(options)} 0 0"


def fstab_with_entry(
    entries: list[dict[str, Any]], wanted: str, path: str, sources: list[str]
) -> tuple[str, bool]:
    """The fstab with exactly one entry for ``path``: ``wanted``.

    Entries for the same mount point, or for the same device (any spelling in
    ``sources``), are replaced by ``wanted`` at the place of the first of them; other
    lines, comments included, are kept as they are. Returns ``(content, changed)``.
    """
    wanted_fields = wanted.split()
    lines: list[str] = []
    placed = False
    matched: list[list[str]] = []
    for entry in entries:
        if entry["spec"] is not None and (entry["file"] == path or entry["spec"] in sources):
            matched.append(entry["line"].split())
            if not placed:
                lines.append(wanted)
                placed = True
            continue
        lines.append(entry["line"])
    if not placed:
        lines.append(wanted)
    content = "\n".join(lines) + "\n"
    return content, matched != [wanted_fields]


def describe_signature(info: dict[str, Any]) -> str:
    if info.get("fstype"):
        found = info["fstype"]
        if info.get("uuid"):
            found += f" (UUID {info['uuid']})"
        return found
    if info.get("pttype"):
        return f"a {info['pttype']} partition table"
    return "an unknown signature"


def missing_options(wanted: list[str], mounted: list[str]) -> list[str]:
    """Wanted mount options the live mount does not show."""
    return [opt for opt in wanted if opt not in FSTAB_ONLY_OPTIONS and opt not in mounted]
