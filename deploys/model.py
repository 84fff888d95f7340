"""Model: the locked files in the model volume, each verified against the lock.

    pyinfra inventory.py deploys/model.py

The stage itself: pyinfra_vllm/stages/model.py.
"""

from pyinfra_vllm.stages.model import model

model()
