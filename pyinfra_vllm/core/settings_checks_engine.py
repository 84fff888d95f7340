"""The rules of the stack, the model and the engine: the vLLM release and its device, the
model's id, name and revision, the scheduler's limits, the benchmark's shape and the driver
branch the stack needs (the rules' conventions: settings_checks.py).
"""

from __future__ import annotations

import re

from pydantic import ValidationInfo

from pyinfra_vllm.core.model_files import INCOMING, VERIFIED_NAME
from pyinfra_vllm.core.stacks import CPU_STACKS, STACKS, StackRow, releases, stack_for

# A Hugging Face repo id: org/name, each of letters, digits and _.- (Hugging Face's own
# rule; a part never starts with "." or "-", so no ".." and no hidden name).
MODEL_ID = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?")
SERVED_MODEL_NAME = re.compile(r"[A-Za-z0-9._/:-]+")
# A branch, tag or commit: main, v1.0, refs/pr/1, a 40-hex commit.
MODEL_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]*")


def known_stack(value: str) -> str:
    # A release with a row for either device; the pair with vllm_device is checked after.
    if value not in STACKS and value not in CPU_STACKS:
        raise ValueError(f"no stack is defined for it; allowed: {releases(STACKS, CPU_STACKS)}")
    return value


def model_id(value: str) -> str:
    parts = value.split("/")
    reserved = [part for part in parts if part in (INCOMING, VERIFIED_NAME)]
    if reserved:
        raise ValueError(
            f"{reserved[0]} is a name the model downloader keeps for itself beside the "
            "files (pyinfra_vllm/core/model_files.py); use the model's Hugging Face id, "
            "e.g. Qwen/Qwen3.6-27B"
        )
    if not MODEL_ID.fullmatch(value) or any(part[0] in ".-" for part in parts):
        raise ValueError(
            "not a Hugging Face model id: org/name (or name), each part of letters, "
            "digits and _.-, not starting with '.' or '-' (no '..'); e.g. "
            "Qwen/Qwen3.6-27B"
        )
    return value


def served_name(value: str | None) -> str | None:
    if value is not None and (not SERVED_MODEL_NAME.fullmatch(value) or value[0] == "-"):
        raise ValueError(
            "has a space or a character other than letters, digits and ._/:-, or starts "
            "with '-': it goes into the engine's command line and the unit file; e.g. "
            "qwen3.6-27b"
        )
    return value


def revision(value: str) -> str:
    if not MODEL_REVISION.fullmatch(value) or ".." in value or "//" in value:
        raise ValueError(
            "not a branch, tag or commit: letters, digits and _./-, starting with a "
            "letter, digit or _, no '..' (e.g. main, v1.0, refs/pr/1 or a commit hash)"
        )
    return value


def scheduler_limits(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                     block_size: int, enable_chunked_prefill: bool) -> None:
    # The same rules vLLM's SchedulerConfig enforces at start-up, checked here so a
    # bad combination fails in seconds instead of crash-looping the service.
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
            f"max_num_seqs ({max_num_seqs})"
        )
    if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"without enable_chunked_prefill, max_num_batched_tokens "
            f"({max_num_batched_tokens}) must be >= max_model_len ({max_model_len})"
        )
    if max_model_len < block_size:
        raise ValueError(
            f"max_model_len ({max_model_len}) must be >= block_size ({block_size})"
        )


def bench_fits(shape: dict[str, int], max_model_len: int) -> None:
    # A request longer than the engine's context is refused by vLLM: every request of
    # the benchmark would fail.
    if shape["input_len"] + shape["output_len"] > max_model_len:
        raise ValueError(
            f"the benchmark's requests ({shape['input_len']} prompt + {shape['output_len']} "
            f"output tokens, bench_input_len and bench_output_len times bench_scale) must fit "
            f"in max_model_len ({max_model_len}): lower them or bench_scale"
        )


def itl_target_refused(value: float | None) -> float | None:
    # vLLM's goodput judges ttft, tpot and e2el only (vllm/benchmarks/serve.py,
    # check_goodput_args); an ITL target the benchmark cannot judge would be reported as met.
    if value is not None:
        raise ValueError(
            "vLLM's goodput (vllm bench serve --goodput) takes ttft, tpot and "
            "e2el targets, not itl: inter-token latency is a list of gaps per request, none "
            "judged against a target. Its per-request figure is TPOT, the mean gap after "
            "the first token: set bench_slo_tpot_ms instead and leave bench_slo_itl_ms unset"
        )
    return value


def bench_goodput_on_stack(slos: dict[str, float], stack: StackRow,
                           vllm_version: str) -> list[tuple[str, str]]:
    """(key, sentence) for each latency target set on a stack without goodput: the
    targets reach vLLM's benchmark client as --goodput, and a release without it would
    fail every benchmark, the canary's too."""
    if not slos or stack.bench_goodput:
        return []
    table = CPU_STACKS if stack.device == "cpu" else STACKS
    having = releases({version: row for version, row in table.items() if row.bench_goodput})
    return [(key, f"{key} is set, but vLLM {vllm_version}'s stack has no benchmark client "
             "with goodput (vllm/benchmarks/serve.py --goodput; stacks.py bench_goodput): "
             f"unset it, or set vllm_version to a release whose {stack.device} stack has it: "
             f"{having}")
            for key in (f"bench_slo_{name}_ms" for name in slos)]


def eager_by_device(value: bool | None, info: ValidationInfo) -> bool | None:
    """enforce_eager's rule: the operator's true or false as given; None, by vllm_device
    (declared before it, so validated first): False on "cuda" (CUDA graphs and
    torch.compile, vLLM's own default), True on "cpu" (its build needs it:
    device_has_stack). Still None only where vllm_device was refused (reported there)."""
    device = info.data.get("vllm_device")
    if value is not None or device is None:
        return value
    return device == "cpu"


def device_has_stack(vllm_version: str, vllm_device: str, enforce_eager: bool) -> None:
    if stack_for(vllm_version, vllm_device) is None:
        rows = releases(CPU_STACKS if vllm_device == "cpu" else STACKS)
        raise ValueError(
            f"vllm_version {vllm_version} has no {vllm_device} stack "
            f"(pyinfra_vllm/core/stacks.py); {vllm_device} stacks: {rows}"
        )
    if vllm_device == "cpu" and not enforce_eager:
        raise ValueError(
            "vllm_device cpu needs enforce_eager true: without it vLLM's CPU build "
            "compiles the model with torch inductor, which needs a C++ compiler on the "
            "host (this suite installs none)"
        )


def driver_branch_serves_stack(nvidia_driver_branch: str, stack: StackRow,
                               vllm_version: str) -> None:
    # The driver stage installs this branch; a branch older than the stack's minimum
    # would install a driver the stack's CUDA build cannot use.
    minimum = stack.min_driver or ""  # every CUDA row names one (StackRow refuses none)
    needed = int(minimum.split(".")[0])
    if int(nvidia_driver_branch[:3]) < needed:
        raise ValueError(
            f"nvidia_driver_branch {nvidia_driver_branch} is older than driver "
            f"{minimum}, the minimum of the vLLM {vllm_version} stack (CUDA "
            f"{stack.cuda}): set nvidia_driver_branch to {needed}-server or newer"
        )
