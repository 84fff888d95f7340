"""Verdicts on a host's collected state: what preflight refuses and what the audit shows.

Pure functions over the dict ``pyinfra_vllm.run.context.collect`` returns and the validated
settings; no host access here, so every branch is unit-tested. Each check is
``{"name", "ok", "severity", "detail", "fix"}``: ``ok`` is True, False, or None when
the check cannot be judged yet (no driver), ``severity`` is "error" (preflight stops
the host) or "warning" (reported, not fatal).
"""

from __future__ import annotations

import re
from typing import Any

from facts.driver import module_mismatch, userspace_driver
from facts.versions import version_tuple
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.core.stack_locks import driver_floor
from pyinfra_vllm.plans.gpu_health import host_gpu_health
from pyinfra_vllm.plans.topology import tp_link_verdict

# Operating systems the suite provisions: Ubuntu 22.04 is the target, 24.04 and
# Debian 12 are supported (and the sandbox hosts are Debian 12).
SUPPORTED_OS = {("Ubuntu", 22), ("Ubuntu", 24), ("Debian", 12)}
SUPPORTED_OS_WORDS = "Ubuntu 22.04, Ubuntu 24.04 or Debian 12"


def check(name: str, ok: bool | None, detail: str, fix: str = "", severity: str = "error"):
    """One verdict, in the shape every check of the suite shares."""
    return {"name": name, "ok": ok, "severity": severity, "detail": detail, "fix": fix}


def check_os(state: dict[str, Any]) -> dict[str, Any]:
    distro = state.get("os") or {}
    name, major = distro.get("name"), distro.get("major")
    pretty = (distro.get("release_meta") or {}).get("PRETTY_NAME") or f"{name} {major}"
    if (name, major) in SUPPORTED_OS:
        return check("os", True, pretty)
    return check(
        "os",
        False,
        f"{pretty} is not supported",
        f"use {SUPPORTED_OS_WORDS}",
    )


def check_driver(state: dict[str, Any], settings: Settings) -> list[dict[str, Any]]:
    """Driver presence, module/userspace match, and the stack's minimum version."""
    checks = []
    module = state.get("kernel_module")
    driver = state.get("driver")
    nvml_error = state.get("nvml_error")
    packages = state.get("driver_packages")
    mismatch = module_mismatch(module, packages, nvml_error)
    if mismatch is not None:
        checks.append(
            check(
                "driver_module_match",
                False,
                mismatch,
                "reboot the host so the installed driver's kernel module is loaded",
            )
        )
        return checks
    installed = userspace_driver(packages)
    if module is None and installed is not None:
        # Installed (by an earlier run, or by hand) but not loaded yet: not a preflight
        # failure, the driver stage reboots (allow_reboot) or stops with this reason.
        name, installed_version = installed
        checks.append(
            check(
                "driver_loaded",
                None,
                f"{name} {installed_version} is installed but no NVIDIA kernel module is loaded: "
                "reboot required",
                "the driver stage reboots the host with allow_reboot=true; otherwise reboot it",
            )
        )
        return checks
    if nvml_error is not None:
        checks.append(
            check(
                "driver_responds",
                False,
                f"nvidia-smi fails: {nvml_error['error']}",
                "check `dmesg | grep -i nvrm` and the driver installation; a reboot "
                "often completes a driver install",
            )
        )
        return checks
    if module is None and driver is None:
        checks.append(
            check(
                "driver_present",
                None,
                "no NVIDIA driver",
                f"the driver stage installs nvidia-headless-{settings.nvidia_driver_branch}",
            )
        )
        return checks
    version = (driver or {}).get("driver_version") or (module or {}).get("version")
    return checks + check_driver_version(version, (driver or {}).get("cuda_version"),
                                         settings)


def check_driver_version(version: str | None, cuda: str | None,
                         settings: Settings) -> list[dict[str, Any]]:
    """The driver against the stack's CUDA runtime (from its lock), and the CUDA version
    nvidia-smi says the driver supports against the stack's build."""
    floor = driver_floor(settings.stack)
    if floor is None:  # a CPU row needs no driver (check_host does not ask it)
        return []
    ok = version_tuple(version) >= version_tuple(floor.driver)
    checks = [check(
        "driver_version",
        ok,
        f"driver {version}; the vLLM {settings.vllm_version} stack's CUDA runtime "
        f"{floor.runtime} ({floor.release}, from its lock) needs >= {floor.driver}",
        "" if ok else f"install driver branch {floor.branch} or newer (nvidia_driver_branch)",
    )]
    if cuda is not None:
        ok = version_tuple(cuda) >= version_tuple(settings.stack.cuda)
        checks.append(check(
            "driver_cuda",
            ok,
            f"the driver supports CUDA {cuda}; the stack is built for CUDA "
            f"{settings.stack.cuda}",
            "" if ok else "install a newer driver branch",
        ))
    return checks


def check_gpus(state: dict[str, Any], settings: Settings) -> list[dict[str, Any]]:
    gpus = state.get("gpus")
    if gpus is None:
        return []
    checks = []
    count = len(gpus)
    tp = settings.tensor_parallel_size
    checks.append(
        check(
            "gpu_count",
            count >= tp,
            f"{count} GPU(s); tensor_parallel_size is {tp}",
            "" if count >= tp else f"set tensor_parallel_size to at most {count}",
        )
    )
    small = [
        gpu
        for gpu in gpus
        if gpu.get("memory_total_mib") is not None
        and gpu["memory_total_mib"] < settings.min_gpu_memory_mib
    ]
    names = sorted({gpu.get("name") or "?" for gpu in gpus})
    checks.append(
        check(
            "gpu_memory",
            not small,
            f"{', '.join(names)}; smallest "
            f"{min((g.get('memory_total_mib') or 0) for g in gpus) if gpus else 0} MiB, "
            f"min_gpu_memory_mib is {settings.min_gpu_memory_mib}",
            "" if not small else "use 80 GB GPUs or lower min_gpu_memory_mib knowingly",
        )
    )
    return checks


# An architecture in torch's list: sm_XY (code for compute capability X.Y), sm_XYa (X.Y
# only), compute_XY (PTX, which the driver compiles for X.Y and newer).
_ARCH = re.compile(r"^(sm|compute)_(\d+)(\d)([af]?)$")


def arch_runs_on(arch: str, capability: str) -> bool:
    """Does ``arch`` (``sm_80``) run on a GPU of ``capability`` (``"8.6"``)? CUDA C++
    Programming Guide, "Binary Compatibility": code for X.y runs on X.z with z >= y; an
    ``a`` (architecture-specific) build only on X.y itself. "PTX Compatibility": PTX runs
    on its capability and every newer one."""
    match = _ARCH.match(arch)
    if match is None:
        return False
    kind, major, minor, suffix = match[1], int(match[2]), int(match[3]), match[4]
    gpu_major, gpu_minor = (int(part) for part in capability.split("."))
    if suffix == "a":
        return (gpu_major, gpu_minor) == (major, minor)
    if kind == "compute":
        return (gpu_major, gpu_minor) >= (major, minor)
    return gpu_major == major and gpu_minor >= minor


def check_gpu_archs(state: dict[str, Any], settings: Settings) -> dict[str, Any] | None:
    """The engine's GPUs against the architectures the stack's torch build carries code
    for (its row's ``cuda_archs``). Not judged (a warning) where nvidia-smi gives no
    compute capability (a driver without the ``compute_cap`` field)."""
    gpus, caps, archs = state.get("gpus"), state.get("compute_caps"), settings.stack.cuda_archs
    if gpus is None or not archs:
        return None
    if caps is None:
        return check("gpu_arch", None, "the GPUs' compute capability could not be read "
                     "(nvidia-smi --query-gpu=compute_cap)", severity="warning")
    used = set(engine_gpus(state, settings))
    engine = [(gpu, caps.get(gpu["pci_bus_id"])) for gpu in gpus if gpu["index"] in used]
    unserved = [(gpu, cap) for gpu, cap in engine
                if not any(arch_runs_on(arch, cap or "0.0") for arch in archs)]
    stack = f"the vLLM {settings.vllm_version} stack's torch {settings.stack.torch}"
    if not unserved:
        seen = sorted({cap or "?" for _, cap in engine})
        return check("gpu_arch", True, f"compute capability {', '.join(seen)}; {stack} "
                     f"carries {' '.join(archs)}")
    words = ", ".join(f"GPU {gpu['index']} ({gpu.get('name') or '?'}) has compute "
                      f"capability {cap or 'unknown'}" for gpu, cap in unserved)
    return check("gpu_arch", False, f"{words}; {stack} carries code for "
                 f"{' '.join(archs)} only", "choose a vllm_version whose row's cuda_archs "
                 "run on these GPUs (pyinfra_vllm/core/stacks.py)")


def check_tp_link(state: dict[str, Any], settings: Settings) -> dict[str, Any] | None:
    topology = state.get("topology")
    tp = settings.tensor_parallel_size
    if topology is None or tp < 2:
        return None
    verdict = tp_link_verdict(topology, tp)
    codes = ", ".join(f"{pair} {code}" for pair, code in (verdict.get("codes") or {}).items())
    if verdict.get("nvlink"):
        return check(
            "tp_nvlink", True, f"{' and '.join(verdict['gpus'])} joined by NVLink ({codes})"
        )
    if not verdict.get("gpus"):
        return check(
            "tp_nvlink",
            False,
            f"fewer than {tp} GPUs in the topology",
            f"set tensor_parallel_size to at most {len(topology.get('gpus') or [])}",
        )
    severity = "warning" if settings.allow_pcie_tensor_parallel else "error"
    return check(
        "tp_nvlink",
        False,
        f"no {tp} GPUs are joined by NVLink: best {' and '.join(verdict['gpus'])} "
        f"link {codes or 'unknown'} (PCIe)",
        "fit or reseat the NVLink bridge, or set allow_pcie_tensor_parallel=true to "
        "accept PCIe tensor parallelism",
        severity=severity,
    )


def engine_gpus(state: dict[str, Any], settings: Settings) -> list[int]:
    """The indices of the GPUs the engine runs on: the tensor-parallel set the topology
    gives (tp_link_verdict), else the first tensor_parallel_size GPUs."""
    tp = settings.tensor_parallel_size
    indices = tp_link_verdict(state.get("topology"), tp).get("indices") or []
    return list(indices) or list(range(tp))


def gpu_health(state: dict[str, Any], settings: Settings,
               previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each GPU's health verdict (pyinfra_vllm.plans.gpu_health.host_gpu_health), by bus id;
    ``previous``: an earlier result, for the counters that rose since."""
    return host_gpu_health(state, engine_gpus(state, settings), previous)


def _health_words(bus_id: str, gpu: dict[str, Any]) -> str:
    index = gpu.get("index")
    name = f"GPU{index} {bus_id}" if index is not None else f"GPU {bus_id}"
    return f"{name}: " + "; ".join(r["detail"] for r in gpu["reasons"])


def _health_fixes(gpus: list[dict[str, Any]]) -> str:
    actions = [r["action"] for gpu in gpus for r in gpu["reasons"] if r.get("action")]
    return "; ".join(dict.fromkeys(actions))


def check_gpu_health(state: dict[str, Any], settings: Settings,
                     health: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The GPUs' health: a failing GPU the engine runs on stops the host (unless
    allow_failing_gpus); a degraded GPU, or a failing one the engine does not use, is a
    warning. Nothing to judge without GPU data (the driver checks say why)."""
    health = gpu_health(state, settings) if health is None else health
    if not health:
        return []
    engine = set(engine_gpus(state, settings))
    failing = {bus: gpu for bus, gpu in health.items() if gpu["verdict"] == "failing"
               and (gpu.get("index") is None or gpu["index"] in engine)}
    others = {bus: gpu for bus, gpu in health.items()
              if gpu["verdict"] != "ok" and bus not in failing}
    checks = []
    if failing:
        checks.append(check(
            "gpu_health", False, "; ".join(_health_words(b, g) for b, g in failing.items()),
            _health_fixes(list(failing.values())),
            severity="warning" if settings.allow_failing_gpus else "error"))
    else:
        checks.append(check("gpu_health", True, f"{len(health)} GPU(s): none failing"))
    if others:
        checks.append(check(
            "gpu_health_degraded", False,
            "; ".join(_health_words(b, g) for b, g in others.items()),
            _health_fixes(list(others.values())), severity="warning"))
    return checks


# vllm_device "cpu": memory each process of the engine holds besides the weights and the
# KV cache: the API server, the engine core and each tensor-parallel worker. Measured
# resident on the tiny model, serving (tests/fixtures/vllm-cpu/processes.txt): API server
# 0.88 GiB, engine core 0.85 GiB, each worker 2.10 GiB less its 1 GiB KV cache = 1.10 GiB
# (python, torch, vLLM, the tokenizer); 1.25 GiB each.
CPU_PROCESS_BYTES = 5 * 1024**3 // 4


def cpu_reserve_bytes(tensor_parallel_size: int) -> int:
    """What the engine's processes take on CPU besides weights and KV cache."""
    return (tensor_parallel_size + 2) * CPU_PROCESS_BYTES


def _bind_groups(bind: str) -> list[list[int]]:
    groups = []
    for group in bind.split("|"):
        ids: list[int] = []
        for part in group.split(","):
            low, _, high = part.partition("-")
            ids.extend(range(int(low), int(high or low) + 1))
        groups.append(ids)
    return groups


def check_cpu_host(state: dict[str, Any], settings: Settings) -> list[dict[str, Any]]:
    """vllm_device "cpu": CPUs for the workers, their thread binding, memory for the KV
    cache (``state["cpu"]``: facts.cpu_host.CpuHostState)."""
    cpu = state.get("cpu") or {}
    cpus = cpu.get("cpus") or []
    tp = settings.tensor_parallel_size
    checks = []
    if not cpus:
        checks.append(check("cpu_count", None, "the host's online CPUs could not be read",
                            severity="warning"))
    else:
        ok = len(cpus) >= tp
        checks.append(check(
            "cpu_count", ok,
            f"{len(cpus)} online CPU(s); tensor_parallel_size {tp} runs {tp} CPU worker(s), "
            "each with at least one CPU of its own",
            "" if ok else f"set tensor_parallel_size to at most {len(cpus)}",
        ))
    bind = settings.vllm_cpu_threads_bind
    nodes = cpu.get("numa_nodes") or 1
    if bind == "auto" and tp > nodes:
        checks.append(check(
            "cpu_threads_bind", False,
            f"vllm_cpu_threads_bind auto binds one NUMA node per worker; the host has {nodes} "
            f"for {tp} workers (vLLM stops: Not enough allowed NUMA nodes to bind threads)",
            "leave vllm_cpu_threads_bind unset (computed from the host's CPUs) or list the "
            "CPUs per worker (0-7|8-15)",
        ))
    elif bind not in (None, "auto", "nobind"):
        groups = _bind_groups(bind)
        unknown = sorted({c for g in groups for c in g} - set(cpus)) if cpus else []
        ok = len(groups) == tp and not unknown
        detail = f"vllm_cpu_threads_bind {bind}: {len(groups)} CPU set(s) for {tp} worker(s)"
        if unknown:
            detail += f"; CPU(s) {unknown} are not online"
        checks.append(check("cpu_threads_bind", ok, detail,
                            "" if ok else f"give one CPU set per worker ({tp}), online CPUs only"))
    total_mib = cpu.get("memory_total_mib")
    kv_gib = settings.vllm_cpu_kvcache_space_gib
    need_mib = tp * kv_gib * 1024 + cpu_reserve_bytes(tp) // 1024**2
    if total_mib is None:
        checks.append(check("cpu_kv_space", None, "the host's memory could not be read",
                            severity="warning"))
    else:
        ok = need_mib <= total_mib
        checks.append(check(
            "cpu_kv_space", ok,
            f"KV cache {tp} worker(s) x {kv_gib} GiB (vllm_cpu_kvcache_space_gib) + "
            f"{cpu_reserve_bytes(tp) / 1024**3:g} GiB for the engine's {tp + 2} processes = "
            f"{need_mib} MiB of the host's {total_mib} MiB, before the weights",
            "" if ok else "lower vllm_cpu_kvcache_space_gib or tensor_parallel_size",
        ))
    return checks


def check_host(state: dict[str, Any], settings: Settings,
               health: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every preflight check for one host, in the order an operator reads them. On
    vllm_device "cpu" the driver, GPU and NVLink checks give way to the CPU ones.
    ``health``: the GPUs' health when the caller judged it already (``gpu_health``)."""
    if settings.vllm_device == "cpu":
        return [check_os(state), *check_cpu_host(state, settings)]
    checks = [check_os(state), *check_driver(state, settings), *check_gpus(state, settings)]
    too_few = any(c["name"] == "gpu_count" and c["ok"] is False for c in checks)
    link = None if too_few else check_tp_link(state, settings)
    checks += [found for found in (link, check_gpu_archs(state, settings)) if found]
    return checks + check_gpu_health(state, settings, health)


def blocking(checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The checks that stop a host: failed and of severity error."""
    return [c for c in checks if c["ok"] is False and c["severity"] == "error"]
