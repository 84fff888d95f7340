"""files/amx_permission.py as the CPU engine's sitecustomize: every new interpreter started
with its directory on PYTHONPATH holds the AMX tile permission, and one without does not
(the permission does not survive exec). Where the machine's CPU or kernel has no AMX, the
module asks for nothing that is granted and the interpreter starts all the same."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyinfra_vllm.core.settings import validate
from pyinfra_vllm.plans import vllm_service as vllm_service_plan
from sandbox.hosts import SERVING_DATA

MODULE = Path(__file__).resolve().parents[2] / "files" / "amx_permission.py"
ARCH_GET_XCOMP_SUPP, ARCH_GET_XCOMP_PERM = 0x1021, 0x1022
XTILEDATA = 1 << 18
# The new interpreter's permitted features (arch_prctl ARCH_GET_XCOMP_PERM), in hex.
READ_PERM = ("import ctypes; libc = ctypes.CDLL(None); mask = ctypes.c_ulong(); "
             f"libc.syscall(158, {ARCH_GET_XCOMP_PERM}, ctypes.byref(mask)); print(mask.value)")


def amx_supported() -> bool:
    if os.uname().machine != "x86_64":
        return False
    mask = ctypes.c_ulong()
    libc = ctypes.CDLL(None)
    return libc.syscall(158, ARCH_GET_XCOMP_SUPP, ctypes.byref(mask)) == 0 and bool(
        mask.value & XTILEDATA)


def permitted(pythonpath: str | None) -> int:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", READ_PERM], env=env, capture_output=True,
                         text=True, check=True).stdout
    return int(out)


@pytest.mark.skipif(not amx_supported(), reason="this machine's CPU or kernel has no AMX tiles")
def test_every_interpreter_with_the_site_directory_holds_the_amx_permission(tmp_path):
    shutil.copy(MODULE, tmp_path / "sitecustomize.py")
    assert ctypes.CDLL(None).syscall(158, 0x1023, 18) == 0  # this process asks
    assert permitted(None) & XTILEDATA == 0  # a new interpreter does not inherit it
    assert permitted(str(tmp_path)) & XTILEDATA == XTILEDATA


def test_the_module_never_fails_an_interpreter(tmp_path):
    shutil.copy(MODULE, tmp_path / "sitecustomize.py")
    assert permitted(str(tmp_path)) >= 0


def test_the_cpu_unit_puts_the_module_on_the_engine_s_path_and_a_gpu_unit_does_not():
    cpu = validate({**SERVING_DATA, "model_id": "sandbox/tiny-qwen2", "gateway_open": True})
    cpu_pairs = dict(vllm_service_plan.environment_pairs(cpu, "/opt/vllm/envs/e/bin/python", [], "0|1"))
    assert cpu_pairs["PYTHONPATH"] == "/usr/local/lib/pyinfra-vllm/engine-site"
    assert vllm_service_plan.AMX_PERMISSION_PATH == cpu_pairs["PYTHONPATH"] + "/sitecustomize.py"
    gpu = validate({"gateway_open": True})
    assert "PYTHONPATH" not in dict(vllm_service_plan.environment_pairs(gpu, "/opt/vllm/envs/e/bin/python", [0, 1]))
