"""Sysctl: kernel parameters for a long-context server, persisted and applied.

    pyinfra inventory.py deploys/sysctl.py

The stage itself: pyinfra_vllm/stages/sysctl.py.
"""

from pyinfra_vllm.stages.sysctl import sysctl

sysctl()
