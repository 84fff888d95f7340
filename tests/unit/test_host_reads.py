"""The run's one read (pyinfra_vllm/run/host_reads.py) against this machine, through pyinfra's
own @local connector: each fact read in the one command equals the same fact read on its
own, and the host is read again once something else ran on it."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from pyinfra.api import Config, FactBase, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.context import ctx_host, ctx_state
from pyinfra.facts.files import File, Sha1File
from pyinfra.facts.server import KernelVersion, LinuxDistribution

from facts.files import FileDigests, PathTypes
from facts.host_state import SECTION, STATUS, side_by_side, split_sections
from facts.storage import Fstab
from facts.sysctl import KernelParam
from pyinfra_vllm.core.settings import validate
from pyinfra_vllm.run import host_reads
from pyinfra_vllm.run.host_reads import Read


@pytest.fixture()
def local():
    inventory = Inventory((["@local"], {}))
    state = State(inventory, Config())
    connect_all(state)
    host = inventory.get_host("@local")
    with ctx_state.use(state), ctx_host.use(host):
        yield state, host


def test_sections_are_taken_apart_by_their_own_nonce_only():
    output = [
        f"{SECTION}-abc 0", "one", f"{STATUS}-abc 0",
        f"{SECTION}-abc 1", f"{STATUS}-zzz 0", "two", f"{STATUS}-abc 3",
        f"{SECTION}-abc 2", "cut off",
    ]
    assert split_sections(output, "abc") == {
        0: (0, ["one"]),
        1: (3, [f"{STATUS}-zzz 0", "two"]),  # another nonce is output, not a marker
    }


def _sh(command: str, **env: str) -> tuple[float, list[str]]:
    start = time.monotonic()
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True,
                          env={**os.environ, **env})
    return time.monotonic() - start, done.stdout.splitlines()


SLOW = ["sleep 0.6; echo first; exit 3", "sleep 0.6; echo second",
        "sleep 0.6; printf 'third\\nlines\\n'; exit 1"]
SLOW_OUTPUT = ["# 0", "first", "= 3", "# 1", "second", "= 0", "# 2", "third", "lines", "= 1"]


def _side_by_side(commands: list[str]) -> str:
    in_order = "; ".join(f"echo '# {index}'; ( {command}\n); echo \"= $?\""
                         for index, command in enumerate(commands))
    return side_by_side(
        commands, lambda index, output, status: f"echo '# {index}'; cat {output}; "
                                                 f"echo \"= $(cat {status})\"", in_order)


def test_side_by_side_runs_the_commands_at_once_and_prints_them_in_order():
    seconds, lines = _sh(_side_by_side(SLOW))
    assert lines == SLOW_OUTPUT
    # Three 0.6 s commands at once, not 1.8 s one after another.
    assert seconds < 1.5


def test_side_by_side_without_a_temporary_directory_runs_them_one_after_another():
    # mktemp -d fails where TMPDIR does not exist: the same output, in order.
    seconds, lines = _sh(_side_by_side(SLOW), TMPDIR="/nonexistent/pyinfra-vllm")
    assert lines == SLOW_OUTPUT
    assert seconds >= 1.8


def test_side_by_side_leaves_no_temporary_directory(tmp_path):
    _sh(_side_by_side(["echo a", "echo b"]), TMPDIR=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_each_fact_read_at_once_equals_the_fact_read_alone(local, tmp_path):
    _state, host = local
    present = tmp_path / "present.txt"
    present.write_text("x\n")
    absent = str(tmp_path / "absent")
    reads = [
        Read(LinuxDistribution), Read(KernelVersion), Read(Fstab),
        Read(FileDigests, {"paths": [str(present), absent]}),
        Read(PathTypes, {"paths": [str(tmp_path), absent]}),
        Read(Sha1File, {"path": str(present)}), Read(Sha1File, {"path": absent}),
        Read(File, {"path": str(present)}),
        Read(KernelParam, {"key": "kernel.no_such_key"}),
    ]
    values = host_reads.read_all(host, reads)
    assert len(values) == len(reads)
    for read in reads:
        assert values[read.key()] == host.get_fact(read.fact, **read.kwargs), read
    assert values[Read(Sha1File, {"path": absent}).key()] is None
    assert values[Read(KernelParam, {"key": "kernel.no_such_key"}).key()] is None


def test_reads_are_answered_until_a_command_runs_then_read_again(local, tmp_path):
    _state, host = local
    path = str(tmp_path / "made")
    read = Read(PathTypes, {"paths": [path]})
    host_reads.answer_from(host, host_reads.read_all(host, [read]))
    assert host.get_fact(PathTypes, paths=[path]) == {path: None}
    (tmp_path / "made").write_text("")  # changed behind pyinfra's back: still the read
    assert host.get_fact(PathTypes, paths=[path]) == {path: None}
    # An operation's command: every read after it goes to the host.
    host.run_shell_command("true")
    assert host.get_fact(PathTypes, paths=[path]) == {path: "file"}


def test_a_read_that_was_not_listed_is_made_on_its_own(local, tmp_path):
    _state, host = local
    host_reads.answer_from(host, {})
    assert host.get_fact(FileDigests, paths=[str(tmp_path / "none")]) == {
        str(tmp_path / "none"): None}


def test_the_default_settings_read_every_stage_at_once_without_duplicates():
    settings = validate({"gateway_open": True})
    reads = host_reads.stage_reads(settings, host_reads.STAGE_READS)
    keys = [read.key() for read in reads]
    assert len(keys) == len(set(keys))
    assert {read.fact.__name__ for read in reads} >= {
        "LinuxDistribution", "GpuHostState", "VllmEnvironments", "KernelParam",
        "ModelFiles", "EngineProcess", "NginxServers", "UnitActivation", "DebPackage"}
    skipped = settings.model_copy(update={"skip_stages": ["gateway", "metrics"]})
    names = {read.fact.__name__ for read in host_reads.stage_reads(skipped, host_reads.STAGE_READS)}
    assert "NginxServers" not in names and "DebPackage" not in names


class Fails(FactBase):
    """A fact whose command fails after printing something."""

    def command(self) -> str:
        return "echo partial; exit 3"


def test_a_read_whose_command_failed_is_left_to_pyinfra(local):
    _state, host = local
    values = host_reads.read_all(host, [Read(Fails), Read(KernelVersion)])
    assert list(values) == [Read(KernelVersion).key()]
