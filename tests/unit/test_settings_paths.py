"""The directories the deploy takes as its own (model_dir, python_env_root,
textfile_collector_dir): the suite's own directories the rules keep them out of are the
ones the code uses, and every system, shared and suite directory is refused for each.

tests/unit/test_settings_rejected.py holds one case of each message; this is the sweep.
"""

from __future__ import annotations

import posixpath

import pytest

from pyinfra_vllm.core import settings_checks_paths
from pyinfra_vllm.core.settings import SettingsError, validate
from pyinfra_vllm.operations.util import uploads
from pyinfra_vllm.plans import driver as driver_plan
from pyinfra_vllm.plans import gateway as gateway_plan
from pyinfra_vllm.plans import model as model_plan
from pyinfra_vllm.plans import units as units_plan
from pyinfra_vllm.plans import vllm_service as vllm_plan

OPEN = {"gateway_open": True}
# The directories the suite creates under fixed names, as the code names them.
SUITE_DIRS = {
    model_plan.TOOL_DIR,
    vllm_plan.STATE_DIR,
    vllm_plan.HELPER_DIR,
    posixpath.dirname(vllm_plan.ENV_PATH),
    uploads.SECRET_DIR,
    uploads.UPLOAD_ROOT,
    gateway_plan.DRAIN_DIR,
}
# And those it creates below them.
SUITE_SUBDIRS = (driver_plan.CUDA_KEY_DIR, gateway_plan.DISABLED_DIR,
                 units_plan.DISABLED_DROP_IN_DIR)
REFUSED = sorted({*settings_checks_paths.SYSTEM_TREES, *settings_checks_paths.SUITE_DIRS,
                  *settings_checks_paths.SHARED_DIRS} - set(settings_checks_paths.VIRTUAL_FS_DIRS))


def test_the_suite_directories_the_rules_know_are_the_code_s():
    assert set(settings_checks_paths.SUITE_DIRS) == SUITE_DIRS
    for path in SUITE_SUBDIRS:
        assert any(settings_checks_paths.within(path, own) for own in SUITE_DIRS), path


@pytest.mark.parametrize("name", settings_checks_paths.OWN_DIR_SETTINGS)
@pytest.mark.parametrize("path", REFUSED)
def test_every_system_shared_and_suite_directory_is_refused(name, path):
    with pytest.raises(SettingsError, match=rf"  {name} = '{path}': is "):
        validate({**OPEN, name: path})


@pytest.mark.parametrize("name", settings_checks_paths.OWN_DIR_SETTINGS)
@pytest.mark.parametrize("tree", sorted({*settings_checks_paths.SYSTEM_TREES,
                                         *settings_checks_paths.SUITE_DIRS}))
def test_nothing_below_a_system_or_suite_directory_is_taken(name, tree):
    with pytest.raises(SettingsError, match=rf"  {name} = '{tree}/x/y': is inside {tree}, "):
        validate({**OPEN, name: f"{tree}/x/y"})


@pytest.mark.parametrize("shared", sorted(settings_checks_paths.SHARED_DIRS
                                          - {"/", "/var", "/var/lib"}))
def test_a_directory_of_its_own_below_a_shared_one_is_taken(shared):
    settings = validate({**OPEN, "python_env_root": f"{shared}/vllm-envs",
                         "model_dir": f"{shared}/vllm-models"})
    assert settings.python_env_root == f"{shared}/vllm-envs"


def test_the_defaults_are_apart():
    assert settings_checks_paths.dirs_apart(
        {name: getattr(validate(OPEN), name) for name in settings_checks_paths.OWN_DIR_SETTINGS}
    ) == []


@pytest.mark.parametrize(
    ("dirs", "problems"),
    [
        ({"model_dir": "/a", "python_env_root": "/a"}, ["python_env_root = '/a' is model_dir too"]),
        ({"model_dir": "/a/b", "python_env_root": "/a"},
         ["python_env_root = '/a' holds model_dir = '/a/b'"]),
        ({"model_dir": "/a", "python_env_root": "/a/b"},
         ["python_env_root = '/a/b' is inside model_dir = '/a'"]),
        # One problem for each key, at most: its first pair.
        ({"model_dir": "/a", "python_env_root": "/a/b", "textfile_collector_dir": "/a/b/c"},
         ["python_env_root = '/a/b' is inside model_dir = '/a'",
          "textfile_collector_dir = '/a/b/c' is inside model_dir = '/a'"]),
        # A common prefix is not a parent.
        ({"model_dir": "/a", "python_env_root": "/ab", "textfile_collector_dir": "/a-b"}, []),
    ],
)
def test_dirs_apart(dirs, problems):
    found = settings_checks_paths.dirs_apart(dirs)
    assert [text.split(":")[0] for _key, text in found] == problems
    assert [key for key, _text in found] == [text.split(" ")[0] for text in problems]
