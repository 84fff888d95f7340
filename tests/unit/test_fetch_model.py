"""files/fetch_model.py against the local mirror (127.0.0.1, port 0), with faults."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import urllib.request
from pathlib import Path
from types import SimpleNamespace

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


# --- large files over several Range connections ----------------------------------------
PIECE = 256 * 1024  # the shards (1.7-2.1 MB) become 7-9 pieces each


@pytest.fixture
def split(monkeypatch):
    """Every file of at least two pieces is split, as 64 MiB+ files are for real."""
    monkeypatch.setattr(fetch_model, "PIECE_BYTES", PIECE)
    monkeypatch.setattr(fetch_model, "SPLIT_MIN_BYTES", 2 * PIECE)


def pieces(size: int) -> int:
    return -(-size // PIECE)


def test_large_file_comes_over_ranged_pieces_and_is_verified(
        split, mirror, mirror_root, lock_file, tmp_path, capsys):
    dest = tmp_path / "m"
    code, summary, err = fetch(lock_file, dest, mirror.url, capsys, "--connections", "4")
    assert code == 0 and summary["ok"]
    files = manifest_files(mirror_root)
    total = sum(f["size"] for f in files.values())
    assert summary["bytes"] == total and summary["hashed_bytes"] == total
    stats = admin(mirror, "/_stats")["files"]
    size = files[SHARD]["size"]
    assert stats[f"{REPO}/{SHARD}"] == {"get": pieces(size), "head": 0,
                                        "ranged": pieces(size), "bytes_sent": size}
    # Small files: one plain request each.
    assert stats[f"{REPO}/config.json"]["get"] == 1
    assert stats[f"{REPO}/config.json"]["ranged"] == 0
    assert f"{SHARD}: {size} bytes in" in err and "4 connections)" in err
    assert_tree_matches(dest, mirror_root)
    assert not list((dest / ".incoming").rglob("*.ranges"))


def test_claims_are_even_shares_of_what_is_left_then_single_pieces(split):
    fetch = fetch_model.RangedFetch(SimpleNamespace(size=20 * PIECE - 5, part="x.part"), 4)
    claims = list(iter(fetch._claim, None))
    assert claims == [(0, 5), (5, 8), (8, 11), (11, 13)] + [(i, i + 1) for i in range(13, 20)]


def test_claims_skip_done_pieces_and_stop_at_a_started_one(split):
    fetch = fetch_model.RangedFetch(SimpleNamespace(size=20 * PIECE, part="x.part"), 2)
    fetch.done[0], fetch.done[3], fetch.done[4] = PIECE, 100, PIECE
    # 18 left: a share of 8, cut short by piece 3 (started: it resumes in its own request)
    assert fetch._claim() == (1, 3)
    assert fetch._claim() == (3, 4)
    assert fetch._claim() == (5, 12)  # 15 left over 2 connections: 7


def test_a_run_of_pieces_is_one_request_and_resumes_where_it_dropped(
        split, mirror, mirror_root, lock_file, tmp_path, capsys):
    # 7 pieces over 2 connections: runs of 3, 2, 1 and 1 pieces, one request each; the
    # first dropped after 300,000 bytes (inside its second piece) and resumed from there.
    admin(mirror, "/_faults", {"path": SHARD, "mode": "drop", "after_bytes": 300_000,
                               "times": 1})
    code, _, err = fetch(lock_file, tmp_path / "m", mirror.url, capsys, "--connections", "2")
    assert code == 0
    size = manifest_files(mirror_root)[SHARD]["size"]
    assert pieces(size) == 7
    stats = admin(mirror, "/_stats")["files"][f"{REPO}/{SHARD}"]
    assert stats == {"get": 5, "head": 0, "ranged": 5, "bytes_sent": size}
    assert "resuming that piece (retry 1/5)" in err
    assert_tree_matches(tmp_path / "m", mirror_root)


def test_connections_1_keeps_one_request_per_file(split, mirror, mirror_root, lock_file,
                                                  tmp_path, capsys):
    code, _, _ = fetch(lock_file, tmp_path / "m", mirror.url, capsys, "--connections", "1")
    assert code == 0
    assert admin(mirror, "/_stats")["files"][f"{REPO}/{SHARD}"]["get"] == 1


def test_dropped_piece_resumes_alone(split, mirror, mirror_root, lock_file, tmp_path, capsys):
    admin(mirror, "/_faults", {"path": SHARD, "mode": "drop", "after_bytes": 100_000,
                               "times": 1})
    code, _, err = fetch(lock_file, tmp_path / "m", mirror.url, capsys, "--connections", "4")
    assert code == 0
    size = manifest_files(mirror_root)[SHARD]["size"]
    stats = admin(mirror, "/_stats")["files"][f"{REPO}/{SHARD}"]
    assert stats["get"] == pieces(size) + 1 and stats["bytes_sent"] == size
    assert "resuming that piece (retry 1/5)" in err
    assert_tree_matches(tmp_path / "m", mirror_root)


def interrupted(dest: Path, mirror_root: Path, done: list[int], garbage: bool = False) -> int:
    """A .part and its record as a run stopped mid-way leaves them; returns bytes kept."""
    data = (mirror_root / REPO / SHARD).read_bytes()
    part = dest / ".incoming" / (SHARD + ".part")
    part.parent.mkdir(parents=True)
    content = bytearray(len(data))
    for index, got in enumerate(done):
        start = index * PIECE
        content[start:start + got] = data[start:start + got]
    if garbage:  # a recorded piece whose bytes on disk are not the file's
        content[2 * PIECE + 10] ^= 0xFF
    part.write_bytes(bytes(content))
    part.with_name(part.name + ".ranges").write_text(
        json.dumps({"size": len(data), "piece": PIECE, "done": done}))
    return sum(done)


def test_split_part_resumes_every_piece_where_it_stopped(split, mirror, mirror_root,
                                                         lock_file, tmp_path, capsys):
    dest = tmp_path / "m"
    size = manifest_files(mirror_root)[SHARD]["size"]
    done = [PIECE, 1000, PIECE, 0] + [0] * (pieces(size) - 4)
    kept = interrupted(dest, mirror_root, done)
    code, summary, err = fetch(lock_file, dest, mirror.url, capsys, "--connections", "4")
    assert code == 0
    stats = admin(mirror, "/_stats")["files"][f"{REPO}/{SHARD}"]
    assert stats["bytes_sent"] == size - kept  # nothing fetched twice
    assert stats["get"] == pieces(size) - 2  # pieces 0 and 2 were complete
    assert f"{SHARD}: resuming {kept} of {size} bytes ({PIECE + 1000} contiguous)" in err
    assert_tree_matches(dest, mirror_root)
    assert not (dest / ".incoming" / (SHARD + ".part.ranges")).exists()


def test_recorded_bytes_are_trusted_only_once_hashed(split, mirror, mirror_root, lock_file,
                                                     tmp_path, capsys):
    dest = tmp_path / "m"
    size = manifest_files(mirror_root)[SHARD]["size"]
    interrupted(dest, mirror_root, [PIECE, 0, PIECE] + [0] * (pieces(size) - 3), garbage=True)
    code, summary, err = fetch(lock_file, dest, mirror.url, capsys, "--connections", "4")
    assert code == 0 and SHARD in summary["downloaded"]
    assert "verification failed on attempt 1" in err  # then fetched again from scratch
    stats = admin(mirror, "/_stats")["files"][f"{REPO}/{SHARD}"]
    assert stats["bytes_sent"] == 2 * size - 2 * PIECE
    assert_tree_matches(dest, mirror_root)


def test_plain_part_of_a_one_connection_run_is_kept_as_prefix(split, mirror, mirror_root,
                                                              lock_file, tmp_path, capsys):
    dest = tmp_path / "m"
    part = dest / ".incoming" / (SHARD + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes((mirror_root / REPO / SHARD).read_bytes()[:PIECE + 123])
    code, summary, _ = fetch(lock_file, dest, mirror.url, capsys, "--connections", "4")
    assert code == 0
    size = manifest_files(mirror_root)[SHARD]["size"]
    assert admin(mirror, "/_stats")["files"][f"{REPO}/{SHARD}"]["bytes_sent"] == \
        size - PIECE - 123
    assert_tree_matches(dest, mirror_root)


def test_a_record_of_other_pieces_keeps_its_contiguous_prefix(split, mirror, mirror_root,
                                                              lock_file, tmp_path, capsys):
    # An earlier version's record (pieces twice as long): its first piece is whole.
    dest = tmp_path / "m"
    data = (mirror_root / REPO / SHARD).read_bytes()
    part = dest / ".incoming" / (SHARD + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes(data[:2 * PIECE] + bytes(len(data) - 2 * PIECE))
    part.with_name(part.name + ".ranges").write_text(json.dumps(
        {"size": len(data), "piece": 2 * PIECE, "done": [2 * PIECE, 0, 0, 0]}))
    code, _, _ = fetch(lock_file, dest, mirror.url, capsys, "--connections", "4")
    assert code == 0
    stats = admin(mirror, "/_stats")["files"][f"{REPO}/{SHARD}"]
    assert stats["bytes_sent"] == len(data) - 2 * PIECE
    assert_tree_matches(dest, mirror_root)


def test_server_without_ranges_gets_one_connection(split, mirror_root, lock_file, tmp_path,
                                                   capsys):
    dest = tmp_path / "m"
    size = manifest_files(mirror_root)[SHARD]["size"]
    interrupted(dest, mirror_root, [PIECE, 0, PIECE] + [0] * (pieces(size) - 3))
    with MirrorServer(mirror_root, ranges=False) as plain:
        code, summary, err = fetch(lock_file, dest, plain.url, capsys, "--connections", "4")
        stats = plain.stats.snapshot()["files"][f"{REPO}/{SHARD}"]
    assert code == 0
    assert f"{SHARD}: HTTP 200 to a Range request: the server does not serve ranges" in err
    # The probe (closed after its headers) and one whole-file request; the split .part
    # was cut to its contiguous prefix, which a 200 then restarts from zero.
    assert stats["get"] == 2 and stats["ranged"] == 0
    assert_tree_matches(dest, mirror_root)
    assert not (dest / ".incoming" / (SHARD + ".part.ranges")).exists()
