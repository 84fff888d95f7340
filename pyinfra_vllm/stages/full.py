"""The whole run: every stage, in the order of the runbook.

Settings are validated first: a bad value stops the whole run before any host is
touched. A host whose state fails a check stops with its reason; the others go on.
Each stage is also a deploy of its own (deploys/<stage>.py), and any can be skipped
with the skip_stages setting.

``full`` is the run, step by step. Its order is STAGES' (pyinfra_vllm/core/settings.py,
the one list of the stages): this module refuses to import where they differ
(pyinfra_vllm/run/stage.py ``runbook_of`` and ``runbook_order``).
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import deploy

from pyinfra_vllm.core.settings import STAGES
from pyinfra_vllm.run.context import context
from pyinfra_vllm.run.stage import runbook_of, runbook_order
from pyinfra_vllm.stages.driver import driver
from pyinfra_vllm.stages.gateway import gateway
from pyinfra_vllm.stages.metrics import metrics
from pyinfra_vllm.stages.mig import mig
from pyinfra_vllm.stages.model import model
from pyinfra_vllm.stages.model_volume import model_volume
from pyinfra_vllm.stages.persistence import persistence
from pyinfra_vllm.stages.preflight import preflight
from pyinfra_vllm.stages.python_env import python_env, python_env_built
from pyinfra_vllm.stages.router import is_router, router
from pyinfra_vllm.stages.sentinel import sentinel
from pyinfra_vllm.stages.sysctl import sysctl
from pyinfra_vllm.stages.vllm_service import vllm_service


@deploy("full")
def full() -> None:
    """Bootstrap or repair a GPU server, stage by stage."""
    # A front door (a host of the inventory's routers group) gets the router stage alone:
    # HAProxy in front of the other hosts' gateways (pyinfra_vllm/stages/router.py).
    if is_router(host):
        router()
        return
    # What every stage reads of a converged host, read in one remote command up front.
    context(host, stages=STAGES)
    # Check, change nothing: OS, driver, GPUs, NVLink between the tensor-parallel GPUs.
    preflight()
    # The pinned driver on a bare host (then reboot), packages held against upgrades.
    driver()
    # MIG off, the mig-parted way: never reset a GPU in use.
    mig()
    # Persistence mode through nvidia-persistenced.
    persistence()
    # Kernel parameters in a sysctl.d drop-in, applied now.
    sysctl()
    # XFS with noatime for the weights, in fstab by UUID.
    model_volume()
    # vLLM and torch, pinned by the stack, in an environment proven before it is used:
    # its build starts here and runs on the host while the model downloads.
    python_env(wait=False)
    # The locked model files, downloaded and verified into the model volume.
    model()
    # The environment's build followed to its end; `current` moved to it.
    python_env_built()
    # The engine under systemd: GPU guard before each start, ready only once it serves.
    vllm_service()
    # nginx in front of the engine: API keys, streaming without buffering, /metrics.
    gateway()
    # The verdicts and the capacity plan, for node_exporter's textfile collector.
    metrics()
    # A one-token completion every interval: out of rotation and restarted when they fail.
    sentinel()


# Each stage is called on a line of its own, never from a loop over a list: pyinfra orders
# a run's operations by the lines they were called from (pyinfra/api/util.py
# get_operation_order_from_stack), and a loop calls every stage from one line, which
# hosts that skip different stages turn into a cycle ("Cycle detected in operation
# ordering DAG"). The calls above, read from this file, are refused as it is imported
# unless they run STAGES each once, in STAGES' order.
RUNBOOK = runbook_of(__file__, "full", globals())
runbook_order(RUNBOOK)
