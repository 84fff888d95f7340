"""The python_env stage's disk check: what building a stack's environment needs free on
python_env_root's file system (pyinfra_vllm/plans/python_env.py build_space), the
refusal where it is short or unknown, and the read it costs only where something is built
(planned as tests/unit/test_stage_reads.py plans a run)."""

from __future__ import annotations

from typing import Any

import pytest
from pyinfra.facts.server import Arch

from facts.storage import FilesystemFree
from facts.units import SystemdBooted
from pyinfra_vllm.core.stacks import CPU_STACKS, STACKS
from pyinfra_vllm.plans.python_env import (
    BUILD_MARGIN_MIB,
    COMPILE_CACHE_MIB,
    build_space,
    space_problem,
)
from tests.unit.converged_host import ConvergedHost
from tests.unit.test_stage_reads import operator_files, plan, scenario  # noqa: F401

MIB = 2**20


def test_every_stack_row_carries_its_environment_s_and_wheels_size():
    for row in (*STACKS.values(), *CPU_STACKS.values()):
        # A few GB each (torch and its CUDA libraries; the CPU builds too, whose torch
        # is PyPI's CUDA one: stacks.py says why); installed, the wheels about double.
        assert 2000 < row.wheels_mib < row.env_mib < 16000, row.vllm
        assert 1.5 < row.env_mib / row.wheels_mib < 2.6, row.vllm


def test_the_measured_rows():
    assert STACKS["0.22.0"].env_mib == 8758  # du -sm of the proven environment
    assert {version: (row.env_mib, row.wheels_mib) for version, row in STACKS.items()} == {
        "0.6.3": (6499, 3254), "0.17.0": (9834, 5013), "0.22.0": (8758, 3923),
        "0.33.0": (8927, 4069)}
    assert {version: (row.env_mib, row.wheels_mib)
            for version, row in CPU_STACKS.items()} == {
        "0.17.0": (7955, 4274), "0.32.0": (5930, 3020)}


def test_the_compile_cache_and_margin():
    # Two compile keys as measured on the H100 (568 MiB of torch.compile's cache + 74 of
    # Triton's); 2 GiB margin.
    assert COMPILE_CACHE_MIB == 642
    assert BUILD_MARGIN_MIB == 2048


@pytest.mark.parametrize(("row", "manager", "link_mode", "compiles", "parts", "total"), [
    # The example fleet: conda (pip's cache keeps the wheels), CUDA graphs and compile.
    (STACKS["0.33.0"], "conda", "hardlink", True, (8927, 4069, 642), 15686),
    # uv hardlink: the environment's files are the cache's, counted once.
    (STACKS["0.22.0"], "uv", "hardlink", True, (8758, 0, 642), 11448),
    # uv copy: the cache's unpacked wheels and the environment's copy of them.
    (STACKS["0.22.0"], "uv", "copy", True, (8758, 8758, 642), 20206),
    # enforce_eager true on CUDA: nothing compiled, no compile cache.
    (STACKS["0.17.0"], "venv", "hardlink", False, (9834, 5013, 0), 16895),
    (STACKS["0.6.3"], "uv", "hardlink", True, (6499, 0, 642), 9189),
    # The CPU rows: always eager (the settings refuse cpu without it).
    (CPU_STACKS["0.32.0"], "uv", "hardlink", False, (5930, 0, 0), 7978),
    (CPU_STACKS["0.17.0"], "conda", "copy", False, (7955, 4274, 0), 14277),
])
def test_what_a_build_needs(row, manager, link_mode, compiles, parts, total):
    space = build_space(row, manager, link_mode, compiles)
    assert (space.environment, space.cache, space.compile_cache) == parts
    assert space.margin == BUILD_MARGIN_MIB
    assert space.total == total == sum(parts) + BUILD_MARGIN_MIB


def test_a_file_system_without_room_is_refused_with_what_it_needs():
    space = build_space(STACKS["0.33.0"], "conda", "hardlink", compiles=True)
    found = {"path": "/opt", "free": 12_000 * MIB + MIB - 1}
    assert space_problem(found, "/opt/vllm", space) == (
        "python_env: 12000 MiB free on the file system holding /opt/vllm (read at /opt); "
        "building vLLM 0.33.0's environment needs 15686 MiB there (8927 MiB the "
        "environment + 4069 MiB pip's cache of its wheels + 642 MiB the engine's compile "
        "cache + 2048 MiB margin): free 3686 MiB or more there, or set python_env_root to "
        "a file system with room")


def test_uv_copy_and_a_cpu_build_name_their_parts():
    copy = build_space(STACKS["0.22.0"], "uv", "copy", compiles=True)
    assert copy.words() == (
        "8758 MiB the environment + 8758 MiB uv's cache of its unpacked wheels "
        "(python_env_link_mode copy) + 642 MiB the engine's compile cache + 2048 MiB margin")
    cpu = build_space(CPU_STACKS["0.32.0"], "uv", "hardlink", compiles=False)
    assert cpu.words() == "5930 MiB the environment + 2048 MiB margin"
    assert cpu.stack == "0.32.0-cpu"


def test_room_enough_is_no_problem_to_the_mib():
    space = build_space(STACKS["0.22.0"], "uv", "hardlink", compiles=True)
    assert space_problem({"path": "/opt/vllm/envs", "free": space.total * MIB}, "/opt/vllm",
                         space) is None
    short = space_problem({"path": "/opt/vllm/envs", "free": space.total * MIB - 1},
                          "/opt/vllm", space)
    assert short is not None and short.startswith("python_env: 11447 MiB free")


def test_free_space_unknown_is_refused_never_taken_for_room():
    space = build_space(CPU_STACKS["0.32.0"], "uv", "hardlink", compiles=False)
    assert space_problem(None, "/srv/vllm", space) == (
        "python_env: the free space of the file system holding /srv/vllm is unknown (df "
        "gave no number); building vLLM 0.32.0-cpu's environment needs 7978 MiB there "
        "(5930 MiB the environment + 2048 MiB margin): fix df on the host, then run again")


# --- the stage, planned ------------------------------------------------------------------

def new_stack(monkeypatch, free: int | None) -> list[dict[str, Any]]:
    """The converged host of tests/unit/test_stage_reads.py, but without an environment
    of the settings' stack (a new stack: python_env builds one), its file system holding
    python_env_root ``free`` bytes free (None: df gave nothing). The FilesystemFree reads'
    arguments, as made."""
    asked: list[dict[str, Any]] = []
    value = ConvergedHost.value

    def answer(self: ConvergedHost, fact: type, kwargs: dict[str, Any]) -> Any:
        if fact is FilesystemFree:
            asked.append(kwargs)
            return None if free is None else {"path": "/opt", "free": free}
        if fact is Arch:
            return "x86_64"
        if fact is SystemdBooted:  # the build runs as a transient unit
            return True
        if fact not in self.answers:  # the build's own reads (its job unit): none yet
            return None
        return value(self, fact, kwargs)

    monkeypatch.setattr(ConvergedHost, "value", answer)
    monkeypatch.setattr(ConvergedHost, "environments", lambda self, root: {
        "current": None, "envs": {}, "uv": None, "conda": False})
    return asked


def test_a_new_stack_on_a_full_file_system_is_refused_before_any_build(
        monkeypatch, operator_files):  # noqa: F811
    asked = new_stack(monkeypatch, free=4_000 * MIB)
    planned = plan(monkeypatch, scenario("fleet", operator_files), ["deploys/python_env.py"])
    assert asked == [{"path": "/opt/vllm/envs"}]
    assert planned.refused == [
        "python_env: 4000 MiB free on the file system holding /opt/vllm (read at /opt); "
        "building vLLM 0.33.0's environment needs 15686 MiB there (8927 MiB the "
        "environment + 4069 MiB pip's cache of its wheels + 642 MiB the engine's compile "
        "cache + 2048 MiB margin): free 11686 MiB or more there, or set python_env_root to "
        "a file system with room"]
    # Nothing installed: no Miniforge, no environment; only the refusal.
    assert [name for name in planned.changes if "refused" not in name] == []


def test_a_new_stack_with_free_space_unknown_is_refused(monkeypatch, operator_files):  # noqa: F811
    new_stack(monkeypatch, free=None)
    planned = plan(monkeypatch, scenario("cpu_tls", operator_files), ["deploys/python_env.py"])
    assert len(planned.refused) == 1
    assert planned.refused[0].startswith(
        "python_env: the free space of the file system holding /opt/vllm is unknown")
    # vLLM's CPU build under conda: pip's cache, and no compile cache (always eager).
    assert ("10998 MiB there (5930 MiB the environment + 3020 MiB pip's cache of its "
            "wheels + 2048 MiB margin)") in planned.refused[0]


def test_a_new_stack_with_room_is_built(monkeypatch, operator_files):  # noqa: F811
    asked = new_stack(monkeypatch, free=16_000 * MIB)
    planned = plan(monkeypatch, scenario("fleet", operator_files), ["deploys/python_env.py"])
    assert asked == [{"path": "/opt/vllm/envs"}]
    assert planned.refused == []
    assert any("Miniforge" in name for name in planned.changes)
    assert any("built and proven" in name for name in planned.changes)


def test_a_proven_environment_costs_no_read_of_free_space(monkeypatch, operator_files):  # noqa: F811
    asked: list[dict[str, Any]] = []
    value = ConvergedHost.value

    def answer(self: ConvergedHost, fact: type, kwargs: dict[str, Any]) -> Any:
        if fact is FilesystemFree:
            asked.append(kwargs)
        return value(self, fact, kwargs)

    monkeypatch.setattr(ConvergedHost, "value", answer)
    planned = plan(monkeypatch, scenario("fleet", operator_files), ["deploys/full.py"])
    assert planned.refused == [] and asked == []
    assert FilesystemFree not in {fact for _stage, fact, _named in planned.alone}
