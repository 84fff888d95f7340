"""The docs say what the code is: the generated settings table, a section per stage, every
fact, every folder and module of the layout, and no path that does not exist."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from pyinfra_vllm.core.settings import STAGES, Settings, reference_markdown

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
START = "<!-- settings:start -->\n"
END = "<!-- settings:end -->"
# A path in backticks that starts with one of our folders, without placeholders.
REPO_PATH = re.compile(
    r"`((?:\.ci|bench|deploys|docs|facts|files|group_data|locks|operations|pyinfra_vllm|"
    r"sandbox|templates|tests|tools)/[\w./-]*)`"
)
FACT_NAME = re.compile(r"`(facts\.\w+\.[A-Z]\w*)`")


def text(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def without_code_blocks(markdown: str) -> str:
    return re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)


def settings_table() -> str:
    doc = text("settings.md")
    return doc[doc.index(START) + len(START) : doc.index(END)]


def test_settings_table_matches_the_model():
    assert settings_table().strip() == reference_markdown().strip(), (
        "docs/settings.md's table is stale: run `python -m pyinfra_vllm.core.settings` and paste "
        "its output between the settings markers"
    )


def test_every_setting_is_in_the_table():
    table = settings_table()
    for name in Settings.model_fields:
        assert f"| `{name}` |" in table


def test_every_stage_has_a_section_in_order():
    doc = text("stages.md")
    sections = re.findall(r"^## (\w+)$", doc, flags=re.M)
    assert sections == list(STAGES)


def test_every_stage_section_names_its_files():
    doc = text("stages.md")
    for stage in STAGES:
        section = doc.split(f"\n## {stage}\n", 1)[1].split("\n## ", 1)[0]
        for path in (f"deploys/{stage}.py", f"pyinfra_vllm/stages/{stage}.py"):
            assert f"`{path}`" in section, f"docs/stages.md, {stage}: {path} not named"
        assert f"`pyinfra inventory.py deploys/{stage}.py`" in section


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.name)
def test_every_path_the_docs_name_exists(doc):
    names = REPO_PATH.findall(without_code_blocks(doc.read_text(encoding="utf-8")))
    missing = sorted({name for name in names if not (ROOT / name).exists()})
    assert missing == [], f"{doc.relative_to(ROOT)} names paths that do not exist"


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.name)
def test_every_fact_the_docs_name_exists(doc):
    missing = []
    for name in FACT_NAME.findall(doc.read_text(encoding="utf-8")):
        _, module, cls = name.split(".")
        path = ROOT / "facts" / f"{module}.py"
        if not path.exists() or cls not in fact_classes(path):
            missing.append(name)
    assert missing == [], f"{doc.relative_to(ROOT)} names facts that do not exist"


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8"))
    missing = [link for link in links if not (doc.parent / link).exists()]
    assert missing == [], f"{doc.relative_to(ROOT)} links to files that do not exist"


def fact_classes(path: Path) -> dict[str, list[str]]:
    """Classes of a facts module that derive from a fact class: {name: [base names]}."""
    found = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b).split("[")[0] for b in node.bases]
            found[node.name] = bases
    return found


def concrete_facts() -> list[str]:
    """Every fact class in facts/ that no other fact class derives from (the bases,
    NvidiaSmiFact and DriverPackageQuery, only share a command)."""
    classes = {}
    for path in sorted((ROOT / "facts").glob("*.py")):
        for name, bases in fact_classes(path).items():
            classes[name] = (path.stem, bases)
    facts = set()
    for name in classes:
        seen, todo = set(), [name]
        while todo:
            current = todo.pop()
            for base in classes.get(current, ("", []))[1]:
                if base == "FactBase":
                    facts.add(name)
                elif base in classes and base not in seen:
                    seen.add(base)
                    todo.append(base)
    bases = {base for name in facts for base in classes[name][1]}
    return sorted(f"facts.{classes[name][0]}.{name}" for name in facts if name not in bases)


def test_the_fact_list_is_what_facts_holds():
    found = concrete_facts()
    assert "facts.topology.GpuTopology" in found
    assert "facts.gpu_host.GpuHostState" in found
    assert not any(name.endswith((".NvidiaSmiFact", ".DriverPackageQuery")) for name in found)


def test_every_fact_is_in_the_facts_doc():
    doc = text("facts.md")
    missing = [name for name in concrete_facts() if f"`{name}`" not in doc]
    assert missing == [], "docs/facts.md does not name these facts"


def tracked_files() -> list[str]:
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"git ls-files cannot run here: {exc}")
    return listed.splitlines()


def test_the_layout_names_every_top_level_folder():
    doc = text("layout.md")
    folders = sorted({path.split("/")[0] for path in tracked_files() if "/" in path})
    missing = [f for f in folders if not re.search(rf"(?<![\w.]){re.escape(f)}/", doc)]
    assert missing == [], "docs/layout.md does not name these folders"


def test_the_layout_is_the_code_s_own():
    from tests.layers import markdown

    doc = text("layout.md")
    start = doc.index("<!-- layers:start -->\n") + len("<!-- layers:start -->\n")
    end = doc.index("<!-- layers:end -->")
    assert doc[start:end] == markdown(), (
        "docs/layout.md's layers and modules are stale: run `python -m tests.layers` and paste it"
    )


def test_the_security_catalogue_is_the_tests_own():
    from tests.catalogue import markdown

    text = Path("docs/security.md").read_text()
    start = text.index("<!-- catalogue:start -->\n") + len("<!-- catalogue:start -->\n")
    end = text.index("<!-- catalogue:end -->")
    assert text[start:end] == markdown(), (
        "docs/security.md's catalogue is stale: run `python -m tests.catalogue` and paste it"
    )


def test_the_gpu_health_page_lists_every_xid_code_the_suite_knows():
    from pyinfra_vllm.plans.gpu_health import XID_CODES

    rows = {int(m.group(1)): m.group(2) for m in re.finditer(
        r"^\| (\d+) \| [^|]+ \| (failing|degraded|info) \|", text("gpu-health.md"), flags=re.M)}
    assert rows == {code: severity for code, (_m, _a, severity) in XID_CODES.items()}
