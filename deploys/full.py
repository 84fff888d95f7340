"""Bootstrap or repair a GPU server, stage by stage, in the order of the runbook.

    pyinfra inventory.py deploys/full.py              # converge
    pyinfra inventory.py deploys/full.py --dry --diff # show what would change

Settings are validated first: a bad value stops the whole run before any host is
touched. A host whose state fails a check stops with its reason; the others go on.
Each stage is also a deploy of its own (deploys/<stage>.py), and any can be skipped
with the skip_stages setting.
"""

from pyinfra import local

# Check, change nothing: OS, driver, GPUs, NVLink between the tensor-parallel GPUs.
local.include("deploys/preflight.py")
# The pinned driver on a bare host (then reboot), packages held against upgrades.
local.include("deploys/driver.py")
# MIG off, the mig-parted way: never reset a GPU in use.
local.include("deploys/mig.py")
# Persistence mode through nvidia-persistenced.
local.include("deploys/persistence.py")
# Kernel parameters in a sysctl.d drop-in, applied now.
local.include("deploys/sysctl.py")
# XFS with noatime for the weights, in fstab by UUID.
local.include("deploys/model_volume.py")
# vLLM and torch, pinned by the stack, in an environment proven before it is used.
local.include("deploys/python_env.py")
# The locked model files, downloaded and verified into the model volume.
local.include("deploys/model.py")
# The engine under systemd: GPU guard before each start, ready only once it serves.
local.include("deploys/vllm_service.py")
# nginx in front of the engine: API keys, streaming without buffering, /metrics.
local.include("deploys/gateway.py")
# The verdicts and the capacity plan, for node_exporter's textfile collector.
local.include("deploys/metrics.py")
