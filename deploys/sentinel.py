"""Sentinel: the engine asked for a one-token completion every interval; the host out of
rotation and the engine restarted when they fail.

    pyinfra inventory.py deploys/sentinel.py

The stage itself: pyinfra_vllm/stages/sentinel.py.
"""

from pyinfra_vllm.stages.sentinel import sentinel

sentinel()
