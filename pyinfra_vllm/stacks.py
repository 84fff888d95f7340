"""Supported software stacks, as data: one row per vLLM release.

``vllm_version`` selects a row. Each number carries its source, so a reader can check
it against the release it describes. The python_env stage installs a row exactly; the
preflight compares the host's driver with ``min_driver``; the compatibility gate
(pyinfra_vllm/compat.py) reads ``architectures`` and ``FIRST_SUPPORTED``.

How the numbers were read (2026, from PyPI, without downloading whole wheels):
``Requires-Dist`` from each wheel's METADATA (PEP 658 ``.whl.metadata`` files, or
``unzip -p`` on the 0.6.3 wheel); ``vllm/model_executor/models/registry.py`` from the
x86_64 wheels of the releases named in FIRST_SUPPORTED, fetched member by member with
HTTP range requests against files.pythonhosted.org.
"""

from __future__ import annotations

STACKS: dict[str, dict] = {
    "0.6.3": {
        "vllm": "0.6.3",
        # vllm-0.6.3 wheel METADATA: Requires-Python >=3.8; 3.10 is the seed's and
        # the oldest Python pyinfra-side tooling here supports. conda installs exactly
        # this; uv/venv use the host's python3 when it is inside python_range.
        "python": "3.10",
        # torch 2.4.0 on PyPI has cp38..cp312 wheels (xformers 0.0.27.post2 the same):
        # Ubuntu 22.04's 3.10 and Debian 12's 3.11 both qualify.
        "python_range": ["3.8", "3.12"],
        # wheel METADATA: Requires-Dist torch==2.4.0, torchvision==0.19,
        # xformers==0.0.27.post2 (linux x86_64).
        "torch": "2.4.0",
        # docs.vllm.ai v0.6.3 installation: PyPI wheels are built with CUDA 12.1.
        "cuda": "12.1",
        # NVIDIA CUDA 12.1 GA release notes, table 3: Linux driver >= 530.30.02.
        "min_driver": "530.30.02",
        # wheel METADATA says transformers>=4.45.0, tokenizers>=0.19.1, numpy<2.0.0, so an
        # unpinned install today takes transformers 5.x, which 0.6.3 cannot import;
        # 4.45.2 is the release 0.6.3 shipped against (its release date, October 2024).
        "pins": {
            "torch": "2.4.0",
            "torchvision": "0.19.0",
            "xformers": "0.0.27.post2",
            "transformers": "4.45.2",
            "tokenizers": "0.20.1",
            "numpy": "1.26.4",
            # triton 3.0.0 (torch 2.4.0's pin) imports setuptools when vLLM is imported
            # (triton/runtime/build.py line 8; seen failing in a sandbox uv venv, which,
            # unlike python3 -m venv on 3.11, seeds no setuptools). 75.1.0: September
            # 2024, before vLLM 0.6.3 (October 2024).
            "setuptools": "75.1.0",
        },
        # vllm/model_executor/models/registry.py in the 0.6.3 wheel (_VLLM_MODELS): its
        # Qwen rows. The full registry of an installed vLLM is read from the host.
        "qwen_architectures": [
            "Qwen2ForCausalLM",
            "Qwen2MoeForCausalLM",
            "Qwen2VLForConditionalGeneration",
            "QWenLMHeadModel",
        ],
        # Built-in table for the compatibility gate (same source); Qwen2ForRewardModel
        # is an embedding (reward) model there, not a generator.
        "architectures": [
            "QWenLMHeadModel",
            "Qwen2ForCausalLM",
            "Qwen2MoeForCausalLM",
            "Qwen2ForRewardModel",
            "Qwen2VLForConditionalGeneration",
        ],
        # vllm/engine/arg_utils.py at v0.6.3: --block-size choices=[8, 16, 32].
        "block_sizes": [8, 16, 32],
    },
    "0.17.0": {
        # The first release whose registry has Qwen3_5ForConditionalGeneration (Qwen3.5 /
        # Qwen3.6 dense, e.g. Qwen/Qwen3.6-27B): absent from 0.16.0's registry.py, present
        # in 0.17.0's. 0.17.1 (same torch pin) also exists on PyPI.
        "vllm": "0.17.0",
        # vllm-0.17.0 wheel METADATA: Requires-Python <3.14,>=3.10. 3.12 is inside that
        # range and is what torch 2.10 and vLLM's own docs build against.
        "python": "3.12",
        "python_range": ["3.10", "3.13"],
        # wheel METADATA: Requires-Dist torch==2.10.0, torchaudio==2.10.0,
        # torchvision==0.25.0, flashinfer-python==0.6.4.
        "torch": "2.10.0",
        # torch-2.10.0 (PyPI, linux x86_64) METADATA: nvidia-cuda-runtime-cu12==12.8.90,
        # nvidia-cublas-cu12==12.8.4.1, nvidia-nccl-cu12==2.27.5: the CUDA 12.8 build
        # (runtime 12.8.90 is CUDA 12.8 Update 1). vLLM's PyPI wheel is built against
        # that torch.
        "cuda": "12.8",
        # NVIDIA CUDA release notes, table 3 ("CUDA Toolkit and Corresponding Driver
        # Versions"): CUDA 12.8 GA >= 570.26, CUDA 12.8 Update 1 >= 570.124.06 (the 12.8.1
        # runfile bundles 570.124.06). The wheel's runtime is Update 1, so the row asks
        # for 570.124.06. NOT re-verified against NVIDIA's page in this session (no
        # access); any 12.x runtime also runs on >= 525.60.13 through minor-version
        # compatibility, without PTX JIT, which Triton/FlashInfer kernels may need.
        "min_driver": "570.124.06",
        # wheel METADATA: transformers<5,>=4.56.0; 4.57.6 is the newest 4.x on PyPI and its
        # METADATA asks tokenizers<=0.23.0,>=0.22.0 (0.22.2 is the newest such release;
        # vLLM asks >=0.21.1). numpy is left to the resolver: vLLM does not cap it and
        # numba==0.61.2 (a vLLM pin) bounds it.
        "pins": {
            "torch": "2.10.0",
            "torchvision": "0.25.0",
            "torchaudio": "2.10.0",
            "flashinfer-python": "0.6.4",
            "transformers": "4.57.6",
            "tokenizers": "0.22.2",
            "numba": "0.61.2",
        },
        # vllm/model_executor/models/registry.py in the 0.17.0 wheel: its Qwen generator
        # rows (text and multimodal).
        "qwen_architectures": [
            "QWenLMHeadModel",
            "Qwen2ForCausalLM",
            "Qwen2MoeForCausalLM",
            "Qwen3ForCausalLM",
            "Qwen3MoeForCausalLM",
            "Qwen3NextForCausalLM",
            "QwenVLForConditionalGeneration",
            "Qwen2VLForConditionalGeneration",
            "Qwen2_5_VLForConditionalGeneration",
            "Qwen2AudioForConditionalGeneration",
            "Qwen3VLForConditionalGeneration",
            "Qwen3VLMoeForConditionalGeneration",
            "Qwen3_5ForConditionalGeneration",
            "Qwen3_5MoeForConditionalGeneration",
        ],
        "architectures": [
            "QWenLMHeadModel",
            "Qwen2ForCausalLM",
            "Qwen2MoeForCausalLM",
            "Qwen2ForRewardModel",
            "Qwen3ForCausalLM",
            "Qwen3MoeForCausalLM",
            "Qwen3NextForCausalLM",
            "QwenVLForConditionalGeneration",
            "Qwen2VLForConditionalGeneration",
            "Qwen2_5_VLForConditionalGeneration",
            "Qwen2AudioForConditionalGeneration",
            "Qwen3VLForConditionalGeneration",
            "Qwen3VLMoeForConditionalGeneration",
            "Qwen3_5ForConditionalGeneration",
            "Qwen3_5MoeForConditionalGeneration",
        ],
        # vllm/config/cache.py in the 0.17.0 wheel: BlockSize = Literal[1, 8, 16, 32, 64,
        # 128, 256]. (The settings' block_size still offers 8/16/32, valid in both rows.)
        "block_sizes": [1, 8, 16, 32, 64, 128, 256],
    },
}

# The first vLLM release whose model registry lists an architecture. Each "first" was
# checked by reading registry.py in the PyPI x86_64 wheel of that release AND of the
# release just before it (named in the comment), where the name is absent.
# "<=0.6.3" rows: present in 0.6.3, the oldest release this table covers; earlier
# history was not checked, so 0.6.3 is what the table claims.
FIRST_SUPPORTED: dict[str, str] = {
    "QWenLMHeadModel": "0.6.3",  # <=0.6.3
    "Qwen2ForCausalLM": "0.6.3",  # <=0.6.3
    "Qwen2MoeForCausalLM": "0.6.3",  # <=0.6.3
    "Qwen2VLForConditionalGeneration": "0.6.3",  # <=0.6.3
    "Qwen2_5_VLForConditionalGeneration": "0.7.2",  # absent in 0.7.1
    "Qwen3ForCausalLM": "0.8.4",  # absent in 0.8.3
    "Qwen3MoeForCausalLM": "0.8.4",  # absent in 0.8.3
    "Qwen3NextForCausalLM": "0.10.2",  # absent in 0.10.1.1
    "Qwen3VLForConditionalGeneration": "0.11.0",  # absent in 0.10.2
    "Qwen3VLMoeForConditionalGeneration": "0.11.0",  # absent in 0.10.2
    "Qwen3_5ForConditionalGeneration": "0.17.0",  # absent in 0.16.0
    "Qwen3_5MoeForConditionalGeneration": "0.17.0",  # absent in 0.16.0
}

# The installers of the Python environment, pinned like the stacks they install.
INSTALLERS: dict[str, dict] = {
    # PyPI: uv 0.13.9 uploaded 2026-11-17, the newest release then (`pip index versions
    # uv`); its wheel carries the static binary, so the index is the only source needed.
    "uv": {"version": "0.13.9"},
    # conda-forge/miniforge tag 26.3.2-3 (2026-05-29; bundles conda 26.3.2, Python
    # 3.13 for conda itself: Miniforge3/construct.yaml). The checksums are the release's
    # .sha256 values as pinned, identically, by Python-for-HPC/PyOMP
    # buildscripts/cibuildwheel/setup-miniforge3.sh (commit b4b024d6) and a fork of
    # spack-packages (miniforge3/package.py); github.com was not reachable from here to
    # read the release assets themselves. The installer refuses to run on a mismatch.
    "miniforge": {
        "version": "26.3.2-3",
        "url": "https://github.com/conda-forge/miniforge/releases/download/{version}/"
        "Miniforge3-{version}-Linux-{arch}.sh",
        "sha256": {
            "x86_64": "848194851a98903134187fbb4ab50efe87b003e0c0f808f97644b7524a62bf2c",
            "aarch64": "2c113a69297e612b01ca0f320c22a3107a11f2ab9b573d79ac868a175945ce29",
        },
    },
}
