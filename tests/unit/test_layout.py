"""Folders are the layers, and imports run one way, from the top down (tests/layers.py).

A module may import modules of its own layer or of a layer below it, never above, and no
module is in a circle of imports, nor is a top-level package (facts, pyinfra_vllm, deploys,
tools, sandbox). A module in no layer's folder fails the check: a new
module is put where its layer is, never guessed. The scripts uploaded to hosts (files/)
import nothing of this repository, since they run alone on the host; the product never
imports the test harness (sandbox/).
"""

from __future__ import annotations

import ast

import pytest

from tests.layers import (
    HOST_SCRIPTS,
    ROOT,
    _is_bare_package,
    circles,
    import_graph,
    layer,
    module_name,
    our_imports,
    package_imports,
    product_files,
    wrong_way,
)


def test_every_product_module_has_a_layer():
    missing = []
    for path in product_files():
        name = module_name(path)
        if name.split(".")[0] == HOST_SCRIPTS or _is_bare_package(path, ROOT):
            continue
        try:
            layer(name)
        except LookupError as error:
            missing.append(str(error))
    assert missing == []


def test_a_module_outside_the_layer_folders_has_no_layer(tmp_path):
    (tmp_path / "pyinfra_vllm").mkdir()
    (tmp_path / "pyinfra_vllm" / "extra.py").touch()
    with pytest.raises(LookupError, match="pyinfra_vllm.extra: in no layer's folder"):
        layer("pyinfra_vllm.extra", tmp_path)


def test_no_import_runs_the_wrong_way():
    assert [problem for path in product_files() for problem in wrong_way(path)] == []


def test_no_circle_of_imports():
    assert circles(import_graph()) == []


def test_the_circle_check_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_circle_of_top_level_packages():
    """facts imports nothing of pyinfra_vllm, which imports facts; deploys and tools import
    both, sandbox imports tools."""
    assert circles(package_imports()) == []


def test_the_package_check_finds_a_circle_no_module_is_in(tmp_path):
    for module, line in (("facts/sample.py", "from pyinfra_vllm.core import extra"),
                         ("facts/other.py", ""),
                         ("pyinfra_vllm/core/extra.py", ""),
                         ("pyinfra_vllm/core/user.py", "from facts import other")):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text(line + "\n")
    assert circles(import_graph(tmp_path)) == []
    assert circles(package_imports(tmp_path)) == [["facts", "pyinfra_vllm"]]


def test_operations_hold_operations():
    """pyinfra_vllm/operations/*.py define pyinfra operations (and their private steps);
    the helpers they share are in pyinfra_vllm/operations/util/, what the host should look
    like in pyinfra_vllm/plans/."""
    found = {}
    for path in sorted((ROOT / "pyinfra_vllm/operations").glob("*.py")):
        if path.name == "__init__.py":
            continue
        functions = [node for node in ast.parse(path.read_text()).body
                     if isinstance(node, ast.FunctionDef)]
        operations = [node.name for node in functions
                      if any(ast.unparse(d).startswith("operation") for d in node.decorator_list)]
        others = [node.name for node in functions
                  if node.name not in operations and not node.name.startswith("_")]
        if not operations or others:
            found[path.name] = others or "no operation"
    assert found == {}


@pytest.mark.parametrize(("source", "line", "problem"), [
    ("facts/sample.py", "from pyinfra_vllm.operations import gate",
     "facts module facts.sample imports operations module pyinfra_vllm.operations.gate"),
    ("facts/sample.py", "from pyinfra_vllm.core.extra import name",
     "facts module facts.sample imports core module pyinfra_vllm.core.extra"),
    ("pyinfra_vllm/operations/sample.py", "from pyinfra_vllm.run.context import context",
     "operations module pyinfra_vllm.operations.sample imports run module "
     "pyinfra_vllm.run.context"),
    ("pyinfra_vllm/run/extra.py", "from pyinfra_vllm.report.runs import record",
     "run module pyinfra_vllm.run.extra imports report module pyinfra_vllm.report.runs"),
    ("pyinfra_vllm/core/extra.py", "from pyinfra_vllm.stages.full import full",
     "core module pyinfra_vllm.core.extra imports stages module pyinfra_vllm.stages.full"),
    ("pyinfra_vllm/core/extra.py", "from ..stages import full",
     "core module pyinfra_vllm.core.extra imports stages module pyinfra_vllm.stages.full"),
    ("pyinfra_vllm/plans/extra.py", "from . import sample",
     ""),
    ("tools/sample.py", "from sandbox import hosts",
     "entry points module tools.sample imports sandbox module sandbox.hosts"),
    ("pyinfra_vllm/operations/util/sample.py", "from pyinfra_vllm.operations import gate", ""),
    ("pyinfra_vllm/operations/sample.py", "from files.vllm_probe import server_flags",
     "imports the host script files.vllm_probe"),
    ("files/sample.py", "import facts.driver", "a host script imports facts.driver"),
])
def test_the_check_fails_on_an_import_running_the_wrong_way(tmp_path, source, line, problem):
    for module in ("pyinfra_vllm/operations/gate.py", "pyinfra_vllm/run/context.py",
                   "sandbox/hosts.py", "pyinfra_vllm/stages/full.py", "files/vllm_probe.py",
                   "facts/driver.py", "pyinfra_vllm/plans/sample.py",
                   "pyinfra_vllm/core/extra.py", "pyinfra_vllm/report/runs.py"):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).touch()
    (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / source).write_text(line + "\n")
    problems = wrong_way(tmp_path / source, tmp_path)
    if not problem:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].endswith(problem), problems


def test_no_stage_refuses_a_host_by_itself():
    """Stages refuse through HostContext.refuse (pyinfra_vllm/run/context.py), which logs
    the reasons once and records the refusal for the audit; pyinfra_vllm.operations.gate
    directly would leave the audit calling the refusal drift."""
    direct = [f"{path.name}:{line}" for path in sorted((ROOT / "pyinfra_vllm/stages").glob("*.py"))
              for line, target in our_imports(path) if target == "pyinfra_vllm.operations.gate"]
    assert direct == []
