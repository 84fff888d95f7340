"""The throw-away model repo of the download benchmarks (bench/download.sh,
bench/download_link.sh): the mirror's tiny Qwen2 plus random "LFS" shards, in the
mirror's layout, so that ``python3 -m sandbox.mirror serve`` serves it.

    PYTHONPATH=. python3 bench/bench_repo.py OUT_DIR SHARD_MIB SHARDS

Shards are ``bench-00000.safetensors``, ``bench-00001.safetensors`` ..., SHARD_MIB MiB
of os.urandom each.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from sandbox.mirror import model


def build(out: Path, shard_mib: int, shards: int) -> None:
    manifest = model.generate(out, repo_id="sandbox/bench-qwen2")
    for index in range(shards):
        with open(out / f"bench-{index:05d}.safetensors", "wb") as handle:
            for _ in range(shard_mib):
                handle.write(os.urandom(1 << 20))
    names = sorted(path.name for path in out.iterdir() if path.is_file())
    manifest["files"] = [model._file_entry(out, name) for name in names]
    manifest["total_size"] = sum(entry["size"] for entry in manifest["files"])
    (out / ".mirror/manifest.json").write_text(json.dumps(manifest, indent=1))
    config = json.loads((out / "config.json").read_text())
    tokenizer = json.loads((out / "tokenizer_config.json").read_text())
    (out / ".mirror/api.json").write_text(
        json.dumps(model.api_response(manifest, config, tokenizer)))


if __name__ == "__main__":
    build(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
