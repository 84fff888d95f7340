"""Folders are the layers, and imports run one way, from the top down.

A module's layer is the folder it is in (``LAYERS``, lowest first): a module may import
modules of its own layer or of a layer below it, never above, and no module is in a
circle of imports. A module in no layer's folder fails the check: a new module is put
where its layer is, never guessed. The scripts uploaded to hosts (files/) import nothing
of this repository, since they run alone on the host; the product never imports the
test harness (sandbox/). docs/layout.md draws the same layers: test_docs_layout checks it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Lowest first: (layer, its folders). A folder's subfolders are in its layer
# (operations/util/ is the operations' helpers, as pyinfra.operations.util).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("pyinfra_vllm/core",)),
    ("facts", ("facts",)),
    ("plans", ("pyinfra_vllm/plans",)),
    ("operations", ("operations",)),
    ("run", ("pyinfra_vllm/run",)),
    ("stages", ("pyinfra_vllm/stages",)),
    ("entry points", ("deploys", "tools")),
    ("sandbox", ("sandbox",)),
]
# Apart from the layers: run alone on the hosts, importing nothing of ours.
HOST_SCRIPTS = "files"
RANK = {name: rank for rank, (name, _) in enumerate(LAYERS)}
PACKAGES = ("pyinfra_vllm", "facts", "operations", "deploys", "tools", "sandbox", HOST_SCRIPTS)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_path(module: str, root: Path = ROOT) -> Path | None:
    path = root.joinpath(*module.split("."))
    if path.with_suffix(".py").exists():
        return path.with_suffix(".py")
    if (path / "__init__.py").exists():
        return path / "__init__.py"
    return None


def layer(module: str, root: Path = ROOT) -> str:
    """The layer of ``module``: that of the deepest layer folder holding it."""
    folder = "/".join(module.split("."))
    path = module_path(module, root)
    if path is not None and path.name != "__init__.py":
        folder = folder.rsplit("/", 1)[0] if "/" in folder else ""
    best: tuple[int, str] | None = None
    for name, folders in LAYERS:
        for top in folders:
            if (folder == top or folder.startswith(top + "/")) and (best is None or len(top) > best[0]):
                best = (len(top), name)
    if best is None:
        raise LookupError(f"{module}: in no layer's folder (tests/unit/test_layout.py LAYERS): "
                          "put it in the folder of its layer")
    return best[1]


def _imported(node: ast.ImportFrom, source: str, path: Path, root: Path) -> list[str]:
    base = node.module or ""
    if node.level:
        package = source.split(".") if path.name == "__init__.py" else source.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    # `from operations import gate` imports the module operations.gate;
    # `from facts.driver import DriverInfo` imports facts.driver.
    names = [f"{base}.{alias.name}" for alias in node.names]
    return [name if module_path(name, root) else base for name in names]


def our_imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) for every import of one of our packages in ``path``, relative
    imports resolved, those only for type checking included."""
    source = module_name(path, root)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            names = _imported(node, source, path, root)
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in PACKAGES]
    return found


def product_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for package in PACKAGES for p in (root / package).rglob("*.py"))


def _is_bare_package(path: Path, root: Path) -> bool:
    """A package's ``__init__.py`` above the layer folders (pyinfra_vllm/): no layer of
    its own, so it may import nothing."""
    return path.name == "__init__.py" and not our_imports(path, root)


def wrong_way(path: Path, root: Path = ROOT) -> list[str]:
    source = module_name(path, root)
    where = path.relative_to(root)
    problems = []
    for line, target in our_imports(path, root):
        if source.split(".")[0] == HOST_SCRIPTS:
            problems.append(f"{where}:{line}: a host script imports {target}")
        elif target.split(".")[0] == HOST_SCRIPTS:
            problems.append(f"{where}:{line}: imports the host script {target}")
        elif RANK[layer(target, root)] > RANK[layer(source, root)]:
            problems.append(f"{where}:{line}: {layer(source, root)} module {source} imports "
                            f"{layer(target, root)} module {target}")
    return problems


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    return {module_name(path, root): {target for _, target in our_imports(path, root)}
            for path in product_files(root)}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


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


def test_operations_hold_operations():
    """operations/*.py define pyinfra operations; their shared helpers are in
    operations/util/, what the host should look like in pyinfra_vllm/plans/."""
    without = []
    for path in sorted((ROOT / "operations").glob("*.py")):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        decorated = [node for node in tree.body if isinstance(node, ast.FunctionDef)
                     and any(ast.unparse(d).startswith("operation") for d in node.decorator_list)]
        if not decorated:
            without.append(path.name)
    assert without == []


@pytest.mark.parametrize(("source", "line", "problem"), [
    ("facts/sample.py", "from operations import gate",
     "facts module facts.sample imports operations module operations.gate"),
    ("operations/sample.py", "from pyinfra_vllm.run.context import context",
     "operations module operations.sample imports run module pyinfra_vllm.run.context"),
    ("pyinfra_vllm/core/extra.py", "from pyinfra_vllm.stages.full import full",
     "core module pyinfra_vllm.core.extra imports stages module pyinfra_vllm.stages.full"),
    ("pyinfra_vllm/core/extra.py", "from ..stages import full",
     "core module pyinfra_vllm.core.extra imports stages module pyinfra_vllm.stages.full"),
    ("pyinfra_vllm/plans/extra.py", "from . import sample",
     ""),
    ("tools/sample.py", "from sandbox import hosts",
     "entry points module tools.sample imports sandbox module sandbox.hosts"),
    ("operations/util/sample.py", "from operations import gate", ""),
    ("operations/sample.py", "from files.vllm_probe import server_flags",
     "imports the host script files.vllm_probe"),
    ("files/sample.py", "import facts.driver", "a host script imports facts.driver"),
])
def test_the_check_fails_on_an_import_running_the_wrong_way(tmp_path, source, line, problem):
    for module in ("operations/gate.py", "pyinfra_vllm/run/context.py", "sandbox/hosts.py",
                   "pyinfra_vllm/stages/full.py", "files/vllm_probe.py", "facts/driver.py",
                   "pyinfra_vllm/plans/sample.py"):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).touch()
    (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / source).write_text(line + "\n")
    problems = wrong_way(tmp_path / source, tmp_path)
    if not problem:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].endswith(problem), problems


def test_the_whole_run_calls_the_stages_in_the_order_settings_name_them():
    """pyinfra_vllm/core/settings.py STAGES is the one list of stages (skip_stages is
    checked against it); pyinfra_vllm/stages/full.py calls them in that order."""
    from pyinfra_vllm.core.settings import STAGES

    tree = ast.parse((ROOT / "pyinfra_vllm/stages/full.py").read_text())
    full = next(node for node in tree.body if isinstance(node, ast.FunctionDef)
                and node.name == "full")
    called = [node.value.func.id for node in full.body if isinstance(node, ast.Expr)
              and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)]
    # python_env_built is the second half of the python_env stage.
    stages = list(dict.fromkeys("python_env" if name == "python_env_built" else name
                                for name in called if name != "context"))
    assert stages == list(STAGES)
