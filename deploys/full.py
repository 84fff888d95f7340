"""Bootstrap or repair a GPU server, stage by stage, in the order of the runbook.

    pyinfra inventory.py deploys/full.py              # converge
    pyinfra inventory.py deploys/full.py --dry --diff # show what would change

The stages and their order: pyinfra_vllm/stages/full.py.
"""

from pyinfra_vllm.stages.full import full

full()
