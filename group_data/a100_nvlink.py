"""Settings of the a100_nvlink group in inventory.py: Qwen3.6-27B on two NVLink-joined
A100 80GB, tensor parallel 2, BF16, 128K context.

The stack is vLLM 0.33.0, the newest row (pyinfra_vllm/core/stacks.py), not the seed's
0.6.3: Qwen3.6-27B's config.json names the architecture Qwen3_5ForConditionalGeneration,
which vLLM first registered in 0.17.0 (absent from 0.16.0's registry; FIRST_SUPPORTED),
and 0.33.0's registry still has it. On 0.6.3 the preflight refuses the host with exactly
that message before anything changes.

0.33.0 is built with CUDA 13.0 (torch 2.14.0; its lock pins the CUDA runtime 13.0.96,
CUDA 13.0 Update 2), whose driver floor is 580.95.05: the driver branch is 580-server.
570 is below it (the settings refuse the combination): CUDA 13.x needs a driver of the
580 branch or newer (NVIDIA's CUDA minor version compatibility table), as the 535 branch
already could not run vLLM's CUDA 12.9 wheels (vllm-project/vllm#30633). The A100's compute
capability 8.0 is among the architectures that torch build carries (sm_75 to sm_120).
0.33.0 needs Python 3.11 or newer, which Ubuntu 22.04's python3 (3.10) is not: the
environment manager stays conda (the default), which installs the row's Python 3.12.

To stay on the previous stack (rolled back, or not yet moved): --data
vllm_version=0.17.0 --data nvidia_driver_branch=570-server, as docs/upgrades.md says.

Lock the model once, on the operator's machine, before the first run:

    python -m tools.model_lock Qwen/Qwen3.6-27B --revision main
"""

vllm_version = "0.33.0"
nvidia_driver_branch = "580-server"
model_id = "Qwen/Qwen3.6-27B"
