"""Stack rows installed from their locks and probed on a machine without a GPU
(tests/fixtures/vllm-cuda-0.17.0/README.md says how; the other rows' fixtures were made
the same way): what the probe found against what the row says, what it could not check,
and the unit each row's hosts get against the server it found."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from facts.versions import version_tuple
from files import vllm_probe
from files.vllm_probe import server_flags
from pyinfra_vllm.core.settings import validate
from pyinfra_vllm.core.stack_locks import read_lock
from pyinfra_vllm.core.stacks import CPU_STACKS, REMOVED_FROM, STACKS, StackRow
from pyinfra_vllm.plans import vllm_service as vllm_service_plan
from pyinfra_vllm.plans.engine_access import endpoint
from pyinfra_vllm.plans.engine_plan import engine_plan, render_unit
from sandbox.hosts import SERVING_DATA

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# (fixture folder, row, its registry's size, its server's option count)
RECORDED = {
    "cuda-0.17.0": ("vllm-cuda-0.17.0", STACKS["0.17.0"], 305, 285),
    "cuda-0.22.0": ("vllm-cuda-0.22.0", STACKS["0.22.0"], 361, 330),
    "cuda-0.33.0": ("vllm-cuda-0.33.0", STACKS["0.33.0"], 415, 409),
    "cpu-0.32.0": ("vllm-cpu-0.32.0", CPU_STACKS["0.32.0"], 391, 404),
}
# group_data/a100_nvlink.py, the example fleet's settings, on a CUDA row.
FLEET = {"model_id": "Qwen/Qwen3.6-27B", "tensor_parallel_size": 2, "dtype": "bfloat16",
         "max_model_len": 131072, "gateway_open": True}


def recorded(key: str) -> tuple[Path, StackRow, dict]:
    folder, row, _, _ = RECORDED[key]
    return FIXTURES / folder, row, json.loads((FIXTURES / folder / "probe.json").read_text())


def settings_for(row: StackRow):
    if row.device == "cpu":
        return validate({**SERVING_DATA, "vllm_version": row.vllm, "gateway_open": True})
    branch = "580-server" if version_tuple(row.min_driver or "0") >= (580,) else "570-server"
    return validate({**FLEET, "vllm_version": row.vllm, "nvidia_driver_branch": branch})


@pytest.mark.parametrize("key", sorted(RECORDED))
def test_it_was_built_from_this_row_s_lock(key):
    _, row, marker = recorded(key)
    assert (marker["stack"], marker["manager"]) == (row.vllm, "uv")
    assert marker["requirements_sha256"] == read_lock(row).sha256


@pytest.mark.parametrize("key", sorted(RECORDED))
def test_what_the_probe_found_is_what_the_row_says(key):
    _, row, marker = recorded(key)
    runtime, archs = marker["runtime"], RECORDED[key][2]
    assert (runtime["vllm"], runtime["vllm_dist"], runtime["device"]) == (row.vllm, row.dist,
                                                                         row.device)
    assert runtime["torch"] == row.torch
    assert set(row.architectures) <= set(runtime["architectures"])
    assert len(runtime["architectures"]) == archs
    assert "Qwen3_5ForConditionalGeneration" in runtime["architectures"]
    gone = {arch for arch, since in REMOVED_FROM.items()
            if version_tuple(row.vllm) >= version_tuple(since)}
    assert not gone & set(runtime["architectures"])
    if row.device == "cuda":
        assert runtime["torch_cuda"] == row.cuda
        assert tuple(runtime["cuda_archs"]) == row.cuda_archs
        # Without a GPU: what could not be checked is named.
        assert runtime["gpus"] is None
        assert runtime["unchecked"] == [vllm_probe.UNCHECKED_KERNELS,
                                        vllm_probe.UNCHECKED_GPUS, vllm_probe.UNCHECKED_HELP]
    else:
        assert runtime["cpu_isa"] == "avx512"


@pytest.mark.parametrize("key", sorted(RECORDED))
def test_the_recorded_help_is_the_probe_s_flags_and_holds_the_row_s_spellings(key):
    folder, row, marker = recorded(key)
    flags = marker["runtime"]["flags"]
    assert server_flags((folder / "help.txt").read_text()) == flags
    assert len(flags) == RECORDED[key][3]
    assert set(row.negative_flags) <= set(flags)
    assert ("--uds" in flags) == row.unix_socket
    assert ("--shutdown-timeout" in flags) == row.shutdown_timeout
    assert row.log_requests_off_flag is None and "--enable-log-requests" in flags


@pytest.mark.parametrize("key", sorted(RECORDED))
def test_every_flag_of_the_row_s_unit_is_one_its_server_accepts(key):
    _, row, marker = recorded(key)
    flags = set(marker["runtime"]["flags"])
    settings = settings_for(row)
    unit = render_unit(engine_plan(settings, python="/opt/vllm/current/bin/python",
                                   model_path="/srv/models/m", accepted=flags,
                                   threads_bind="0|1" if row.device == "cpu" else None,
                                   place=endpoint(settings)))
    start = unit.split("\nExecStart=", 1)[1].split("\nExecStartPost=", 1)[0]
    used = set(re.findall(r'"(--[a-z0-9][a-z0-9-]*)"', start))
    assert {"--tensor-parallel-size", "--max-model-len", "--uds"} <= used
    assert used <= flags, used - flags


@pytest.mark.parametrize("key", sorted(RECORDED))
def test_the_unit_of_a_first_run_is_the_one_the_next_run_writes(key):
    """The first run renders the unit before the environment exists (the row's spellings);
    the next one from the installed server's flags: equal, or the second run of a fresh
    host would change the unit and restart the engine."""
    _, row, marker = recorded(key)
    settings = settings_for(row)
    place = endpoint(settings)
    before = vllm_service_plan.server_flags(settings, "/srv/models/m", place=place)
    after = vllm_service_plan.server_flags(settings, "/srv/models/m",
                                           set(marker["runtime"]["flags"]), place=place)
    assert before == after
    assert "--disable-log-requests" not in after


def test_vllm_0_33_says_off_with_disable_where_0_17_said_no():
    help_all = (FIXTURES / "vllm-cuda-0.33.0" / "help-all.txt").read_text()
    assert "--enable-prefix-caching, --disable-prefix-caching" in help_all
    assert "--enforce-eager, --no-enforce-eager" in help_all
    # Request logging is off unless asked, as in 0.17.0.
    logging = help_all.split("--enable-log-requests, --disable-log-requests", 1)[1]
    assert "(default: False)" in logging.split("\n  --", 1)[0]
    settings = settings_for(STACKS["0.33.0"])
    flags = vllm_service_plan.server_flags(settings, "/srv/models/m", place=endpoint(settings))
    assert "--disable-prefix-caching" in flags and "--no-enable-prefix-caching" not in flags
