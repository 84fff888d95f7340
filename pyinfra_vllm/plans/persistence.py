"""The persistence daemon's unit and the suite's drop-in for it."""

from __future__ import annotations

PERSISTENCED_UNIT = "nvidia-persistenced.service"
PERSISTENCED_DROP_IN = "/etc/systemd/system/nvidia-persistenced.service.d/50-pyinfra-vllm.conf"
