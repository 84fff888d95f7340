"""Model volume: XFS for the weights, mounted with noatime at model_dir, in fstab by UUID.

With ``model_volume_device`` set: a device carrying nothing is formatted only with
``model_volume_mkfs``; a device carrying anything but XFS stops the host, untouched.
The fstab line (``UUID=... <model_dir> xfs noatime,nofail 0 0``) is verified with
``findmnt --verify`` before it replaces /etc/fstab. Without a device, ``model_dir`` is
just a directory on the root file system.

    pyinfra inventory.py deploys/model_volume.py
"""

from __future__ import annotations

from pyinfra.facts.files import Directory
from pyinfra.operations import files

from facts.storage import BlockDevice, Fstab, MountPoint
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.operations import model_volume as model_volume_ops
from pyinfra_vllm.plans.engine_access import Endpoint
from pyinfra_vllm.run.context import HostContext
from pyinfra_vllm.run.host_reads import Read
from pyinfra_vllm.run.stage import stage


def model_volume_reads(settings: Settings, _place: Endpoint) -> list[Read]:
    """What the model_volume stage reads of a converged host: the run's one read."""
    path = settings.model_dir
    reads = [Read(Directory, {"path": path})]
    if settings.model_volume_device is not None:
        reads += [Read(BlockDevice, {"device": settings.model_volume_device}), Read(Fstab),
                  Read(MountPoint, {"path": path})]
    return reads


@stage(reads=model_volume_reads)
def model_volume(ctx: HostContext) -> None:
    """Model volume: XFS for the weights, mounted with noatime at model_dir, in fstab by UUID."""
    settings = ctx.settings
    if settings.model_volume_device is None:
        files.directory(name="Model volume: model directory", path=settings.model_dir)
    else:
        model_volume_ops.mounted(
            name="Model volume: XFS mounted at the model directory",
            device=settings.model_volume_device,
            path=settings.model_dir,
            options=list(settings.model_volume_mount_options),
            mkfs=settings.model_volume_mkfs,
        )
