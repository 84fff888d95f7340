"""The example fleet's stack, vLLM 0.17.0 for CUDA, installed from its lock and probed on
a machine without a GPU (tests/fixtures/vllm-cuda/README.md says how): what the probe
checked, what it could not, and the unit the fleet gets against the server it found."""

from __future__ import annotations

import json
import re
from pathlib import Path

from files import vllm_probe
from files.vllm_probe import server_flags
from pyinfra_vllm.core.settings import validate
from pyinfra_vllm.core.stack_locks import read_lock
from pyinfra_vllm.core.stacks import STACKS
from pyinfra_vllm.plans import vllm_service as vllm_service_plan

HERE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cuda"
ROW = STACKS["0.17.0"]
MARKER = json.loads((HERE / "probe.json").read_text())
RUNTIME = MARKER["runtime"]
# group_data/a100_nvlink.py, the example fleet's settings.
FLEET = {"vllm_version": "0.17.0", "nvidia_driver_branch": "570-server",
         "model_id": "Qwen/Qwen3.6-27B", "tensor_parallel_size": 2, "dtype": "bfloat16",
         "max_model_len": 131072, "gateway_open": True}


def test_it_was_built_from_this_row_s_lock():
    assert MARKER["stack"] == "0.17.0" and MARKER["manager"] == "uv"
    assert MARKER["requirements_sha256"] == read_lock(ROW).sha256


def test_what_the_probe_checked():
    assert (RUNTIME["vllm"], RUNTIME["vllm_dist"], RUNTIME["device"]) == ("0.17.0", "vllm",
                                                                         "cuda")
    assert (RUNTIME["torch"], RUNTIME["torch_cuda"]) == (ROW.torch, ROW.cuda)
    # The row's architectures are the ones torch's library says it carries.
    assert tuple(RUNTIME["cuda_archs"]) == ROW.cuda_archs
    assert "Qwen3_5ForConditionalGeneration" in RUNTIME["architectures"]
    assert set(ROW.architectures) <= set(RUNTIME["architectures"])
    assert len(RUNTIME["architectures"]) == 305


def test_what_it_could_not_check_without_a_gpu_is_named():
    assert RUNTIME["gpus"] is None
    assert RUNTIME["unchecked"] == [vllm_probe.UNCHECKED_KERNELS, vllm_probe.UNCHECKED_GPUS,
                                    vllm_probe.UNCHECKED_HELP]


def test_the_recorded_help_is_the_probe_s_flags():
    help_text = (HERE / "help.txt").read_text()
    assert server_flags(help_text) == RUNTIME["flags"]
    assert len(RUNTIME["flags"]) == 285
    # What the unit relies on for this row: its Unix socket, the negative spellings.
    assert {"--uds", *ROW.negative_flags} <= set(RUNTIME["flags"])


def test_every_flag_of_the_fleet_s_unit_is_one_the_server_accepts():
    settings = validate(FLEET)
    unit = vllm_service_plan.render_unit(settings, python="/opt/vllm/current/bin/python",
                                         model_path="/srv/models/Qwen/Qwen3.6-27B",
                                         accepted=set(RUNTIME["flags"]))
    start = unit.split("\nExecStart=", 1)[1].split("\nExecStartPost=", 1)[0]
    used = set(re.findall(r'"(--[a-z0-9][a-z0-9-]*)"', start))
    assert {"--tensor-parallel-size", "--max-model-len", "--dtype", "--uds"} <= used
    assert used <= set(RUNTIME["flags"]), used - set(RUNTIME["flags"])
