"""Every stack row has its whole lock, made from exactly the row's inputs and holding
exactly its pins; installed with hashes required and no resolve."""

from __future__ import annotations

import dataclasses

import pytest

from pyinfra_vllm.core.stack_locks import (
    DriverFloor,
    StackLockError,
    cuda_runtime,
    disagreements,
    driver_floor,
    inputs_sha256,
    lock_path,
    parse_versions,
    read_lock,
)
from pyinfra_vllm.core.stacks import CPU_STACKS, STACKS

ROWS = [pytest.param(row, id=f"{device}-{version}")
        for device, table in (("cuda", STACKS), ("cpu", CPU_STACKS))
        for version, row in table.items()]


@pytest.mark.parametrize("row", ROWS)
def test_every_row_has_a_lock_made_from_its_inputs_holding_its_pins(row):
    lock = read_lock(row)  # raises when the header's inputs-sha256 is not the row's
    assert disagreements(row, lock) == []
    assert f"# inputs-sha256: {inputs_sha256(row)}\n" in lock.text


@pytest.mark.parametrize("row", ROWS)
def test_every_package_of_a_lock_is_pinned_exactly_with_hashes(row):
    lock = read_lock(row)
    entries = [block for block in lock.text.split("\n") if block and block[0].isalnum()]
    assert len(entries) > 100  # the transitive closure, not only the row's pins
    for entry in entries:
        assert "==" in entry and entry.rstrip().endswith("\\"), entry
    # Each requirement continues with at least one --hash line.
    blocks = lock.text.split("\n")
    for i, line in enumerate(blocks):
        if line and line[0].isalnum():
            assert blocks[i + 1].strip().startswith("--hash=sha256:"), line


def test_the_063_lock_closes_what_an_unpinned_install_gets_wrong():
    lock = read_lock(STACKS["0.6.3"])
    # transformers 5.x cannot be imported by vLLM 0.6.3: the row pins 4.45.2 and the lock
    # holds exactly that, for every Python.
    assert lock.versions["transformers"] == {"4.45.2"}
    # Transitive packages are pinned too (outlines, via vLLM; pyairports, via outlines,
    # the one source archive).
    assert len(lock.versions["outlines"]) == 1 and lock.versions["pyairports"] == {"0.0.1"}


def test_a_row_changed_without_its_lock_refreshed_is_refused():
    row = dataclasses.replace(STACKS["0.6.3"],
                              pins={**STACKS["0.6.3"].pins, "transformers": "4.45.1"})
    with pytest.raises(StackLockError) as raised:
        read_lock(row)
    message = str(raised.value)
    assert str(lock_path(row)) in message and "other inputs" in message
    assert "python -m tools.stack_lock 0.6.3 --device cuda" in message


def test_a_missing_lock_names_the_command_that_writes_it():
    row = dataclasses.replace(STACKS["0.6.3"], vllm="0.0.1")
    with pytest.raises(StackLockError, match=r"vllm-0\.0\.1\.txt.*tools\.stack_lock 0\.0\.1"):
        read_lock(row)


def test_disagreements_name_the_package_and_both_versions():
    row = STACKS["0.6.3"]
    lock = read_lock(row)
    other = type(lock)(lock.path, lock.text, lock.sha256,
                       {**lock.versions, "numpy": frozenset({"1.26.3", "1.26.4"})})
    assert disagreements(row, other) == ["numpy: row 1.26.4, lock ['1.26.3', '1.26.4']"]


def test_parse_versions_reads_markers_and_normalizes_names():
    text = ("Typing_Extensions==4.1 ; python_version < '3.10' \\\n"
            "    --hash=sha256:aa\n"
            "typing-extensions==4.2 ; python_version >= '3.10' \\\n"
            "fastapi[standard]==0.1 \\\n")
    assert parse_versions(text) == {"typing-extensions": {"4.1", "4.2"}, "fastapi": {"0.1"}}


# --- the driver a CUDA row's lock needs ----------------------------------------------------
@pytest.mark.parametrize("version", sorted(STACKS))
def test_each_cuda_row_s_min_driver_is_the_one_its_lock_s_runtime_needs(version):
    row = STACKS[version]
    floor = driver_floor(row)
    assert floor is not None and floor.driver == row.min_driver
    assert floor.runtime.startswith(row.cuda + ".")  # 12.8.90 in the CUDA 12.8 row


def test_the_runtimes_the_rows_lock():
    assert driver_floor(STACKS["0.6.3"]) == DriverFloor("12.1.105", "CUDA 12.1 Update 1",
                                                        "530.30.02")
    assert driver_floor(STACKS["0.17.0"]) == DriverFloor("12.8.90", "CUDA 12.8 Update 1",
                                                         "570.124.06")
    assert driver_floor(STACKS["0.33.0"]) == DriverFloor("13.0.96", "CUDA 13.0 Update 2",
                                                         "580.95.05")
    assert driver_floor(CPU_STACKS["0.17.0"]) is None  # a CPU row asks no driver


def test_a_cuda_13_lock_names_its_runtime_without_a_suffix_for_linux_x86_64():
    lock = read_lock(STACKS["0.33.0"])
    # The universal lock pins 13.5.37 for s390x; the hosts are x86_64.
    assert lock.versions["nvidia-cuda-runtime"] == frozenset({"13.0.96", "13.5.37"})
    assert cuda_runtime(lock) == "13.0.96"


def test_a_runtime_without_a_driver_line_is_refused_naming_it(monkeypatch):
    from pyinfra_vllm.core import stack_locks

    monkeypatch.setattr(stack_locks, "CUDA_RUNTIME_DRIVERS", {"12.1.105": ("x", "1")})
    with pytest.raises(StackLockError) as raised:
        driver_floor(STACKS["0.17.0"])
    assert ("holds CUDA runtime 12.8.90 (nvidia-cuda-runtime-cu12 or nvidia-cuda-runtime), "
            "which pyinfra_vllm/core/stacks.py CUDA_RUNTIME_DRIVERS has no driver for") in str(
        raised.value)
