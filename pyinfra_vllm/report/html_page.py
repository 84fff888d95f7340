"""The audit's HTML report: one file a person opens in a browser, beside the JSON and
Markdown ones.

Self-contained: inline CSS and inline SVG, no script, no font, no image to fetch; its
Content-Security-Policy (``default-src 'none'``) keeps a browser from loading anything
else, so it opens the same offline. Every value from the report is escaped
(``html.escape``), in the page and in the SVG alike, its control characters replaced
(pyinfra_vllm/report/text.py): host names, package names, findings and refusal
reasons come from hosts and settings.

Rendered from the report as its JSON file holds it (pyinfra_vllm/report/runs.py) and the
rows of the terminal table (``summary.summary_rows``), so the fleet table has the
terminal's columns and words.
"""

from __future__ import annotations

import html
import re
from typing import Any

from pyinfra_vllm.plans.bench import bench_words
from pyinfra_vllm.plans.router import server_words
from pyinfra_vllm.report.changes import change_words, previous_words
from pyinfra_vllm.report.text import printable

# One colour per link type of `nvidia-smi topo -m`, with its legend's meaning, best
# first (NVIDIA's legend, printed under the matrix). SOC is the pre-2017 name of SYS.
LINK_KINDS: dict[str, tuple[str, str, str]] = {
    # kind: (fill, text colour, meaning)
    "NV#": ("#1b7837", "#ffffff", "NVLink: a bonded set of # NVLinks"),
    "PIX": ("#2166ac", "#ffffff", "PCIe, at most a single PCIe bridge"),
    "PXB": ("#67a9cf", "#000000", "PCIe, multiple PCIe bridges (no host bridge)"),
    "PHB": ("#fdb863", "#000000", "PCIe and a PCIe host bridge (typically the CPU)"),
    "NODE": ("#e66101", "#ffffff", "PCIe and the interconnect between host bridges in a NUMA node"),
    "SYS": ("#b2182b", "#ffffff", "PCIe and the SMP interconnect between NUMA nodes (QPI/UPI)"),
    "X": ("#d9d9d9", "#000000", "the device itself"),
}
UNKNOWN = ("#ffffff", "#000000", "not in the output, or a code this report does not know")
_NVLINK = re.compile(r"^NV\d+$")
CELL = 46
LABEL = 78

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#1a1a1a;background:#fff}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ccc}
h3{font-size:15px;margin:18px 0 6px}.meta{color:#555}
table{border-collapse:collapse;margin:6px 0}th,td{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f2f2f2}.scroll{overflow-x:auto}td:first-child{white-space:nowrap}
.converged{background:#e6f4ea}.drift{background:#fff4d6}.refused{background:#fde2e1}.unchecked{background:#eee}
.pill{display:inline-block;padding:1px 8px;border-radius:9px;margin-right:6px}
ul{margin:4px 0 4px 18px;padding:0}code{background:#f4f4f4;padding:0 3px}
.legend{display:flex;flex-wrap:wrap;gap:4px 16px;margin:6px 0}.legend span{white-space:nowrap}
.host{margin-top:30px}
"""


def esc(value: Any) -> str:
    """Any value as HTML text (attribute-safe: quotes escaped too), ``printable`` first:
    no control character reaches the page (or a terminal that prints the file)."""
    return html.escape(printable("-" if value is None else value), quote=True)


def link_kind(code: str | None) -> str:
    """The legend entry of one matrix code: ``NV#`` for every NV<n>, ``SYS`` for SOC,
    ``?`` for a missing or unknown code."""
    if code is None:
        return "?"
    code = code.strip()
    if _NVLINK.match(code):
        return "NV#"
    if code == "SOC":
        return "SYS"
    return code if code in LINK_KINDS else "?"


def link_colours(kind: str) -> tuple[str, str, str]:
    return LINK_KINDS.get(kind, UNKNOWN)


def host_status(entry: dict[str, Any]) -> str:
    """converged, drift, refused or unchecked: the CSS class of a host's row. A host
    refused without a plan (its settings are invalid) is refused, not unchecked."""
    if entry.get("refused"):
        return "refused"
    if entry.get("drift") is None:
        return "unchecked"
    return "drift" if entry.get("drift") else "converged"


def matrix_labels(topology: dict[str, Any]) -> list[str]:
    return list(topology.get("gpus") or []) + list(topology.get("nics") or [])


def matrix_code(topology: dict[str, Any], row: str, col: str) -> str | None:
    """The code between two devices of a topology (facts/topology.py parse_topology)."""
    if row == col:
        return "X"
    links = topology.get("links") or {}
    nic_links = topology.get("nic_links") or {}
    for a, b in ((row, col), (col, row)):
        code = (links.get(a) or {}).get(b) or (nic_links.get(a) or {}).get(b)
        if code:
            return str(code)
    return None


def matrix_svg(topology: dict[str, Any], highlight: list[str] | None = None) -> str:
    """The link matrix as an SVG grid, one coloured cell per pair of devices; the cells
    between the tensor-parallel GPUs (``highlight``) are outlined."""
    labels = matrix_labels(topology)
    legend = topology.get("nic_legend") or {}
    names = [f"{label} {legend[label]}" if label in legend else label for label in labels]
    marked = set(highlight or [])
    size = LABEL + CELL * len(labels) + 2
    width = size + LABEL  # the last column's slanted label runs past the grid
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="matrix" width="{width}" '
        f'height="{size}" viewBox="0 0 {width} {size}" role="img" '
        f'aria-label="GPU link matrix">'
    ]
    for i, name in enumerate(names):
        middle = LABEL + CELL * i + CELL // 2
        parts.append(f'<text x="{middle}" y="{LABEL - 8}" font-size="11" '
                     f'text-anchor="start" transform="rotate(-45 {middle} {LABEL - 8})">'
                     f'{esc(name)}</text>')
        parts.append(f'<text x="{LABEL - 6}" y="{middle + 4}" font-size="11" '
                     f'text-anchor="end">{esc(name)}</text>')
    for i, row in enumerate(labels):
        for j, col in enumerate(labels):
            code = matrix_code(topology, row, col)
            kind = link_kind(code)
            fill, ink, meaning = link_colours(kind)
            x, y = LABEL + CELL * j, LABEL + CELL * i
            outline = row != col and row in marked and col in marked
            stroke = ' stroke="#000000" stroke-width="3"' if outline else ' stroke="#ffffff"'
            parts.append(
                f'<g class="cell" data-kind="{esc(kind)}"><title>{esc(row)} - {esc(col)}: '
                f'{esc(code or "?")} ({esc(meaning)})</title>'
                f'<rect x="{x}" y="{y}" width="{CELL}" height="{CELL}" fill="{fill}"{stroke}/>'
                f'<text x="{x + CELL // 2}" y="{y + CELL // 2 + 4}" font-size="11" '
                f'text-anchor="middle" fill="{ink}">{esc(code or "?")}</text></g>'
            )
    parts.append("</svg>")
    return "".join(parts)


def legend_html(kinds: list[str]) -> str:
    """The colours' legend: every link type, and "?" when the matrix has one."""
    shown = list(LINK_KINDS) + (["?"] if "?" in kinds else [])
    items = []
    for kind in shown:
        fill, _ink, meaning = link_colours(kind)
        items.append(
            f'<span><svg xmlns="http://www.w3.org/2000/svg" width="14" height="14">'
            f'<rect width="14" height="14" fill="{fill}" stroke="#888888"/></svg> '
            f"<strong>{esc(kind)}</strong> {esc(meaning)}</span>"
        )
    return f'<div class="legend">{"".join(items)}</div>'


def _list(items: list[Any], empty: str | None = None) -> str:
    if not items:
        return f"<p>{esc(empty)}</p>" if empty else ""
    return "<ul>" + "".join(f"<li>{esc(item)}</li>" for item in items) + "</ul>"


def _table(header: tuple[str, ...] | list[str], rows: list[Any], classes: list[str] | None = None) -> str:
    head = "".join(f"<th>{esc(cell)}</th>" for cell in header)
    body = []
    for index, row in enumerate(rows):
        css = f' class="{esc(classes[index])}"' if classes else ""
        body.append(f"<tr{css}>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>")
    return (f'<div class="scroll"><table><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>")


def _fleet_table(report: dict[str, Any], table: list[tuple[str, ...]], anchors: dict[str, str]) -> str:
    header, rows = table[0], table[1:]
    cells, classes = [], []
    for row in rows:
        name = row[0]
        entry = report["hosts"].get(name) or {}
        link = f'<a href="#{anchors[name]}">{esc(name)}</a>' if name in anchors else esc(name)
        cells.append([link, *(esc(cell) for cell in row[1:])])
        classes.append(host_status(entry))
    return _table(header, cells, classes)


def _changes_section(found: dict[str, Any] | None) -> str:
    if found is None:
        return ""
    parts = ["<h2>Changed since the previous audit</h2>", f"<p>{esc(previous_words(found))}</p>"]
    if found.get("previous") is None:
        return "".join(parts)
    rows = [[esc(name), "host added"] for name in found["added"]]
    rows += [[esc(name), "not in this audit (removed from the inventory, or left out by --limit)"]
             for name in found["removed"]]
    for name, host in found["hosts"].items():
        words = [w for change in host for w in change_words(change)]
        rows.append([esc(name), _list(words)])
    if rows:
        parts.append(_table(("host", "what changed"), rows))
    else:
        parts.append("<p>Nothing changed: same hosts, verdicts, drift, driver, GPUs and "
                     "findings.</p>")
    return "".join(parts)


def _drift_section(entry: dict[str, Any]) -> str:
    parts = ["<h3>Drift</h3>"]
    if entry.get("drift") is None:
        parts.append(f"<p>{esc(entry.get('drift_note') or 'not checked')}</p>")
        if entry.get("refused"):  # refused without a plan: its settings are invalid
            parts.append("<p>Refused:</p>" + _list(entry["refused"]))
        return "".join(parts)
    drift = entry.get("drift") or []
    refused = entry.get("refused") or []
    if drift:
        parts.append(f"<p>{len(drift)} operation(s) of <code>deploys/full.py</code> would "
                     "change:</p>")
        parts.append(_table(("stage", "operation"),
                            [[esc(d.get("stage") or "-"), esc(d.get("operation"))] for d in drift]))
    elif not refused:
        parts.append("<p>Converged: <code>deploys/full.py</code> would change nothing.</p>")
    if entry.get("conditional"):
        words = [f"{d.get('operation')} [{d.get('stage') or '-'}]" for d in entry["conditional"]]
        parts.append("<p>Only if an operation before them changes:</p>" + _list(words))
    if refused:
        parts.append("<p>Refused:</p>" + _list(refused))
    if entry.get("drift_note"):
        parts.append(f"<p>Note: {esc(entry['drift_note'])}</p>")
    if "findings" in entry:
        parts.append("<h3>Findings</h3>")
        parts.append(_list(entry.get("findings") or [], "Nothing changed by hand was found."))
    return "".join(parts)


def _topology_section(entry: dict[str, Any]) -> str:
    topology = (entry.get("state") or {}).get("topology")
    parts = ["<h3>GPU link matrix</h3>"]
    if topology is None or not topology.get("gpus"):
        return "".join(parts) + "<p>No topology read (no NVIDIA driver, or NVML failed).</p>"
    labels = matrix_labels(topology)
    kinds = [link_kind(matrix_code(topology, r, c)) for r in labels for c in labels]
    tp = ((entry.get("summary") or {}).get("tp_link") or {}).get("gpus") or []
    parts.append(matrix_svg(topology, tp))
    parts.append(legend_html(kinds))
    if tp:
        parts.append(f"<p>Outlined: the tensor-parallel GPUs ({esc(', '.join(tp))}).</p>")
    return "".join(parts)


def _gib(value: Any) -> str:
    return f"{value / 1024**3:.2f} GiB" if isinstance(value, int | float) else "-"


def _capacity_section(entry: dict[str, Any]) -> str:
    if "capacity" not in entry and "compatibility" not in entry:
        return ""
    parts = ["<h3>Model: compatibility and capacity plan</h3>"]
    capacity = entry.get("capacity")
    if entry.get("compatibility") is None and capacity is None:
        return "".join(parts) + f"<p>Not planned: {esc(entry.get('model_note') or 'no model lock')}</p>"
    checks = list(entry.get("compatibility") or [])
    # The model gates' checks hold the capacity check already when they ran.
    if capacity and capacity.get("check") and capacity["check"] not in checks:
        checks.append(capacity["check"])
    if checks:
        ok = {True: "yes", False: "NO", None: "-"}
        parts.append(_table(("check", "ok", "detail", "fix"), [
            [esc(c.get("name")), esc(ok.get(c.get("ok"), "-")), esc(c.get("detail")), esc(c.get("fix"))]
            for c in checks]))
    if capacity and "error" in capacity:
        parts.append(f"<p>Capacity: {esc(capacity['error'])}</p>")
    elif capacity:
        rows = [
            ("memory per GPU", f"{capacity.get('gpu_memory_mib')} MiB "
                               f"({capacity.get('gpu_memory_source')})"),
            ("tensor parallel size", capacity.get("tensor_parallel_size")),
            ("model", f"{capacity.get('model_type')} "
                      f"{', '.join(capacity.get('architectures') or [])}"),
            ("weights", f"{_gib(capacity.get('weights_bytes'))} ({capacity.get('weights_source')}), "
                        f"{_gib(capacity.get('weights_bytes_per_gpu'))} per GPU"),
            ("held back per GPU", _gib(capacity.get("reserve_bytes"))),
            ("KV cache per token", f"{capacity.get('kv_bytes_per_token')} bytes "
                                   f"({capacity.get('kv_bytes_per_token_per_gpu')} per GPU)"),
            ("KV budget per GPU", _gib(capacity.get("kv_budget_bytes_per_gpu"))),
            ("max_model_len", capacity.get("max_model_len")),
            ("sequences of max_model_len at once", capacity.get("sequences")),
            ("longest max_model_len that fits", capacity.get("max_model_len_that_fits")),
        ]
        parts.append(_table(("capacity plan", "value"), [[esc(k), esc(v)] for k, v in rows]))
    return "".join(parts)


# The GPU-health counters the reports show, with their column heads.
HEALTH_COLUMNS = (
    ("ecc_volatile_uncorrectable", "ECC uncorr. (vol.)"),
    ("ecc_aggregate_uncorrectable", "ECC uncorr. (agg.)"),
    ("ecc_aggregate_correctable", "ECC corr. (agg.)"),
    ("remapped_rows_pending", "rows pending"),
    ("pcie_width_current", "PCIe width"),
    ("pcie_replays", "PCIe replays"),
    ("nvlink_errors", "NVLink errors"),
    ("xid_events", "Xid events"),
)


def _gpu_health_section(entry: dict[str, Any]) -> str:
    """Each GPU's health verdict, its reasons with what to do, and its counters."""
    health = entry.get("gpu_health") or {}
    if not health:
        return ""
    rows = []
    for bus, gpu in sorted(health.items()):
        counters = gpu.get("counters") or {}
        reasons = [f"{r.get('detail')}: {r.get('action')}" for r in gpu.get("reasons") or []]
        index = gpu.get("index")
        rows.append([esc("-" if index is None else index), esc(bus), esc(gpu.get("verdict")),
                     _list(reasons) if reasons else "-",
                     *(esc(counters.get(key, "-")) for key, _ in HEALTH_COLUMNS)])
    return "<h3>GPU health</h3>" + _table(
        ("GPU", "bus id", "verdict", "reasons", *(head for _, head in HEALTH_COLUMNS)), rows)


def _front_door_section(entry: dict[str, Any]) -> str:
    """A router host's pool: each serving host in or out, and why ("" for any other host:
    its place in the pool is its row's "front door")."""
    router = entry.get("router")
    if entry.get("role") != "router" or not router:
        return ""
    rows = [[esc(server.get("host")), esc("yes" if server.get("in_pool") else "NO"),
             esc(server_words(server))] for server in router.get("servers") or []]
    return "<h3>Front door's pool</h3>" + (
        _table(("serving host", "in pool", "HAProxy's status and last check"), rows) if rows
        else f"<p>{esc(router.get('reason'))}</p>")


def _host_section(name: str, anchor: str, entry: dict[str, Any], row: dict[str, str]) -> str:
    """One host: the terminal table's row for it as a list, then its drift, findings,
    link matrix, model plan and checks."""
    summary = entry.get("summary") or {}
    state = entry.get("state") or {}
    status = host_status(entry)
    facts = [(column, value) for column, value in row.items() if column != "host"]
    facts[1:1] = [("kernel", state.get("kernel") or "-")]
    facts.append(("module/package mismatch", summary.get("module_mismatch") or "none"))
    parts = [
        f'<section class="host" id="{anchor}"><h2>{esc(name)} '
        f'<span class="pill {status}">{esc(status)}</span></h2>',
        _table(("what", "found"), [[esc(k), esc(v)] for k, v in facts]),
        _front_door_section(entry),
        _drift_section(entry),
        _topology_section(entry),
        _gpu_health_section(entry),
        _capacity_section(entry),
    ]
    if "bench" in entry:
        parts.append(f"<p>Benchmark: {esc(bench_words(entry))}</p>")
    checks = entry.get("checks") or []
    if checks:
        ok = {True: "yes", False: "NO", None: "-"}
        parts.append("<h3>Checks</h3>")
        parts.append(_table(("check", "ok", "detail", "fix"), [
            [esc(c.get("name")), esc(ok.get(c.get("ok"), "-")), esc(c.get("detail")), esc(c.get("fix"))]
            for c in checks]))
    return "".join(parts) + "</section>"


def render_html(report: dict[str, Any], table: list[tuple[str, ...]]) -> str:
    """The whole page. ``table``: the terminal table's rows, header first
    (``summary.summary_rows``)."""
    hosts = report.get("hosts") or {}
    names = sorted(hosts)
    anchors = {name: f"host-{index}" for index, name in enumerate(names)}
    rows = {row[0]: dict(zip(table[0], row, strict=True)) for row in table[1:]}
    statuses = [host_status(hosts[name]) for name in names]
    counts = ", ".join(f"{statuses.count(s)} {s}"
                       for s in ("converged", "drift", "refused", "unchecked") if s in statuses)
    generated = report.get("generated_at")
    body = [
        "<h1>GPU fleet audit</h1>",
        f'<p class="meta">Generated {esc(generated)} by <code>deploys/audit.py</code> for '
        f"{len(names)} host(s): {esc(counts or 'none')}.</p>",
        "<h2>Fleet</h2>",
        _fleet_table(report, table, anchors) if len(table) > 1 else "<p>No host audited.</p>",
        _changes_section(report.get("changes")),
        *(_host_section(name, anchors[name], hosts[name], rows.get(name, {})) for name in names),
    ]
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "style-src 'unsafe-inline'\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>GPU fleet audit {esc(generated)}</title><style>{STYLE}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )
