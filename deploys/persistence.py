"""Persistence: the nvidia-persistenced daemon keeps every GPU initialised.

    pyinfra inventory.py deploys/persistence.py

The stage itself: pyinfra_vllm/stages/persistence.py.
"""

from pyinfra_vllm.stages.persistence import persistence

persistence()
