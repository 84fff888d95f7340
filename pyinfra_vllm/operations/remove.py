"""Taking off what the suite installed (deploys/remove.py): units, the nginx site, package
holds, the model volume's fstab line, the suite's running jobs, its Python environments
and the model's files, each read first so that a host with nothing left to remove gets
no command.

Files and directories alone go with ``file_set.absent``; these are the removals that need
more than a delete: a unit stopped and systemd reloaded, nginx tested before its reload,
a hold released, a mount let go, a job stopped, the suite's own entries told from the
operator's in a directory a setting names.
"""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import OperationValueError, QuoteString, StringCommand, operation

from facts.driver import HeldPackages
from facts.files import PathTypes
from facts.model import ModelFiles
from facts.python_env import EnvRootEntries
from facts.storage import Fstab, MountPoint
from facts.units import JobUnits, UnitActivation
from pyinfra_vllm.core.model_files import model_path
from pyinfra_vllm.operations.util import jobs
from pyinfra_vllm.plans.model import DOWNLOADER_NAMES, model_removal
from pyinfra_vllm.plans.python_env import root_removal

FSTAB = "/etc/fstab"
# Where the site's files wait while nginx -t runs without them: on /etc's file system, so
# moving them there and back is a rename.
SITE_PARKING = "/etc/nginx/.pyinfra-vllm-removed"


@operation()
def jobs_stopped():
    """
    Stop the suite's long jobs that still run (a model download or an environment's
    build that an earlier run started and was stopped or lost before it ended:
    pyinfra_vllm/operations/util/jobs.py), and remove their job directories, before the files they
    write are removed.

    No job running: no command.
    """
    found = host.get_fact(JobUnits)
    running = sorted(unit for unit, active in found.items() if active in jobs.RUNNING)
    if not running:
        host.noop("no job of the suite runs")
        return
    yield StringCommand("systemctl stop --", *(QuoteString(unit) for unit in running))
    yield StringCommand("rm -rf --", *(QuoteString(jobs.job_dir(unit.removesuffix(".service")))
                                       for unit in running))


@operation()
def unit_removed(unit: str, paths: list[str] | None = None):
    """
    Stop and disable a systemd unit, and remove the suite's files for it.

    + unit: the unit's full name, e.g. ``vllm.service``
    + paths: the suite's unit file and drop-ins (or a drop-in alone, for a unit a package
      owns): removed, then systemd reloads and forgets the unit's failed state

    A unit systemd does not know and none of ``paths``: no command.
    """
    found = host.get_fact(UnitActivation, unit=unit)
    kinds = host.get_fact(PathTypes, paths=sorted(paths or []))
    present = [path for path in sorted(paths or []) if kinds.get(path)]
    running = found is not None and (found["active"] not in ("inactive", "failed")
                                     or found["enabled"] == "enabled")
    if not running and not present:
        host.noop(f"{unit} is stopped and disabled, and its files are gone")
        return
    if running:
        yield StringCommand("systemctl disable --now", QuoteString(unit))
    for path in present:
        yield StringCommand("rm -rf --one-file-system --" if kinds[path] == "directory"
                            else "rm -f --", QuoteString(path))
    if present:
        yield "systemctl daemon-reload"
        # A failed unit stays listed after its file is gone until its state is reset.
        yield StringCommand("systemctl reset-failed", QuoteString(unit), "2>/dev/null || true")


def _site_removal_script(paths: list[str], parking: str, service: str) -> str:
    """One shell command: park ``paths``, ``nginx -t``, then delete them and reload, or put
    them back when the test fails (nginx never left failing). Without an nginx binary the
    files are simply deleted. Paths are quoted with shlex: they are parts of a script."""
    q = shlex.quote
    lines = [f"rm -rf {q(parking)} && install -d -m 700 -o root -g root {q(parking)} || exit 1"]
    restore = []
    for index, path in enumerate(paths):
        parked = f"{parking}/{index}"
        lines.append(f"mv -f {q(path)} {q(parked)} || exit 1")
        restore.append(f"mv -f {q(parked)} {q(path)}")
    lines.append(
        "if ! command -v nginx >/dev/null 2>&1; then rm -rf " + q(parking) + "; "
        "elif out=$(nginx -t 2>&1); then rm -rf " + q(parking) + "; "
        f"systemctl try-reload-or-restart {q(service)}; "
        f"else {'; '.join(restore)}; rm -rf {q(parking)}; "
        'echo "nginx -t fails without the gateway'"'"'s files; they are back:" >&2; '
        "printf '%s\\n' \"$out\" | grep -v -F vllm-api-keys >&2; exit 1; fi"
    )
    return "; ".join(lines)


@operation()
def nginx_site_removed(paths: list[str], parking: str = SITE_PARKING, service: str = "nginx"):
    """
    Remove the gateway's nginx files, tested by ``nginx -t`` before nginx reloads.

    + paths: the site, the API key file, the engine's key file, the TLS directory, the
      staging directory
    + parking: root-only directory the files wait in while nginx is tested without them
    + service: the unit reloaded (only if it runs) once the test passed

    If nginx -t fails without them (another file includes one), they are put back and the
    operation fails with nginx's message, without the lines naming the key file. None
    present: no command.
    """
    kinds = host.get_fact(PathTypes, paths=sorted(paths))
    present = [path for path in sorted(paths) if kinds.get(path)]
    if not present:
        host.noop("the gateway's nginx files are gone")
        return
    yield StringCommand(_site_removal_script(present, parking, service))


@operation()
def holds_released(prefixes: list[str]):
    """
    Release the dpkg holds of the driver and CUDA packages (``apt-mark unhold``).

    + prefixes: package name prefixes the driver stage held (nvidia-, libnvidia-, cuda-)

    The packages stay installed. None held: no command.
    """
    held = [name for name in host.get_fact(HeldPackages) if name.startswith(tuple(prefixes))]
    if not held:
        host.noop("no NVIDIA driver or CUDA package is held")
        return
    yield StringCommand("apt-mark", "unhold", *[QuoteString(name) for name in sorted(held)])


def _fstab_without(path: str, fstab: str = FSTAB) -> str:
    """One shell command: ``fstab`` without the lines mounting ``path`` (field 2), replaced
    by rename, the previous one kept as ``<fstab>.pyinfra-vllm.bak``."""
    q = shlex.quote
    new = f"{fstab}.pyinfra-new"
    return (f"awk -v p={q(path)} '$1 ~ /^#/ || $2 != p' {q(fstab)} > {q(new)} && "
            f"chmod 644 {q(new)} && cp -p {q(fstab)} {q(fstab + '.pyinfra-vllm.bak')} && "
            f"mv -f {q(new)} {q(fstab)}")


@operation()
def volume_released(path: str):
    """
    Unmount the model volume and remove its ``/etc/fstab`` line; the device and its data
    are left as they are (never formatted, never wiped).

    + path: the mount point (model_dir)

    Nothing mounted there and no fstab line for it: no command.
    """
    if not path.startswith("/") or path == "/":
        raise OperationValueError(f"volume_released: {path!r} is not a mount point below /")
    mounted = host.get_fact(MountPoint, path=path)
    lines = [entry for entry in host.get_fact(Fstab) if entry.get("file") == path]
    if mounted is None and not lines:
        host.noop(f"nothing mounted at {path} and no fstab line for it")
        return
    if mounted is not None:
        yield StringCommand("umount", QuoteString(path))
    if lines:
        yield StringCommand(_fstab_without(path))


@operation()
def environments_removed(root: str):
    """
    Remove what the python_env stage put under python_env_root, and nothing else: the
    environments it built in ``{root}/envs`` (with its marker, or under the names it
    gives them: a build cut short has no marker yet), uv's and Miniforge's prefixes,
    Miniforge's installer and the ``current`` link; then ``envs`` and ``root``
    themselves, each only when that left it empty.

    + root: python_env_root

    What else is there is the operator's and stays, with the directories holding it
    (pyinfra_vllm/plans/python_env.py ``root_removal`` says what counts as the suite's).
    No link is followed and no mount crossed (``rm --one-file-system``); a root that is
    a link or a mount point stays. Nothing of the suite's left: no command.
    """
    if not root.startswith("/") or root.rstrip("/") == "":
        raise OperationValueError(f"environments_removed: {root!r} is not a directory below /")
    removal = root_removal(root, host.get_fact(EnvRootEntries, root=root))
    if not (removal.trees or removal.files or removal.emptied):
        entries = "entry" if removal.kept == 1 else "entries"
        kept = f"; {removal.kept} {entries} not the suite's kept" if removal.kept else ""
        host.noop(f"nothing of the suite's is left under {root}{kept}")
        return
    if removal.trees:
        yield StringCommand("rm -rf --one-file-system --",
                            *(QuoteString(path) for path in removal.trees))
    if removal.files:
        yield StringCommand("rm -f --", *(QuoteString(path) for path in removal.files))
    if removal.emptied:
        yield StringCommand("rmdir --", *(QuoteString(path) for path in removal.emptied))


@operation()
def model_files_removed(model_dir: str, model_id: str, files: list[str] | None = None):
    """
    Remove the model's files the downloader wrote in ``{model_dir}/{model_id}``, and
    nothing else: the files of the model lock and of the host's verification record,
    the download area (``.incoming``), the record and the download's lock file; then
    the directories of those files, the model's directory and its organisation's, where
    that left them empty.

    + model_dir: the model volume's mount point, never removed
    + model_id: the model's Hugging Face id
    + files: the paths of the model lock's files (empty when the lock is not at hand: the
      host's record names what was verified)

    A file of another name is the operator's and stays, with the directories holding it;
    no link is followed (pyinfra_vllm/plans/model.py ``model_removal``). Nothing of the
    downloader's left: no command.
    """
    path = model_path(model_dir, model_id)
    found = host.get_fact(ModelFiles, path=path)
    kinds = (host.get_fact(PathTypes, paths=[f"{path}/{name}" for name in DOWNLOADER_NAMES])
             if found is not None else {})
    removal = model_removal(model_dir, model_id, found, kinds, files or [])
    if not (removal.trees or removal.files):
        kept = f"; {removal.kept} file(s) not the downloader's kept" if removal.kept else ""
        host.noop(f"nothing of the model's is left in {path}{kept}")
        return
    if removal.trees:
        yield StringCommand("rm -rf --one-file-system --",
                            *(QuoteString(name) for name in removal.trees))
    yield StringCommand("rm -f --", *(QuoteString(name) for name in removal.files))
    # A directory of the lock's that is not there, or is a link, is passed over.
    yield StringCommand(
        "for d in", *(QuoteString(name) for name in removal.emptied),
        '; do if [ -d "$d" ] && [ ! -L "$d" ]; then',
        'rmdir --ignore-fail-on-non-empty -- "$d" || exit 1; fi; done',
    )


@operation(is_idempotent=False)
def sysctl_reapplied(keys: list[str]):
    """
    Re-apply the kernel parameters the remaining sysctl files set (``sysctl --system``),
    after the suite's drop-in is gone.

    + keys: the parameters the suite's drop-in set

    A parameter of another file the host refuses to set (in a container, a read-only
    ``kernel.pid_max`` or ``fs.protected_*``: "permission denied") is that file's matter,
    not this removal's: only a refusal naming one of ``keys`` fails the operation. A key
    only the drop-in set keeps its live value until the next boot. Run it with ``_if``
    the drop-in's removal changed.
    """
    pattern = "(" + "|".join(key.replace(".", "[.]") for key in sorted(keys)) + ")"
    yield StringCommand(
        "refused=$(sysctl --system 2>&1 >/dev/null);",
        'printf "%s\\n" "$refused" | grep -E', QuoteString(pattern), ">&2 && exit 1; true",
    )
