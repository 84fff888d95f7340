"""Supported software stacks, as data: one row per vLLM release.

``vllm_version`` selects a row. Each number carries its source, so a reader can check
it against the release it describes. The runtime layer installs a row exactly; the
preflight compares the host's driver with ``min_driver``.
"""

from __future__ import annotations

STACKS: dict[str, dict] = {
    "0.6.3": {
        "vllm": "0.6.3",
        # vllm-0.6.3 wheel METADATA: Requires-Python >=3.8; 3.10 is the seed's and
        # the oldest Python pyinfra-side tooling here supports.
        "python": "3.10",
        # wheel METADATA: Requires-Dist torch==2.4.0, torchvision==0.19,
        # xformers==0.0.27.post2.
        "torch": "2.4.0",
        # docs.vllm.ai v0.6.3 installation: PyPI wheels are built with CUDA 12.1.
        "cuda": "12.1",
        # NVIDIA CUDA 12.1 GA release notes, table 3: Linux driver >= 530.30.02.
        "min_driver": "530.30.02",
        # wheel METADATA says transformers>=4.45.0, so an unpinned install today takes
        # transformers 5.x, which 0.6.3 cannot import; 4.45.2 is the release 0.6.3
        # shipped against (notes/seed-review.md).
        "pins": {
            "torch": "2.4.0",
            "torchvision": "0.19.0",
            "xformers": "0.0.27.post2",
            "transformers": "4.45.2",
            "tokenizers": "0.20.1",
            "numpy": "1.26.4",
        },
        # vllm/model_executor/models/registry.py at v0.6.3: its Qwen rows (the full
        # registry of an installed vLLM is read from the host).
        "qwen_architectures": [
            "Qwen2ForCausalLM",
            "Qwen2MoeForCausalLM",
            "Qwen2VLForConditionalGeneration",
            "QWenLMHeadModel",
        ],
        # vllm/engine/arg_utils.py at v0.6.3: --block-size choices.
        "block_sizes": [8, 16, 32],
    },
}
