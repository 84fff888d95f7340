"""Deterministic generator of a tiny Qwen2 model repository that vLLM 0.6.3 can load.

No real model can be downloaded in the sandbox, so the test servers fetch this one from the
host-side mirror instead. It has everything the real thing has and the suite looks at:
``config.json`` (``Qwen2ForCausalLM``), ``generation_config.json`` with both EOS ids, a byte-level
BPE tokenizer in Qwen2's file layout, four bf16 safetensors shards with their index, and the
git/LFS identities Hugging Face reports (blob sha1, LFS sha256, commit sha).

Everything is a pure function of ``(repo_id, revision, seed)``: the same call writes the same
bytes, so hashes can be asserted and a lock file written against it stays valid.
"""

from __future__ import annotations

import array
import hashlib
import json
import random
from pathlib import Path

from sandbox.mirror import safetensors_io, tokenizer

DEFAULT_REPO_ID = "sandbox/tiny-qwen2"
DEFAULT_REVISION = "main"
GENERATOR_VERSION = 1
METADATA_DIR = ".mirror"  # manifest and API answer live here; never served as repo files
MANIFEST_NAME = "manifest.json"
API_NAME = "api.json"

# Small, but shaped like Qwen2.5: GQA with 2 KV heads (so TP=2 splits them evenly), biases on
# q/k/v only, untied lm_head, 128K positions. hidden_size and vocab_size are chosen so the four
# shards are ~1.8 MiB each: large enough that a mid-file connection drop means something.
DIMENSIONS = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,  # head_dim 64, derived as hidden_size / heads, as Qwen2 does
    "num_key_value_heads": 2,
    "vocab_size": 1024,  # >= the tokenizer's 616 tokens; padded like Qwen's 151936 > 151665
    "max_position_embeddings": 131072,
}
NUM_SHARDS = 4
WEIGHT_SCALE = 0.04  # uniform(-s, s): about the 0.02 std of Qwen2's initializer_range

# Fixed identity for the synthetic git history, so the commit sha is reproducible.
_GIT_IDENTITY = "sandbox-mirror <sandbox-mirror@localhost> 1719792000 +0000"
_TIMESTAMP = "2024-07-01T00:00:00.000Z"

GITATTRIBUTES = "*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def model_config(vocab_size: int = DIMENSIONS["vocab_size"]) -> dict[str, object]:
    """``config.json``; field set and spelling follow Qwen2.5-Instruct's."""
    specials = tokenizer.special_token_ids(tokenizer.train_bpe()[0])
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": specials[tokenizer.ENDOFTEXT],
        "eos_token_id": specials[tokenizer.IM_END],
        "hidden_act": "silu",
        "hidden_size": DIMENSIONS["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": DIMENSIONS["intermediate_size"],
        "max_position_embeddings": DIMENSIONS["max_position_embeddings"],
        "max_window_layers": DIMENSIONS["num_hidden_layers"],
        "model_type": "qwen2",
        "num_attention_heads": DIMENSIONS["num_attention_heads"],
        "num_hidden_layers": DIMENSIONS["num_hidden_layers"],
        "num_key_value_heads": DIMENSIONS["num_key_value_heads"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": DIMENSIONS["max_position_embeddings"],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.2",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def generation_config(specials: dict[str, int]) -> dict[str, object]:
    """Qwen's: both ``<|im_end|>`` and ``<|endoftext|>`` stop generation (vLLM reads this list)."""
    return {
        "bos_token_id": specials[tokenizer.ENDOFTEXT],
        "do_sample": True,
        "eos_token_id": [specials[tokenizer.IM_END], specials[tokenizer.ENDOFTEXT]],
        "pad_token_id": specials[tokenizer.ENDOFTEXT],
        "repetition_penalty": 1.05,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "transformers_version": "4.45.2",
    }


def tensor_specs() -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2ForCausalLM's parameter names and (out, in) shapes, in state_dict order."""
    hidden = DIMENSIONS["hidden_size"]
    inter = DIMENSIONS["intermediate_size"]
    head_dim = hidden // DIMENSIONS["num_attention_heads"]
    q_dim = DIMENSIONS["num_attention_heads"] * head_dim
    kv_dim = DIMENSIONS["num_key_value_heads"] * head_dim
    specs: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (DIMENSIONS["vocab_size"], hidden))]
    for layer in range(DIMENSIONS["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        specs += [
            (p + "self_attn.q_proj.weight", (q_dim, hidden)),
            (p + "self_attn.q_proj.bias", (q_dim,)),
            (p + "self_attn.k_proj.weight", (kv_dim, hidden)),
            (p + "self_attn.k_proj.bias", (kv_dim,)),
            (p + "self_attn.v_proj.weight", (kv_dim, hidden)),
            (p + "self_attn.v_proj.bias", (kv_dim,)),
            (p + "self_attn.o_proj.weight", (hidden, q_dim)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    specs += [("model.norm.weight", (hidden,)),
              ("lm_head.weight", (DIMENSIONS["vocab_size"], hidden))]
    return specs


def _float32_to_bf16(values: array.array) -> bytes:
    """bf16 is the upper 16 bits of an IEEE float32 (truncation, little-endian)."""
    raw = values.tobytes()
    out = bytearray(len(raw) // 2)
    out[0::2] = raw[2::4]
    out[1::2] = raw[3::4]
    return bytes(out)


def tensor_bytes(name: str, shape: tuple[int, ...], seed: int) -> bytes:
    """The tensor's bf16 data: norms are ones (their real init), the rest seeded uniform noise.

    The PRNG is seeded per tensor name, so a value never depends on sharding or order.
    """
    count = safetensors_io.element_count(shape)
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return _float32_to_bf16(array.array("f", [1.0]) * count)
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    rand = random.Random(int.from_bytes(digest[:8], "little")).random
    scale = WEIGHT_SCALE
    values = array.array("f", [(2.0 * rand() - 1.0) * scale for _ in range(count)])
    return _float32_to_bf16(values)


def shard_plan(specs: list[tuple[str, tuple[int, ...]]], num_shards: int
               ) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Split tensors in order into ``num_shards`` runs of about equal byte size.

    A tensor goes to the shard its first byte falls in, so no shard is empty as long as no
    single tensor is larger than total/num_shards (true for these dimensions).
    """
    sizes = [safetensors_io.element_count(shape) * 2 for _, shape in specs]
    total = sum(sizes)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(num_shards)]
    start = 0
    for spec, size in zip(specs, sizes, strict=True):
        shards[min(start * num_shards // total, num_shards - 1)].append(spec)
        start += size
    return [shard for shard in shards if shard]


def shard_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def _write_json(path: Path, data: object) -> None:
    # Sorted keys and a trailing newline, like `save_pretrained`; bytes are reproducible.
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")


def _write_weights(out_dir: Path, seed: int) -> tuple[list[str], int, int]:
    """Write the shards and index; return (file names, total tensor bytes, parameter count)."""
    plan = shard_plan(tensor_specs(), NUM_SHARDS)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    params = 0
    names = []
    for index, shard in enumerate(plan, start=1):
        fname = shard_name(index, len(plan))
        # Within a file, the real writer orders tensors by name; so do we.
        tensors = [(n, "BF16", s, tensor_bytes(n, s, seed)) for n, s in sorted(shard)]
        safetensors_io.write(out_dir / fname, tensors, {"format": "pt"})
        for n, _, s, data in tensors:
            weight_map[n] = fname
            total_bytes += len(data)
            params += safetensors_io.element_count(s)
        names.append(fname)
    _write_json(out_dir / "model.safetensors.index.json",
                {"metadata": {"total_size": total_bytes}, "weight_map": weight_map})
    return names + ["model.safetensors.index.json"], total_bytes, params


def write_tokenizer(out_dir: Path) -> tuple[list[str], dict[str, int]]:
    """The tokenizer's four files in Qwen2's layout into ``out_dir``: (their names, the
    special tokens' ids)."""
    vocab, merges = tokenizer.train_bpe()
    _write_json(out_dir / "tokenizer.json", tokenizer.tokenizer_json(vocab, merges))
    _write_json(out_dir / "tokenizer_config.json",
                tokenizer.tokenizer_config(vocab, DIMENSIONS["max_position_embeddings"]))
    _write_json(out_dir / "vocab.json", vocab)
    (out_dir / "merges.txt").write_text(tokenizer.merges_txt(merges), encoding="utf-8")
    names = ["tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"]
    return names, tokenizer.special_token_ids(vocab)


def _readme(repo_id: str) -> str:
    return (f"---\nlicense: apache-2.0\nlibrary_name: transformers\npipeline_tag: text-generation\n"
            f"---\n# {repo_id}\n\nA tiny, randomly initialised Qwen2ForCausalLM generated by "
            f"sandbox.mirror for tests. It produces noise, not language.\n")


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob with these contents."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The pointer git stores in place of an LFS file; HF's blobId for LFS files is its sha1."""
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\n"
            f"size {size}\n").encode()


def _file_entry(out_dir: Path, name: str) -> dict[str, object]:
    data = (out_dir / name).read_bytes()
    sha256 = hashlib.sha256(data).hexdigest()
    is_lfs = name.endswith(".safetensors")
    pointer = lfs_pointer(sha256, len(data)) if is_lfs else None
    content_sha1 = git_blob_sha1(data)
    return {
        "path": name,
        "size": len(data),
        "sha256": sha256,
        "git_sha1": content_sha1,
        "lfs": is_lfs,
        # What git (and the HF API's blobId) holds: the pointer for LFS files, else the file.
        "blob_id": git_blob_sha1(pointer) if pointer else content_sha1,
        "pointer_size": len(pointer) if pointer else None,
    }


def _commit_sha(files: list[dict[str, object]], repo_id: str, revision: str) -> str:
    """A real git commit id over a flat tree of the repo's blobs (LFS files as pointers)."""
    tree = b"".join(b"100644 " + str(f["path"]).encode() + b"\0" + bytes.fromhex(str(f["blob_id"]))
                    for f in sorted(files, key=lambda f: str(f["path"]).encode()))
    tree_sha = hashlib.sha1(b"tree %d\0" % len(tree) + tree).hexdigest()
    body = (f"tree {tree_sha}\nauthor {_GIT_IDENTITY}\ncommitter {_GIT_IDENTITY}\n\n"
            f"{repo_id} ({revision}), sandbox.mirror generator v{GENERATOR_VERSION}\n").encode()
    return hashlib.sha1(b"commit %d\0" % len(body) + body).hexdigest()


def api_response(manifest: dict[str, object], config: dict[str, object],
                 tok_config: dict[str, object]) -> dict[str, object]:
    """What ``GET /api/models/{repo}/revision/{rev}?blobs=true`` answers on the Hub."""
    repo_id = str(manifest["repo_id"])
    siblings = []
    for f in manifest["files"]:  # type: ignore[union-attr]
        entry: dict[str, object] = {"rfilename": f["path"], "blobId": f["blob_id"],
                                    "size": f["size"]}
        if f["lfs"]:
            entry["lfs"] = {"sha256": f["sha256"], "size": f["size"],
                            "pointerSize": f["pointer_size"]}
        siblings.append(entry)
    params = manifest["weights"]["parameters"]  # type: ignore[index]
    return {
        "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
        "id": repo_id,
        "modelId": repo_id,
        "author": repo_id.split("/")[0],
        "sha": manifest["sha"],
        "lastModified": _TIMESTAMP,
        "createdAt": _TIMESTAMP,
        "private": False,
        "disabled": False,
        "gated": False,
        "downloads": 0,
        "likes": 0,
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["transformers", "safetensors", "qwen2", "text-generation"],
        "config": {
            "architectures": config["architectures"],
            "model_type": config["model_type"],
            "tokenizer_config": {k: tok_config[k] for k in
                                 ("bos_token", "chat_template", "eos_token", "pad_token",
                                  "unk_token")},
        },
        "safetensors": {"parameters": {"BF16": params}, "total": params},
        "siblings": siblings,
        "spaces": [],
        "usedStorage": manifest["total_size"],
    }


def generate(out_dir: Path, *, repo_id: str = DEFAULT_REPO_ID,
             revision: str = DEFAULT_REVISION, seed: int = 0) -> dict[str, object]:
    """Write the repository into ``out_dir`` and return its manifest.

    Manifest: ``repo_id``, ``revision`` (branch), ``sha`` (40-hex commit id), ``files`` (each
    ``path, size, sha256, git_sha1, lfs, blob_id, pointer_size``), ``total_size``, ``weights``.
    The manifest and the Hub API answer are also written under ``out_dir/.mirror/``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = model_config()
    tok_names, specials = write_tokenizer(out_dir)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation_config(specials))
    (out_dir / ".gitattributes").write_text(GITATTRIBUTES, encoding="utf-8")
    (out_dir / "README.md").write_text(_readme(repo_id), encoding="utf-8")
    weight_names, tensor_total, params = _write_weights(out_dir, seed)
    names = sorted([".gitattributes", "README.md", "config.json", "generation_config.json",
                    *tok_names, *weight_names])
    files = [_file_entry(out_dir, name) for name in names]
    manifest: dict[str, object] = {
        "repo_id": repo_id,
        "revision": revision,
        "sha": _commit_sha(files, repo_id, revision),
        "generator": {"name": "sandbox.mirror", "version": GENERATOR_VERSION, "seed": seed},
        "files": files,
        "total_size": sum(int(f["size"]) for f in files),
        "weights": {"dtype": "BF16", "num_shards": len(weight_names) - 1,
                    "total_size": tensor_total, "parameters": params},
    }
    meta = out_dir / METADATA_DIR
    meta.mkdir(exist_ok=True)
    _write_json(meta / MANIFEST_NAME, manifest)
    tok_config = json.loads((out_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    _write_json(meta / API_NAME, api_response(manifest, config, tok_config))
    return manifest


def load_manifest(repo_dir: Path) -> dict[str, object]:
    """Read the manifest ``generate`` wrote into ``repo_dir``."""
    return json.loads((Path(repo_dir) / METADATA_DIR / MANIFEST_NAME).read_text(encoding="utf-8"))
