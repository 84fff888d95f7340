"""Gateway: nginx in front of the engine, with API keys, streaming and a safe reload.

    pyinfra inventory.py deploys/gateway.py

The stage itself: pyinfra_vllm/stages/gateway.py.
"""

from pyinfra_vllm.stages.gateway import gateway

gateway()
