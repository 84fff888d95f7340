"""The audit's reports: one JSON file for machines, one Markdown file for people, and a
short table on the terminal.

pyinfra runs a deploy file once per host, in parallel greenlets; this module outlives
those runs, so it gathers every host's entry and rewrites both files after each one
(a run cut short still leaves what it read). The terminal table is printed once, when
the process exits, after pyinfra's own output.
"""

from __future__ import annotations

import atexit
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from deploys.checks import blocking, check_host
from facts.nvidia import tp_link_verdict

_RUN: dict[str, Any] = {"hosts": {}, "paths": None, "registered": False}


def summarize(name: str, state: dict[str, Any], settings: Any) -> dict[str, Any]:
    """One host's entry in the report: the raw state, the checks, and a digest."""
    checks = check_host(state, settings)
    gpus = state.get("gpus")
    driver = state.get("driver") or {}
    module = state.get("kernel_module") or {}
    topology = state.get("topology")
    link = None
    if topology is not None and settings.tensor_parallel_size >= 2:
        link = tp_link_verdict(topology, settings.tensor_parallel_size)
    nvlink = state.get("nvlink")
    distro = state.get("os") or {}
    digest = {
        "os": (distro.get("release_meta") or {}).get("PRETTY_NAME") or distro.get("name"),
        "driver_present": bool(module) or bool(driver),
        "driver_version": driver.get("driver_version") or module.get("version"),
        "cuda_version": driver.get("cuda_version"),
        "kernel_module": module or None,
        "gpu_count": len(gpus) if gpus is not None else 0,
        "gpu_names": sorted({g.get("name") for g in gpus or []}),
        "mig": [
            {"index": g["index"], "current": g.get("mig_current"), "pending": g.get("mig_pending")}
            for g in gpus or []
        ],
        "persistence": [
            {"index": g["index"], "mode": g.get("persistence_mode")} for g in gpus or []
        ],
        "tensor_parallel_size": settings.tensor_parallel_size,
        "tp_link": link,
        "nvlink_active_links": (
            None
            if nvlink is None
            else {str(gpu): sum(1 for link in links if link["active"]) for gpu, links in nvlink.items()}
        ),
        "module_mismatch": next(
            (c["detail"] for c in checks if c["name"] == "driver_module_match"), None
        ),
        "verdict": _verdict(checks),
    }
    return {"summary": digest, "checks": checks, "state": state}


def _verdict(checks: list[dict[str, Any]]) -> str:
    failed = blocking(checks)
    if failed:
        return "; ".join(c["detail"] for c in failed)
    unknown = [c["detail"] for c in checks if c["ok"] is None]
    warnings = [c["detail"] for c in checks if c["ok"] is False]
    return "; ".join(unknown + [f"warning: {w}" for w in warnings]) or "ok"


def _mig_words(summary: dict[str, Any]) -> str:
    if not summary["mig"]:
        return "-"
    states = {(m["current"], m["pending"]) for m in summary["mig"]}
    if states == {("Disabled", "Disabled")}:
        return "disabled"
    return ", ".join(f"GPU{m['index']} {m['current']}/{m['pending']}" for m in summary["mig"])


def _persistence_words(summary: dict[str, Any]) -> str:
    modes = {p["mode"] for p in summary["persistence"]}
    if not modes:
        return "-"
    if len(modes) == 1:
        return {"Enabled": "enabled", "Disabled": "disabled"}.get(next(iter(modes)), str(modes))
    return ", ".join(f"GPU{p['index']} {p['mode']}" for p in summary["persistence"])


def _link_words(summary: dict[str, Any], state: dict[str, Any]) -> str:
    link = summary["tp_link"]
    if state.get("topology") is None:
        return "-"
    if link is None:
        return "n/a (TP=1)"
    if not link.get("gpus"):
        return f"fewer than {summary['tensor_parallel_size']} GPUs"
    codes = ", ".join(f"{pair} {code}" for pair, code in (link.get("codes") or {}).items())
    if link.get("nvlink"):
        return f"NVLink ({codes})"
    return f"no NVLink ({codes})" if codes else "no NVLink"


def _nvlink_words(state: dict[str, Any]) -> str:
    nvlink = state.get("nvlink")
    if nvlink is None:
        return "-"
    if not nvlink:
        return "no NVLink exposed"
    counts = {gpu: sum(1 for link in links if link["active"]) for gpu, links in nvlink.items()}
    if not any(counts.values()):
        return "all links inactive"
    if len(set(counts.values())) == 1:
        return f"{next(iter(counts.values()))} links up per GPU"
    return ", ".join(f"GPU{gpu} {count} up" for gpu, count in sorted(counts.items()))


def _gpu_words(summary: dict[str, Any]) -> str:
    if not summary["driver_present"]:
        return "no NVIDIA driver"
    if summary["gpu_count"] == 0:
        return "0"
    return f"{summary['gpu_count']}x {', '.join(summary['gpu_names'])}"


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# GPU fleet audit",
        "",
        f"Generated {report['generated_at']} by `deploys/audit.py` for "
        f"{len(report['hosts'])} host(s).",
        "",
    ]
    for name, entry in sorted(report["hosts"].items()):
        s, state = entry["summary"], entry["state"]
        lines += [f"## {name}", ""]
        lines += [
            f"- OS: {s['os']} (kernel {state.get('kernel')})",
            f"- GPUs: {_gpu_words(s)}",
            f"- Driver: {s['driver_version'] or 'none'}; CUDA (driver): {s['cuda_version'] or '-'}",
        ]
        module = s["kernel_module"]
        if module:
            flavour = "open" if module.get("open") else "proprietary"
            lines.append(f"- Kernel module: {module.get('version')} ({flavour})")
        toolkit = state.get("cuda_toolkit")
        lines.append(f"- CUDA toolkit (nvcc): {toolkit['version'] if toolkit else 'not installed'}")
        lines.append(f"- MIG (current/pending): {_mig_words(s)}")
        lines.append(f"- Persistence mode: {_persistence_words(s)}")
        lines.append(f"- Module/package mismatch: {s['module_mismatch'] or 'none'}")
        lines.append(f"- Tensor-parallel GPUs: {_link_words(s, state)}")
        nvlink = state.get("nvlink")
        lines.append(f"- NVLink: {_nvlink_words(state)}")
        if nvlink:
            for gpu, links in sorted(nvlink.items(), key=lambda item: int(item[0])):
                active = [link for link in links if link["active"]]
                speeds = sorted({link["speed_gbps"] for link in active if link["speed_gbps"]})
                lines.append(
                    f"- NVLink GPU{gpu}: {len(active)}/{len(links)} links active"
                    + (f" at {', '.join(f'{v:g}' for v in speeds)} GB/s" if speeds else "")
                )
        topology = state.get("topology")
        if topology is not None and topology.get("gpus"):
            labels = topology["gpus"]
            lines += ["", "| | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
            for row in labels:
                cells = ["X" if row == col else topology["links"][row].get(col, "?") for col in labels]
                lines.append(f"| {row} | " + " | ".join(cells) + " |")
        lines += ["", "| check | ok | detail | fix |", "|---|---|---|---|"]
        for check in entry["checks"]:
            ok = {True: "yes", False: "NO", None: "-"}[check["ok"]]
            if check["ok"] is False and check["severity"] == "warning":
                ok = "warn"
            lines.append(f"| {check['name']} | {ok} | {check['detail']} | {check['fix']} |")
        lines += ["", f"Verdict: {s['verdict']}", ""]
    return "\n".join(lines)


def summary_table(report: dict[str, Any]) -> str:
    header = (
        "host", "OS", "GPUs", "driver", "CUDA", "MIG", "persistence", "NVLink", "TP GPUs",
        "verdict",
    )
    rows = [header]
    for name, entry in sorted(report["hosts"].items()):
        s = entry["summary"]
        rows.append(
            (
                name,
                s["os"] or "-",
                _gpu_words(s),
                s["driver_version"] or "-",
                s["cuda_version"] or "-",
                _mig_words(s),
                _persistence_words(s),
                _nvlink_words(entry["state"]),
                _link_words(s, entry["state"]),
                s["verdict"],
            )
        )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(str(cell).ljust(widths[i]) for i, cell in enumerate(row)).rstrip()
        for row in rows
    )


def _paths(report_dir: str) -> tuple[Path, Path]:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    directory = Path(report_dir)
    return directory / f"audit-{stamp}.json", directory / f"audit-{stamp}.md"


def _write(report: dict[str, Any]) -> None:
    json_path, md_path = _RUN["paths"]
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    md_path.write_text(render_markdown(report) + "\n")


def _report() -> dict[str, Any]:
    return {
        "generated_at": _RUN["generated_at"],
        "hosts": _RUN["hosts"],
    }


def _print_summary() -> None:
    if not _RUN["hosts"]:
        return
    json_path, md_path = _RUN["paths"]
    print("\n" + summary_table(_report()), file=sys.stderr)
    print(f"\nAudit reports written to {json_path} and {md_path}", file=sys.stderr)


def record(name: str, entry: dict[str, Any], report_dir: str) -> None:
    """Add one host's entry and rewrite the run's reports."""
    if _RUN["paths"] is None:
        _RUN["paths"] = _paths(report_dir)
        _RUN["generated_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if not _RUN["registered"]:
        atexit.register(_print_summary)
        _RUN["registered"] = True
    _RUN["hosts"][name] = entry
    _write(_report())
