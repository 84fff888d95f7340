"""The model directory of the engine trial on a GPU (bench/gpu_engine.md): Qwen3.6-27B's
config.json (tests/fixtures/hf/qwen3.6-27b/), an image processor's configuration, and the
sandbox mirror's tokenizer; no weights (the trial asks vLLM for random ones of the
config's shapes: --load-format dummy).

    python3 -m bench.gpu_trial.model_dir DEST

The config is the model's own (Qwen3_5ForConditionalGeneration); the trial gives the
engine --language-model-only, so the vision tower is not built. The tokenizer's 616 tokens are ids the model has (its vocabulary is 248,320): prompts of
random ids, as the benchmark sends, are what the engine computes on; its answers mean
nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sandbox.mirror.model import write_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "tests" / "fixtures" / "hf" / "qwen3.6-27b" / "config.json"
# Qwen3-VL's image processor, as its Hugging Face repositories configure it (16-pixel
# patches merged 2 x 2); read by vLLM's processor even where no image is allowed.
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "min_pixels": 65536, "max_pixels": 16777216,
}


def write(dest: Path) -> list[str]:
    """The directory's files, written; their names."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(CONFIG.read_text())
    (dest / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    names, _ = write_tokenizer(dest)
    return ["config.json", "preprocessor_config.json", *names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path)
    args = parser.parse_args()
    print(f"{args.dest}: {', '.join(write(args.dest))}")


if __name__ == "__main__":
    main()
