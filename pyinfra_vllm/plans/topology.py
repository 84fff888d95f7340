"""The tensor-parallel link verdict: which GPUs a tensor-parallel group uses, and over
what links, judged on the matrix facts/topology.py reads (``GpuTopology``, its
``parse_topology``): pure functions, for preflight, the engine's unit and the audit.
"""

from __future__ import annotations

import re
from itertools import combinations
from typing import Any

_NVLINK_CODE_RE = re.compile(r"^NV(\d+)$")

# PCIe path codes from `nvidia-smi topo -m`'s legend, best first; SOC is the pre-2017
# name of SYS. NV# ranks above all of them, by link count.
_PCIE_RANK = {"PIX": 5, "PXB": 4, "PHB": 3, "NODE": 2, "SYS": 1, "SOC": 1}


def is_nvlink(code: str | None) -> bool:
    return code is not None and _NVLINK_CODE_RE.match(code) is not None


def _link_rank(code: str | None) -> int:
    """Higher is better: NV# by link count above every PCIe path; unknown lowest."""
    if code is None:
        return 0
    match = _NVLINK_CODE_RE.match(code)
    if match is not None:
        return 100 + int(match.group(1))
    return _PCIE_RANK.get(code, 0)


def _code(topology: dict[str, Any], a: str, b: str) -> str | None:
    links = topology.get("links") or {}
    code = (links.get(a) or {}).get(b)
    if code is None:
        code = (links.get(b) or {}).get(a)
    return code


def nvlink_joined(topology: dict[str, Any] | None, gpu_labels: list[str]) -> bool:
    """True when there are at least two GPUs and every pair of them shows ``NV#``."""
    if topology is None or len(gpu_labels) < 2:
        return False
    return all(is_nvlink(_code(topology, a, b)) for a, b in combinations(gpu_labels, 2))


def _gpu_index(label: str) -> int | None:
    match = re.match(r"^GPU(\d+)$", label)
    return int(match.group(1)) if match is not None else None


def _verdict(topology: dict[str, Any], labels: list[str], nvlink: bool) -> dict[str, Any]:
    codes = {}
    for a, b in combinations(labels, 2):
        code = _code(topology, a, b)
        if code is not None:
            codes[f"{a}-{b}"] = code
    return {
        "gpus": list(labels),
        "indices": [_gpu_index(label) for label in labels],
        "codes": codes,
        "nvlink": nvlink,
    }


def tp_link_verdict(topology: dict[str, Any] | None, n: int) -> dict[str, Any]:
    """Which ``n`` GPUs a tensor-parallel group of size ``n`` should use, and over what.

    Returns ``{"gpus": ["GPU0", "GPU1"], "indices": [0, 1], "codes": {"GPU0-GPU1":
    "NV12"}, "nvlink": True}`` for the first set (in GPU order) whose pairs are all
    ``NV#``. Without one, the set with the best worst link (then the best total;
    NV# > PIX > PXB > PHB > NODE > SYS), with ``"nvlink": False``. With fewer than
    ``n`` GPUs (or no topology): ``{"gpus": [], "indices": [], "codes": {}, "nvlink":
    False}``. With ``n`` < 2 no link is involved: the first ``n`` GPUs, no codes and
    ``"nvlink": False``.
    """
    gpus = list((topology or {}).get("gpus") or [])
    if topology is None or n < 1 or len(gpus) < n:
        return {"gpus": [], "indices": [], "codes": {}, "nvlink": False}
    if n < 2:
        return _verdict(topology, gpus[:n], False)
    best: tuple[tuple[int, int], tuple[str, ...]] | None = None
    for group in combinations(gpus, n):
        ranks = [_link_rank(_code(topology, a, b)) for a, b in combinations(group, 2)]
        if all(rank > 100 for rank in ranks):
            return _verdict(topology, list(group), True)
        score = (min(ranks), sum(ranks))
        if best is None or score > best[0]:
            best = (score, group)
    # best is set: len(gpus) >= n >= 2 gives at least one group.
    return _verdict(topology, list(best[1]) if best is not None else [], False)
