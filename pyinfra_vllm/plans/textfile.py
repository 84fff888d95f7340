"""The host's verdicts for node_exporter's textfile collector, in Prometheus text format.

The same checks preflight and the audit judge (pyinfra_vllm/plans/checks.py, pyinfra_vllm/plans/gates.py),
and the capacity plan, as gauges; written by the metrics stage to
``{textfile_collector_dir}/pyinfra_vllm.prom``, where node_exporter's textfile collector
picks them up. Only values the deploy itself does not change go in (no MIG or
persistence state, no timestamp), so a converged host's file stays byte for byte the
same and a re-run changes nothing.
"""

from __future__ import annotations

from typing import Any

# 1 passed, 0 failed, -1 not judged (no driver yet, a warning the settings allow).
_CHECK_VALUE = {True: 1, False: 0, None: -1}


def _label(value: Any) -> str:
    text = str(value)
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metrics_text(host: str, checks: list[dict[str, Any]], info: dict[str, Any],
                 capacity: dict[str, Any] | None) -> str:
    """The .prom file: check gauges, an info gauge, and the capacity plan's numbers."""
    lines = [
        "# Written by pyinfra-vllm (deploys/metrics.py); replaced on every run.",
        "# HELP pyinfra_vllm_check_ok Deploy checks: 1 passed, 0 failed, -1 not judged.",
        "# TYPE pyinfra_vllm_check_ok gauge",
    ]
    for check in checks:
        lines.append(f'pyinfra_vllm_check_ok{{check="{_label(check["name"])}",'
                     f'severity="{_label(check["severity"])}"}} {_CHECK_VALUE[check["ok"]]}')
    labels = ",".join(f'{key}="{_label(value)}"' for key, value in sorted(info.items()))
    lines += [
        "# HELP pyinfra_vllm_info The stack this host is deployed with.",
        "# TYPE pyinfra_vllm_info gauge",
        f"pyinfra_vllm_info{{host=\"{_label(host)}\",{labels}}} 1",
    ]
    if capacity and "error" not in capacity:
        for name, key, words in (
            ("sequences", "sequences", "max_model_len sequences that fit at once"),
            ("kv_bytes_per_token", "kv_bytes_per_token", "KV cache bytes per token"),
            ("weights_bytes_per_gpu", "weights_bytes_per_gpu", "model weights per GPU"),
            ("kv_budget_bytes_per_gpu", "kv_budget_bytes_per_gpu",
             "memory left for the KV cache per GPU"),
        ):
            lines += [
                f"# HELP pyinfra_vllm_capacity_{name} Capacity plan: {words}.",
                f"# TYPE pyinfra_vllm_capacity_{name} gauge",
                f"pyinfra_vllm_capacity_{name} {int(capacity[key])}",
            ]
    return "\n".join(lines) + "\n"


# A GPU's verdict as a number: the alert rules compare it.
_VERDICT_VALUE = {"ok": 0, "degraded": 1, "failing": 2, "unknown": 3}
# Counters that follow the load, not the GPU's health (the PCIe generation drops when a
# GPU idles): left out, so that a converged host's file stays the same between runs.
_VOLATILE_COUNTERS = {"pcie_gen_current"}


def gpu_health_text(host: str, health: dict[str, Any]) -> str:
    """The GPU-health .prom file: each GPU's verdict, one series per reason that holds,
    and its error counters (pyinfra_vllm.plans.gpu_health.host_gpu_health's result)."""
    lines = [
        "# Written by pyinfra-vllm (deploys/preflight.py); replaced on every run.",
        "# HELP pyinfra_vllm_gpu_health GPU health verdict: 0 ok, 1 degraded, 2 failing, "
        "3 unknown (could not be read).",
        "# TYPE pyinfra_vllm_gpu_health gauge",
    ]
    gpus = sorted(health.items(), key=lambda item: (item[1].get("index") is None,
                                                     item[1].get("index") or 0, item[0]))

    def labels(bus_id: str, gpu: dict[str, Any]) -> str:
        index = "" if gpu.get("index") is None else gpu["index"]
        return f'host="{_label(host)}",gpu="{index}",bus_id="{_label(bus_id)}"'

    lines += [f"pyinfra_vllm_gpu_health{{{labels(b, g)}}} {_VERDICT_VALUE[g['verdict']]}"
              for b, g in gpus]
    lines += ["# HELP pyinfra_vllm_gpu_health_reason A GPU health finding (1 while it holds).",
              "# TYPE pyinfra_vllm_gpu_health_reason gauge"]
    lines += [f'pyinfra_vllm_gpu_health_reason{{{labels(b, g)},reason="{_label(r["code"])}",'
              f'severity="{_label(r["severity"])}"}} 1' for b, g in gpus for r in g["reasons"]]
    names = sorted({name for _, g in gpus for name in g.get("counters") or {}}
                   - _VOLATILE_COUNTERS)
    for name in names:
        lines += [f"# HELP pyinfra_vllm_gpu_{name} GPU health counter {name} (nvidia-smi, "
                  "the kernel log).", f"# TYPE pyinfra_vllm_gpu_{name} gauge"]
        lines += [f"pyinfra_vllm_gpu_{name}{{{labels(b, g)}}} {int(g['counters'][name])}"
                  for b, g in gpus if name in (g.get("counters") or {})]
    return "\n".join(lines) + "\n"
