"""MIG: off on every GPU, so vLLM's tensor parallelism gets whole GPUs.

    pyinfra inventory.py deploys/mig.py

The stage itself: pyinfra_vllm/stages/mig.py.
"""

from pyinfra_vllm.stages.mig import mig

mig()
