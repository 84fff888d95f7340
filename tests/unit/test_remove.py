"""The removal's commands run by a real shell: the re-apply of the remaining sysctl files
(a refusal of another file's key, a container's read-only kernel.pid_max, passes; one of
the suite's keys fails), and the removal of the suite's environments and of the model's
files from real directories, read by the facts' own commands: what the operator put
there stays, a link's target is never touched, and a second removal has nothing to do."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from pyinfra.context import ctx_host, ctx_state
from pyinfra_testing.util import FakeState, create_host

from facts.files import PathTypes
from facts.model import ModelFiles
from facts.python_env import MARKER, EnvRootEntries
from pyinfra_vllm.operations import remove as remove_ops
from pyinfra_vllm.plans.model import DOWNLOADER_NAMES

FIXTURE = Path(__file__).resolve().parents[1] / "operations/remove.sysctl_reapplied/two-keys.json"


@pytest.mark.parametrize(("refused", "status"), [
    ("kernel.pid_max", 0),
    ("vm.max_map_count", 1),
    ("vmXmax_map_count", 0),  # the dots are literal: no other key matches by accident
])
def test_only_a_refusal_of_the_suites_keys_fails(tmp_path, refused, status):
    command = json.loads(FIXTURE.read_text())["commands"][0]
    fake = tmp_path / "sysctl"
    fake.write_text(f'#!/bin/sh\necho \'sysctl: permission denied on key "{refused}"\' >&2\n'
                    "exit 1\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    proc = subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True)
    assert proc.returncode == status
    assert (refused in proc.stderr) == (status == 1)


def _read(fact, **arguments):
    """What ``fact`` returns for this machine, its command run by sh."""
    command = fact().command(**arguments).get_raw_value()
    output = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
    return fact().process(output.stdout.splitlines())


def _removed(operation, facts: dict, **arguments) -> tuple[list[str], str | None]:
    """Run ``operation`` against ``facts``, then its commands by sh: (commands, noop)."""
    state = FakeState()
    host = create_host(state, facts=facts)
    with ctx_state.use(state), ctx_host.use(host):
        commands = [command.get_raw_value() for command in operation._inner(**arguments)]
    for command in commands:
        subprocess.run(["sh", "-c", command], check=True)
    return commands, host.noop_description


def _environments_removed(root: Path) -> tuple[list[str], str | None]:
    found = _read(EnvRootEntries, root=str(root))
    return _removed(remove_ops.environments_removed,
                    {"python_env.EnvRootEntries": {f"root={root}": found}}, root=str(root))


def _tree(paths: list[str], base: Path) -> set[str]:
    return {path for path in paths if os.path.lexists(base / path)}


def test_only_the_suite_s_environments_go_from_python_env_root(tmp_path):
    root, outside = tmp_path / "vllm", tmp_path / "elsewhere"
    (outside / "data").mkdir(parents=True)
    (outside / "data" / "precious").write_text("the operator's\n")
    built = root / "envs" / "vllm-0.17.0-9b1d5faa"
    for directory in (built / "bin", root / "envs" / "vllm-0.17.0-9b1d5faa-g2" / "bin",
                      root / "envs" / "my-env", root / "uv" / "bin"):
        directory.mkdir(parents=True)
    (built / MARKER).write_text("{}\n")
    (built / "bin" / "out").symlink_to(outside / "data")
    (root / "current").symlink_to(built)
    (root / "notes.txt").write_text("the operator's\n")
    (root / "odd name").write_text("the operator's\n")
    (root / "linked").symlink_to(outside / "data")

    commands, _ = _environments_removed(root)
    assert commands[0].startswith("rm -rf --one-file-system -- ")
    left = ["notes.txt", "odd name", "linked", "envs/my-env", "envs", "uv", "current",
            "envs/vllm-0.17.0-9b1d5faa", "envs/vllm-0.17.0-9b1d5faa-g2"]
    assert _tree(left, root) == {"notes.txt", "odd name", "linked", "envs/my-env", "envs"}
    assert (outside / "data" / "precious").read_text() == "the operator's\n"
    assert os.readlink(root / "linked") == str(outside / "data")

    again, noop = _environments_removed(root)
    assert again == []
    assert noop == f"nothing of the suite's is left under {root}; 4 entries not the suite's kept"

    for name in ("notes.txt", "odd name", "linked"):
        (root / name).unlink()
    (root / "envs" / "my-env").rmdir()
    assert _environments_removed(root)[0] == [f"rmdir -- {root}/envs {root}"]
    assert not root.exists() and (outside / "data" / "precious").exists()


def _model_files_removed(model_dir: Path, files: list[str]) -> tuple[list[str], str | None]:
    path = model_dir / "Org" / "model"
    names = [f"{path}/{name}" for name in DOWNLOADER_NAMES]
    found = _read(ModelFiles, path=str(path))
    facts = {"model.ModelFiles": {f"path={path}": found},
             "files.PathTypes": {f"paths={names}": _read(PathTypes, paths=names)}}
    return _removed(remove_ops.model_files_removed, facts, model_dir=str(model_dir),
                    model_id="Org/model", files=files)


def test_only_the_downloader_s_files_go_from_the_model_s_directory(tmp_path):
    model_dir = tmp_path / "models"
    path = model_dir / "Org" / "model"
    (path / "shards").mkdir(parents=True)
    (path / ".incoming" / "shards").mkdir(parents=True)
    (tmp_path / "elsewhere").write_text("the operator's\n")
    for name in ("config.json", "shards/1.safetensors", "verified-only.txt", ".fetch.lock",
                 ".incoming/shards/2.safetensors.part"):
        (path / name).write_text("x\n")
    (path / ".verified.json").write_text(json.dumps({"files": {"verified-only.txt": {}}}))
    (path / "chat_template.jinja").write_text("the operator's\n")
    (path / "shards" / "2.safetensors").symlink_to(tmp_path / "elsewhere")
    lock = ["config.json", "shards/1.safetensors", "shards/2.safetensors", "gone.bin"]

    _model_files_removed(model_dir, lock)
    assert sorted(os.listdir(path)) == ["chat_template.jinja", "shards"]
    assert os.listdir(path / "shards") == ["2.safetensors"]
    assert (tmp_path / "elsewhere").read_text() == "the operator's\n"
    again, noop = _model_files_removed(model_dir, lock)
    assert again == []
    # The link stays, uncounted: facts.model.ModelFiles lists plain files.
    assert noop == f"nothing of the model's is left in {path}; 1 file(s) not the downloader's kept"

    (path / "chat_template.jinja").unlink()
    (path / "shards" / "2.safetensors").unlink()
    (path / "config.json").write_text("x\n")
    _model_files_removed(model_dir, lock)
    assert not (model_dir / "Org").exists() and model_dir.is_dir()
