"""pyinfra_vllm/operations/util/uploads.py: the commands that keep an upload private, under sudo
too."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from pyinfra.api import FileUploadCommand, StringCommand
from pyinfra.context import ctx_host, ctx_state
from pyinfra_testing.util import (
    FakeState,
    coerce_operation_arguments,
    create_host,
    parse_value,
    patch_files,
)

from pyinfra_vllm.operations.util.uploads import (
    SECRET_DIR,
    UPLOAD_ROOT,
    env_file_text,
    private_upload,
    secret_file,
    sourced,
    spool_dir,
)
from tests.layers import ROOT, module_name, product_files


def test_the_destination_has_its_mode_before_the_upload_and_the_spool_is_private():
    prepare, upload, cleanup = list(private_upload(b"secret\n", "/etc/x/keys.conf", mode="600",
                                                   owner="root:www-data"))
    spool = spool_dir("/etc/x/keys.conf")
    assert spool.startswith(UPLOAD_ROOT + "/")
    assert isinstance(prepare, StringCommand) and prepare.get_raw_value() == (
        f"install -d -m 711 -o root -g root {UPLOAD_ROOT} "
        f'&& install -d -m 700 -o "${{SUDO_USER:-$(id -un)}}" {spool} '
        "&& mkdir -p /etc/x && install -m 600 /dev/null /etc/x/keys.conf "
        "&& chown root:www-data /etc/x/keys.conf")
    # pyinfra's SFTP step (as the login user, under sudo) lands in the private spool.
    assert isinstance(upload, FileUploadCommand)
    assert upload.dest == "/etc/x/keys.conf"
    assert upload.remote_temp_filename == f"{spool}/upload"
    assert upload.src.getvalue() == b"secret\n"
    assert cleanup.get_raw_value() == f"rm -rf {spool}"


def test_secret_files_live_in_a_root_only_tmpfs_directory():
    prepare, upload, _cleanup = list(secret_file(b"t\n", "hf_token"))
    assert f"&& install -d -m 700 -o root -g root {SECRET_DIR} " in prepare.get_raw_value()
    assert upload.dest == f"{SECRET_DIR}/hf_token"


def test_a_secret_below_the_directory_makes_every_directory_down_to_it_root_only(tmp_path):
    prepare, upload, _cleanup = list(secret_file(b"t\n", "jobs/unit-1/env"))
    assert (f"&& install -d -m 700 -o root -g root {SECRET_DIR} {SECRET_DIR}/jobs "
            f"{SECRET_DIR}/jobs/unit-1 ") in prepare.get_raw_value()
    # On a real shell, from nothing: install -d alone would make the parents 0755.
    if os.geteuid() != 0:
        pytest.skip("install -o root needs root")
    dest = tmp_path / "secrets" / "jobs" / "unit-1" / "env"
    prepare, *_ = private_upload(b"t\n", str(dest), parent_mode="700",
                                 private_from=str(tmp_path / "secrets"))
    subprocess.run(["sh", "-c", prepare.get_raw_value().split(" && ", 2)[2]], check=True,
                   env={**os.environ, "SUDO_USER": "root"})
    modes = {path.name: oct(path.stat().st_mode & 0o777)
             for path in (dest.parents[2], dest.parents[1], dest.parent, dest)}
    assert modes == {"secrets": "0o700", "jobs": "0o700", "unit-1": "0o700", "env": "0o600"}


def test_env_files_keep_values_values():
    text = env_file_text({"HTTPS_PROXY": "http://u:p w$x@proxy:3128"}).decode()
    assert text == "HTTPS_PROXY='http://u:p w$x@proxy:3128'\n"
    assert StringCommand(*sourced("/run/x.env"), "true").get_raw_value() == (
        "set -a && . /run/x.env && set +a && true")


# --- every file the suite uploads goes through the private spool -------------------------
# Under sudo, pyinfra stages a plain upload at /tmp/pyinfra-<sha1 of the destination>
# (Host.get_temp_filename), a name any local user can compute and create first: with
# fs.protected_regular=0 root then copies that user's file (a script root runs), with 1
# the copy fails on every run. Only private_upload names the stage itself, in the spool.

FIXTURES = ROOT / "tests" / "operations"


def _upload_steps(commands: list) -> list[tuple[object, list, object]]:
    """(the command before, the upload, the command after) for each ``["upload", data,
    dest]`` of a fixture's expected commands."""
    plain = [command["command"] if isinstance(command, dict) else command
             for command in commands]
    return [(plain[i - 1] if i else None, command, plain[i + 1] if i + 1 < len(plain) else None)
            for i, command in enumerate(plain)
            if isinstance(command, list) and command and command[0] == "upload"]


UPLOADING = [path for path in sorted(FIXTURES.glob("*/*.json"))
             if _upload_steps(json.loads(path.read_text()).get("commands", []))]


def _fixture_id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def test_the_fixtures_upload_from_every_operation_that_uploads():
    # What the two tests below walk: an operation whose fixtures stopped uploading would
    # drop out of them unnoticed.
    assert {path.parent.name for path in UPLOADING} >= {
        "driver.upgrade_blacklist", "file_set.present", "gateway.site", "model.downloaded",
        "model_volume.mounted", "python_env.environment", "python_env.miniforge",
        "python_env.uv", "sysctl.drop_in"}


@pytest.mark.parametrize("path", UPLOADING, ids=_fixture_id)
def test_every_upload_of_a_fixture_is_made_in_the_private_spool(path):
    for before, (_upload, _data, dest), after in _upload_steps(
            json.loads(path.read_text())["commands"]):
        spool = spool_dir(dest)
        # The login user's 0700 directory under the root-owned spool, and the destination
        # with its mode, before the upload; the directory gone after it.
        assert isinstance(before, str) and before.startswith(
            f"install -d -m 711 -o root -g root {UPLOAD_ROOT} "
            f'&& install -d -m 700 -o "${{SUDO_USER:-$(id -un)}}" {spool} '), (dest, before)
        assert f" /dev/null {shlex.quote(dest)} && chown " in before, (dest, before)
        assert after == f"rm -rf {spool}", (dest, after)


def _replayed_uploads(path: Path, monkeypatch) -> list[FileUploadCommand]:
    """The uploads the fixture's operation yields, replayed as tests/test_operations.py
    does (the fixture format keeps neither an upload's stage nor its other arguments)."""
    data = json.loads(path.read_text())
    module, name = path.parent.name.rsplit(".", 1)
    op = getattr(importlib.import_module(f"pyinfra_vllm.operations.{module}"), name)
    args, kwargs = coerce_operation_arguments(op, parse_value(data.get("args", [])),
                                              parse_value(data.get("kwargs", {})))
    state = FakeState()
    host = create_host(state, facts=data.get("facts", {}))
    monkeypatch.chdir(ROOT)  # local files are named from the repository root
    with ctx_state.use(state), ctx_host.use(host), patch_files(data.get("local_files", {})):
        commands = list(op._inner(*args, **kwargs))
    return [command for command in commands if isinstance(command, FileUploadCommand)]


@pytest.mark.parametrize("path", UPLOADING, ids=_fixture_id)
def test_pyinfra_stages_every_upload_of_a_fixture_in_the_private_spool(path, monkeypatch):
    uploads = _replayed_uploads(path, monkeypatch)
    assert len(uploads) == len(_upload_steps(json.loads(path.read_text())["commands"]))
    for upload in uploads:
        # Without remote_temp_filename, pyinfra's sudo upload stages at /tmp/pyinfra-<sha1>.
        assert upload.remote_temp_filename == f"{spool_dir(upload.dest)}/upload", upload.dest


# The product: what runs against hosts (the sandbox harness is the tests').
_PRODUCT = [path for path in product_files() if path.relative_to(ROOT).parts[0] != "sandbox"]


def test_only_private_upload_builds_an_upload():
    builders = {}
    for path in _PRODUCT:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                called = ast.unparse(node.func).rsplit(".", 1)[-1]
                if called in ("FileUploadCommand", "put_file"):
                    builders.setdefault(module_name(path), []).append(node.lineno)
    assert sorted(builders) == ["pyinfra_vllm.operations.util.uploads"], builders


_UPLOADS = re.compile(r"\bFileUploadCommand\b|\bput_file\b")
# ``files.put._inner(`` or, inside pyinfra's files.py, ``put._inner(``.
_CALLS = re.compile(r"(?:\b(\w+)\.)?\b(\w+)\._inner\(")


def _pyinfra_uploaders(module: str, name: str, seen: set[tuple[str, str]]) -> list[str]:
    """The pyinfra operations that ``module.name`` is or calls (read from their source,
    through every ``_inner`` call) which upload a file."""
    if (module, name) in seen:
        return []
    seen.add((module, name))
    operation = getattr(importlib.import_module(f"pyinfra.operations.{module}"), name)
    source = inspect.getsource(operation._inner)
    found = [f"{module}.{name}"] if _UPLOADS.search(source) else []
    for called_module, called in _CALLS.findall(source):
        found += _pyinfra_uploaders(called_module or module, called, seen)
    return found


def _pyinfra_operations_called() -> set[tuple[str, str]]:
    """(module, operation) of every pyinfra operation the product names."""
    called = set()
    for path in _PRODUCT:
        tree = ast.parse(path.read_text())
        modules = {alias.asname or alias.name: alias.name for node in ast.walk(tree)
                   if isinstance(node, ast.ImportFrom) and node.module == "pyinfra.operations"
                   for alias in node.names if alias.name != "util"}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "pyinfra.operations.") and not node.module.startswith(
                    "pyinfra.operations.util"):
                called |= {(node.module.rsplit(".", 1)[1], alias.name) for alias in node.names}
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules):
                called.add((modules[node.value.id], node.attr))
    return called


def test_no_pyinfra_operation_the_product_calls_uploads():
    # files.put, files.template, server.script and the like upload through /tmp under
    # sudo; the product writes files with file_set.present and private_upload instead.
    called = _pyinfra_operations_called()
    assert ("apt", "packages") in called and ("files", "directory") in called
    assert {op: found for op in sorted(called)
            if (found := _pyinfra_uploaders(*op, set()))} == {}


def test_the_pyinfra_upload_scan_finds_the_operations_that_upload():
    for module, name in (("files", "put"), ("files", "template"), ("server", "script"),
                         ("files", "sync")):
        assert "files.put" in _pyinfra_uploaders(module, name, set()), (module, name)
