"""Text a host chooses, in the audit's reports and on the terminal: escaped in Markdown
(no table cell, link or HTML of its own), without escape sequences or control characters
on the terminal and in every report file, exact in the JSON. The fleet is the one built
from real machines' outputs (tests/unit/fleet_reports.py), with one host's GPU name,
served model id, refusal, drift and finding replaced by hostile text."""

from __future__ import annotations

import io
import json
import re
from typing import Any

import pytest

import tools.audit
from pyinfra_vllm.report import runs as report_module
from pyinfra_vllm.report.changes import changes, markdown_changes
from pyinfra_vllm.report.markdown import render_markdown
from pyinfra_vllm.report.summary import summary_table
from pyinfra_vllm.report.text import markdown_text, printable, printable_keeping_colours
from tests.unit.fleet_reports import connected_state, fleet, h200_state, host_entry

HOSTILE = "| <script>alert(1)</script> [x](http://evil) \x1b[31mRED\x1b[0m \r"
# HOSTILE in Markdown: the pipe, brackets and HTML escaped, and the ":" of "://" (no bare
# URL made a link); no escape sequence, and the carriage return a space.
HOSTILE_MD = "\\| &lt;script&gt;alert(1)&lt;/script&gt; \\[x\\](http\\://evil) RED  "
# HOSTILE on the terminal: the same words, no escape sequence, the carriage return a space.
HOSTILE_TERMINAL = "| <script>alert(1)</script> [x](http://evil) RED  "
# What a terminal would act on: C0 controls but the newline, DEL and C1 controls.
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")
# A link's "](" that Markdown reads as one: its "]" not escaped.
LINK = re.compile(r"(?<!\\)\]\(")
NAME = "gpu-h200-01"  # one H200


def hostile_report() -> dict[str, Any]:
    """The fleet with NAME's GPUs named HOSTILE, its engine serving HOSTILE, and HOSTILE
    in its drift, refusal and findings."""
    report = fleet()
    state = h200_state()
    state["gpus"] = [dict(gpu, name=HOSTILE) for gpu in state["gpus"]]
    entry = host_entry(NAME, state, [{"operation": HOSTILE, "stage": "sysctl"}],
                       [f"preflight: {HOSTILE}"], [f"python_env: {HOSTILE}"])
    entry["engine"] = {"models": [{"id": HOSTILE, "max_model_len": 4096}], "metrics": {}}
    report["hosts"][NAME] = entry
    return report


def cells(row: str) -> list[str]:
    """The cells of a Markdown table row as GFM splits it: at each "|" not escaped by a
    backslash (a backslash escapes the character after it, itself too)."""
    found, cell, chars = [], "", iter(row.strip().removeprefix("|"))
    for char in chars:
        if char == "\\":
            cell += char + next(chars, "")
        elif char == "|":
            found.append(cell)
            cell = ""
        else:
            cell += char
    return found + ([cell] if cell.strip() else [])


def tables(markdown: str) -> list[list[str]]:
    """Every table of a Markdown text, as its rows."""
    found: list[list[str]] = []
    previous = ""
    for line in markdown.splitlines():
        if line.startswith("|"):
            if not previous.startswith("|"):
                found.append([])
            found[-1].append(line)
        previous = line
    return found


def test_host_text_in_markdown_is_escaped():
    markdown = render_markdown(hostile_report())
    assert "<script" not in markdown and not LINK.search(markdown)
    assert not CONTROL.search(markdown)
    host = markdown.split(f"## {NAME}\n", 1)[1].split("\n## ", 1)[0]
    assert f"- GPUs: 1x {HOSTILE_MD}" in host
    assert f"Engine: {HOSTILE_MD} (4096)" in host
    assert f"- Refused: preflight: {HOSTILE_MD}" in host
    assert f"| sysctl | {HOSTILE_MD} |" in host
    assert f"- python_env: {HOSTILE_MD}" in host
    drift_row = next(line for line in markdown.splitlines() if line.startswith(f"| {NAME} |"))
    assert drift_row == (f"| {NAME} | 1 change(s), refused | {HOSTILE_MD} [sysctl] | "
                         f"preflight: {HOSTILE_MD} |")
    # No row has a cell more than its table's header: the "|" stayed text.
    for table in tables(markdown):
        assert {len(cells(row)) for row in table} == {len(cells(table[0]))}, table


def test_host_text_in_the_changes_section_is_escaped():
    report = hostile_report()
    before = json.loads(json.dumps(report))
    before["hosts"][NAME].update(drift=[], refused=[], findings=[])
    lines = markdown_changes(changes(before, report, "audit-earlier.json"))
    assert f"- {NAME}: refused, new: preflight: {HOSTILE_MD}" in lines
    assert f"- {NAME}: operations that would change, new: {HOSTILE_MD} \\[sysctl\\]" in lines
    assert not any("<script" in line or CONTROL.search(line) for line in lines)


def test_the_terminal_table_has_no_control_character():
    table = summary_table(hostile_report())
    assert not CONTROL.search(table)
    row = next(line for line in table.splitlines() if line.startswith(NAME))
    assert f"1x {HOSTILE_TERMINAL}" in row
    assert f"{HOSTILE_TERMINAL} (4096)" in row
    # The columns still line up: every row is cut at the same places.
    header, *rows = table.splitlines()
    start = header.index("verdict")
    assert all(line[start - 2:start] == "  " for line in rows)


def test_the_audit_s_lines_have_no_control_character():
    report = hostile_report()
    flagged = [name for name, entry in report["hosts"].items()
               if entry["drift"] or entry["refused"]]
    code, lines = tools.audit.verdict(report, {"plan": [{"hosts_with_change": flagged}]})
    assert code == 1
    assert f"drift: host {NAME}: refused: preflight: {HOSTILE_TERMINAL}" in lines
    assert f"drift: host {NAME}: found: python_env: {HOSTILE_TERMINAL}" in lines
    assert (f"drift: host {NAME}: 1 operation(s) would change: {HOSTILE_TERMINAL} [sysctl]"
            in lines)
    assert not any(CONTROL.search(line) for line in lines)


class FailedPyinfra:
    """subprocess.Popen's stand-in: a pyinfra run that printed ``stderr`` and failed."""

    def __init__(self, stderr: str) -> None:
        self.stdout = io.StringIO("")
        self.stderr = io.StringIO(stderr)
        self.returncode = 1

    def wait(self) -> int:
        return self.returncode


def test_the_wrapper_passes_pyinfra_s_colours_and_nothing_else(monkeypatch, capsys):
    # pyinfra prints a host's refusal in red, and what the host said as it is: here a
    # window title, a screen clear and a carriage return that would hide the error.
    said = "\x1b]0;pwned\x07\x1b[2Jrefused: disk\rall fine\b"
    output = f"\x1b[31m[gpu-1] {said}\x1b[0m\n--> pyinfra error: {said}\n"
    monkeypatch.setattr(tools.audit.subprocess, "Popen", lambda *a, **k: FailedPyinfra(output))
    assert tools.audit.run(["inventory.py"]) == 2
    err = capsys.readouterr().err
    assert "\x1b[31m[gpu-1] refused: disk all fine?\x1b[0m\n" in err
    assert "  --> pyinfra error: refused: disk all fine?\n" in err
    assert not CONTROL.search(err.replace("\x1b[31m", "").replace("\x1b[0m", ""))


def test_the_json_report_keeps_host_text_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(report_module.atexit, "register", lambda *args: None)
    report = hostile_report()
    run_state = connected_state(list(report["hosts"]))
    for name, entry in report["hosts"].items():
        report_module.record(run_state, name, entry, str(tmp_path))
    run = report_module.audit_run(run_state, str(tmp_path))
    written = json.loads(run.json_path.read_text())["hosts"][NAME]
    assert written["summary"]["gpu_names"] == [HOSTILE]
    assert written["engine"]["models"][0]["id"] == HOSTILE
    assert written["refused"] == [f"preflight: {HOSTILE}"]
    markdown = run.md_path.read_text()
    page = run.json_path.with_suffix(".html").read_text()
    assert HOSTILE_MD in markdown and "<script" not in markdown
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script" not in page
    for text in (markdown, page):
        assert not CONTROL.search(text)


@pytest.mark.parametrize(("text", "shown"), [
    ("\x1b[31mred\x1b[0m", "red"),
    ("\x1b]0;title\x07after", "after"),  # OSC, ended by BEL
    ("\x1b]8;;http://evil\x1b\\link\x1b]8;;\x1b\\", "link"),  # a hyperlink, ended by ST
    ("\x1b[2J\x1b[Hcleared", "cleared"),
    ("\x1bcreset", "reset"),  # ESC c resets the terminal
    ("tail \x1b", "tail "),
    ("\x9b31mC1 CSI", "?31mC1 CSI"),
    ("back\b\b\b\bspace", "back????space"),
    ("bell\x07 del\x7f nul\x00", "bell? del? nul?"),
    ("one\ntwo\r\nthree\tfour", "one two  three four"),
    ("plain: 8x NVIDIA H200 → ok", "plain: 8x NVIDIA H200 → ok"),
])
def test_printable(text, shown):
    assert printable(text) == shown


def test_printable_keeping_colours():
    assert (printable_keeping_colours("\x1b[1;31mrefused\x1b[0m \x1b]0;t\x07x\r")
            == "\x1b[1;31mrefused\x1b[0m x ")


@pytest.mark.parametrize(("text", "shown"), [
    ("a | b", "a \\| b"),
    ("[x](http://evil)", "\\[x\\](http\\://evil)"),
    ("see www.evil.example or WWW.evil.example", "see www\\.evil.example or WWW\\.evil.example"),
    ("awww.example, a: b, c://", "awww.example, a: b, c\\://"),
    ("`code`", "\\`code\\`"),
    ("<b>&amp;</b>", "&lt;b&gt;&amp;amp;&lt;/b&gt;"),
    # A backslash of the host's cannot undo an escape: "\|" stays text.
    ("\\| cell", "\\\\\\| cell"),
    ("two\nlines", "two lines"),
    (None, "None"),
])
def test_markdown_text(text, shown):
    assert markdown_text(text) == shown
