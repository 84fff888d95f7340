"""What the suite reads of pyinfra beyond its operations and facts, checked by behaviour.

The audit's drift (pyinfra_vllm/report/drift.py ``host_plan``) reads pyinfra's prepared
state, and ``--diff`` (pyinfra_vllm/operations/util/file_diff.py) reuses pyinfra's diff switch
and printer. pyinfra documents these but may change them in a minor release: pyproject.toml
pins the tested range (pyinfra_vllm/core/versions.py ``PYINFRA_TESTED``). A newer pyinfra
that breaks one fails here, naming the attribute and the version, instead of the audit
saying "converged".
"""

from __future__ import annotations

import re
from pathlib import Path

import pyinfra
import pyinfra.version
import pytest
from pyinfra.api import Config, Inventory, State, operation
from pyinfra.api.operation import OperationMeta
from pyinfra.api.state import StateStage
from pyinfra.api.util import format_text
from pyinfra.context import ctx_host, ctx_state
from pyinfra.facts.files import FileContents
from pyinfra.operations.util.files import generate_color_diff
from pyinfra_cli.prints import build_plan_json

from pyinfra_vllm.core.versions import PYINFRA_TESTED, pyinfra_problem

VERSION = pyinfra.version.__version__
ROOT = Path(__file__).resolve().parents[2]


def broken(attribute: str, what: str) -> str:
    return (f"pyinfra {VERSION}: {attribute} {what}; pyinfra_vllm/report/drift.py and "
            "pyinfra_vllm/operations/util/file_diff.py rely on it "
            "(see PYINFRA_TESTED in pyinfra_vllm/core/versions.py)")


@operation()
def probe(change: bool):
    """
    One command when ``change``, none otherwise.

    + change: whether the host differs
    """
    if change:
        yield "true"


@pytest.fixture
def prepared(monkeypatch):
    """One host, prepared as the CLI prepares it: a changing, an unchanged and a
    conditional operation, under a deploy named ``stage``."""
    monkeypatch.setattr(pyinfra, "is_cli", True)
    inventory = Inventory((["h1"], {}))
    state = State(inventory, Config(), check_for_changes=True)
    state.set_stage(StateStage.Prepare)
    host = inventory.get_host("h1")
    state.activate_host(host)  # as connecting does: the CLI's plan lists activated hosts
    with ctx_state.use(state), ctx_host.use(host):
        with host.deploy("stage", None, None, in_deploy=False):
            metas = {
                "change": probe(name="Changes", change=True),
                "same": probe(name="Unchanged", change=False),
                "if": probe(name="Conditional", change=True, _if=lambda: False),
            }
    return state, host, metas


def test_the_tested_range_is_the_pinned_one_and_holds_this_pyinfra():
    assert pyinfra_problem(VERSION) is None, (
        f"pyinfra {VERSION} is installed, outside PYINFRA_TESTED {PYINFRA_TESTED}: run this "
        "file's tests on it, then widen PYINFRA_TESTED and pyproject.toml together")
    low, high = (".".join(map(str, v)) for v in PYINFRA_TESTED)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"pyinfra>={low},<{high}",' in pyproject, (
        "pyproject.toml pins another pyinfra range than PYINFRA_TESTED")
    assert re.search(rf"^pyinfra=={re.escape(VERSION)}$",
                     (ROOT / "requirements.lock").read_text(), re.M)


def test_will_change_is_the_flag_of_the_cli_plan(prepared):
    state, host, metas = prepared
    assert isinstance(metas["change"], OperationMeta), broken("an operation call", "no longer "
                                                               "returns an OperationMeta")
    flags = {key: meta.will_change for key, meta in metas.items()}
    assert flags == {"change": True, "same": False, "if": True}, broken(
        "OperationMeta.will_change", f"gives {flags} for a changing, an unchanged and a "
        "conditional operation after prepare")
    # pyinfra's own --dry --json plan (what tools/audit.py cross-checks) agrees.
    plan = {op["names"][0]: (op["hosts_with_change"], op["hosts_with_conditional_change"])
            for op in build_plan_json(state)}
    assert plan == {"stage | Changes": (["h1"], []), "stage | Unchanged": ([], []),
                    "stage | Conditional": ([], ["h1"])}, broken("build_plan_json", f"gives {plan}")


def test_the_prepared_state_holds_what_the_audit_reads(prepared):
    state, host, metas = prepared
    hashes = list(host.op_hash_order)
    assert len(hashes) == 3, broken("Host.op_hash_order", f"is {hashes}")
    ops = state.ops.get(host)
    assert isinstance(ops, dict) and set(ops) == set(hashes), broken(
        "State.ops", "is no longer {host: {op hash: StateOperationHostData}}")
    by_name = {sorted(state.op_meta[h].names)[0]: ops[h] for h in hashes}
    assert set(by_name) == {"stage | Changes", "stage | Unchanged", "stage | Conditional"}, \
        broken("StateOperationMeta.names", f"are {set(by_name)}: no longer 'deploy | name'")
    assert by_name["stage | Changes"].operation_meta is metas["change"], broken(
        "StateOperationHostData.operation_meta", "is not the OperationMeta the call returned "
        "(the audit knows gate.refuse by it)")
    assert not by_name["stage | Changes"].global_arguments.get("_if")
    assert by_name["stage | Conditional"].global_arguments.get("_if"), broken(
        "StateOperationHostData.global_arguments['_if']", "is empty for a conditional operation")
    assert state.op_meta[hashes[0]].args == [], broken("StateOperationMeta.args",
                                                      "is not [] for a named operation")


def test_check_for_changes_off_is_visible(monkeypatch):
    state = State(Inventory((["h1"], {})), Config(), check_for_changes=False)
    assert state.should_check_for_changes() is False, broken(
        "State.should_check_for_changes()", "does not say -y turned change detection off")


def test_the_diff_switch_and_printer():
    assert Config().DIFF is False, broken("Config.DIFF", "is not False by default")
    state = State(Inventory((["h1"], {})), Config())
    assert state.is_executing is False, broken("State.is_executing", "is not False before execute")
    lines = list(generate_color_diff(["a\n", "b\n", "c\n"], ["a\n", "B\n", "c\n"]))
    assert lines == ["@@ -1,3 +1,3 @@", "  a", format_text("- b", "red"),
                     format_text("+ B", "green"), "  c"], broken("generate_color_diff",
                                                               f"prints {lines}")
    fact = FileContents()
    assert fact.command("/etc/x").get_raw_value().startswith("( test -e /etc/x && cat /etc/x )"), \
        broken("FileContents.command", "no longer cats the file")
    assert fact.process(["one", "two"]) == ["one", "two"]


def test_a_function_command_runs_remote_commands_with_its_operations_arguments():
    # The rolling restart (pyinfra_vllm/operations/vllm_service.py ``_roll``) and the watch of a
    # long job (pyinfra_vllm/operations/util/jobs.py) run their commands from a FunctionCommand
    # with the operation's connector arguments (_sudo, _env ...): pyinfra passes those to
    # StringCommands only, so ``connector_arguments`` reads them from
    # host.current_op_global_arguments while the operation runs. Run for real on @local
    # (``echo``).
    from pyinfra.api import FunctionCommand, StringCommand
    from pyinfra.api.connect import connect_all
    from pyinfra.api.operation import add_op
    from pyinfra.api.operations import run_ops

    from pyinfra_vllm.operations.util.jobs import connector_arguments

    seen: dict = {}

    def step(state, host):
        seen["ok"], output = host.run_shell_command(
            StringCommand("echo", '"$ROLLING_PROBE"'), **connector_arguments(host))
        seen["lines"] = output.stdout_lines
        return True

    @operation(is_idempotent=False)
    def rolling_probe():
        """
        A FunctionCommand that runs a command.
        """
        yield FunctionCommand(step, (), {})

    state = State(Inventory((["@local"], {})), Config())
    connect_all(state)
    add_op(state, rolling_probe, _env={"ROLLING_PROBE": "from the operation"})
    run_ops(state)
    assert seen == {"ok": True, "lines": ["from the operation"]}, broken(
        "host.current_op_global_arguments", "no longer carries the operation's arguments")


def test_the_one_read_stands_on_what_pyinfra_reads_and_runs_through():
    # pyinfra_vllm/run/host_reads.py answers host.get_fact and watches run_shell_command and
    # put_file on the Host object, and facts/host_state.py writes pyinfra's missing-binary
    # line itself. A section its fact cannot process fails the host as pyinfra's get_fact
    # does (facts/base.py makes parser errors FactProcessError, the one it catches), with
    # pyinfra's own helpers.
    import inspect

    from pyinfra.api import arguments, util
    from pyinfra.api import facts as pyinfra_facts
    from pyinfra.api.host import Host

    from facts.host_state import MISSING_COMMAND

    for name in ("get_fact", "run_shell_command", "put_file"):
        assert callable(getattr(Host, name, None)), broken(f"Host.{name}", "is gone")
    marker = getattr(pyinfra_facts, "_MISSING_COMMAND_MARKER", None)
    assert marker == MISSING_COMMAND, broken("the missing-command marker", f"is {marker!r}")
    source = inspect.getsource(pyinfra_facts._get_fact)
    assert "except FactProcessError" in source and "could not process fact" in source, broken(
        "get_fact", "no longer turns a FactProcessError into \"could not process fact\"")
    for module, name in ((util, "log_error_or_warning"), (util, "get_kwargs_str"),
                         (arguments, "pop_global_arguments")):
        assert callable(getattr(module, name, None)), broken(f"{module.__name__}.{name}", "is gone")
