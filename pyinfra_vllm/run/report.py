"""The audit's reports: one JSON file for machines, one Markdown file for people, and a
short table on the terminal.

pyinfra runs a deploy file once per host, in parallel greenlets; this module outlives
those runs, so it gathers every host's entry, per run (pyinfra's State), and writes the
reports once, when the last of the run's hosts is recorded (a run cut short writes what
it read when the process exits). The terminal table is printed once, when the process
exits, after pyinfra's own output.

What hosts report is text of their choosing: the Markdown report escapes every value of
it and the terminal table strips its control characters (pyinfra_vllm/run/report_text.py);
the JSON report keeps it exact.

Drift: when deploys/audit.py runs after deploys/full.py in the same ``--dry`` run
(``python -m tools.audit`` does that), ``host_plan`` reads, from pyinfra's own state,
which of the host's operations would change: ``OperationMeta.will_change``, pyinfra's
documented property for the flag it set at prepare time, the same flag its "Detected
changes" table and ``--dry --json`` plan are built from (pyinfra 3.10
``api/operation.py``; ``pyinfra_cli/prints.py`` ``build_plan_json``). The prepared state
itself (``state.ops``, ``state.op_meta``, ``host.op_hash_order``) is pyinfra's documented
API but no promise: the supported pyinfra versions are pinned
(pyinfra_vllm/core/versions.py ``PYINFRA_TESTED``) and tests/unit/test_pyinfra_contract.py
checks what this module reads.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from weakref import WeakKeyDictionary

import pyinfra.version

from facts.topology import tp_link_verdict
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.core.versions import pyinfra_problem
from pyinfra_vllm.plans import checks as host_checks
from pyinfra_vllm.plans.bench import bench_words
from pyinfra_vllm.plans.checks import blocking, check_host, gpu_health
from pyinfra_vllm.plans.gates import gpu_memory_mib, model_gates
from pyinfra_vllm.plans.gateway import foreign_servers, foreign_words
from pyinfra_vllm.plans.units import foreign_drop_ins
from pyinfra_vllm.plans.vllm_service import difference_words, engine_differences
from pyinfra_vllm.run import report_store
from pyinfra_vllm.run.report_changes import changes, markdown_changes
from pyinfra_vllm.run.report_html import HEALTH_COLUMNS, render_html
from pyinfra_vllm.run.report_text import markdown_text, printable

# When set (python -m tools.audit sets it), the paths of the reports are written to
# this file as JSON, so the wrapper reads the report this run wrote.
INDEX_ENV = "PYINFRA_VLLM_AUDIT_INDEX"


def summarize(name: str, state: dict[str, Any], settings: Settings,
              previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """One host's entry in the report: the raw state, the checks, the GPUs' health
    (``previous``: the host's entry in an earlier report, for the counters that rose
    since), and a digest."""
    health = gpu_health(state, settings, (previous or {}).get("gpu_health"))
    checks = check_host(state, settings, health)
    digest = _digest(state, checks, health, settings.tensor_parallel_size)
    return {"summary": digest, "checks": checks, "state": state, "gpu_health": health}


def _digest(state: dict[str, Any], checks: list[dict[str, Any]], health: dict[str, Any],
            tensor_parallel_size: int | None) -> dict[str, Any]:
    """An entry's ``summary``; ``tensor_parallel_size`` None: not known (the settings are
    invalid), so no tensor-parallel link is judged."""
    gpus = state.get("gpus")
    driver = state.get("driver") or {}
    module = state.get("kernel_module") or {}
    topology = state.get("topology")
    link = None
    if topology is not None and tensor_parallel_size is not None and tensor_parallel_size >= 2:
        link = tp_link_verdict(topology, tensor_parallel_size)
    nvlink = state.get("nvlink")
    distro = state.get("os") or {}
    return {
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
        "tensor_parallel_size": tensor_parallel_size,
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
        "health": health_words(health),
    }


def health_words(health: dict[str, Any]) -> str:
    """The GPUs' health in a few words: "ok", or each GPU that is not with its reasons'
    codes; "-" without GPU data."""
    if not health:
        return "-"
    bad = [(bus, gpu) for bus, gpu in sorted(health.items()) if gpu["verdict"] != "ok"]
    if not bad:
        return "ok"
    return ", ".join(
        f"{'GPU' + str(gpu['index']) if gpu.get('index') is not None else bus} "
        f"{gpu['verdict']} ({' '.join(r['code'] for r in gpu['reasons'])})"
        for bus, gpu in bad)


def _verdict(checks: list[dict[str, Any]]) -> str:
    failed = blocking(checks)
    if failed:
        return "; ".join(c["detail"] for c in failed)
    unknown = [c["detail"] for c in checks if c["ok"] is None]
    warnings = [c["detail"] for c in checks if c["ok"] is False]
    return "; ".join(unknown + [f"warning: {w}" for w in warnings]) or "ok"


# A setting's name, where a problem of the settings' message begins with it.
_SETTING_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SETTINGS_NOTE = "not checked: the settings are invalid, so no stage was planned"


def settings_problems(message: str) -> list[tuple[str | None, str]]:
    """(setting, problem) for each problem that a SettingsError's ``message`` lists
    (pyinfra_vllm/core/settings.py ``validate``: a header line, one indented line per
    problem, then what to do), in the settings' own words, secrets masked as they mask
    them. The setting is the name the problem begins with (a rule across settings
    begins with the one it names first), None when it begins with none."""
    found: list[tuple[str | None, str]] = []
    for line in message.splitlines()[1:]:
        if not line.startswith("  "):
            continue
        # "(settings)" is where a rule across settings is placed on no key.
        text = line.strip().removeprefix("(settings): ")
        match = _SETTING_NAME.match(text)
        key = match.group() if match else None
        found.append((key, text.removeprefix(f"{key}: ") if key else text))
    return found or [(None, " ".join(message.split()))]


def settings_refusal(state: dict[str, Any], message: str) -> dict[str, Any]:
    """The entry of a host whose settings are invalid (``message``: the SettingsError's):
    its OS and GPU state as read, and each problem as a failed ``settings`` check and a
    refusal, ``settings: <key>: <problem>``. Nothing is judged against settings it does
    not have: no GPU health, no drift, no model plan."""
    reasons = [f"settings: {key}: {problem}" if key else f"settings: {problem}"
               for key, problem in settings_problems(message)]
    fix = " ".join(line.strip() for line in message.splitlines()[1:]
                   if line.strip() and not line.startswith(" "))
    checks = [host_checks.check("settings", False, reason, fix) for reason in reasons]
    return {"summary": _digest(state, checks, {}, None), "checks": checks, "state": state,
            "gpu_health": {}, "drift": None, "conditional": None, "refused": reasons,
            "drift_note": _SETTINGS_NOTE}


def split_op_name(name: str) -> tuple[str | None, str]:
    """(stage, operation) from one pyinfra operation name.

    Each stage is a ``@deploy`` named after it, and pyinfra prefixes the operations a
    deploy adds with the names of the deploys it runs in (pyinfra 3.10
    ``api/host.py`` deploy, ``api/operation.py`` generate_operation_name), so the
    operations deploys/full.py adds are named ``"full | sysctl | Sysctl: ..."``: the
    stage is the last name before the operation's own. A path there (an older
    ``local.include`` of ``deploys/sysctl.py``) counts by its stem. Without any prefix
    the stage is read from the suite's ``"Stage: what"`` naming, e.g.
    ``"Model volume: ..."`` is ``model_volume``.
    """
    deploy, sep, operation = name.rpartition(" | ")
    if sep:
        return Path(deploy.rpartition(" | ")[2]).stem, operation
    head, sep, _ = name.partition(": ")
    return (head.strip().lower().replace(" ", "_") if sep else None), name


def _operation_words(meta: Any) -> str:
    """One operation's name as pyinfra prints it, without the stage file prefix. Names are
    shared by every host that reached the same line (``StateOperationMeta.names``)."""
    names = sorted({split_op_name(name)[1] for name in meta.names})
    words = " / ".join(names)
    if meta.args:
        words += f" ({', '.join(str(arg) for arg in meta.args)})"
    return words


def host_plan(state: Any, host: Any, refused: list[str], refusals: list[Any] | None = None,
              planned: bool = True) -> dict[str, Any]:
    """What the deploy files loaded before deploys/audit.py in this run would change on
    ``host``, read from pyinfra's prepared state.

    ``drift``: the operations that would change, in the host's order, each
    ``{"operation", "stage"}`` ([] is converged). ``conditional``: operations that
    change only when their ``_if`` holds (pyinfra's "Conditional Change" column; in this
    suite a reload or restart after another operation of the same stage changed), not
    counted as drift. ``refused``: why a stage stopped the host (pyinfra_vllm/run/context.py
    HostContext.refused); the refusing operations themselves (``refusals``: what
    ``gate.refuse`` returned, HostContext.refusals) are not drift. All three are None, with
    ``drift_note`` saying why, when no stage was planned before the audit in this run
    (``planned``), pyinfra ran with ``-y`` (no change detection), or this pyinfra is not
    one the audit was tested with.
    """
    note = pyinfra_problem(pyinfra.version.__version__)
    if note is not None:
        note = f"not checked: {note}"
    elif not state.should_check_for_changes():
        note = "not checked: pyinfra ran with -y, which skips change detection"
    elif not planned:
        note = (
            "not checked: deploys/audit.py ran alone; python -m tools.audit INVENTORY "
            "plans deploys/full.py first"
        )
    if note is not None:
        return {"drift": None, "conditional": None, "refused": None, "drift_note": note}
    drift: list[dict[str, Any]] = []
    conditional: list[dict[str, Any]] = []
    host_ops = state.ops.get(host, {})
    for op_hash in host.op_hash_order:
        op_data = host_ops.get(op_hash)
        if op_data is None:
            continue
        # With change detection on, pyinfra set the flag while preparing: will_change
        # returns it (it would run the operation again only where none was set).
        if not op_data.operation_meta.will_change:
            continue
        if any(op_data.operation_meta is refusal for refusal in refusals or ()):
            continue
        meta = state.op_meta[op_hash]
        stage = split_op_name(sorted(meta.names)[0])[0] if meta.names else None
        item = {"operation": _operation_words(meta), "stage": stage}
        (conditional if op_data.global_arguments.get("_if") else drift).append(item)
    return {"drift": drift, "conditional": conditional, "refused": list(refused),
            "drift_note": None}


def environment_findings(environments: dict[str, Any], path: str) -> list[str]:
    """What changed by hand in the vLLM environments the host runs or is to run (the one
    ``current`` points at, and ``path``), as the audit names it; [] when nothing did."""
    findings = []
    for where in dict.fromkeys([environments.get("current"), path]):
        integrity = (environments["envs"].get(where) or {}).get("integrity") or {}
        if integrity.get("state") == "changed":
            what = "; ".join(integrity.get("packages") or integrity.get("files") or [])
            findings.append(f"python_env: {where} changed by hand since it was proven: "
                            f"{what or 'files differ'}")
    return findings


def host_problems(entry: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """(operations that would change, refusal reasons) of one report entry."""
    return list(entry.get("drift") or []), list(entry.get("refused") or [])


def model_plans(
    settings: Settings,
    lock: dict[str, Any] | None,
    state: dict[str, Any],
    registry: list[str] | None = None,
) -> dict:
    """The model's checks and memory plan, exactly as preflight judges them
    (pyinfra_vllm/plans/gates.py), or why there are none.

    Returns ``{"compatibility": [checks], "capacity": plan, "why": None}``, or
    ``{"compatibility": None, "capacity": None, "why": ...}`` without a model lock.
    """
    if not lock:
        return {
            "compatibility": None,
            "capacity": None,
            "why": "no model lock: python -m tools.model_lock writes one (setting model_lock)",
        }
    gates = model_gates(settings, lock, state, registry)
    if settings.vllm_device == "cpu":
        # The KV budget of each CPU worker stands where a GPU's memory does.
        capacity = dict(gates["capacity"], gpu_memory_mib=settings.vllm_cpu_kvcache_space_gib
                        * 1024, gpu_memory_source="vllm_cpu_kvcache_space_gib, per CPU worker")
        return {"compatibility": gates["checks"], "capacity": capacity, "why": None}
    source = "host" if state.get("gpus") else "min_gpu_memory_mib (no GPU read on the host)"
    capacity = dict(gates["capacity"], gpu_memory_mib=gpu_memory_mib(state, settings),
                    gpu_memory_source=source)
    return {"compatibility": gates["checks"], "capacity": capacity, "why": None}


def _drift_words(entry: dict[str, Any]) -> str:
    if entry.get("drift") is None:
        # Refused without a plan: its settings are invalid (settings_refusal).
        return "refused" if entry.get("refused") else "-"
    drift, refused = host_problems(entry)
    words = [f"{len(drift)} change(s)"] if drift else []
    if refused:
        words.append("refused")
    return ", ".join(words) or "converged"


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
    if state.get("topology") is None or summary["tensor_parallel_size"] is None:
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
                f"| {_md(name)} | {_drift_words(entry)} | {changes or '-'} | "
                f"{'<br>'.join(_md(r) for r in refused) or '-'} |"
            )
        lines.append("")
    for name, entry in sorted(report["hosts"].items()):
        s, state = entry["summary"], entry["state"]
        lines += [f"## {_md(name)}", ""]
        lines += _markdown_host_state(s, state)
        lines += ["", "| check | ok | detail | fix |", "|---|---|---|---|"]
        for check in entry["checks"]:
            ok = {True: "yes", False: "NO", None: "-"}[check["ok"]]
            if check["ok"] is False and check["severity"] == "warning":
                ok = "warn"
            lines.append(f"| {check['name']} | {ok} | {_md(check['detail'])} | "
                         f"{_md(check['fix'])} |")
        lines += ["", f"Verdict: {_md(s['verdict'])}", ""]
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
        lines += (_markdown_drift(entry) + _markdown_integrity(entry) + _markdown_model(entry)
                  + _markdown_model_integrity(entry))
    return "\n".join(lines)



def _markdown_host_state(summary: dict[str, Any], state: dict[str, Any]) -> list[str]:
    """The start of a host's section: what was read of its OS, driver, GPUs and links
    (``summary``: the entry's, ``state``: the raw facts)."""
    # Every value was read from the host: escaped, so none is Markdown syntax.
    lines = [
        f"- OS: {_md(summary['os'])} (kernel {_md(state.get('kernel'))})",
        f"- GPUs: {_md(_gpu_words(summary))}",
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
    lines.append(f"- MIG (current/pending): {_md(_mig_words(summary))}")
    lines.append(f"- Persistence mode: {_md(_persistence_words(summary))}")
    lines.append(f"- Module/package mismatch: {_md(summary['module_mismatch'] or 'none')}")
    lines.append(f"- Tensor-parallel GPUs: {_md(_link_words(summary, state))}")
    nvlink = state.get("nvlink")
    lines.append(f"- NVLink: {_md(_nvlink_words(state))}")
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


def integrity(
    drop_ins: dict[str, list[dict[str, Any]]],
    own_drop_ins: dict[str, list[str]],
    nginx: dict[str, Any] | None,
    gateway_ports: list[int] | None,
    engine: dict[str, Any] | None,
    engine_expected: dict[str, Any] | None,
) -> dict[str, Any]:
    """The audit's ``integrity`` field: what was changed by hand around the suite.

    + drop_ins: facts.units.UnitDropIns per unit the suite manages; own_drop_ins: the
      suite's own drop-ins per unit (never foreign)
    + nginx: facts.nginx.NginxServers; gateway_ports: the gateway's ports (None: the
      gateway stage is skipped, nothing is judged)
    + engine: facts.vllm_service.EngineProcess; engine_expected: what the vllm_service
      stage rendered (None when it did not plan in this run)

    ``{"drop_ins": {unit: [path]}, "nginx": [foreign file] | None, "engine": {"argv",
    "env", "hardening"} | None, "engine_note": why engine is None}``: secrets only as
    ``(secret)``.
    """
    foreign = {
        unit: [d["path"] for d in foreign_drop_ins(found, tuple(own_drop_ins.get(unit, ())))]
        for unit, found in sorted(drop_ins.items())
    }
    note = None
    differences = None
    if engine_expected is None:
        note = "not checked: the vllm_service stage did not plan in this run"
    else:
        differences = engine_differences(engine, engine_expected)
        if differences is None:
            note = "no engine running"
    return {
        "drop_ins": foreign,
        "nginx": None if gateway_ports is None else foreign_servers(nginx, gateway_ports),
        "engine": differences,
        "engine_note": note,
    }


def integrity_problems(entry: dict[str, Any]) -> list[str]:
    """The ``integrity`` field in sentences, one per finding ([] when none)."""
    found = entry.get("integrity")
    if not found:
        return []
    lines = [f"foreign drop-in for {unit}: {path}"
             for unit, paths in found["drop_ins"].items() for path in paths]
    lines += [f"foreign nginx server: {foreign_words(item)}"
              + (f" (cannot be set aside: {item['unsafe']})" if item["unsafe"] else "")
              for item in found["nginx"] or []]
    engine = found["engine"]
    if engine and (engine["argv"] or engine["env"] or engine.get("hardening")):
        lines.append(f"engine runs with another configuration than its unit: "
                     f"{difference_words(engine)}")
    return lines


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


def model_integrity(content: dict[str, Any] | None, path: str) -> dict[str, Any]:
    """The deep check of one host's model (facts.model.ModelContent, model_verify deep)
    as its report entry's ``model_integrity``: the directory, whether it exists, what was
    hashed, and every file of the lock whose content does not match it (``problems``:
    path -> mismatch, size, missing or unreadable), or why the check did not run
    (``error``)."""
    if content is None:
        return {"path": path, "present": False, "files": 0, "bytes": 0, "seconds": 0.0,
                "problems": {}, "error": None}
    return {"path": path, "present": True, "files": content["files"],
            "bytes": content["bytes"], "seconds": content["seconds"],
            "problems": dict(sorted(content["problems"].items())), "error": content["error"]}


def environment_integrity(content: dict[str, Any] | None, path: str | None) -> dict[str, Any]:
    """The deep check of one host's vLLM environment (facts.python_env.EnvironmentContent,
    python_env_verify deep) as its report entry's ``environment_integrity``: the
    environment checked (None: none proven to check, the stat check already has it built
    again), what was hashed, every file that no longer matches its wheel's RECORD
    (``problems``: path -> mismatch, missing, unreadable or unknown-hash) and their
    ``packages``, or why the check did not run (``error``)."""
    if content is None:
        return {"path": path, "files": 0, "bytes": 0, "seconds": 0.0, "problems": {},
                "packages": [], "error": None}
    return {"path": path, "files": content["files"], "bytes": content["bytes"],
            "seconds": content["seconds"], "problems": dict(sorted(content["problems"].items())),
            "packages": list(content["packages"]), "error": content["error"]}


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


def engine_words(entry: dict[str, Any]) -> str:
    """What the engine says it serves (``EngineServing``), in a few words."""
    if "engine" not in entry:
        return "-"  # not asked: vllm_start is off or the stage is skipped
    engine = entry["engine"]
    if engine is None:
        return "not answering"
    if engine.get("listener_uid"):
        # Not asked: the engine's key goes to no one else.
        return (f"not the engine: uid {engine['listener_uid']} holds its address "
                "(not asked)")
    served = ", ".join(f"{m['id']} ({m['max_model_len']})" for m in engine["models"])
    metrics = engine["metrics"]
    kv = metrics.get("vllm:kv_cache_usage_perc", metrics.get("vllm:gpu_cache_usage_perc"))
    words = [served or "no model"]
    if "vllm:num_requests_running" in metrics:
        words.append(f"{metrics['vllm:num_requests_running']:.0f} running")
    if kv is not None:
        words.append(f"KV {kv:.0%}")
    return ", ".join(words)


def summary_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    """The terminal table's rows, header first (the HTML report's fleet table too)."""
    header: tuple[str, ...] = (
        "host", "OS", "GPUs", "driver", "CUDA", "MIG", "persistence", "NVLink", "TP GPUs",
        "health", "verdict", "drift",
    )
    asked = any("engine" in entry for entry in report["hosts"].values())
    if asked:
        header += ("engine",)
    rows: list[tuple[str, ...]] = [header]
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
                s.get("health") or "-",
                s["verdict"],
                _drift_words(entry),
                *([engine_words(entry)] if asked else []),
            )
        )
    return rows


def summary_table(report: dict[str, Any]) -> str:
    """The terminal table: ``summary_rows`` in aligned columns, each cell ``printable``
    (a host's GPU name or model id may hold escape sequences and control characters)."""
    rows = [[printable(cell) for cell in row] for row in summary_rows(report)]
    header = rows[0]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()
        for row in rows
    )


def _paths(report_dir: str) -> tuple[Path, Path]:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    directory = Path(report_dir)
    return directory / f"audit-{stamp}.json", directory / f"audit-{stamp}.md"


@dataclass
class AuditRun:
    """One pyinfra run's reports: where they go, the previous report they are compared
    with (read before this run writes or prunes anything), and the hosts' entries."""

    json_path: Path
    md_path: Path
    previous: tuple[Path, dict[str, Any]] | None
    # The report sets kept in the reports' directory (None: all).
    keep: int | None
    generated_at: str
    hosts: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The files of older report sets this run removed (audit_report_keep).
    removed: list[Path] = field(default_factory=list)
    written: bool = False

    def report(self) -> dict[str, Any]:
        return {"generated_at": self.generated_at, "hosts": self.hosts}


# Keyed by pyinfra's State, as the run context is keyed by its Host objects: a second
# run in the same process (pyinfra's API, a test) writes reports of its own.
_RUNS: WeakKeyDictionary[Any, AuditRun] = WeakKeyDictionary()


def audit_run(pyinfra_state: Any, report_dir: str, keep: int | None = None) -> AuditRun:
    """The reports of the run ``pyinfra_state`` (pyinfra's State), begun on its first use:
    their paths in ``report_dir`` and the previous report there; the terminal table is
    printed when the process exits."""
    run = _RUNS.get(pyinfra_state)
    if run is None:
        json_path, md_path = _paths(report_dir)
        run = AuditRun(json_path, md_path, report_store.previous_report(json_path), keep,
                       datetime.now(timezone.utc).isoformat(timespec="seconds"))
        _RUNS[pyinfra_state] = run
        atexit.register(_finish, run)
    return run


def _write(run: AuditRun) -> None:
    json_path, md_path = run.json_path, run.md_path
    json_path.parent.mkdir(parents=True, exist_ok=True)
    previous_path, previous = run.previous or (None, None)
    report = dict(run.report(), changes=changes(previous, run.report(),
                                                previous_path.name if previous_path else None))
    json_path.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    md_path.write_text(render_markdown(report) + "\n")
    json_path.with_suffix(".html").write_text(render_html(report, summary_rows(report)))
    report_store.publish_latest(json_path)
    if run.keep is not None:
        run.removed += report_store.prune(json_path.parent, run.keep,
                                          report_store.stamp_of(json_path) or "")
    index = os.environ.get(INDEX_ENV)
    if index:
        paths = {"json": str(json_path.resolve()), "markdown": str(md_path.resolve()),
                 "html": str(json_path.with_suffix(".html").resolve())}
        Path(index).write_text(json.dumps(paths) + "\n")
    run.written = True


def _finish(run: AuditRun) -> None:
    """At the process's exit: the reports of a run cut short before its last host was
    recorded (what it read), then the terminal table."""
    if run.hosts and not run.written:
        _write(run)
    _print_summary(run)


def _print_summary(run: AuditRun) -> None:
    if not run.hosts:
        return
    json_path, md_path = run.json_path, run.md_path
    print("\n" + summary_table(run.report()), file=sys.stderr)
    print(f"\nAudit reports written to {json_path} and {md_path}", file=sys.stderr)
    removed = {report_store.stamp_of(path) for path in run.removed}
    print(f"HTML report: {json_path.with_suffix('.html')}; "
          f"{json_path.parent / (report_store.LATEST + '.{json,md,html}')} point at this audit"
          + (f"; {len(removed)} older report set(s) removed (audit_report_keep)"
             if removed else ""), file=sys.stderr)


def previous_entry(pyinfra_state: Any, name: str, report_dir: str,
                   keep: int | None = None) -> dict[str, Any] | None:
    """The host's entry in the audit report in ``report_dir`` before the run
    ``pyinfra_state``'s (None: none)."""
    _path, previous = audit_run(pyinfra_state, report_dir, keep).previous or (None, None)
    return ((previous or {}).get("hosts") or {}).get(name)


def record(pyinfra_state: Any, name: str, entry: dict[str, Any], report_dir: str,
           keep: int | None = None) -> None:
    """Add one host's entry to the reports of the run ``pyinfra_state``, and write them
    once every host of the run is recorded; ``keep``: the report sets kept in
    ``report_dir`` (None: all)."""
    run = audit_run(pyinfra_state, report_dir, keep)
    run.hosts[name] = entry
    # pyinfra prepares a deploy file for each of the run's active hosts
    # (pyinfra_cli/util.py _parallel_load_hosts): with the last one recorded, the audit
    # of the run is whole.
    if {host.name for host in pyinfra_state.active_hosts} <= set(run.hosts):
        _write(run)
