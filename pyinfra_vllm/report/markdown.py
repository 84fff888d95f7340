"""The audit's Markdown report, for people: what changed since the previous audit, the
drift, and a section per host (what was read, the checks, the GPUs' health, the engine,
the benchmark, the drift, the hand changes and the model).

What hosts report is text of their choosing: every value of it is escaped
(pyinfra_vllm/report/text.py ``markdown_text``), so none is Markdown syntax.
"""

from __future__ import annotations

from typing import Any

from pyinfra_vllm.plans.bench import bench_words
from pyinfra_vllm.plans.router import server_words
from pyinfra_vllm.plans.sentinel import sentinel_words
from pyinfra_vllm.report.changes import markdown_changes
from pyinfra_vllm.report.drift import host_problems
from pyinfra_vllm.report.front_door import front_door_words, is_router_entry
from pyinfra_vllm.report.html_page import HEALTH_COLUMNS
from pyinfra_vllm.report.summary import (
    drift_words,
    engine_words,
    gpu_words,
    link_words,
    mig_words,
    nvlink_words,
    persistence_words,
)
from pyinfra_vllm.report.text import markdown_text
from pyinfra_vllm.report.verdicts import integrity_problems


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# GPU fleet audit",
        "",
        f"Generated {report['generated_at']} by `deploys/audit.py` for "
        f"{len(report['hosts'])} host(s).",
        "",
    ]
    lines += markdown_changes(report.get("changes"))
    if any(entry.get("drift") is not None for entry in report["hosts"].values()):
        lines += [
            "## Drift",
            "",
            "What `deploys/full.py` would change now (a `--dry` plan), and the hosts a "
            "stage refused.",
            "",
            "| host | drift | would change | refused |",
            "|---|---|---|---|",
        ]
        for name, entry in sorted(report["hosts"].items()):
            drift, refused = host_problems(entry)
            changes = "<br>".join(f"{_md(d['operation'])} [{_md(d['stage'])}]" for d in drift)
            lines.append(
                f"| {_md(name)} | {drift_words(entry)} | {changes or '-'} | "
                f"{'<br>'.join(_md(r) for r in refused) or '-'} |"
            )
        lines.append("")
    for name, entry in sorted(report["hosts"].items()):
        s, state = entry["summary"], entry["state"]
        lines += [f"## {_md(name)}", ""]
        lines += (_markdown_host_state(s, state) if not is_router_entry(entry) else
                  [f"- OS: {_md(s['os'])} (kernel {_md(state.get('kernel'))}); a front "
                   "door (the routers group): no GPU, driver or engine judged"])
        lines += ["", "| check | ok | detail | fix |", "|---|---|---|---|"]
        for check in entry["checks"]:
            ok = {True: "yes", False: "NO", None: "-"}[check["ok"]]
            if check["ok"] is False and check["severity"] == "warning":
                ok = "warn"
            lines.append(f"| {check['name']} | {ok} | {_md(check['detail'])} | "
                         f"{_md(check['fix'])} |")
        lines += ["", f"Verdict: {_md(s['verdict'])}", ""] + _markdown_front_door(entry)
        lines += _markdown_gpu_health(entry)
        if "engine" in entry:
            lines += [f"Engine: {_md(engine_words(entry))}", ""]
            metrics = (entry["engine"] or {}).get("metrics") or {}
            if metrics:
                lines += ["| engine metric | value |", "|---|---|"]
                lines += [f"| `{name}` | {value:g} |" for name, value in sorted(metrics.items())]
                lines.append("")
        if "bench" in entry:
            lines += [f"Benchmark: {_md(bench_words(entry))}", ""]
        if "sentinel" in entry:
            lines += [f"Sentinel: {_md(sentinel_words(entry))}", ""]
        lines += (_markdown_drift(entry) + _markdown_integrity(entry) + _markdown_model(entry)
                  + _markdown_model_integrity(entry))
    return "\n".join(lines)


def _markdown_front_door(entry: dict[str, Any]) -> list[str]:
    """A router host's pool, each serving host in or out and why; a serving host's place
    in the front door's pool ([] without a router host in the audit)."""
    if not is_router_entry(entry):
        return ([f"Front door: {_md(front_door_words(entry))}", ""]
                if "front_door" in entry else [])
    lines = [f"Front door: {_md(front_door_words(entry))}", ""]
    servers = entry["router"]["servers"]
    if servers:
        lines += ["| serving host | in pool | HAProxy's status and last check |", "|---|---|---|"]
        lines += [f"| {_md(server['host'])} | {'yes' if server['in_pool'] else 'NO'} | "
                  f"{_md(server_words(server))} |" for server in servers]
        lines.append("")
    return lines


def _markdown_host_state(summary: dict[str, Any], state: dict[str, Any]) -> list[str]:
    """The start of a host's section: what was read of its OS, driver, GPUs and links
    (``summary``: the entry's, ``state``: the raw facts)."""
    # Every value was read from the host: escaped, so none is Markdown syntax.
    lines = [
        f"- OS: {_md(summary['os'])} (kernel {_md(state.get('kernel'))})",
        f"- GPUs: {_md(gpu_words(summary))}",
        f"- Driver: {_md(summary['driver_version'] or 'none')}; "
        f"CUDA (driver): {_md(summary['cuda_version'] or '-')}",
    ]
    module = summary["kernel_module"]
    if module:
        flavour = "open" if module.get("open") else "proprietary"
        lines.append(f"- Kernel module: {_md(module.get('version'))} ({flavour})")
    toolkit = state.get("cuda_toolkit")
    lines.append("- CUDA toolkit (nvcc): "
                 + (_md(toolkit["version"]) if toolkit else "not installed"))
    lines.append(f"- MIG (current/pending): {_md(mig_words(summary))}")
    lines.append(f"- Persistence mode: {_md(persistence_words(summary))}")
    lines.append(f"- Module/package mismatch: {_md(summary['module_mismatch'] or 'none')}")
    lines.append(f"- Tensor-parallel GPUs: {_md(link_words(summary, state))}")
    nvlink = state.get("nvlink")
    lines.append(f"- NVLink: {_md(nvlink_words(state))}")
    if nvlink:
        for gpu, links in sorted(nvlink.items(), key=lambda item: int(item[0])):
            active = [link for link in links if link["active"]]
            speeds = sorted({link["speed_gbps"] for link in active if link["speed_gbps"]})
            lines.append(
                f"- NVLink GPU{_md(gpu)}: {len(active)}/{len(links)} links active"
                + (f" at {', '.join(f'{v:g}' for v in speeds)} GB/s" if speeds else "")
            )
    topology = state.get("topology")
    if topology is not None and topology.get("gpus"):
        labels = topology["gpus"]
        lines += ["", "| | " + " | ".join(_md(label) for label in labels) + " |",
                  "|---" * (len(labels) + 1) + "|"]
        for row in labels:
            cells = ["X" if row == col else _md(topology["links"][row].get(col, "?"))
                     for col in labels]
            lines.append(f"| {_md(row)} | " + " | ".join(cells) + " |")
    return lines


def _markdown_gpu_health(entry: dict[str, Any]) -> list[str]:
    """Each GPU's health verdict, its reasons with what to do, and its counters."""
    health = entry.get("gpu_health") or {}
    if not health:
        return []
    lines = ["### GPU health", "",
             "| GPU | bus id | verdict | reasons | " + " | ".join(h for _, h in HEALTH_COLUMNS)
             + " |", "|---" * (4 + len(HEALTH_COLUMNS)) + "|"]
    for bus, gpu in sorted(health.items()):
        counters = gpu.get("counters") or {}
        reasons = "<br>".join(_md(f"{r['detail']}: {r['action']}") for r in gpu["reasons"])
        cells = [_md(counters.get(key, "-")) for key, _ in HEALTH_COLUMNS]
        index = gpu.get("index")
        lines.append(f"| {'-' if index is None else _md(index)} | {_md(bus)} | "
                     f"{_md(gpu['verdict'])} | "
                     f"{reasons or '-'} | " + " | ".join(cells) + " |")
    return lines + [""]


def _md(text: Any) -> str:
    """A value read from a host (or any value shown with it) as Markdown text that stays
    one table cell or list item, with no link, code span or HTML of its own."""
    return markdown_text(text)


def _markdown_drift(entry: dict[str, Any]) -> list[str]:
    lines = ["### Drift", ""]
    if entry.get("drift") is None:
        refused = [f"- Refused: {_md(reason)}" for reason in entry.get("refused") or []]
        return lines + [_md(entry.get("drift_note") or "not checked"), ""] + (
            refused + [""] if refused else [])
    drift, refused = host_problems(entry)
    if drift:
        lines += [
            f"{len(drift)} operation(s) of `deploys/full.py` would change:",
            "",
            "| stage | operation |",
            "|---|---|",
        ]
        lines += [f"| {_md(d['stage'] or '-')} | {_md(d['operation'])} |" for d in drift]
        lines.append("")
    elif not refused:
        lines += ["Converged: `deploys/full.py` would change nothing.", ""]
    if entry.get("conditional"):
        words = ", ".join(f"{_md(d['operation'])} [{_md(d['stage'])}]"
                          for d in entry["conditional"])
        lines += [f"Only if an operation before them changes: {words}.", ""]
    for reason in refused:
        lines.append(f"- Refused: {_md(reason)}")
    if entry.get("drift_note"):
        lines.append(f"- Note: {_md(entry['drift_note'])}")
    return lines + ([""] if refused or entry.get("drift_note") else [])


def _markdown_model(entry: dict[str, Any]) -> list[str]:
    if "compatibility" not in entry and "capacity" not in entry:
        return []
    lines = ["### Model", ""]
    if entry.get("compatibility") is None and entry.get("capacity") is None:
        return lines + [f"Not planned: {_md(entry.get('model_note') or 'no model lock')}", ""]
    lines += ["| check | ok | detail | fix |", "|---|---|---|---|"]
    for check in entry.get("compatibility") or []:
        ok = {True: "yes", False: "NO", None: "-"}[check["ok"]]
        lines.append(
            f"| {check['name']} | {ok} | {_md(check['detail'])} | {_md(check['fix'])} |"
        )
    capacity = entry.get("capacity") or {}
    check = capacity.get("check")
    if check:
        ok = {True: "yes", False: "NO", None: "-"}[check["ok"]]
        lines.append(
            f"| {check['name']} | {ok} | {_md(check['detail'])} | {_md(check['fix'])} |"
        )
    lines.append("")
    if "error" in capacity:
        lines.append(f"- Capacity: {_md(capacity['error'])}")
    elif capacity:
        lines += [
            f"- Capacity at {capacity['gpu_memory_mib']} MiB per GPU "
            f"({_md(capacity['gpu_memory_source'])}): {capacity['sequences']} sequence(s) of "
            f"{capacity['max_model_len']} tokens at once; KV cache "
            f"{capacity['kv_bytes_per_token']} bytes per token; the longest "
            f"max_model_len that fits: {capacity['max_model_len_that_fits']}",
        ]
    return lines + [""]


def _markdown_integrity(entry: dict[str, Any]) -> list[str]:
    if "integrity" not in entry and not entry.get("findings"):
        return []
    lines = ["### Hand changes", ""]
    # The audit's findings hold these and the vLLM environments' (environment_findings).
    problems = entry.get("findings") or integrity_problems(entry)
    lines += [f"- {_md(problem)}" for problem in problems]
    if not problems:
        lines.append("No foreign drop-in, no foreign nginx server on the gateway's port, "
                     "and the engine runs with its unit's configuration.")
    note = (entry.get("integrity") or {}).get("engine_note")
    if note:
        lines.append(f"- Engine: {_md(note)}")
    return lines + [""]


def _markdown_model_integrity(entry: dict[str, Any]) -> list[str]:
    found = entry.get("model_integrity")
    if found is None:
        return []
    lines = ["### Model files, re-hashed", ""]
    if found["error"]:
        return lines + [f"Not checked: {_md(found['error'])}", ""]
    if not found["present"]:
        return lines + [f"No model directory at `{found['path']}`: nothing to check.", ""]
    rate = found["bytes"] / max(found["seconds"], 1e-9) / 2**20
    lines.append(f"{found['files']} file(s), {found['bytes']} bytes in `{found['path']}`, "
                 f"hashed in {found['seconds']:g} s ({rate:.0f} MiB/s).")
    lines.append("")
    if not found["problems"]:
        return lines + ["Every file matches the lock.", ""]
    lines += ["| file | problem |", "|---|---|"]
    lines += [f"| {_md(path)} | {_md(problem)} |" for path, problem in found["problems"].items()]
    return lines + [""]
