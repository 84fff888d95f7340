"""Each host of an audit in a few words: the terminal table (``summary_table``), whose
rows (``summary_rows``) are the HTML report's fleet table too, and the words the
Markdown report shares with it.
"""

from __future__ import annotations

from typing import Any

from pyinfra_vllm.report.drift import host_problems
from pyinfra_vllm.report.front_door import front_door_words, is_router_entry
from pyinfra_vllm.report.text import printable


def drift_words(entry: dict[str, Any]) -> str:
    if entry.get("drift") is None:
        # Refused without a plan: its settings are invalid (settings_refusal).
        return "refused" if entry.get("refused") else "-"
    drift, refused = host_problems(entry)
    words = [f"{len(drift)} change(s)"] if drift else []
    if refused:
        words.append("refused")
    return ", ".join(words) or "converged"


def mig_words(summary: dict[str, Any]) -> str:
    if not summary["mig"]:
        return "-"
    states = {(m["current"], m["pending"]) for m in summary["mig"]}
    if states == {("Disabled", "Disabled")}:
        return "disabled"
    return ", ".join(f"GPU{m['index']} {m['current']}/{m['pending']}" for m in summary["mig"])


def persistence_words(summary: dict[str, Any]) -> str:
    modes = {p["mode"] for p in summary["persistence"]}
    if not modes:
        return "-"
    if len(modes) == 1:
        return {"Enabled": "enabled", "Disabled": "disabled"}.get(next(iter(modes)), str(modes))
    return ", ".join(f"GPU{p['index']} {p['mode']}" for p in summary["persistence"])


def link_words(summary: dict[str, Any], state: dict[str, Any]) -> str:
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


def nvlink_words(state: dict[str, Any]) -> str:
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


def gpu_words(summary: dict[str, Any]) -> str:
    if not summary["driver_present"]:
        return "no NVIDIA driver"
    if summary["gpu_count"] == 0:
        return "0"
    return f"{summary['gpu_count']}x {', '.join(summary['gpu_names'])}"


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
    # The front door's view beside each verdict, where the audit read a router host.
    routed = any(is_router_entry(entry) for entry in report["hosts"].values())
    if routed:
        header = (*header[:11], "front door", *header[11:])
    if asked:
        header += ("engine",)
    rows: list[tuple[str, ...]] = [header]
    for name, entry in sorted(report["hosts"].items()):
        s = entry["summary"]
        hardware = ("-",) * 8 if is_router_entry(entry) else (
            gpu_words(s),
            s["driver_version"] or "-",
            s["cuda_version"] or "-",
            mig_words(s),
            persistence_words(s),
            nvlink_words(entry["state"]),
            link_words(s, entry["state"]),
            s.get("health") or "-",
        )
        rows.append(
            (
                name,
                s["os"] or "-",
                *hardware,
                s["verdict"],
                *([front_door_words(entry)] if routed else []),
                drift_words(entry),
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
