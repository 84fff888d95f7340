"""Rolling restarts across the fleet: at most ``rolling_batch`` hosts drained and
restarted at once, and the rollout stopped at the first host that fails.

pyinfra 3 runs one operation on every host at once, a greenlet per host, and waits for
all of them before the next operation (pyinfra/api/operations.py, ``_run_single_op``);
its ``_parallel`` argument cuts the hosts into batches but runs the next batch whatever
the previous one did. Here the hosts' greenlets of one run share a ``Rollout`` (one per
pyinfra ``State``): a gevent semaphore of ``rolling_batch`` slots, taken before a host
is drained and given back once its engine is ready, and the first failure, which every
host still waiting reads when its turn comes and fails with instead of changing
anything. The hosts take their turns in the order pyinfra runs them, which comes from
its set of active hosts (``State.active_hosts``), not the inventory's order: no host is
a designated canary; whichever goes first and fails stops the others.

A host is drained with two flag files (on the /run tmpfs, so a reboot clears them) that
the gateway's site tests on every request (templates/nginx-vllm.conf.j2): first
``LEAVE_FLAG``, /health answers 503 while /v1 still serves, so load balancers take the
host out (drain_leave_s) before any request meets a refusal; then ``DRAIN_FLAG``, /v1
answers 503 too while the requests in flight finish (drain_grace_s). Both are removed
together when the host serves again. Files a restart brings (the engine's
unit and environment file) wait beside their live paths under ``STAGED_SUFFIX``
(pyinfra_vllm/operations/file_set.py ``present(stage=True)``) and are moved into place inside the
slot (``promote_command``), so a host the rollout never reaches keeps its unit.
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import operation

from facts.files import PathTypes
from pyinfra_vllm.operations.util.rolling import (
    undrain_command,
)
from pyinfra_vllm.plans.gateway import DRAIN_FLAG, LEAVE_FLAG

# What not_draining reads (the vllm_service stage declares the same read).
FLAGS_READ = {"paths": [DRAIN_FLAG, LEAVE_FLAG]}


@operation()
def not_draining():
    """
    Serve again where a drain outlived its restart: its flags removed.

    A host whose engine failed readiness stays drained (its /health answers 503); so does
    one whose drain stopped after it left the load balancers (the leave flag alone). Once
    a later run has its engine running, this puts it back. No flag: no command.
    """
    found = host.get_fact(PathTypes, **FLAGS_READ)
    if not any(found.get(path) for path in FLAGS_READ["paths"]):
        host.noop("the gateway is not draining")
        return
    yield undrain_command()
