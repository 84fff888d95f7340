"""files/fetch_model.py against the local mirror (127.0.0.1, port 0), with faults."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import urllib.request
from pathlib import Path

import pytest

from sandbox.mirror import model
from sandbox.mirror.server import MirrorServer
from tools.model_lock import build_lock, fetch_api, write_lock

ROOT = Path(__file__).resolve().parents[2]
REPO = "sandbox/tiny-qwen2"
SHARD = "model-00002-of-00004.safetensors"
TOKEN = "hf_fetch-test-secret-0001"


def _load_fetch_model():
    spec = importlib.util.spec_from_file_location("fetch_model", ROOT / "files/fetch_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fetch_model = _load_fetch_model()
fetch_model.PROGRESS_SECONDS = 0.0  # exercise the periodic progress line


@pytest.fixture(scope="module")
def lock_file(mirror, tmp_path_factory: pytest.TempPathFactory) -> Path:
    api = fetch_api(mirror.url, REPO, "main")
    out = tmp_path_factory.mktemp("lock") / "lock.json"
    write_lock(build_lock(api, model_id=REPO, revision="main", base_url=mirror.url), out)
    return out


@pytest.fixture(autouse=True)
def clean(mirror):
    mirror.faults.clear()
    mirror.stats.reset()


def admin(mirror, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(mirror.url + path, data=data,
                                     method="POST" if body is not None else "GET")
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.load(response)


def fetch(lock: Path, dest: Path, url: str, capsys, *extra: str) -> tuple[int, dict, str]:
    code = fetch_model.main(["--lock", str(lock), "--dest", str(dest), "--base-url", url,
                             "--jobs", "4", "--timeout", "5", *extra])
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert len(lines) == 1, out  # stdout is the summary line alone
    return code, json.loads(lines[0]), err


def manifest_files(root: Path) -> dict[str, dict]:
    return {f["path"]: f for f in model.load_manifest(root / REPO)["files"]}


def assert_tree_matches(dest: Path, root: Path) -> None:
    for path, entry in manifest_files(root).items():
        assert hashlib.sha256((dest / path).read_bytes()).hexdigest() == entry["sha256"]
    assert not list((dest / ".incoming").rglob("*.part"))


def test_first_run_downloads_everything_then_rerun_does_nothing(
        mirror, mirror_root, lock_file, tmp_path, capsys):
    dest = tmp_path / "model"
    code, summary, err = fetch(lock_file, dest, mirror.url, capsys)
    files = sorted(manifest_files(mirror_root))
    assert code == 0 and summary["ok"] and summary["changed"]
    assert summary["downloaded"] == files and summary["skipped"] == []
    total = sum(f["size"] for f in manifest_files(mirror_root).values())
    assert summary["bytes"] == total and summary["hashed_bytes"] == total
    assert_tree_matches(dest, mirror_root)
    assert "MiB/s" in err
    verified = json.loads((dest / ".verified.json").read_text())["files"]
    assert sorted(verified) == files

    mirror.stats.reset()
    code, summary, _ = fetch(lock_file, dest, mirror.url, capsys)
    assert code == 0 and summary["changed"] is False
    assert summary["skipped"] == files and summary["downloaded"] == []
    assert summary["hashed_files"] == 0 and summary["hashed_bytes"] == 0
    assert summary["bytes"] == 0
    assert admin(mirror, "/_stats")["totals"]["get"] == 0


def test_dropped_connection_resumes_with_range(mirror, mirror_root, lock_file, tmp_path,
                                               capsys):
    admin(mirror, "/_faults", {"path": SHARD, "mode": "drop", "after_bytes": 700_000,
                               "times": 1})
    code, summary, err = fetch(lock_file, tmp_path / "m", mirror.url, capsys)
    assert code == 0, summary
    stats = admin(mirror, "/_stats")["files"][f"{REPO}/{SHARD}"]
    assert stats["get"] == 2 and stats["ranged"] == 1
    size = manifest_files(mirror_root)[SHARD]["size"]
    assert stats["bytes_sent"] == size  # resumed, not fetched again from zero
    assert "resuming" in err
    assert_tree_matches(tmp_path / "m", mirror_root)


def test_partial_file_from_an_earlier_run_is_resumed(mirror, mirror_root, lock_file,
                                                      tmp_path, capsys):
    dest = tmp_path / "m"
    part = dest / ".incoming" / (SHARD + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes((mirror_root / REPO / SHARD).read_bytes()[:123_456])
    code, summary, _ = fetch(lock_file, dest, mirror.url, capsys)
    assert code == 0
    stats = admin(mirror, "/_stats")["files"][f"{REPO}/{SHARD}"]
    assert stats["ranged"] == 1
    assert summary["bytes"] == sum(f["size"] for f in manifest_files(mirror_root).values()) \
        - 123_456
    assert_tree_matches(dest, mirror_root)


def test_corrupt_byte_is_fetched_again(mirror, mirror_root, lock_file, tmp_path, capsys):
    admin(mirror, "/_faults", {"path": SHARD, "mode": "corrupt", "offset": 4096, "times": 1})
    code, summary, err = fetch(lock_file, tmp_path / "m", mirror.url, capsys)
    assert code == 0 and SHARD in summary["downloaded"]
    assert admin(mirror, "/_stats")["files"][f"{REPO}/{SHARD}"]["get"] == 2
    assert "verification failed on attempt 1" in err
    assert_tree_matches(tmp_path / "m", mirror_root)


def test_always_corrupt_stops_naming_file_and_both_checksums(mirror, mirror_root, lock_file,
                                                             tmp_path, capsys):
    admin(mirror, "/_faults", {"path": SHARD, "mode": "corrupt", "offset": 10, "times": -1})
    dest = tmp_path / "m"
    code, summary, err = fetch(lock_file, dest, mirror.url, capsys)
    expected = manifest_files(mirror_root)[SHARD]["sha256"]
    assert code == 1 and summary["ok"] is False
    assert SHARD in summary["error"] and expected in summary["error"]
    assert "got" in summary["error"] and SHARD in err
    assert not (dest / SHARD).exists()  # nothing unverified under a final name
    assert not (dest / ".incoming" / (SHARD + ".part")).exists()


def test_changed_file_is_rehashed_and_damaged_file_refetched(mirror, mirror_root, lock_file,
                                                             tmp_path, capsys):
    dest = tmp_path / "m"
    fetch(lock_file, dest, mirror.url, capsys)
    os.utime(dest / "config.json", ns=(1, 1))  # same bytes, new mtime: re-hash only
    data = bytearray((dest / SHARD).read_bytes())
    data[100] ^= 0xFF  # same size, different bytes: fetch again
    (dest / SHARD).write_bytes(bytes(data))
    mirror.stats.reset()
    code, summary, _ = fetch(lock_file, dest, mirror.url, capsys)
    assert code == 0 and summary["changed"]
    assert summary["verified"] == ["config.json"] and summary["downloaded"] == [SHARD]
    assert admin(mirror, "/_stats")["totals"]["get"] == 1
    assert_tree_matches(dest, mirror_root)


def test_refetch_replaces_exactly_a_file_changed_under_the_same_size_and_mtime(
        mirror, mirror_root, lock_file, tmp_path, capsys):
    dest = tmp_path / "m"
    fetch(lock_file, dest, mirror.url, capsys)
    before = (dest / SHARD).stat()
    with open(dest / SHARD, "r+b") as handle:  # in place: same inode, size
        handle.seek(100)
        handle.write(b"\x00\x01")
    os.utime(dest / SHARD, ns=(before.st_atime_ns, before.st_mtime_ns))
    mirror.stats.reset()
    # The record and the stat agree: a plain run trusts the damaged file.
    code, summary, _ = fetch(lock_file, dest, mirror.url, capsys)
    assert code == 0 and summary["skipped"] == sorted(manifest_files(mirror_root))
    # Named with --refetch: removed, fetched, verified, renamed; nothing else touched.
    code, summary, err = fetch(lock_file, dest, mirror.url, capsys, "--refetch", SHARD)
    assert code == 0 and summary["changed"]
    assert summary["downloaded"] == [SHARD]
    assert summary["skipped"] == sorted(set(manifest_files(mirror_root)) - {SHARD})
    stats = admin(mirror, "/_stats")
    assert stats["totals"]["get"] == 1 and stats["files"][f"{REPO}/{SHARD}"]["get"] == 1
    assert f"{SHARD}: content known not to match the lock; fetching again" in err
    assert_tree_matches(dest, mirror_root)
    record = json.loads((dest / ".verified.json").read_text())["files"][SHARD]
    assert record["mtime_ns"] == (dest / SHARD).stat().st_mtime_ns != before.st_mtime_ns
    # The next plain run has nothing to do.
    code, summary, _ = fetch(lock_file, dest, mirror.url, capsys)
    assert code == 0 and summary["changed"] is False


def test_refetch_of_a_file_the_lock_does_not_name_is_refused(mirror, lock_file, tmp_path,
                                                            capsys):
    code, summary, _ = fetch(lock_file, tmp_path / "m", mirror.url, capsys,
                             "--refetch", "weights.bin")
    assert code == 2
    assert summary["error"] == "--refetch weights.bin: not a file of the lock"
    assert not (tmp_path / "m" / ".verified.json").exists()


def test_token_is_sent_and_never_printed(mirror_root, lock_file, tmp_path, capsys):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with MirrorServer(mirror_root, token=TOKEN) as gated:
        code, summary, err = fetch(lock_file, tmp_path / "a", gated.url, capsys)
        assert code == 3 and "401" in summary["error"]
        code, summary, err = fetch(lock_file, tmp_path / "b", gated.url, capsys,
                                   "--token-file", str(token_file))
        assert code == 0
        assert TOKEN not in json.dumps(summary) and TOKEN not in err


def test_lock_path_outside_dest_is_refused(lock_file, tmp_path, capsys):
    lock = json.loads(lock_file.read_text())
    lock["files"][0]["path"] = "../escape.json"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(lock))
    code, summary, _ = fetch(bad, tmp_path / "m", "http://127.0.0.1:9", capsys)
    assert code == 2 and "escape" in summary["error"]


def test_git_blob_digest_matches_git():
    digest = fetch_model.Digest("git-blob-sha1", 6)
    digest.update(b"hello\n")
    assert digest.hexdigest() == "ce013625030ba8dba906f756967f9e9ca394464a"  # git hash-object
