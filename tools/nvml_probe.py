"""Print, read-only, what NVML says about each GPU: the answers a GPU guard relies on.

    python3 tools/nvml_probe.py

Queries only (no setter is called). Each line is ``key: value`` or ``key: error``.
"""

from __future__ import annotations

import pynvml


def ask(label: str, call, *args) -> None:
    try:
        value = call(*args)
    except pynvml.NVMLError as error:
        value = f"NVMLError {error.value}: {error}"
    if isinstance(value, bytes):
        value = value.decode()
    print(f"{label}: {value}")


def main() -> None:
    pynvml.nvmlInit()
    ask("driver", pynvml.nvmlSystemGetDriverVersion)
    ask("nvml", pynvml.nvmlSystemGetNVMLVersion)
    ask("cuda_driver", pynvml.nvmlSystemGetCudaDriverVersion)
    count = pynvml.nvmlDeviceGetCount()
    print(f"count: {count}")
    for index in range(count):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        ask(f"gpu{index}.name", pynvml.nvmlDeviceGetName, handle)
        ask(f"gpu{index}.uuid", pynvml.nvmlDeviceGetUUID, handle)
        ask(f"gpu{index}.memory_total", lambda h: pynvml.nvmlDeviceGetMemoryInfo(h).total, handle)
        ask(f"gpu{index}.mig_mode", pynvml.nvmlDeviceGetMigMode, handle)
        ask(f"gpu{index}.persistence", pynvml.nvmlDeviceGetPersistenceMode, handle)
        ask(f"gpu{index}.compute_processes",
            lambda h: [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)],
            handle)
        for link in range(2):
            ask(f"gpu{index}.nvlink{link}.state", pynvml.nvmlDeviceGetNvLinkState, handle, link)
    pynvml.nvmlShutdown()


if __name__ == "__main__":
    main()
