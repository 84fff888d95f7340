"""The access table (pyinfra_vllm/plans/access.py): what it declares, the unit that makes
the socket directory agreeing with it, the PathModes fact's command on real paths, and
pyinfra_vllm/operations/access.py's commands run by a real shell on real files (as root: they
chown)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from pyinfra_testing.util import get_command_string

from facts.files import PathModes
from pyinfra_vllm.core.settings import validate
from pyinfra_vllm.operations.util.access import repair_command
from pyinfra_vllm.plans import access, engine_access
from pyinfra_vllm.plans import gateway as gateway_plan
from pyinfra_vllm.plans import vllm_service as vllm_service_plan
from pyinfra_vllm.plans.engine_plan import engine_plan, render_unit

ON_SOCKET = validate({"vllm_version": "0.17.0", "vllm_device": "cpu", "gateway_open": True})
ON_TCP = validate({"gateway_open": True})  # vLLM 0.6.3: no --uds
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")


def sh(command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=False)


def modes(paths: list[str]) -> dict:
    """facts.files.PathModes read here, by its own command."""
    fact = PathModes()
    output = sh(get_command_string(fact.command(paths=paths))).stdout.splitlines()
    return fact.process(output)


def test_every_secret_is_root_s_alone_and_the_socket_directory_nginx_s_too():
    declared = {row.path: (row.owner, row.group, row.mode, row.kind) for row in access.TABLE}
    for path in (engine_access.KEY_ENV_PATH, engine_access.KEY_NGINX_PATH,
                 vllm_service_plan.ENV_PATH, gateway_plan.KEYS_PATH, gateway_plan.TLS_KEY_PATH):
        assert declared[path] == ("root", "root", "600", "file"), path
    assert declared[access.SECRET_DIR] == ("root", "root", "700", "directory")
    assert declared[access.JOB_ROOT] == ("root", "root", "700", "directory")
    assert declared[access.UPLOAD_ROOT] == ("root", "root", "711", "directory")
    assert declared[engine_access.SOCKET_DIR] == ("vllm", "www-data", "750", "directory")
    assert declared[engine_access.FIREWALL_PATH] == ("root", "root", "644", "file")
    # No row lets anyone but its owner write, nor others read a secret.
    for row in access.TABLE:
        assert int(row.mode, 8) & 0o022 == 0 or row.kind == "socket", row.path


def test_each_stage_keeps_the_rows_its_settings_make_apply():
    on_socket = [row.path for row in
                 access.rows(ON_SOCKET, "vllm_service", engine_access.endpoint(ON_SOCKET))]
    assert engine_access.SOCKET_DIR in on_socket and engine_access.SOCKET_PATH in on_socket
    assert engine_access.FIREWALL_PATH not in on_socket
    on_tcp = [row.path for row in
              access.rows(ON_TCP, "vllm_service", engine_access.endpoint(ON_TCP))]
    assert engine_access.FIREWALL_PATH in on_tcp and engine_access.SOCKET_DIR not in on_tcp
    gateway = access.read(ON_SOCKET, "gateway", engine_access.endpoint(ON_SOCKET))["paths"]
    assert gateway == sorted([engine_access.KEY_NGINX_PATH, gateway_plan.KEYS_PATH,
                              gateway_plan.STAGING_DIR])
    # (The settings check the files themselves: a copy is enough to choose the rows.)
    tls = ON_SOCKET.model_copy(update={"gateway_tls_cert": "/c.pem", "gateway_tls_key": "/k.pem"})
    assert gateway_plan.TLS_KEY_PATH in access.read(tls, "gateway",
                                                    engine_access.endpoint(tls))["paths"]
    assert access.STAGES == ("gateway", "vllm_service")


def test_the_unit_makes_the_socket_directory_as_the_table_declares_it():
    row = access.ROWS[engine_access.SOCKET_DIR]
    unit = render_unit(engine_plan(ON_SOCKET, python="/opt/vllm/current/bin/python",
                                   model_path="/srv/models/m", threads_bind="0|1",
                                   place=engine_access.endpoint(ON_SOCKET)))
    assert (f"ExecStartPre=+/usr/bin/install -d -o {row.owner} -g {row.group} -m 0{row.mode} "
            f"{row.path}\n") in unit


def test_path_modes_reads_each_path_itself_and_never_follows_a_link(tmp_path):
    secret = tmp_path / "engine-key.env"
    secret.write_text("VLLM_API_KEY=x\n")
    secret.chmod(0o644)
    folder = tmp_path / "vllm-engine"
    folder.mkdir()
    folder.chmod(0o2750)
    link = tmp_path / "vllm.env"
    link.symlink_to(secret)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(folder / "engine.sock"))
    try:
        found = modes([str(secret), str(folder), str(link), str(folder / "engine.sock"),
                       str(tmp_path / "none"), str(tmp_path / "dangling")])
    finally:
        server.close()
    user = Path(tmp_path).owner()
    assert found[str(secret)] == {"owner": user, "group": Path(secret).group(), "mode": "644",
                                  "kind": "file"}
    assert found[str(folder)]["mode"] == "2750" and found[str(folder)]["kind"] == "directory"
    assert found[str(link)]["kind"] == "link"
    assert found[str(folder / "engine.sock")]["kind"] == "socket"
    assert found[str(tmp_path / "none")] is None


def wanted(kind: str, mode: str, owner: str = "root", group: str = "root",
           chmod_as: str = "root") -> dict[str, str]:
    return {"owner": owner, "group": group, "mode": mode, "kind": kind, "chmod_as": chmod_as}


@as_root
def test_a_world_readable_secret_is_closed_again(tmp_path):
    secret = tmp_path / "engine-key.env"
    secret.write_text("VLLM_API_KEY=x\n")
    secret.chmod(0o644)
    os.chown(secret, 65534, 65534)
    have = modes([str(secret)])[str(secret)]
    done = sh(get_command_string(repair_command(str(secret), wanted("file", "600"), have)))
    assert done.returncode == 0, done.stderr
    assert modes([str(secret)])[str(secret)] == {"owner": "root", "group": "root", "mode": "600",
                                                 "kind": "file"}


@as_root
def test_an_opened_directory_is_closed_and_its_set_group_id_bit_cleared(tmp_path):
    folder = tmp_path / "vllm-engine"
    folder.mkdir()
    folder.chmod(0o2777)
    have = modes([str(folder)])[str(folder)]
    done = sh(get_command_string(repair_command(str(folder), wanted("directory", "750"), have)))
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750


@as_root
def test_a_link_put_in_the_place_of_a_secret_is_never_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("anything\n")
    target.chmod(0o644)
    secret = tmp_path / "engine-key.env"
    secret.write_text("VLLM_API_KEY=x\n")
    secret.chmod(0o644)
    have = modes([str(secret)])[str(secret)]
    command = get_command_string(repair_command(str(secret), wanted("file", "600"), have))
    # Swapped for a link between the read and the change: nothing is changed.
    secret.unlink()
    secret.symlink_to(target)
    done = sh(command)
    assert done.returncode == 1
    assert done.stderr.strip() == f"{secret} is no longer a file: left as it is"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


@as_root
def test_a_socket_s_mode_is_changed_as_its_directory_s_owner():
    # Not in tmp_path: pytest's base directory is root's alone, nobody could reach it.
    base = Path(tempfile.mkdtemp(prefix="pyinfra-vllm-access-"))
    base.chmod(0o711)
    folder = base / "vllm-engine"
    folder.mkdir()
    os.chown(folder, 65534, 65534)
    path = folder / "engine.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    try:
        os.chown(path, 65534, 65534)
        os.chmod(path, 0o600)
        have = modes([str(path)])[str(path)]
        command = repair_command(str(path), wanted("socket", "666", "nobody", have["group"],
                                                   chmod_as="nobody"), have)
        assert get_command_string(command).endswith(
            f"&& runuser -u nobody -- chmod 00666 -- {path}")
        done = sh(get_command_string(command))
        assert done.returncode == 0, done.stderr
        assert stat.S_IMODE(path.stat().st_mode) == 0o666
    finally:
        server.close()
        shutil.rmtree(base)


def test_the_audit_names_each_path_and_what_it_should_be():
    rows = access.rows(ON_SOCKET, "vllm_service", engine_access.endpoint(ON_SOCKET))
    found = {
        engine_access.KEY_ENV_PATH: {"owner": "root", "group": "root", "mode": "644",
                                     "kind": "file"},
        engine_access.SOCKET_DIR: {"owner": "vllm", "group": "www-data", "mode": "777",
                                   "kind": "directory"},
        vllm_service_plan.ENV_PATH: {"owner": "root", "group": "root", "mode": "777",
                                     "kind": "link"},
        access.SECRET_DIR: None,
    }
    assert access.findings(rows, found) == [
        "access: /etc/vllm/engine-key.env is root:root 0644, should be root:root 0600 (the "
        "engine's own key, VLLM_API_KEY (the unit's second EnvironmentFile))",
        "access: /etc/vllm/vllm.env is a symbolic link, should be a file root:root 0600: "
        "not followed, not changed",
        "access: /run/vllm-engine is vllm:www-data 0777, should be vllm:www-data 0750 (the "
        "engine's socket directory: only nginx's workers may enter it (also made so by the "
        "unit's ExecStartPre at every start))",
    ]
    assert access.wrong_kinds(rows, found) == [
        "vllm_service: /etc/vllm/vllm.env (the engine's environment file (the unit's first "
        "EnvironmentFile)) is a symbolic link, not a file root:root 0600: the suite neither "
        "follows nor changes it; look at what it is and move it away, and the next run makes "
        "the suite's own in its place"]
    # Converged: nothing found.
    same = {row.path: {"owner": row.owner, "group": row.group, "mode": row.mode,
                       "kind": row.kind} for row in rows}
    assert access.findings(rows, same) == [] and access.wrong_kinds(rows, same) == []


def test_docs_security_md_carries_the_table():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    start, end = "<!-- access:start -->\n", "<!-- access:end -->"
    assert doc[doc.index(start) + len(start):doc.index(end)] == access.markdown(), (
        "docs/security.md's access table is stale: paste pyinfra_vllm.plans.access.markdown()"
        " between its access markers")


def test_the_catalogue_s_refusal_is_the_stage_s_own_sentence():
    fixture = Path(__file__).resolve().parents[1] / "operations" / "gate.refuse" / \
        "secret-replaced-by-a-link.json"
    reasons = json.loads(fixture.read_text())["kwargs"]["reasons"]
    link = {engine_access.KEY_ENV_PATH: {"owner": "root", "group": "root", "mode": "777",
                                         "kind": "link"}}
    rows = access.rows(ON_SOCKET, "vllm_service", engine_access.endpoint(ON_SOCKET))
    assert reasons == access.wrong_kinds(rows, link)
