"""What preflight reads about a host whose engine runs on CPU (vllm_device "cpu"), in one
remote command: its online CPUs, NUMA nodes, memory and the CPU features vLLM's CPU
build picks its kernels by.
"""

from __future__ import annotations

import re
from typing import Any

from typing_extensions import override

from facts.base import FactBase

# /proc/cpuinfo flags vLLM's CPU build looks at: avx512f picks its AVX-512 kernels
# (vllm/_C) over the AVX2 ones (vllm/_C_AVX2); avx512_bf16 and amx_bf16 are the native
# bfloat16 paths (vllm/platforms/cpu.py import_kernels, v1/attention/backends/cpu_attn.py).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def parse_cpu_list(text: str) -> list[int]:
    """A kernel CPU list (``0-3,8,10-11``) as ids."""
    ids: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        ids.extend(range(int(low), int(high or low) + 1))
    return ids


def cpu_ranges(ids: list[int]) -> str:
    """CPU ids as a kernel CPU list: ``[0, 1, 2, 5]`` -> ``0-2,5``."""
    parts: list[str] = []
    start = prev = None
    for cpu in sorted(ids):
        if start is None:
            start = prev = cpu
        elif cpu == prev + 1:  # type: ignore[operator]
            prev = cpu
        else:
            parts.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = prev = cpu
    if start is not None:
        parts.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ",".join(parts)


class CpuHostState(FactBase[dict[str, Any]]):
    """
    Returns the host's online CPUs, NUMA nodes, total memory and CPU features:

    .. code:: python

        {
            "cpus": [0, 1],                # /sys/devices/system/cpu/online
            "numa_nodes": 1,               # /sys/devices/system/node/node*; 1 without
            "memory_total_mib": 24032,     # MemTotal of /proc/meminfo
            "flags": {"avx2": True, "avx512f": False, "avx512_bf16": False,
                      "amx_bf16": False},
        }

    A value it cannot read is None (``cpus`` an empty list).
    """

    @override
    def command(self) -> str:
        return (
            "echo '## cpus'; cat /sys/devices/system/cpu/online 2>/dev/null; "
            "echo '## nodes'; ls -d /sys/devices/system/node/node[0-9]* 2>/dev/null | wc -l; "
            "echo '## memory'; grep -m1 '^MemTotal:' /proc/meminfo; "
            "echo '## flags'; grep -m1 '^flags' /proc/cpuinfo || true"
        )

    @override
    @staticmethod
    def default() -> dict[str, Any]:
        return {"cpus": [], "numa_nodes": None, "memory_total_mib": None, "flags": None}

    @override
    def process(self, output: list[str]) -> dict[str, Any]:
        result = self.default()
        section = None
        for line in output:
            if line.startswith("## "):
                section = line[3:].strip()
                continue
            text = line.strip()
            if not text:
                continue
            if section == "cpus" and re.fullmatch(r"[\d,-]+", text):
                result["cpus"] = parse_cpu_list(text)
            elif section == "nodes" and text.isdigit():
                result["numa_nodes"] = max(int(text), 1)
            elif section == "memory":
                match = re.match(r"MemTotal:\s+(\d+)\s+kB", text)
                if match:
                    result["memory_total_mib"] = int(match[1]) // 1024
            elif section == "flags" and text.startswith("flags"):
                present = set(text.partition(":")[2].split())
                result["flags"] = {flag: flag in present for flag in FLAGS}
        return result
