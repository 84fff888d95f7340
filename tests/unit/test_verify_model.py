"""files/verify_model.py, the deep check, against real files in tmp_path; the
ModelContent fact's own command run by a real shell on them; what counts as silently
changed; the refusal's words."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
from pyinfra_testing.util import get_command_string

from facts.model import ModelContent, silently_changed
from pyinfra_vllm.plans.model import corrupt_reason

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "files" / "verify_model.py"
_SPEC = importlib.util.spec_from_file_location("verify_model", SCRIPT)
verify_model = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(verify_model)

SHARD = "model-00002-of-00002.safetensors"
# A marker in the shard's bytes: it must never reach the output.
MARKER = b"SECRET-WEIGHTS-MARKER"


@pytest.fixture()
def model(tmp_path) -> tuple[Path, dict]:
    """A model directory of three files (two sha256 shards, one git-blob config) and its lock."""
    dest = tmp_path / "model"
    (dest / "sub").mkdir(parents=True)
    contents = {
        "model-00001-of-00002.safetensors": os.urandom(3 * 2**20 + 17),
        SHARD: MARKER + os.urandom(20 * 2**20),  # more than one 16 MiB read
        "sub/config.json": b'{"architectures": ["Qwen2ForCausalLM"]}\n',
    }
    files = []
    for path, data in contents.items():
        (dest / path).write_bytes(data)
        if path.endswith(".json"):
            digest = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            files.append({"path": path, "size": len(data), "algo": "git-blob-sha1",
                          "digest": digest})
        else:
            files.append({"path": path, "size": len(data), "algo": "sha256",
                          "digest": hashlib.sha256(data).hexdigest()})
    return dest, {"files": files}


def run_script(dest: Path, lock: dict, tmp_path: Path, *extra: str) -> tuple[int, list[str]]:
    lock_file = tmp_path / "lock.json"
    lock_file.write_text(json.dumps(lock))
    proc = subprocess.run(["python3", str(SCRIPT), "--dest", str(dest), "--lock", str(lock_file),
                           *extra], capture_output=True, text=True, check=False)
    return proc.returncode, proc.stdout.splitlines()


def summary(lines: list[str]) -> dict:
    assert lines[-1].startswith("summary\t")
    return json.loads(lines[-1].split("\t", 1)[1])


def flip_byte_keeping_stat(path: Path, offset: int) -> None:
    """One byte changed in place; size and mtime (to the nanosecond) as before."""
    before = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def test_a_sound_model_prints_only_the_summary(model, tmp_path):
    dest, lock = model
    code, lines = run_script(dest, lock, tmp_path)
    assert code == 0
    assert len(lines) == 1
    total = sum(f["size"] for f in lock["files"])
    assert summary(lines) | {"seconds": 0} == {"files": 3, "bytes": total, "bad": 0,
                                               "jobs": summary(lines)["jobs"], "seconds": 0}


def test_a_byte_changed_under_the_same_size_and_mtime_is_named(model, tmp_path):
    dest, lock = model
    flip_byte_keeping_stat(dest / SHARD, 18 * 2**20)  # in the second 16 MiB read
    code, lines = run_script(dest, lock, tmp_path, "--jobs", "3")
    assert code == 1
    assert lines[:-1] == [f"mismatch\t{SHARD}"]
    assert summary(lines)["bad"] == 1 and summary(lines)["jobs"] == 3


def test_missing_and_resized_files_are_named_without_reading_them(model, tmp_path):
    dest, lock = model
    (dest / "sub/config.json").unlink()
    with open(dest / "model-00001-of-00002.safetensors", "ab") as handle:
        handle.write(b"x")
    code, lines = run_script(dest, lock, tmp_path)
    assert code == 1
    assert sorted(lines[:-1]) == ["missing\tsub/config.json",
                                  "size\tmodel-00001-of-00002.safetensors"]
    # Only the one sound shard was read.
    assert summary(lines)["bytes"] == len(MARKER) + 20 * 2**20


def test_an_unreadable_file_is_named_with_its_reason(model, tmp_path):
    dest, lock = model
    (dest / SHARD).unlink()
    (dest / SHARD).mkdir()  # stat works, reading fails (EISDIR), as on a failing disk
    size = (dest / SHARD).stat().st_size  # the lock says this size: the read is tried
    lock["files"] = [dict(f, size=size) if f["path"] == SHARD else f for f in lock["files"]]
    code, lines = run_script(dest, lock, tmp_path)
    assert code == 1
    assert lines[:-1] == [f"unreadable\t{SHARD}\tIs a directory"]


def test_no_byte_of_any_file_reaches_the_output(model, tmp_path):
    dest, lock = model
    flip_byte_keeping_stat(dest / SHARD, len(MARKER) + 5)
    proc = subprocess.run(["python3", str(SCRIPT), "--dest", str(dest), "--manifest",
                           json.dumps(lock["files"])], capture_output=True, check=False)
    assert proc.returncode == 1
    assert MARKER not in proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0] == f"mismatch\t{SHARD}".encode()


@pytest.mark.parametrize("path", ["../outside", "/etc/passwd", ".", ""])
def test_a_path_outside_the_model_is_refused(model, tmp_path, path):
    dest, lock = model
    lock["files"].append({"path": path, "size": 1, "algo": "sha256", "digest": "0" * 64})
    lock_file = tmp_path / "lock.json"
    lock_file.write_text(json.dumps(lock))
    proc = subprocess.run(["python3", str(SCRIPT), "--dest", str(dest), "--lock",
                           str(lock_file)], capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"file path {path!r} is not a plain relative path" in proc.stderr


def test_two_reused_buffers_per_thread(model):
    dest, lock = model
    entry = next(f for f in lock["files"] if f["path"] == SHARD)
    assert verify_model.hash_file(str(dest / SHARD), "sha256", entry["size"]) == (
        entry["digest"], entry["size"])
    first = verify_model._BUFFERS.pair
    verify_model.hash_file(str(dest / SHARD), "sha256", entry["size"])
    assert verify_model._BUFFERS.pair is first
    assert [len(buffer) for buffer in first] == [16 * 2**20, 16 * 2**20]


# --- the fact, its own command on a real shell -----------------------------------------
def fact_of(path: Path, lock: dict | str) -> dict | None:
    fact = ModelContent()
    command = get_command_string(fact.command(path=str(path), lock=lock))
    proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
    assert proc.stderr == ""
    return fact.process(proc.stdout.splitlines()) if proc.stdout else None


def test_the_fact_names_a_silently_changed_shard(model):
    dest, lock = model
    flip_byte_keeping_stat(dest / SHARD, 7)
    found = fact_of(dest, lock)
    total = sum(f["size"] for f in lock["files"])
    assert found["problems"] == {SHARD: "mismatch"}
    assert (found["files"], found["bytes"], found["error"]) == (3, total, None)


def test_the_fact_reads_a_lock_file_from_the_command_line(model, tmp_path):
    dest, lock = model
    lock_file = tmp_path / "lock.json"
    lock_file.write_text(json.dumps(dict(lock, model_id="sandbox/tiny")))
    assert fact_of(dest, str(lock_file))["problems"] == {}


def test_the_fact_is_none_without_the_directory(model, tmp_path):
    _, lock = model
    assert fact_of(tmp_path / "absent", lock) is None


def test_the_fact_says_why_the_check_did_not_run():
    fact = ModelContent()
    assert fact.process(["error\tno python3"])["error"] == "no python3"
    broken = fact.process(["verify_model: the lock lists no files", "exit\t2"])
    assert broken["error"] == "verify_model: the lock lists no files"
    assert broken["problems"] == {} and broken["files"] == 0
    assert fact.process(["exit\t137"])["error"] == "the verifier exited 137 without a summary"


# --- what the stage does with it ---------------------------------------------------------
LOCK = {"files": [
    {"path": "a.safetensors", "size": 10, "algo": "sha256", "digest": "a" * 64},
    {"path": "b.safetensors", "size": 10, "algo": "sha256", "digest": "b" * 64},
]}
RECORD = {path: {"size": 10, "mtime_ns": 5, "algo": "sha256", "digest": d * 64}
          for path, d in (("a.safetensors", "a"), ("b.safetensors", "b"))}


def test_silently_changed_is_what_the_stat_check_trusts():
    files = {"a.safetensors": {"size": 10, "mtime_ns": 5},
             "b.safetensors": {"size": 10, "mtime_ns": 6}}  # b's mtime moved: refetched anyway
    content = {"problems": {"a.safetensors": "mismatch", "b.safetensors": "mismatch"}}
    assert silently_changed(content, {"verified": RECORD, "files": files}, LOCK) == [
        "a.safetensors"]
    assert silently_changed(None, None, LOCK) == []
    assert silently_changed({"problems": {}}, {"verified": RECORD, "files": files}, LOCK) == []


def test_the_refusal_names_the_files_and_the_setting():
    assert corrupt_reason("Qwen/Qwen3.6-27B", "/srv/models/Qwen/Qwen3.6-27B",
                          ["model-00002-of-00015.safetensors", "model-00009-of-00015.safetensors"]
                          ) == (
        "model: 2 file(s) of Qwen/Qwen3.6-27B in /srv/models/Qwen/Qwen3.6-27B no longer "
        "match the lock under an unchanged size and mtime: model-00002-of-00015.safetensors, "
        "model-00009-of-00015.safetensors; set model_repair=true to fetch exactly them again "
        "(the engine then restarts)")
