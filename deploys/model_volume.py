"""Model volume: XFS for the weights, mounted with noatime at model_dir, in fstab by UUID.

    pyinfra inventory.py deploys/model_volume.py

The stage itself: pyinfra_vllm/stages/model_volume.py.
"""

from pyinfra_vllm.stages.model_volume import model_volume

model_volume()
