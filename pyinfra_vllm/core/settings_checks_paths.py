"""The rules of the paths on the host: the directories the deploy takes as its own
(model_dir, python_env_root, textfile_collector_dir), pip_ca_bundle, and the model
volume's device and mount options (the rules' conventions: settings_checks.py).
"""

from __future__ import annotations

import posixpath
import re

from pydantic import ValidationInfo

# The deploy runs as root and takes model_dir, python_env_root and textfile_collector_dir
# as its own: it creates, chowns and mounts over them and writes there, and
# deploys/remove.py deletes what it wrote there. Three rules keep them where nothing else
# lives. (1) Never in a system directory, nor anywhere below one: there the suite's files
# would mix with the distribution's or the kernel's, be emptied at boot, or sit where
# another user may write (a home, /tmp) and could swap a part of the path for a symbolic
# link that steers what root writes and deletes. Each names what it holds, for the message.
_DISTRIBUTION = ("the distribution's programs, libraries and configuration, which its "
                 "packages own and replace")
_HOMES = ("the users' homes: the user who owns a directory of the path could swap a part "
          "of it for a symbolic link and steer what root writes and deletes")
SYSTEM_TREES = {
    **dict.fromkeys(("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                     "/boot", "/snap"), _DISTRIBUTION),
    "/dev": "the device files, a kernel file system",
    **dict.fromkeys(("/run", "/var/run", "/var/lock"), "runtime state, emptied at every boot"),
    **dict.fromkeys(("/tmp", "/var/tmp"), "scratch space every user may write: another "
                     "user could put a symbolic link where root writes"),
    **dict.fromkeys(("/var/log", "/var/cache", "/var/spool", "/var/mail", "/var/backups",
                     "/var/lib/dpkg", "/var/lib/apt", "/var/lib/systemd"),
                    "the system's logs, caches and package state"),
    **dict.fromkeys(("/home", "/root"), _HOMES),
}
# (2) Never one of the suite's own directories (fixed names: pyinfra_vllm/plans and
# pyinfra_vllm/operations/util name them, tests/unit/test_settings_paths.py holds the
# lists equal), nor below or above one: the setting's files and the suite's would mix.
SUITE_DIRS = {
    "/var/lib/pyinfra-vllm": "the suite's tools, keys and what it set aside",
    "/var/lib/vllm": "the engine's state, the vllm account's home",
    "/usr/local/lib/pyinfra-vllm": "the engine's helpers",
    "/etc/vllm": "the engine's environment file",
    "/run/pyinfra-vllm": "the suite's secrets and jobs",
    "/run/pyinfra-vllm-upload": "the suite's upload spool",
    "/run/pyinfra-vllm-drain": "the gateway's drain flag",
}
# (3) Never a directory that holds others' directories side by side, nor one holding a
# system or suite directory (/, /var, /var/lib): only a directory of its own below it,
# e.g. /srv/models or /opt/vllm. And the three settings apart from each other
# (``dirs_apart``).
SHARED_DIRS = frozenset({"/", "/opt", "/srv", "/var", "/var/lib", "/var/opt", "/var/local",
                         "/mnt", "/media"})
# The settings those rules are for, in the order ``dirs_apart`` names them.
OWN_DIR_SETTINGS = ("model_dir", "python_env_root", "textfile_collector_dir")
# Kernel file systems: nothing of ours lives there.
VIRTUAL_FS_DIRS = ("/proc", "/sys")
PATH_CHARS = re.compile(r"[A-Za-z0-9_./-]+")
# An example of each path setting, for the messages.
PATH_EXAMPLES = {
    "model_dir": "/srv/models",
    "python_env_root": "/opt/vllm",
    "textfile_collector_dir": "/var/lib/pyinfra-vllm-metrics",
    "pip_ca_bundle": "/etc/ssl/certs/ca-certificates.crt",
}

# Mount options that disable write barriers: ext4's barrier=0/nobarrier lose data on
# power failure, and XFS removed nobarrier in Linux 4.19 (mount fails).
BARRIER_DISABLING_OPTIONS = ("nobarrier", "barrier=0")
# One mount option: a name, optionally =value; options are list items, never "a,b".
MOUNT_OPTION = re.compile(r"[a-z0-9_]+(=[A-Za-z0-9_.:/-]+)?")


def host_path(value: str | None, info: ValidationInfo) -> str | None:
    """A path on the host (PATH_EXAMPLES names the settings); all but pip_ca_bundle are
    directories the deploy takes as its own."""
    if value is None:
        return value
    example = PATH_EXAMPLES[str(info.field_name)]
    system = info.field_name != "pip_ca_bundle"
    if not value.startswith("/"):
        raise ValueError(f"not an absolute path; e.g. {example}")
    if not PATH_CHARS.fullmatch(value):
        raise ValueError(
            "has characters other than letters, digits and _./- (it is written into "
            f"unit files, config files and commands); e.g. {example}"
        )
    if posixpath.normpath(value) != value or "//" in value:
        raise ValueError(
            "not a normalized path: no '.' or '..' part, no '//', no trailing '/'; "
            f"e.g. {example}"
        )
    if any(within(value, fs) for fs in VIRTUAL_FS_DIRS):
        raise ValueError(f"is on a kernel file system (/proc, /sys); e.g. {example}")
    if system:
        problem = _own_dir_problem(value)
        if problem is not None:
            raise ValueError(f"{problem}, e.g. {example}")
    return value


def within(path: str, parent: str) -> bool:
    """Is ``path`` ``parent`` or below it (both normalized, absolute)?"""
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _own_dir_problem(value: str) -> str | None:
    """Why ``value`` cannot be a directory the deploy takes as its own (SYSTEM_TREES,
    SUITE_DIRS, SHARED_DIRS), ending in what to do but the example; None: it can."""
    for suite_dir, holds in SUITE_DIRS.items():
        if within(value, suite_dir):
            where = "is" if value == suite_dir else "is inside"
            return (f"{where} {suite_dir}, the suite's own directory ({holds}): this "
                    "setting's files and the suite's would mix, and deploys/remove.py "
                    "removes the suite's there; use a directory of its own apart from it")
    for tree, holds in SYSTEM_TREES.items():
        if within(value, tree):
            where = "is" if value == tree else "is inside"
            return (f"{where} {tree}, {holds}; the deploy, as root, creates, chowns and "
                    "mounts over this directory and writes there, so none is taken in the "
                    "system's directories (/etc, /usr, /run, /var/log ...), the homes "
                    "(/home, /root) or /tmp: use a directory of its own outside them")
    holds_one = any(within(path, value) for path in (*SUITE_DIRS, *SYSTEM_TREES))
    if value in SHARED_DIRS or holds_one:
        return ("is / or a system directory, which the deploy would take over (create, "
                "mount over, chown) along with the others' directories in it; use a "
                "directory of its own below it")
    return None


def dirs_apart(dirs: dict[str, str]) -> list[tuple[str, str]]:
    """OWN_DIR_SETTINGS, each with its value: none the same as another, inside one or
    holding one. Each problem as (key, sentence naming both keys and values), under the
    later key of the pair."""
    problems = []
    names = [name for name in OWN_DIR_SETTINGS if name in dirs]
    for index, later in enumerate(names):
        for earlier in names[:index]:
            inner, outer = dirs[later], dirs[earlier]
            if inner == outer:
                relation = f"is {earlier} too"
            elif within(inner, outer):
                relation = f"is inside {earlier} = {outer!r}"
            elif within(outer, inner):
                relation = f"holds {earlier} = {outer!r}"
            else:
                continue
            problems.append((later, (
                f"{later} = {inner!r} {relation}: model_dir, python_env_root and "
                "textfile_collector_dir must each be a directory of its own, none inside "
                "another (the model volume mounts over model_dir, and deploys/remove.py "
                "takes the suite's files out of each: one's would be taken for the "
                f"other's); move {later} apart, e.g. model_dir /srv/models, python_env_root "
                "/opt/vllm, textfile_collector_dir /var/lib/pyinfra-vllm-metrics"
            )))
            break
    return problems


def device_path(value: str | None) -> str | None:
    if value is not None and (posixpath.normpath(value) != value or "//" in value):
        raise ValueError("not a normalized device path (no '.' or '..' part, no '//'); "
                         "e.g. /dev/nvme1n1")
    return value


def no_barrier_off(value: list[str]) -> list[str]:
    malformed = [opt for opt in value if not MOUNT_OPTION.fullmatch(opt)]
    if malformed:
        raise ValueError(
            f"{malformed} is not one mount option each: a lowercase name, optionally "
            "=value of letters, digits and _.:/- (no comma, space or newline); give "
            'each option as its own item, e.g. ["noatime", "nodev"]'
        )
    refused = [opt for opt in value if opt in BARRIER_DISABLING_OPTIONS]
    if refused:
        raise ValueError(
            f"{refused} disables write barriers and risks the volume on power loss "
            "(XFS removed nobarrier in Linux 4.19); use noatime alone"
        )
    return value
