"""Router: the fleet's front door, HAProxy in front of the serving hosts' gateways.

    pyinfra inventory.py deploys/router.py --limit routers

The stage itself: pyinfra_vllm/stages/router.py; the whole run (deploys/full.py) runs it,
and only it, on the hosts of the inventory's routers group.
"""

from pyinfra_vllm.stages.router import router

router()
