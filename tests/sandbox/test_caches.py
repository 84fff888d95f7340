"""A host's own package caches (sandbox/hosts.py _own_caches, _keep_downloads): what it
downloaded goes back into the shared caches as hard links, nothing there replaced (on a
temporary directory laid out as a stopped host's; no containers, no root needed); which
hosts of a plan get one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandbox import hosts as sbx
from sandbox.util import SandboxError


def test_a_host_s_downloads_are_kept_and_the_shared_entries_left_as_they_were(
        tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    monkeypatch.setattr(sbx, "CACHE_DIR", shared)
    (shared / "uv-cache" / "archive-v0" / "old").mkdir(parents=True)
    (shared / "uv-cache" / "archive-v0" / "old" / "torch.py").write_text("shared\n")
    (shared / "pip-cache").mkdir()
    host_dir = tmp_path / "hosts" / "gpu-sbx-1"
    own = host_dir / "upper" / "root" / ".cache" / "uv"
    (own / "archive-v0" / "old").mkdir(parents=True)
    (own / "archive-v0" / "old" / "torch.py").write_text("the host's\n")  # not taken
    (own / "archive-v0" / "new").mkdir()
    (own / "archive-v0" / "new" / "vllm.py").write_text("downloaded\n")
    (own / ".tmpAbC1").mkdir()  # a download cut short: left out
    (own / ".lock").write_text("")
    # A host whose caches were the bind mounts: their empty mount point only.
    (host_dir / "upper" / "root" / ".cache" / "pip").mkdir()

    assert sbx._keep_downloads(host_dir) == []
    kept = shared / "uv-cache" / "archive-v0"
    assert (kept / "old" / "torch.py").read_text() == "shared\n"
    assert (kept / "new" / "vllm.py").read_text() == "downloaded\n"
    assert os.path.samefile(kept / "new" / "vllm.py", own / "archive-v0" / "new" / "vllm.py")
    assert sorted(path.name for path in (shared / "uv-cache").iterdir()) == ["archive-v0"]
    assert list((shared / "pip-cache").iterdir()) == []


def test_the_own_cache_s_parents_keep_the_rootfs_modes(tmp_path):
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    (lower / "root").mkdir(parents=True, mode=0o700)
    (lower / "var").mkdir(mode=0o755)
    # Before the overlay is mounted: no upper directory yet.
    sbx._private_parents(upper, lower, Path("/root/.cache"))
    sbx._private_parents(upper, lower, Path("/var/cache"))
    modes = {path: (upper / path).stat().st_mode & 0o7777
             for path in ("root", "root/.cache", "var", "var/cache")}
    # An upper directory's mode is the merged one's: /root stays root's alone.
    assert modes == {"root": 0o700, "root/.cache": 0o700, "var": 0o755, "var/cache": 0o700}


def test_the_hosts_with_their_own_caches_are_every_host_or_those_named():
    hosts = sbx.plan(3, ["seed580", "bare", "h200"])
    assert sbx.cache_owners(hosts, True) == {"gpu-sbx-1", "gpu-sbx-2", "gpu-sbx-3"}
    assert sbx.cache_owners(hosts, False) == set()
    assert sbx.cache_owners(hosts, ["gpu-sbx-1", "gpu-sbx-3"]) == {"gpu-sbx-1", "gpu-sbx-3"}
    with pytest.raises(SandboxError, match=r"own_caches names gpu-sbx-6: not among the hosts "
                                           r"planned \(gpu-sbx-1, gpu-sbx-2, gpu-sbx-3\)"):
        sbx.cache_owners(hosts, ["gpu-sbx-1", "gpu-sbx-6"])
