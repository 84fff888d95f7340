"""The run's one read (pyinfra_vllm/run/host_reads.py) against this machine, through pyinfra's
own @local connector: each fact read in the one command equals the same fact read on its
own, and the host is read again once something else ran on it."""

from __future__ import annotations

import logging
import os
import subprocess
import time

import pytest
from pyinfra.api import Config, FactBase, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.context import ctx_host, ctx_state
from pyinfra.facts.files import File, Sha1File
from pyinfra.facts.server import KernelVersion, LinuxDistribution

from facts import base
from facts.files import FileDigests, PathTypes
from facts.gpu_host import GPU_GROUP, GpuHostState
from facts.host_state import (
    SECTION,
    STATUS,
    arrange,
    sections_command,
    side_by_side,
    split_sections,
)
from facts.storage import Fstab
from facts.sysctl import KernelParam
from pyinfra_vllm.core.settings import validate
from pyinfra_vllm.plans.engine_access import endpoint
from pyinfra_vllm.run import host_reads
from pyinfra_vllm.run.context import collect
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


def test_every_stage_declares_its_reads():
    # The stages declare their reads when they are defined (stage(reads=...)).
    import pyinfra_vllm.stages.audit  # noqa: F401
    import pyinfra_vllm.stages.full  # noqa: F401
    from pyinfra_vllm.core.settings import STAGES

    assert set(host_reads.STAGE_READS) == {*STAGES, "audit"}


def test_the_default_settings_read_every_stage_at_once_without_duplicates():
    import pyinfra_vllm.stages.audit  # noqa: F401
    import pyinfra_vllm.stages.full  # noqa: F401

    settings = validate({"gateway_open": True})
    reads = host_reads.stage_reads(settings, host_reads.STAGE_READS, endpoint(settings))
    keys = [read.key() for read in reads]
    assert len(keys) == len(set(keys))
    assert {read.fact.__name__ for read in reads} >= {
        "LinuxDistribution", "VllmEnvironments", "KernelParam", "ModelFiles",
        "EngineProcess", "NginxServers", "UnitActivation", "DebPackage"}
    # The GPU facts are reads of their own, one group side by side; GpuHostState, the
    # same facts as one fact, is not read.
    gpu = [read for read in reads if read.group == GPU_GROUP]
    assert [read.fact for read in gpu] == list(GpuHostState.facts.values())
    assert "GpuHostState" not in {read.fact.__name__ for read in reads}
    skipped = settings.model_copy(update={"skip_stages": ["gateway", "metrics"]})
    names = {read.fact.__name__ for read in
             host_reads.stage_reads(skipped, host_reads.STAGE_READS, endpoint(skipped))}
    assert "NginxServers" not in names
    # vLLM 0.6.3 listens on TCP: the vllm_service stage reads nftables' package, the
    # gateway's and the metrics' packages are not read.
    packages = [read.kwargs["package"] for read in
                host_reads.stage_reads(skipped, host_reads.STAGE_READS, endpoint(skipped))
                if read.fact.__name__ == "DebPackage"]
    assert packages == ["nftables"]


class Fails(FactBase):
    """A fact whose command fails after printing something."""

    def command(self) -> str:
        return "echo partial; exit 3"


def test_a_read_whose_command_failed_is_left_to_pyinfra(local):
    _state, host = local
    values = host_reads.read_all(host, [Read(Fails), Read(KernelVersion)])
    assert list(values) == [Read(KernelVersion).key()]


def test_a_group_runs_side_by_side_each_line_its_own_section():
    commands = ["echo alone", list(SLOW), "echo last; exit 4"]
    sections = {0: (0, ["alone"]), 1: (3, ["first"]), 2: (0, ["second"]),
                3: (1, ["third", "lines"]), 4: (4, ["last"])}
    seconds, lines = _sh(sections_command(commands, "abc"))
    assert split_sections(lines, "abc") == sections
    assert seconds < 1.5  # the three 0.6 s commands at once
    # Without a temporary directory: the same sections, one after another.
    seconds, lines = _sh(sections_command(commands, "abc"), TMPDIR="/nonexistent/pyinfra-vllm")
    assert split_sections(lines, "abc") == sections
    assert seconds >= 1.8


def test_a_group_runs_where_it_starts_and_a_line_given_twice_runs_once():
    commands, positions = arrange([("a", None), ("g1", "gpu"), ("b", None), ("g2", "gpu"),
                                   ("a", None), ("g1", "gpu")])
    assert commands == ["a", ["g1", "g2"], "b"]
    assert positions == [0, 1, 3, 2, 0, 1]


def test_the_state_is_collected_from_the_one_read_as_gpu_host_state_gives_it(local, caplog):
    _state, host = local
    reads = host_reads.state_reads(validate({"gateway_open": True}))
    host_reads.answer_from(host, host_reads.read_all(host, reads))
    caplog.set_level(logging.DEBUG, logger="pyinfra")
    state = collect(host)
    assert "was not read with the host's state" not in caplog.text
    # GpuHostState read alone: the same facts, the same values, the same keys.
    alone = host.get_fact(GpuHostState)
    assert state == {"os": host.get_fact(LinuxDistribution),
                     "kernel": host.get_fact(KernelVersion), **alone}


class Unparsable(base.FactBase):
    """A fact of this project's kind whose parser fails on what its command prints."""

    def command(self, word: str) -> str:
        return f"echo {word}"

    def process(self, output: list[str]) -> float:
        return float(output[0])


class UpstreamUnparsable(FactBase):
    """The same on pyinfra's own base, as pyinfra's facts are: its parser's ValueError
    is not pyinfra's FactProcessError."""

    def command(self, word: str) -> str:
        return f"echo {word}"

    def process(self, output: list[str]) -> float:
        return float(output[0])


def _beside_another(config: Config) -> tuple[State, object]:
    """@local beside a host that is never connected: pyinfra fails a host and goes on
    only while another one is left (a run whose last host fails ends, "No hosts
    remaining!")."""
    inventory = Inventory((["@local", "bystander"], {}))
    state = State(inventory, config)
    host = inventory.get_host("@local")
    state.limit_hosts = [host]
    connect_all(state)
    state.limit_hosts = None
    state.activate_host(inventory.get_host("bystander"))
    return state, host


def _errors(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]


@pytest.mark.parametrize("fact", [Unparsable, UpstreamUnparsable])
def test_a_section_its_fact_cannot_process_fails_that_host_not_the_run(fact, caplog):
    state, host = _beside_another(Config())
    with ctx_state.use(state), ctx_host.use(host):
        values = host_reads.read_all(host, [Read(fact, {"word": "garbage"}), Read(KernelVersion)])
    assert values[Read(fact, {"word": "garbage"}).key()] is None  # the fact's default
    assert values[Read(KernelVersion).key()] == host.get_fact(KernelVersion)
    assert state.failed_hosts == {host}
    assert [h.name for h in state.active_hosts] == ["bystander"]
    assert any(line.endswith(f"could not process fact: {fact.name} word=garbage")
               for line in _errors(caplog)), _errors(caplog)
    assert any("ValueError: could not convert string to float: 'garbage'" in line
               for line in _errors(caplog))


def test_the_one_read_fails_a_host_exactly_as_pyinfra_fails_it_for_the_fact_alone(caplog):
    read = Read(Unparsable, {"word": "garbage"})
    state, host = _beside_another(Config())
    with ctx_state.use(state), ctx_host.use(host):
        in_the_one_read = host_reads.read_all(host, [read])[read.key()]
    logged = _errors(caplog)
    caplog.clear()
    alone_state, alone_host = _beside_another(Config())
    with ctx_state.use(alone_state), ctx_host.use(alone_host):
        alone = alone_host.get_fact(Unparsable, word="garbage")  # pyinfra's own get_fact
    assert in_the_one_read == alone is None
    assert {h.name for h in state.failed_hosts} == {h.name for h in alone_state.failed_hosts}
    assert logged == _errors(caplog) and len(logged) == 2


def test_ignore_errors_makes_it_a_warning_and_keeps_the_host(caplog):
    state, host = _beside_another(Config(IGNORE_ERRORS=True))
    with ctx_state.use(state), ctx_host.use(host):
        values = host_reads.read_all(host, [Read(Unparsable, {"word": "garbage"})])
    assert list(values.values()) == [None]
    assert state.failed_hosts == set() and host in state.active_hosts
    assert _errors(caplog) == []
    assert any("Error (ignored): could not process fact" in record.getMessage()
               for record in caplog.records if record.levelno == logging.WARNING)
