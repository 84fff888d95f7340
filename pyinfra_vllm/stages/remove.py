"""Remove: take off what the suite installed, keep what the host may need.

In order: the suite's long jobs still running (a model download or an environment's
build an interrupted run left: stopped, so nothing writes into what is removed next),
the engine (vllm.service stopped, disabled, its unit, environment file and helpers
removed, systemd reloaded; on TCP its nftables table unloaded), the gateway's nginx
files (site, API keys, the engine's key, TLS; nginx -t before the reload, the files
put back if nginx would fail without them), node_exporter (the suite's drop-in removed,
the service stopped and disabled: without the drop-in it would listen on every
address), the metrics and benchmark textfiles and the old per-host scrape job, the
sysctl drop-in (then ``sysctl --system``), the persistence daemon's drop-in, the
driver's package holds, upgrade blacklist and apt sources, the Python environments
(what the suite put in python_env_root: the operator's files there stay, and the
directory with them), the engine's state directory, the benchmark's records and the
suite's own files under /var/lib/pyinfra-vllm. With ``remove_model_files`` the model's
files, with ``remove_volume_fstab`` the volume's mount and fstab line. A directory with
the suite's own fixed name goes whole; in one a setting names, only what the suite put
there.

Kept: the distribution packages (nginx, prometheus-node-exporter, the NVIDIA driver),
which the host may need and another user may rely on; the vllm account; what the suite
set aside (foreign nginx files and drop-ins under /var/lib/pyinfra-vllm/nginx-disabled
and disabled-drop-ins: the operator's, never deleted); the live kernel parameters (the
drop-in gone, ``sysctl --system`` re-applies the remaining files, but a key no other
file sets keeps its value until the next boot). Nothing is formatted or wiped. A second
removal changes nothing. docs/stages.md says what each step reads.

    pyinfra inventory.py deploys/remove.py
"""

from __future__ import annotations

from pyinfra import host, logger
from pyinfra.api import deploy
from pyinfra.operations import systemd

from pyinfra_vllm.core.locks import LockFileError, load_lock
from pyinfra_vllm.core.settings import Settings, load_settings
from pyinfra_vllm.operations import file_set
from pyinfra_vllm.operations import remove as remove_ops
from pyinfra_vllm.operations import vllm_service as vllm_service_ops
from pyinfra_vllm.operations.util.uploads import SECRET_DIR
from pyinfra_vllm.plans import bench as bench_plan
from pyinfra_vllm.plans import driver as driver_plan
from pyinfra_vllm.plans import engine_access
from pyinfra_vllm.plans import gateway as gateway_plan
from pyinfra_vllm.plans import metrics as metrics_plan
from pyinfra_vllm.plans import model as model_plan
from pyinfra_vllm.plans import persistence as persistence_plan
from pyinfra_vllm.plans import sysctl as sysctl_plan
from pyinfra_vllm.plans import vllm_service as vllm_plan
from pyinfra_vllm.plans.python_env import COMPILE_CACHE_ROOT
from pyinfra_vllm.stages.sentinel import sentinel_removed

# Under /var/lib/pyinfra-vllm (pyinfra_vllm/plans/model.py TOOL_DIR): the downloader and the
# model locks go; gateway_plan.DISABLED_DIR and units.DISABLED_DROP_IN_DIR, what the suite
# set aside, stay.
TOOL_FILES = (f"{model_plan.TOOL_DIR}/fetch_model.py", f"{model_plan.TOOL_DIR}/locks")


@deploy("remove")
def remove() -> None:
    """Remove what the suite installed; keep packages, data and what it set aside."""
    settings = load_settings(host)

    _services(settings)
    _system(settings)
    _data(settings)


def _services(settings: Settings) -> None:
    """The suite's jobs, the engine, the gateway's site and node_exporter's drop-in."""
    remove_ops.jobs_stopped(
        name="Remove: the suite's running jobs stopped (a model download, an environment's build)",
    )
    # The sentinel first: it would restart the engine stopped below, and its program
    # goes with the helpers' directory.
    sentinel_removed(settings, "Remove")
    remove_ops.unit_removed(
        name="Remove: vllm.service stopped, disabled and removed",
        unit=f"{vllm_plan.SERVICE}.service",
        paths=[vllm_plan.UNIT_PATH, f"{vllm_plan.UNIT_PATH}.d"],
    )
    vllm_service_ops.engine_firewall(name="Remove: the engine's nftables table unloaded")
    file_set.absent(
        name="Remove: the engine's environment file and helpers",
        paths=[vllm_plan.ENV_PATH.rpartition("/")[0], vllm_plan.HELPER_DIR],
    )

    remove_ops.nginx_site_removed(
        name="Remove: the gateway's nginx site, API keys, the engine's key and TLS files "
        "(nginx -t before reload)",
        paths=[gateway_plan.SITE_PATH, gateway_plan.KEYS_PATH, engine_access.KEY_NGINX_PATH,
               gateway_plan.TLS_DIR, gateway_plan.STAGING_DIR],
    )

    remove_ops.unit_removed(
        name="Remove: node_exporter stopped and disabled, the suite's drop-in removed",
        unit=metrics_plan.UNIT,
        paths=[metrics_plan.DROP_IN],
    )
    file_set.absent(
        name="Remove: the metrics textfiles and the old scrape job",
        paths=[f"{settings.textfile_collector_dir}/{metrics_plan.TEXTFILE_NAME}",
               f"{settings.textfile_collector_dir}/{metrics_plan.HEALTH_TEXTFILE_NAME}",
               bench_plan.textfile_path(settings), metrics_plan.LEGACY_SCRAPE_JOB],
    )


def _system(settings: Settings) -> None:
    """The kernel parameters, the persistence daemon's drop-in, the driver's holds."""
    sysctl_file = file_set.absent(
        name="Remove: the sysctl drop-in",
        paths=[sysctl_plan.drop_in_path(settings.sysctl_file_priority)],
    )
    remove_ops.sysctl_reapplied(
        name="Remove: sysctl --system (the remaining files)",
        keys=sorted(settings.sysctl),
        _if=sysctl_file.did_change,
    )

    persistenced = file_set.absent(
        name="Remove: the nvidia-persistenced drop-in",
        paths=[persistence_plan.PERSISTENCED_DROP_IN],
    )
    # The daemon keeps running: it is the driver package's, and persistence mode is what
    # NVIDIA recommends; it starts with the package's command line at its next start.
    systemd.daemon_reload(name="Remove: reload systemd units", _if=persistenced.did_change)

    remove_ops.holds_released(
        name="Remove: holds on the NVIDIA driver and CUDA packages released",
        prefixes=list(driver_plan.DRIVER_PACKAGE_PREFIXES),
    )
    file_set.absent(
        name="Remove: the driver's upgrade blacklist and apt sources",
        paths=[driver_plan.BLACKLIST_FILE, "/etc/apt/sources.list.d/pyinfra-vllm-nvidia.list",
               driver_plan.CUDA_SOURCE, driver_plan.CUDA_KEYRING],
    )


def _data(settings: Settings) -> None:
    """The environments and the suite's tools; the model's files and volume only when
    the settings say so."""
    # python_env_root is the operator's choice, and may hold the operator's files: only
    # what the python_env stage put there goes.
    remove_ops.environments_removed(
        name="Remove: the suite's Python environments, uv and Miniforge (python_env_root)",
        root=settings.python_env_root,
    )
    file_set.absent(
        name="Remove: the engine's state and compile caches, the benchmark's records and the "
        "suite's tools",
        paths=[vllm_plan.STATE_DIR, COMPILE_CACHE_ROOT, bench_plan.RECORD_DIR,
               driver_plan.CUDA_KEY_DIR,
               *TOOL_FILES, SECRET_DIR, gateway_plan.DRAIN_DIR],
    )

    if settings.remove_model_files:
        # model_dir/model_id may hold the operator's files too: only the downloader's go.
        remove_ops.model_files_removed(
            name="Remove: the model's files (remove_model_files)",
            model_dir=settings.model_dir,
            model_id=settings.model_id,
            files=_lock_files(settings),
        )
    if settings.remove_volume_fstab:
        remove_ops.volume_released(
            name="Remove: the model volume unmounted, its fstab line removed "
            "(remove_volume_fstab)",
            path=settings.model_dir,
        )
    if not settings.remove_model_files:
        host.log_styled(
            f"remove: the model's files under {settings.model_dir} are kept (set "
            "remove_model_files=true to delete them)", log_func=logger.info)


def _lock_files(settings: Settings) -> list[str]:
    """The paths of the model lock's files, when the lock is at hand and is this model's;
    without it the host's own record names the files it verified."""
    try:
        lock = load_lock(settings, required=False)
    except LockFileError as exc:
        host.log_styled(f"remove: {exc}; the model's files are those the host's record "
                        "names", fg="yellow", log_func=logger.warning)
        return []
    return [entry["path"] for entry in lock["files"]] if lock else []
