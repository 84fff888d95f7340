"""The model volume stage's helpers: the fstab line and rewrite, mount options, blkid and mount parsing."""

from __future__ import annotations

import pytest
from pyinfra.api import OperationValueError

from facts.storage import MountPoint, parse_blkid_export, parse_fstab
from facts.units import UnitPids
from pyinfra_vllm.plans.model_volume import (
    describe_signature,
    fstab_options,
    fstab_with_entry,
    missing_options,
    render_fstab_line,
)

UUID = "6e0f8d0c-4c41-4bf4-9d0a-2f6f1e9b7a11"


def test_fstab_line_by_uuid_with_nofail():
    assert render_fstab_line(UUID, "/srv/models", ["noatime"]) == (
        f"UUID={UUID} /srv/models xfs noatime,nofail 0 0")
    assert fstab_options(["noatime", "nofail"]) == "noatime,nofail"
    assert fstab_options([]) == "nofail"
    with pytest.raises(OperationValueError):
        render_fstab_line(UUID, "/srv/my models", ["noatime"])


def test_fstab_rewrite_keeps_other_lines_and_is_idempotent():
    wanted = render_fstab_line(UUID, "/srv/models", ["noatime"])
    old = parse_fstab([
        "# /etc/fstab",
        "UUID=abc / ext4 errors=remount-ro 0 1",
        "/dev/loop3 /srv/models xfs defaults 0 0",
        "",
        "/swap.img none swap sw 0 0",
    ])
    content, changed = fstab_with_entry(old, wanted, "/srv/models", ["/dev/loop3"])
    assert changed
    assert content.splitlines() == [
        "# /etc/fstab", "UUID=abc / ext4 errors=remount-ro 0 1", wanted, "",
        "/swap.img none swap sw 0 0"]
    again, changed_again = fstab_with_entry(parse_fstab(content.splitlines()), wanted,
                                            "/srv/models", ["/dev/loop3"])
    assert (again, changed_again) == (content, False)
    # The same line with other spacing is not a change; a duplicate is.
    spaced = parse_fstab([f"UUID={UUID}\t/srv/models  xfs noatime,nofail 0 0"])
    assert fstab_with_entry(spaced, wanted, "/srv/models", [])[1] is False
    dup = parse_fstab([wanted, f"/dev/disk/by-uuid/{UUID} /mnt/x xfs defaults 0 0"])
    content, changed = fstab_with_entry(dup, wanted, "/srv/models", [f"/dev/disk/by-uuid/{UUID}"])
    assert changed and content == wanted + "\n"


def test_options_and_signatures():
    assert missing_options(["noatime", "nofail"], ["rw", "noatime"]) == []
    assert missing_options(["noatime"], ["rw", "relatime"]) == ["noatime"]
    assert describe_signature({"fstype": "ext4", "uuid": "u"}) == "ext4 (UUID u)"
    assert describe_signature({"fstype": None, "pttype": "gpt"}) == "a gpt partition table"


def test_blkid_parsing():
    assert parse_blkid_export([]) is None
    empty = parse_blkid_export(["BLOCK_DEVICE", "REALPATH=/dev/loop3", "BLKID_EXIT=2"])
    assert empty == {"path": "/dev/loop3", "fstype": None, "uuid": None, "pttype": None,
                     "usage": None, "probe_error": None, "mountpoints": []}
    ext4 = parse_blkid_export(["BLOCK_DEVICE", "REALPATH=/dev/loop3", "DEVNAME=/dev/loop3",
                               "UUID=u-1", "BLOCK_SIZE=4096", "TYPE=ext4", "USAGE=filesystem",
                               "BLKID_EXIT=0"])
    assert (ext4["fstype"], ext4["uuid"], ext4["probe_error"]) == ("ext4", "u-1", None)
    gpt = parse_blkid_export(["BLOCK_DEVICE", "REALPATH=/dev/sdb", "PTUUID=x", "PTTYPE=gpt",
                              "BLKID_EXIT=0"])
    assert gpt["pttype"] == "gpt" and gpt["fstype"] is None
    odd = parse_blkid_export(["BLOCK_DEVICE", "REALPATH=/dev/sdb", "BLKID_EXIT=8"])
    assert odd["probe_error"] == "blkid -p exited 8"
    mounted = parse_blkid_export(["BLOCK_DEVICE", "REALPATH=/dev/sdb", "MOUNTED_AT=/data",
                                  "MOUNTED_AT=/srv/a\\x20b", "TYPE=xfs", "BLKID_EXIT=0"])
    assert mounted["mountpoints"] == ["/data", "/srv/a b"]


def test_mount_and_unit_facts_parse():
    assert MountPoint().process(["/dev/loop3 xfs rw,noatime,inode64"]) == {
        "source": "/dev/loop3", "fstype": "xfs", "options": ["rw", "noatime", "inode64"]}
    assert MountPoint().process(["/dev/my\\x20disk xfs rw"])["source"] == "/dev/my disk"
    assert UnitPids().process(["4242", "17", ""]) == [17, 4242]
