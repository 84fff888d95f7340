"""The generated tiny Qwen2 repository: deterministic, self-consistent, shaped like the real one.

Checked with the project's own safetensors reader so CI needs nothing extra; the same files were
also loaded with the real safetensors/transformers in a throwaway venv (see the mirror README).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from itertools import pairwise
from pathlib import Path

import pytest

from sandbox.mirror import model, safetensors_io

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("repo")
    return out, model.generate(out)


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Qwen2ForCausalLM's parameters, written out from the config independently of the generator."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "lm_head.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    return shapes


def test_generate_is_deterministic(repo, tmp_path):
    out, manifest = repo
    again = model.generate(tmp_path / "again")
    assert again == manifest
    for entry in manifest["files"]:
        name = entry["path"]
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes()


def test_seed_changes_weights_not_config(repo, tmp_path):
    _, manifest = repo
    other = model.generate(tmp_path / "seed1", seed=1)
    by_path = {f["path"]: f["sha256"] for f in manifest["files"]}
    for entry in other["files"]:
        changed = entry["sha256"] != by_path[entry["path"]]
        assert changed == entry["path"].endswith(".safetensors"), entry["path"]
    assert other["sha"] != manifest["sha"]


def test_manifest_matches_files(repo):
    out, manifest = repo
    assert re.fullmatch(r"[0-9a-f]{40}", manifest["sha"])
    assert manifest["repo_id"] == "sandbox/tiny-qwen2" and manifest["revision"] == "main"
    listed = {f["path"] for f in manifest["files"]}
    on_disk = {p.name for p in out.iterdir() if p.is_file()}
    assert listed == on_disk
    assert (out / ".mirror" / "manifest.json").is_file()  # metadata kept out of the repo files
    for f in manifest["files"]:
        data = (out / f["path"]).read_bytes()
        assert f["size"] == len(data)
        assert f["sha256"] == hashlib.sha256(data).hexdigest()
        assert f["git_sha1"] == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        assert f["lfs"] == f["path"].endswith(".safetensors")
        if f["lfs"]:
            pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{f['sha256']}\n"
                       f"size {f['size']}\n").encode()
            assert f["pointer_size"] == len(pointer)
            assert f["blob_id"] == hashlib.sha1(b"blob %d\0" % len(pointer) + pointer).hexdigest()
        else:
            assert f["blob_id"] == f["git_sha1"] and f["pointer_size"] is None
    assert manifest["total_size"] == sum(f["size"] for f in manifest["files"])
    assert model.load_manifest(out) == manifest


def test_api_json_has_hub_shape(repo):
    out, manifest = repo
    api = _json(out / ".mirror" / "api.json")
    assert api["id"] == api["modelId"] == "sandbox/tiny-qwen2"
    assert api["sha"] == manifest["sha"]
    assert api["config"]["architectures"] == ["Qwen2ForCausalLM"]
    siblings = {s["rfilename"]: s for s in api["siblings"]}
    for f in manifest["files"]:
        s = siblings[f["path"]]
        assert (s["size"], s["blobId"]) == (f["size"], f["blob_id"])
        if f["lfs"]:
            assert s["lfs"] == {"sha256": f["sha256"], "size": f["size"],
                                "pointerSize": f["pointer_size"]}
        else:
            assert "lfs" not in s
    assert api["safetensors"]["total"] == manifest["weights"]["parameters"]


def test_shards_parse_and_match_qwen2(repo):
    out, manifest = repo
    cfg = _json(out / "config.json")
    index = _json(out / "model.safetensors.index.json")
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{n}-of-00004.safetensors" for n in range(1, 5)]
    found: dict[str, tuple[int, ...]] = {}
    tensor_bytes = 0
    for shard in shards:
        metadata, tensors = safetensors_io.read(out / shard)
        assert metadata == {"format": "pt"}
        for name, (info, raw) in tensors.items():
            assert info.dtype == "BF16" and index["weight_map"][name] == shard
            found[name] = info.shape
            tensor_bytes += len(raw)
        assert 1 * MiB < (out / shard).stat().st_size < 2.5 * MiB  # a mid-file drop means something
    assert found == _expected_shapes(cfg)
    assert index["metadata"]["total_size"] == tensor_bytes == manifest["weights"]["total_size"]


def test_shard_header_layout_by_hand(repo):
    out, _ = repo
    blob = (out / "model-00001-of-00004.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", blob[:8])
    assert header_len % 8 == 0
    header = json.loads(blob[8:8 + header_len])
    assert header.pop("__metadata__") == {"format": "pt"}
    ends = sorted(tuple(t["data_offsets"]) for t in header.values())
    assert ends[0][0] == 0 and ends[-1][1] == len(blob) - 8 - header_len
    assert all(a[1] == b[0] for a, b in pairwise(ends))  # packed, no gaps


def test_weight_values_are_sane_bf16(repo):
    out, _ = repo
    _, tensors = safetensors_io.read(out / "model-00004-of-00004.safetensors")
    weights = safetensors_io.bf16_to_floats(tensors["lm_head.weight"][1])
    assert all(math.isfinite(x) and abs(x) <= model.WEIGHT_SCALE for x in weights)
    assert len(set(weights)) > 100  # noise, not a constant
    assert set(safetensors_io.bf16_to_floats(tensors["model.norm.weight"][1])) == {1.0}


def test_config_fields(repo):
    out, _ = repo
    cfg = _json(out / "config.json")
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is False
    assert cfg["rope_theta"] == 1000000.0 and cfg["max_position_embeddings"] == 131072
    assert cfg["use_sliding_window"] is False
    # TP=2 must split attention heads, KV heads and the MLP evenly.
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        assert cfg[key] % 2 == 0
    assert cfg["hidden_size"] % cfg["num_attention_heads"] == 0


def test_generation_config_has_both_eos_ids(repo):
    out, _ = repo
    gen = _json(out / "generation_config.json")
    added = {t["content"]: t["id"] for t in _json(out / "tokenizer.json")["added_tokens"]}
    assert gen["eos_token_id"] == [added["<|im_end|>"], added["<|endoftext|>"]]
    assert _json(out / "config.json")["eos_token_id"] == added["<|im_end|>"]


def test_tokenizer_files_are_consistent(repo):
    out, _ = repo
    tok = _json(out / "tokenizer.json")
    vocab = tok["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(len(vocab)))
    assert _json(out / "vocab.json") == vocab
    merges = [m.split(" ") for m in tok["model"]["merges"]]
    lines = (out / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("#version") and [ln.split(" ") for ln in lines[1:]] == merges
    for a, b in merges:  # what `tokenizers` checks on load
        assert a in vocab and b in vocab and a + b in vocab
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert sorted(specials.values()) == [len(vocab), len(vocab) + 1, len(vocab) + 2]
    assert set(specials) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    assert max(specials.values()) < _json(out / "config.json")["vocab_size"]
    tcfg = _json(out / "tokenizer_config.json")
    assert tcfg["tokenizer_class"] == "Qwen2Tokenizer" and tcfg["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in tcfg["chat_template"]
    assert {v["content"] for v in tcfg["added_tokens_decoder"].values()} == set(specials)


def test_own_reader_rejects_broken_files():
    good = safetensors_io.encode([("a", "BF16", (2,), b"\0\0\0\0")], {"format": "pt"})
    safetensors_io.parse_header(good)
    with pytest.raises(safetensors_io.SafetensorsError):
        safetensors_io.parse_header(good[:-1])  # truncated data
    with pytest.raises(safetensors_io.SafetensorsError):
        safetensors_io.parse_header(struct.pack("<Q", 10**9) + good[8:])  # absurd header length
    with pytest.raises(safetensors_io.SafetensorsError):
        safetensors_io.encode([("a", "BF16", (3,), b"\0\0")])  # shape/bytes mismatch
