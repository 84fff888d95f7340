"""The audit's HTML report, the "changed since the previous audit" section, retention and
the latest links, on reports built from real machines' recorded outputs
(tests/unit/fleet_reports.py). The page in a real browser: test_report_browser.py."""

from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from pyinfra_vllm.core.settings import SettingsError, validate
from pyinfra_vllm.report import runs as report_module
from pyinfra_vllm.report import store as report_store
from pyinfra_vllm.report.changes import changes, markdown_changes
from pyinfra_vllm.report.html_page import LINK_KINDS, UNKNOWN, link_kind, matrix_svg, render_html
from pyinfra_vllm.report.markdown import render_markdown
from pyinfra_vllm.report.summary import summary_rows
from tests.unit.fleet_reports import (
    GATEWAY,
    REBOOT,
    SYSCTL,
    TORCH,
    connected_state,
    fleet,
    previous_of,
    topology,
)

SVG = "{http://www.w3.org/2000/svg}"
NV, PIX, PXB, NODE, SYS, SELF = (LINK_KINDS[k][0] for k in ("NV#", "PIX", "PXB", "NODE", "SYS", "X"))


class Tables(HTMLParser):
    """Every table of a page as rows of cell texts."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.cell is not None:
            self.tables[-1][-1].append("".join(self.cell).strip())
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


def tables(page: str) -> list[list[list[str]]]:
    parser = Tables()
    parser.feed(page)
    return parser.tables


def matrices(page: str) -> list[ET.Element]:
    return [ET.fromstring(svg) for svg in re.findall(r'<svg [^>]*class="matrix".*?</svg>', page, re.S)]


def cells(svg: ET.Element) -> dict[tuple[str, str], tuple[str, str]]:
    """{(row, column): (fill, code)} of a matrix, from each cell's title and rectangle."""
    found = {}
    for group in svg.iter(f"{SVG}g"):
        title = group.find(f"{SVG}title").text
        pair, _, rest = title.partition(": ")
        row, _, col = pair.partition(" - ")
        found[(row, col)] = (group.find(f"{SVG}rect").get("fill"), group.find(f"{SVG}text").text)
    return found


def test_the_fleet_table_has_the_terminal_tables_columns_and_words():
    report = fleet()
    page = render_html(report, summary_rows(report))
    fleet_table = tables(page)[0]
    assert fleet_table == [list(row) for row in summary_rows(report)]
    assert fleet_table[0] == ["host", "OS", "GPUs", "driver", "CUDA", "MIG", "persistence",
                              "NVLink", "TP GPUs", "health", "verdict", "drift"]
    assert fleet_table[1][:3] == ["gpu-dgx-01", "Ubuntu 24.04.3 LTS", "8x NVIDIA A100-SXM4-40GB"]
    assert [row[-1] for row in fleet_table[1:]] == ["1 change(s)", "converged", "refused"]
    # Each row is coloured by the host's state and links to its section.
    assert '<tr class="drift"><td><a href="#host-0">gpu-dgx-01</a>' in page
    assert '<tr class="converged"><td><a href="#host-1">gpu-h200-01</a>' in page
    assert '<tr class="refused"><td><a href="#host-2">gpu-pcie-01</a>' in page
    assert 'id="host-2"><h2>gpu-pcie-01 <span class="pill refused">refused</span>' in page
    # Nothing to fetch and no script: the page has none, and its policy allows none.
    assert "default-src 'none'; style-src 'unsafe-inline'" in page
    assert not re.search(r"<(script|link|img|iframe|object)\b|\b(src|href)=\"(?!#)|url\(|"
                         r"@import|https?://(?!www\.w3\.org/2000/svg)", page)


def test_per_host_drift_refusals_findings_and_capacity():
    report = fleet()
    page = render_html(report, summary_rows(report))
    found = tables(page)
    assert ["stage", "operation"] in [t[0] for t in found]
    assert [["stage", "operation"], ["sysctl", SYSCTL["operation"]]] in found
    assert f"<h3>Findings</h3><ul><li>{TORCH.replace('>', '&gt;')}</li></ul>" in page
    assert f"<p>Refused:</p><ul><li>{REBOOT}</li></ul>" in page
    assert "Converged: <code>deploys/full.py</code> would change nothing." in page
    plan = next(t for t in found if t[0] == ["capacity plan", "value"])
    assert dict(plan[1:]) == {
        "memory per GPU": "40960 MiB (host)",
        "tensor parallel size": "2",
        "model": "qwen3_5_text Qwen3_5ForConditionalGeneration",
        "weights": "51.78 GiB (lock), 25.89 GiB per GPU",
        "held back per GPU": "3.00 GiB",
        "KV cache per token": "65536 bytes (32768 per GPU)",
        "KV budget per GPU": "7.91 GiB",
        "max_model_len": "131072",
        "sequences of max_model_len at once": "1",
        "longest max_model_len that fits": "256800",
    }
    # The capacity check once, with the model gates' others.
    checks = next(t for t in found if t[0] == ["check", "ok", "detail", "fix"])
    assert [row[:2] for row in checks[1:]] == [
        ["model_architecture", "NO"], ["context_length", "yes"], ["capacity", "yes"]]
    assert "Not planned: no model lock: python -m tools.model_lock writes one" in page


def test_every_value_is_escaped():
    report = fleet()
    bad = '<script>alert("x")</script>'
    entry = report["hosts"].pop("gpu-h200-01")
    entry["findings"] = [f"python_env: {bad} changed"]
    entry["refused"] = ["<img src=x onerror=alert(1)>"]
    entry["drift"] = [{"operation": "Files: '&' <b>", "stage": "<i>"}]
    entry["summary"]["verdict"] = bad
    entry["state"]["topology"]["gpus"] = ["GPU0", "<svg onload=alert(1)>"]
    report["hosts"]['gpu-"&<b>'] = entry
    page = render_html(report, summary_rows(report))
    assert "<script" not in page and "<img" not in page and "<b>" not in page
    assert "<i>" not in page and "<svg onload" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "gpu-&quot;&amp;&lt;b&gt;" in page
    assert "Files: &#x27;&amp;&#x27; &lt;b&gt;" in page
    # The SVG stays well-formed XML, labels escaped.
    svg = matrices(page)[0]  # gpu-"&<b> sorts first
    assert [t.text for t in svg.iter(f"{SVG}text")][:2] == ["GPU0", "GPU0"]
    assert "<svg onload=alert(1)>" in [t.text for t in svg.iter(f"{SVG}text")]


def test_link_kinds_and_their_colours():
    assert [link_kind(code) for code in ("NV12", "NV18", "NV2", "PIX", "PXB", "PHB", "NODE",
                                         "SYS", "SOC", "X", None, "N/A", "NV")] == [
        "NV#", "NV#", "NV#", "PIX", "PXB", "PHB", "NODE", "SYS", "SYS", "X", "?", "?", "?"]
    fills = [fill for fill, _ink, _meaning in LINK_KINDS.values()]
    assert len(set(fills + [UNKNOWN[0]])) == len(LINK_KINDS) + 1  # one colour per link type


def test_the_dgx_matrix_colours_each_link_type():
    svg = ET.fromstring(matrix_svg(topology("topo-8xA100-sxm4-40gb-dgx-10nic-nps4-01.txt"),
                                   ["GPU0", "GPU1"]))
    found = cells(svg)
    assert len(found) == 18 * 18  # 8 GPUs and 10 NICs
    assert found[("GPU0", "GPU1")] == (NV, "NV12")
    assert found[("GPU7", "GPU3")] == (NV, "NV12")
    assert found[("GPU0", "GPU0")] == (SELF, "X")
    assert found[("GPU0", "NIC0")] == (PXB, "PXB")
    assert found[("NIC0", "GPU0")] == (PXB, "PXB")
    assert found[("GPU0", "NIC2")] == (SYS, "SYS")
    assert found[("NIC8", "NIC9")] == (PIX, "PIX")
    assert {fill for fill, _ in found.values()} == {NV, PXB, PIX, SYS, SELF}
    # The NIC labels carry their device names; the tensor-parallel pair is outlined.
    labels = {t.text for t in svg.iter(f"{SVG}text")}
    assert {"NIC0 mlx5_0", "NIC9 mlx5_9"} <= labels
    outlined = [g.find(f"{SVG}title").text.split(":")[0] for g in svg.iter(f"{SVG}g")
                if g.find(f"{SVG}rect").get("stroke-width") == "3"]
    assert outlined == ["GPU0 - GPU1", "GPU1 - GPU0"]


def test_the_pcie_matrix_has_node_pix_and_sys():
    report = fleet()
    page = render_html(report, summary_rows(report))
    dgx, h200, pcie = matrices(page)
    assert len(cells(h200)) == 1 and cells(h200)[("GPU0", "GPU0")] == (SELF, "X")
    found = cells(pcie)
    assert found[("GPU0", "GPU1")] == (PIX, "PIX")
    assert found[("GPU0", "GPU2")] == (NODE, "NODE")
    assert found[("GPU0", "GPU3")] == (SYS, "SYS")
    assert found[("GPU5", "mlx5_1")] == (PIX, "PIX")
    # The legend names every type with the matrix's colour.
    for kind, (fill, _ink, meaning) in LINK_KINDS.items():
        assert f'fill="{fill}" stroke="#888888"/></svg> <strong>{kind}</strong> {meaning}' in page


def test_a_missing_cell_is_unknown_not_a_colour_of_the_legend():
    topo = topology("topo-2xA100-pcie-40gb-NODE-no-nvlink-01.txt")
    del topo["links"]["GPU0"]["GPU1"], topo["links"]["GPU1"]["GPU0"]
    found = cells(ET.fromstring(matrix_svg(topo)))
    assert found[("GPU0", "GPU1")] == (UNKNOWN[0], "?")


def test_changes_since_the_previous_audit():
    report = fleet()
    found = changes(previous_of(report), report, "audit-20261130T100000Z.json")
    assert found["previous"] == {"generated_at": "2026-11-30T10:00:00+00:00",
                                 "file": "audit-20261130T100000Z.json"}
    assert (found["added"], found["removed"]) == (["gpu-h200-01"], ["gpu-old-01"])
    verdict = report["hosts"]["gpu-pcie-01"]["summary"]["verdict"]
    assert found["hosts"] == {
        "gpu-dgx-01": [
            {"field": "driver", "before": "570.172.08", "after": "580.159.04"},
            {"field": "gpus", "before": 7, "after": 8},
            {"field": "operations", "added": [f"{SYSCTL['operation']} [sysctl]"],
             "removed": [f"{GATEWAY['operation']} [gateway]"]},
            {"field": "findings", "added": [TORCH], "removed": []},
        ],
        "gpu-pcie-01": [
            {"field": "verdict", "before": "ok", "after": verdict},
            {"field": "refused", "added": [REBOOT], "removed": []},
        ],
    }
    assert markdown_changes(found) == [
        "## Changed since the previous audit",
        "",
        "Compared with the audit of 2026-11-30T10:00:00+00:00 (audit-20261130T100000Z.json).",
        "",
        "- Host added: gpu-h200-01",
        "- Host not in this audit (removed from the inventory, or left out by --limit): gpu-old-01",
        "- gpu-dgx-01: driver: 570.172.08 → 580.159.04",
        "- gpu-dgx-01: GPU count: 7 → 8",
        # Host text, escaped for Markdown: the brackets, and TORCH's "->".
        f"- gpu-dgx-01: operations that would change, new: {SYSCTL['operation']} \\[sysctl\\]",
        f"- gpu-dgx-01: operations that would change, gone: {GATEWAY['operation']} "
        "\\[gateway\\]",
        f"- gpu-dgx-01: findings, new: {TORCH.replace('>', '&gt;')}",
        f"- gpu-pcie-01: verdict: ok → {verdict}",
        f"- gpu-pcie-01: refused, new: {REBOOT}",
        "",
    ]
    report["changes"] = found
    page = render_html(report, summary_rows(report))
    section = next(t for t in tables(page) if t[0] == ["host", "what changed"])
    assert section[1:3] == [
        ["gpu-h200-01", "host added"],
        ["gpu-old-01", "not in this audit (removed from the inventory, or left out by --limit)"]]
    assert section[3][0] == "gpu-dgx-01" and "driver: 570.172.08 → 580.159.04" in section[3][1]
    md = render_markdown(report)
    assert md.index("## Changed since the previous audit") < md.index("## Drift")


def test_drift_count_and_an_older_report_without_fields():
    report = fleet()
    before = json.loads(json.dumps(report))
    before["hosts"]["gpu-h200-01"]["drift"] = None  # audited alone then: not checked
    for entry in before["hosts"].values():
        del entry["findings"]  # a report from before the findings field
    entry = before["hosts"]["gpu-dgx-01"]
    entry["drift"] = []
    assert changes(before, report)["hosts"] == {
        "gpu-dgx-01": [{"field": "drift", "before": 0, "after": 1},
                       {"field": "operations", "added": [f"{SYSCTL['operation']} [sysctl]"],
                        "removed": []}],
        "gpu-h200-01": [{"field": "drift", "before": None, "after": 0}],
    }
    assert markdown_changes(changes(before, report))[6] == (
        "- gpu-h200-01: drift (operations that would change): not checked → 0")


def test_nothing_to_compare_and_nothing_changed():
    report = fleet()
    assert markdown_changes(changes(None, report)) == [
        "## Changed since the previous audit", "",
        "No earlier audit report in this directory: nothing to compare with.", ""]
    same = changes(json.loads(json.dumps(report)), report)
    assert markdown_changes(same)[-2] == (
        "Nothing changed: same hosts, verdicts, drift, driver, GPUs and findings.")
    assert "Nothing changed: same hosts" in render_html({**report, "changes": same},
                                                         summary_rows(report))


def write_set(directory: Path, stamp: str, report: dict | None = None) -> list[Path]:
    paths = [directory / f"audit-{stamp}{suffix}" for suffix in report_store.SUFFIXES]
    for path in paths:
        path.write_text(json.dumps(report or {"generated_at": stamp, "hosts": {}}))
    return paths


STAMPS = ["20261126T100000Z", "20261127T100000Z", "20261128T100000Z", "20261129T100000Z",
          "20261130T100000Z"]


def test_retention_removes_only_older_report_sets(tmp_path):
    for stamp in STAMPS:
        write_set(tmp_path, stamp)
    others = [tmp_path / "notes.txt", tmp_path / "audit-by-hand.json",
              tmp_path / "audit-20261125T100000Z.json.bak"]
    for path in others:
        path.write_text("mine")
    (tmp_path / "latest.json").symlink_to(f"audit-{STAMPS[0]}.json")
    removed = report_store.prune(tmp_path, 2, STAMPS[-1])
    assert sorted(p.name for p in removed) == sorted(
        f"audit-{stamp}{suffix}" for stamp in STAMPS[:3] for suffix in (".html", ".json", ".md"))
    assert sorted(report_store.report_sets(tmp_path)) == STAMPS[3:]
    assert all(path.read_text() == "mine" for path in others)
    assert (tmp_path / "latest.json").is_symlink()
    # The set just written stays even when newer ones fill the quota.
    assert report_store.prune(tmp_path, 1, STAMPS[3]) == []
    assert report_store.prune(tmp_path, 1, STAMPS[4])[0].name.startswith(f"audit-{STAMPS[3]}")


def test_the_setting_refuses_keeping_no_report():
    assert validate({"gateway_open": True}).audit_report_keep == 30
    with pytest.raises(SettingsError, match=r"audit_report_keep = 0: Input should be greater "
                       r"than or equal to 1 \(allowed: >= 1 and <= 10000\)"):
        validate({"gateway_open": True, "audit_report_keep": 0})


def test_latest_links_point_at_the_newest_set(tmp_path):
    old = write_set(tmp_path, STAMPS[0])
    new = write_set(tmp_path, STAMPS[1])
    report_store.publish_latest(old[0])
    written = report_store.publish_latest(new[0])
    assert [p.name for p in written] == ["latest.json", "latest.md", "latest.html"]
    for latest, target in zip(written, new, strict=True):
        assert latest.is_symlink() and os.readlink(latest) == target.name  # relative
        assert latest.resolve() == target.resolve()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_latest_are_copies_where_symlinks_are_refused(tmp_path, monkeypatch):
    new = write_set(tmp_path, STAMPS[1], {"generated_at": "copy", "hosts": {}})

    def refuse(*_args, **_kwargs):
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(report_store.os, "symlink", refuse)
    for latest in report_store.publish_latest(new[0]):
        assert not latest.is_symlink()
        assert json.loads(latest.read_text())["generated_at"] == "copy"


def test_previous_report_skips_newer_and_unreadable_sets(tmp_path):
    write_set(tmp_path, STAMPS[0], {"generated_at": "first", "hosts": {"a": {}}})
    (tmp_path / f"audit-{STAMPS[1]}.json").write_text('{"generated_at": "cut sh')
    write_set(tmp_path, STAMPS[3], {"generated_at": "newer", "hosts": {}})
    path, found = report_store.previous_report(tmp_path / f"audit-{STAMPS[2]}.json")
    assert (path.name, found["generated_at"]) == (f"audit-{STAMPS[0]}.json", "first")
    assert report_store.previous_report(tmp_path / f"audit-{STAMPS[0]}.json") is None
    assert report_store.previous_report(tmp_path / "absent" / f"audit-{STAMPS[0]}.json") is None


def test_record_writes_the_three_reports_compares_links_and_prunes(tmp_path, monkeypatch):
    report = fleet()
    before = previous_of(report)
    for stamp in STAMPS[:3]:
        write_set(tmp_path, stamp, before)
    monkeypatch.setattr(report_module.atexit, "register", lambda *args: None)
    run_state = connected_state(list(report["hosts"]))
    for name, entry in report["hosts"].items():
        report_module.record(run_state, name, entry, str(tmp_path), keep=2)
    run = report_module.audit_run(run_state, str(tmp_path))
    json_path, md_path = run.json_path, run.md_path
    stamp = report_store.stamp_of(json_path)
    assert sorted(report_store.report_sets(tmp_path)) == [STAMPS[2], stamp]
    written = json.loads(json_path.read_text())
    assert written["changes"]["previous"]["file"] == f"audit-{STAMPS[2]}.json"
    assert written["changes"]["added"] == ["gpu-h200-01"]
    assert "- Host added: gpu-h200-01" in md_path.read_text()
    page = json_path.with_suffix(".html").read_text()
    assert "<h2>Changed since the previous audit</h2>" in page
    for suffix in report_store.SUFFIXES:
        assert os.readlink(tmp_path / f"latest{suffix}") == f"audit-{stamp}{suffix}"
    assert len(run.removed) == 6  # two older sets of three files
