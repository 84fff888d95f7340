"""Settings of the a100_nvlink group in inventory.py: Qwen3.6-27B on two NVLink-joined
A100 80GB, tensor parallel 2, BF16, 128K context.

The stack is vLLM 0.17.0, not the seed's 0.6.3: Qwen3.6-27B's config.json names the
architecture Qwen3_5ForConditionalGeneration, which vLLM first registered in 0.17.0
(absent from 0.16.0's registry; pyinfra_vllm/core/stacks.py FIRST_SUPPORTED). On 0.6.3 the
preflight refuses the host with exactly that message before anything changes. 0.17.0 is
built with CUDA 12.8 (torch 2.10), so the driver branch moves to 570-server: 535 is
below that stack's minimum driver, and the settings refuse the combination.

Lock the model once, on the operator's machine, before the first run:

    python -m tools.model_lock Qwen/Qwen3.6-27B --revision main
"""

vllm_version = "0.17.0"
nvidia_driver_branch = "570-server"
model_id = "Qwen/Qwen3.6-27B"
