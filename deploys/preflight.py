"""Preflight: check the host can serve the stack before anything changes.

    pyinfra inventory.py deploys/preflight.py

The stage itself: pyinfra_vllm/stages/preflight.py.
"""

from pyinfra_vllm.stages.preflight import preflight

preflight()
