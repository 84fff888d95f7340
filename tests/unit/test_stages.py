"""The one list of the stages: pyinfra_vllm/core/settings.py STAGES names them, each
@stage function takes its stage's name from its own (pyinfra_vllm/run/stage.py) and the
whole run's RUNBOOK (pyinfra_vllm/stages/full.py) runs them in STAGES' order; a name or an
order that disagrees is refused as its module is imported."""

from __future__ import annotations

from functools import partial

import pytest

from pyinfra_vllm.core.settings import STAGES
from pyinfra_vllm.run import stage as stage_module
from pyinfra_vllm.run.context import HostContext
from pyinfra_vllm.run.stage import STAGE_OF, runbook_order, stage
from pyinfra_vllm.stages.bench import bench
from pyinfra_vllm.stages.full import RUNBOOK
from pyinfra_vllm.stages.python_env import python_env, python_env_built

ORDER = ", ".join(STAGES)


@pytest.fixture(autouse=True)
def own_registry(monkeypatch):
    # The stages a test makes stay out of the registry the product's stages are in.
    monkeypatch.setattr(stage_module, "STAGE_OF", dict(stage_module.STAGE_OF))
    monkeypatch.setattr(stage_module, "CONTINUING", set(stage_module.CONTINUING))


def test_the_whole_run_runs_the_stages_in_the_order_settings_name_them():
    started = [STAGE_OF[getattr(step, "func", step)] for step in RUNBOOK
               if getattr(step, "func", step) is not python_env_built]
    assert started == list(STAGES)
    # python_env's build starts before the model and ends after it.
    assert RUNBOOK.index(python_env_built) == STAGES.index("model") + 1
    assert STAGE_OF[python_env_built] == "python_env"
    assert STAGE_OF[bench] == "bench" and "bench" not in STAGES


def test_every_stage_is_named_after_its_function():
    assert {STAGE_OF[step]: step.__name__ for step in (python_env, bench)} == {
        "python_env": "python_env", "bench": "bench"}
    for step in RUNBOOK:
        function = getattr(step, "func", step)
        if function is not python_env_built:
            assert STAGE_OF[function] == function.__name__


def test_a_stage_takes_its_name_from_its_function():
    def sysctl(ctx: HostContext) -> None:
        pass

    made = stage()(sysctl)
    assert stage_module.STAGE_OF[made] == "sysctl"
    assert made.__name__ == "sysctl"


def test_a_function_named_after_no_stage_is_refused():
    def sysctls(ctx: HostContext) -> None:
        pass

    with pytest.raises(ValueError) as refused:
        stage()(sysctls)
    assert str(refused.value) == (
        f"@stage {__name__}.sysctls: 'sysctls' is no stage of "
        f"pyinfra_vllm/core/settings.py STAGES ({ORDER}): name the function after its "
        "stage, or add the stage to STAGES at its place in the runbook (runbook=False: a "
        "stage run on its own)")


def test_a_stage_of_the_runbook_cannot_be_run_on_its_own():
    def model(ctx: HostContext) -> None:
        pass

    with pytest.raises(ValueError, match="'model' is one of STAGES, run by the whole "
                                         "run: remove runbook=False"):
        stage(runbook=False)(model)


def test_a_stage_continues_only_a_stage_function():
    def model_checked(ctx: HostContext) -> None:
        pass

    with pytest.raises(ValueError, match=r"model_checked: continues=.*, which is no "
                                         r"@stage function"):
        stage(continues=print)(model_checked)


@pytest.mark.parametrize(("change", "problem"), [
    (lambda steps: [steps[1], steps[0], *steps[2:]],
     "runbook: the stages run in the order driver, preflight, mig,"),
    (lambda steps: [step for step in steps if step is not RUNBOOK[4]],
     "runbook: the stages run in the order preflight, driver, mig, persistence, "
     "model_volume,"),
    (lambda steps: [*steps, RUNBOOK[0]], ", sentinel, preflight; pyinfra_vllm/core/"),
    (lambda steps: [*steps, bench], ", sentinel, bench; pyinfra_vllm/core/"),
    (lambda steps: [python_env_built, *[s for s in steps if s is not python_env_built]],
     "runbook: python_env_built ends the stage python_env, which no step before it starts"),
    (lambda steps: [*steps, print], "runbook: <built-in function print> is no @stage function"),
])
def test_a_runbook_out_of_the_order_of_stages_is_refused(change, problem):
    runbook_order(RUNBOOK)
    with pytest.raises(ValueError) as refused:
        runbook_order(change(list(RUNBOOK)))
    assert problem in str(refused.value)
    if "the order" in problem:
        assert str(refused.value).endswith(f"STAGES is {ORDER}: one order, STAGES'")


def test_the_build_started_without_waiting_is_python_env():
    (started,) = [step for step in RUNBOOK if isinstance(step, partial)]
    assert started.func is python_env and started.keywords == {"wait": False}


def test_the_access_tables_stages_are_stages():
    # pyinfra_vllm/plans/access.py keeps its rows by stage; the audit reads a stage's rows
    # unless skip_stages names it, so each is a name skip_stages takes.
    from pyinfra_vllm.plans import access

    assert access.STAGES and set(access.STAGES) <= set(STAGES)


def test_the_runbook_is_read_from_the_calls_of_full_each_on_its_own_line(tmp_path):
    # pyinfra orders a run's operations by the lines they were called from: a loop over a
    # list of stages calls them all from one line, and hosts that skip different stages
    # then make pyinfra's order a cycle. runbook_of reads only calls written one by one.
    from pyinfra_vllm.run.stage import runbook_of
    from pyinfra_vllm.stages import full

    names = vars(full)
    explicit = tmp_path / "explicit.py"
    explicit.write_text("def full():\n    context(host)\n    preflight()\n"
                        "    python_env(wait=False)\n    python_env_built()\n")
    (first, started, ended) = runbook_of(str(explicit), "full", names)
    assert first is full.preflight and ended is python_env_built
    assert started.func is python_env and started.keywords == {"wait": False}

    looped = tmp_path / "looped.py"
    looped.write_text("def full():\n    for step in RUNBOOK:\n        step()\n")
    assert runbook_of(str(looped), "full", names) == ()
    with pytest.raises(ValueError, match=r"runbook: the stages run in the order "
                                         r"\(none called\); pyinfra_vllm/core/settings.py"):
        runbook_order(runbook_of(str(looped), "full", names))
