"""Remove what the suite installed from the hosts; packages, data and the operator's
files stay (remove_model_files and remove_volume_fstab take more).

    pyinfra inventory.py deploys/remove.py --dry   # what would go
    pyinfra inventory.py deploys/remove.py

The stage itself: pyinfra_vllm/stages/remove.py.
"""

from pyinfra_vllm.stages.remove import remove

remove()
