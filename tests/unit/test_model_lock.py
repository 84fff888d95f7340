"""tools.model_lock: a recorded Hub answer, the mirror-shaped one, and the live mirror."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandbox.mirror import model
from sandbox.mirror.server import MirrorServer
from tools.model_lock import (
    LockError,
    api_url,
    build_lock,
    fetch_api,
    fetch_config,
    git_blob_sha1,
    main,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "api"
TOKEN = "hf_lock-test-secret-0002"


def load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_lock_from_recorded_hub_answer():
    lock = build_lock(load("whisper.cpp.blobs.json"), model_id="ggerganov/whisper.cpp",
                      revision="main", base_url="https://huggingface.co/", now="T")
    assert lock["commit"] == "5359861c739e955e79d9a303bcbc70fb988958b1"
    assert lock["base_url"] == "https://huggingface.co" and lock["lock_version"] == 1
    files = {f["path"]: f for f in lock["files"]}
    assert len(files) == 12
    assert files["README.md"] == {"path": "README.md", "size": 3196, "algo": "git-blob-sha1",
                                  "digest": "bb0749e3c17cdf1d040a7e95fbf45610a212ec0a",
                                  "lfs": False}
    medium = files["ggml-medium.bin"]
    assert medium["algo"] == "sha256" and medium["size"] == 1533763059
    assert medium["digest"] == "6c14d5adee5f86394037b4e4e8b59f1673b6cee10e3cf0b11bbdbee79c156208"
    assert lock["total_size"] == sum(f["size"] for f in files.values())


def test_exclude_globs():
    lock = build_lock(load("whisper.cpp.blobs.json"), model_id="x/y", revision="main",
                      base_url="b", exclude=["*.en.bin", "ggml-large*"])
    assert [f["path"] for f in lock["files"]] == [
        "README.md", "ggml-base.bin", "ggml-medium.bin", "ggml-small.bin", "ggml-tiny.bin"]


def test_answer_without_blobs_is_refused():
    api = load("whisper.cpp.blobs.json")
    api["siblings"] = [{"rfilename": s["rfilename"]} for s in api["siblings"]]
    with pytest.raises(LockError, match="blobs=true"):
        build_lock(api, model_id="x/y", revision="main", base_url="b")


def test_answer_without_commit_is_refused():
    with pytest.raises(LockError, match="commit"):
        build_lock({"sha": "main", "siblings": [{}]}, model_id="x/y", revision="main",
                   base_url="b")


def test_revision_is_one_quoted_segment():
    assert api_url("https://h/", "a/b", "refs/pr/1") == \
        "https://h/api/models/a/b/revision/refs%2Fpr%2F1?blobs=true"


def test_mirror_shaped_answer_matches_generator_manifest(tmp_path):
    manifest = model.generate(tmp_path / "r")
    lock = build_lock(load("tiny-qwen2.mirror.json"), model_id="sandbox/tiny-qwen2",
                      revision="main", base_url="b")
    assert lock["commit"] == manifest["sha"]
    for entry, f in zip(lock["files"], sorted(manifest["files"], key=lambda f: f["path"]),
                        strict=True):
        assert entry["digest"] == (f["sha256"] if f["lfs"] else f["git_sha1"])


def test_cli_against_gated_mirror_keeps_token_secret(tmp_path, capsys, monkeypatch):
    root = tmp_path / "root"
    manifest = model.generate(root / "sandbox/tiny-qwen2")
    out = tmp_path / "locks" / "tiny.json"
    with MirrorServer(root, token=TOKEN) as mirror:
        assert main(["sandbox/tiny-qwen2", "--base-url", mirror.url, "--out", str(out)]) == 1
        assert "401" in capsys.readouterr().err
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        assert main(["sandbox/tiny-qwen2", "--base-url", mirror.url, "--out", str(out)]) == 0
    printed = capsys.readouterr()
    lock = json.loads(out.read_text())
    assert lock["commit"] == manifest["sha"] and len(lock["files"]) == len(manifest["files"])
    assert TOKEN not in printed.out + printed.err + out.read_text()
    # config.json rides in the lock, as the mirror serves it at the locked commit.
    served = json.loads((root / "sandbox/tiny-qwen2/config.json").read_text())
    assert lock["config"] == served and lock["config"]["architectures"] == ["Qwen2ForCausalLM"]


def test_config_that_does_not_match_its_lock_entry_is_refused(tmp_path):
    root = tmp_path / "root"
    model.generate(root / "sandbox/tiny-qwen2")
    with MirrorServer(root) as mirror:
        api = fetch_api(mirror.url, "sandbox/tiny-qwen2", "main")
        lock = build_lock(api, model_id="sandbox/tiny-qwen2", revision="main",
                          base_url=mirror.url)
        entry = next(f for f in lock["files"] if f["path"] == "config.json")
        entry["digest"] = "0" * 40
        with pytest.raises(LockError, match=r"config.json: \d+ bytes with git-blob-sha1 "):
            fetch_config(lock)


def test_git_blob_sha1_is_gits():
    # `printf 'hello\n' | git hash-object --stdin`
    assert git_blob_sha1(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"
