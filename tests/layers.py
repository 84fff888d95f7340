"""The repository's layers: each module's layer is the folder it is in (``LAYERS``,
lowest first), and imports run one way, from the top down.

    python -m tests.layers        # prints docs/layout.md's layers and modules

tests/unit/test_layout.py checks the imports against the layers; tests/unit/test_docs.py
keeps docs/layout.md equal to what this prints.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first: (layer, its folders, what it holds). A folder's subfolders are in its
# layer (pyinfra_vllm/operations/util/ holds the operations' helpers, as
# pyinfra.operations.util).
LAYERS: list[tuple[str, tuple[str, ...], str]] = [
    ("facts", ("facts",),
     "what is read from a host: pyinfra facts and their parsers, with the version numbers "
     "and the downloader's names they share"),
    ("core", ("pyinfra_vllm/core",),
     "settings, stacks as data, templates, the pyinfra versions the audit was tested with, "
     "a model's paths, secrets and locks on the operator's machine, text from hosts made "
     "safe to show"),
    ("plans", ("pyinfra_vllm/plans",),
     "what a host should look like, and the verdicts on what it is: pure functions"),
    ("operations", ("pyinfra_vllm/operations",),
     "pyinfra operations: the commands; their shared helpers in pyinfra_vllm/operations/util/"),
    ("run", ("pyinfra_vllm/run",),
     "one run: the context per host, its one read of the host, the shape of every stage"),
    ("report", ("pyinfra_vllm/report",),
     "the audit's reports: each host's entry and drift, the JSON, Markdown and HTML files "
     "and the terminal table"),
    ("stages", ("pyinfra_vllm/stages",), "one @stage function per stage, full and audit"),
    ("entry points", ("deploys", "tools"), "what operators run"),
    ("sandbox", ("sandbox",), "the test harness: the product never imports it"),
]
# Apart from the layers: run alone on the hosts, importing nothing of ours.
HOST_SCRIPTS = "files"
RANK = {name: rank for rank, (name, _folders, _what) in enumerate(LAYERS)}
PACKAGES = ("pyinfra_vllm", "facts", "deploys", "tools", "sandbox", HOST_SCRIPTS)


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
    for name, folders, _what in LAYERS:
        for top in folders:
            if (folder == top or folder.startswith(top + "/")) and (best is None or len(top) > best[0]):
                best = (len(top), name)
    if best is None:
        raise LookupError(f"{module}: in no layer's folder (tests/layers.py LAYERS): "
                          "put it in the folder of its layer")
    return best[1]


def _imported(node: ast.ImportFrom, source: str, path: Path, root: Path) -> list[str]:
    base = node.module or ""
    if node.level:
        package = source.split(".") if path.name == "__init__.py" else source.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    # `from pyinfra_vllm.operations import gate` imports the module
    # pyinfra_vllm.operations.gate;
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
    if path.name != "__init__.py" or our_imports(path, root):
        return False
    try:
        layer(module_name(path, root), root)
    except LookupError:
        return True
    return False


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


def first_sentence(path: Path) -> str:
    """A module's docstring up to its first full stop or blank line, on one line."""
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(docstring.split("\n\n")[0].split())
    head, dot, _ = text.partition(". ")
    return (head + "." if dot else text).replace("|", "\\|")


def folder_of(module: str) -> str:
    """The folder a module is drawn in: its package (facts, tools, sandbox), the layer
    folder of pyinfra_vllm (pyinfra_vllm/core), or the operations' helpers
    (pyinfra_vllm/operations/util)."""
    parts = module.split(".")
    if parts[0] != "pyinfra_vllm":
        return parts[0]
    depth = 3 if parts[1:3] == ["operations", "util"] and len(parts) > 3 else 2
    return "/".join(parts[:depth])


def package_imports(root: Path = ROOT) -> dict[str, set[str]]:
    """Which top-level package imports which (facts, pyinfra_vllm, deploys, tools,
    sandbox): the layers seen from above, a package's imports of itself left out."""
    graph: dict[str, set[str]] = {}
    for source, targets in import_graph(root).items():
        top = source.split(".")[0]
        graph.setdefault(top, set()).update(
            target.split(".")[0] for target in targets if target.split(".")[0] != top)
    return graph


def folder_imports(root: Path = ROOT) -> list[tuple[str, str]]:
    """Which folder imports which: the drawing of the repository's imports, by folder."""
    return sorted({(folder_of(source), folder_of(target))
                   for source, targets in import_graph(root).items() for target in targets
                   if folder_of(source) != folder_of(target)})


def markdown(root: Path = ROOT) -> str:
    rows = ["| layer | folders | what |", "|---|---|---|"]
    for name, folders, what in reversed(LAYERS):
        rows.append(f"| {name} | {', '.join(f'`{folder}/`' for folder in folders)} | {what} |")
    rows += ["", "| folder | imports |", "|---|---|"]
    imports: dict[str, list[str]] = {}
    for source, target in folder_imports(root):
        imports.setdefault(source, []).append(f"`{target}/`")
    rows += [f"| `{source}/` | {', '.join(targets)} |" for source, targets in imports.items()]
    rows += ["", "| module | layer | what |", "|---|---|---|"]
    for path in product_files(root):
        name = module_name(path, root)
        if name.split(".")[0] == HOST_SCRIPTS:
            where = "host script"
        elif _is_bare_package(path, root):
            where = ""
        else:
            where = layer(name, root)
        rows.append(f"| `{path.relative_to(root).as_posix()}` | {where} | {first_sentence(path)} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
