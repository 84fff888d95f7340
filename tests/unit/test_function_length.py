"""Every function fits on a screen: at most ``MAX_LINES`` lines.

A function is counted from its ``def`` line to its last line (``ast``'s ``end_lineno -
lineno + 1``), docstring and comments included: an operation reads top to bottom like
the runbook step it is, and a longer one is split into well-named helpers (in its
module, pyinfra_vllm/operations/util/ when shared, pyinfra_vllm/plans/ when pure planning).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 60
# The product's folders: the test harness (sandbox/, tests/) is not counted.
FOLDERS = ("deploys", "pyinfra_vllm", "facts", "tools", "files")


def long_functions(path: Path, root: Path = ROOT,
                   max_lines: int = MAX_LINES) -> list[str]:
    """``file:function:length`` of each function in ``path`` longer than ``max_lines``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > max_lines:
                found.append(f"{path.relative_to(root).as_posix()}:{node.name}:{length}")
    return found


def test_no_function_is_longer_than_a_screen():
    too_long = [
        problem
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        for problem in long_functions(path)
    ]
    assert too_long == [], (
        f"functions over {MAX_LINES} lines (file:function:length): split them into "
        "well-named helpers"
    )


def test_the_check_counts_from_def_to_last_line(tmp_path):
    body = "".join(f"    x{index} = {index}\n" for index in range(MAX_LINES - 1))
    (tmp_path / "fits.py").write_text(f"def fits():\n{body}")
    (tmp_path / "long.py").write_text(
        f"class Holder:\n    @staticmethod\n    async def long():\n"
        f"{body.replace('    ', '        ')}        return None\n"
    )
    assert long_functions(tmp_path / "fits.py", tmp_path) == []
    assert long_functions(tmp_path / "long.py", tmp_path) == [f"long.py:long:{MAX_LINES + 1}"]
