"""Python environment: vLLM and torch, pinned by the stack, in an environment of their own.

    pyinfra inventory.py deploys/python_env.py

The stage itself: pyinfra_vllm/stages/python_env.py.
"""

from pyinfra_vllm.stages.python_env import python_env

python_env()
