"""Each host's entry in the audit's report: the digest of what was read, the checks and
the GPUs' health (``summarize``), a router host's (``router_summary``), the entry of a host
whose settings are invalid (``settings_refusal``), the model's plan (``model_plans``), and
what was changed by hand around the suite (``integrity``, the deep checks of the model and
the environment), each judged by pyinfra_vllm/plans/.
"""

from __future__ import annotations

import re
from typing import Any

from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.plans import checks as host_checks
from pyinfra_vllm.plans.checks import blocking, check_host, gpu_health
from pyinfra_vllm.plans.gates import gpu_memory_mib, model_gates
from pyinfra_vllm.plans.gateway import foreign_servers, foreign_words
from pyinfra_vllm.plans.router import UNIT as ROUTER_UNIT
from pyinfra_vllm.plans.topology import tp_link_verdict
from pyinfra_vllm.plans.units import foreign_drop_ins
from pyinfra_vllm.plans.vllm_service import difference_words, engine_differences


def summarize(name: str, state: dict[str, Any], settings: Settings,
              previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """One host's entry in the report: the raw state, the checks, the GPUs' health
    (``previous``: the host's entry in an earlier report, for the counters that rose
    since), and a digest."""
    health = gpu_health(state, settings, (previous or {}).get("gpu_health"))
    checks = check_host(state, settings, health)
    digest = _digest(state, checks, health, settings.tensor_parallel_size)
    return {"summary": digest, "checks": checks, "state": state, "gpu_health": health}


def router_summary(state: dict[str, Any], judged: dict[str, Any]) -> dict[str, Any]:
    """A router host's entry (``role`` "router"): its OS, and the front door's verdict
    (``judged``: pyinfra_vllm/plans/router.py ``verdict``) as its one check besides the
    OS's; no GPU, driver or engine is judged on a front door."""
    checks = [host_checks.check_os(state),
              host_checks.check("front_door", judged["ok"], judged["reason"],
                                "" if judged["ok"] else f"journalctl -u {ROUTER_UNIT}; "
                                "each gateway's /health")]
    return {"role": "router", "summary": _digest(state, checks, {}, None), "checks": checks,
            "state": state, "gpu_health": {}, "router": judged}


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
