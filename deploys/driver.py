"""Driver: install the pinned branch on a host without one, and keep it from drifting.

    pyinfra inventory.py deploys/driver.py

The stage itself: pyinfra_vllm/stages/driver.py.
"""

from pyinfra_vllm.stages.driver import driver

driver()
