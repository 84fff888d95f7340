"""Audit: read every host's OS, driver, GPUs, MIG, persistence, topology and NVLink

    pyinfra inventory.py deploys/audit.py

The stage itself: pyinfra_vllm/stages/audit.py.
"""

from pyinfra_vllm.stages.audit import audit

audit()
