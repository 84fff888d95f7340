"""vLLM service: the OpenAI server under systemd, tensor parallel on the NVLink-joined GPUs.

    pyinfra inventory.py deploys/vllm_service.py

The stage itself: pyinfra_vllm/stages/vllm_service.py.
"""

from pyinfra_vllm.stages.vllm_service import vllm_service

vllm_service()
