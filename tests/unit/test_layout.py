"""Imports run one way: entry points -> stages -> plans -> operations -> facts -> core.

docs/layout.md draws the same layers. A module may import modules of its own layer or
of a layer below it, never above; the scripts uploaded to hosts (files/) import nothing
of this repository, since they run alone on the host.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("deploys", "tools", "pyinfra_vllm", "operations", "facts", "files")

# Highest first. A module's layer is the first whose prefix matches its dotted name.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("entry points", ("deploys", "tools")),
    ("stages", ("pyinfra_vllm.stages",)),
    ("plans", (
        "pyinfra_vllm.context", "pyinfra_vllm.host_reads", "pyinfra_vllm.checks", "pyinfra_vllm.gates",
        "pyinfra_vllm.capacity", "pyinfra_vllm.compat", "pyinfra_vllm.report",
        "pyinfra_vllm.textfile", "pyinfra_vllm.locks", "pyinfra_vllm.report_changes",
        "pyinfra_vllm.report_html", "pyinfra_vllm.report_store", "pyinfra_vllm.gpu_health",
    )),
    ("operations", ("operations",)),
    ("facts", ("facts",)),
    ("core", ("pyinfra_vllm",)),
]
RANK = {name: len(LAYERS) - i for i, (name, _) in enumerate(LAYERS)}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> str:
    for name, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    raise LookupError(f"{module}: in no layer of LAYERS")


def is_module(name: str, root: Path) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or path.is_dir()


def our_imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) for every import of one of our packages in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from operations import gate` imports the module operations.gate;
            # `from facts.driver import DriverInfo` imports facts.driver.
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [n if is_module(n, root) else node.module for n in names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in PACKAGES]
    return found


def product_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for package in PACKAGES for p in (root / package).rglob("*.py"))


def wrong_way(path: Path, root: Path = ROOT) -> list[str]:
    source = module_name(path, root)
    where = path.relative_to(root)
    problems = []
    for line, target in our_imports(path, root):
        if source.startswith("files"):
            problems.append(f"{where}:{line}: a host script imports {target}")
        elif target.startswith("files"):
            problems.append(f"{where}:{line}: imports the host script {target}")
        elif RANK[layer(target)] > RANK[layer(source)]:
            problems.append(f"{where}:{line}: {layer(source)} module {source} imports "
                            f"{layer(target)} module {target}")
    return problems


def test_every_product_module_has_a_layer():
    for path in product_files():
        if not module_name(path).startswith("files"):
            layer(module_name(path))


def test_no_import_runs_the_wrong_way():
    assert [problem for path in product_files() for problem in wrong_way(path)] == []


@pytest.mark.parametrize(("source", "line", "problem"), [
    ("facts/sample.py", "from operations import gate",
     "facts module facts.sample imports operations module operations.gate"),
    ("operations/sample.py", "from pyinfra_vllm.context import context",
     "operations module operations.sample imports plans module pyinfra_vllm.context"),
    ("pyinfra_vllm/extra.py", "from pyinfra_vllm.stages.full import full",
     "core module pyinfra_vllm.extra imports stages module pyinfra_vllm.stages.full"),
    ("operations/sample.py", "from files.vllm_probe import server_flags",
     "imports the host script files.vllm_probe"),
    ("files/sample.py", "import facts.driver", "a host script imports facts.driver"),
])
def test_the_check_fails_on_an_import_running_the_wrong_way(tmp_path, source, line, problem):
    for module in ("operations/gate.py", "pyinfra_vllm/context.py",
                   "pyinfra_vllm/stages/full.py", "files/vllm_probe.py", "facts/driver.py"):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).touch()
    (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / source).write_text(line + "\n")
    problems = wrong_way(tmp_path / source, tmp_path)
    assert len(problems) == 1 and problems[0].endswith(problem), problems
