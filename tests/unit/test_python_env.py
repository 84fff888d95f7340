"""The python_env stage's helpers: requirements, interpreter, environment path, download environment, the host's Python, and the probe's flag parser."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from files import vllm_probe
from files.vllm_probe import server_flags
from pyinfra_vllm.core.stack_locks import read_lock, requirements_text
from pyinfra_vllm.core.stacks import STACKS
from pyinfra_vllm.operations.util.uploads import env_file_text
from pyinfra_vllm.plans.python_env import (
    download_env,
    environment_base,
    environment_path,
    generations,
    integrity_problem,
    interpreter,
    prunable,
    python_problem,
    returns_to_kept,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


HELP_063 = FIXTURES / "vllm/vllm-0.6.3-api-server-help.txt"


# --- requirements and environment paths -----------------------------------------------
def test_requirements_text_of_the_063_stack():
    assert requirements_text(STACKS["0.6.3"]) == (
        "vllm==0.6.3\n"
        "numpy==1.26.4\n"
        "setuptools==75.1.0\n"
        "tokenizers==0.20.1\n"
        "torch==2.4.0\n"
        "torchvision==0.19.0\n"
        "transformers==4.45.2\n"
        "xformers==0.0.27.post2\n"
    )


def test_requirements_text_puts_vllm_first_then_sorted_pins():
    lines = requirements_text(STACKS["0.17.0"]).splitlines()
    assert lines[0] == "vllm==0.17.0"
    assert lines[1:] == sorted(lines[1:])
    assert "torch==2.10.0" in lines and "transformers==4.57.6" in lines


def test_interpreter_conda_installs_the_stack_python_others_use_python3():
    assert interpreter("conda", STACKS["0.6.3"]) == "3.10"
    assert interpreter("conda", STACKS["0.17.0"]) == "3.12"
    assert interpreter("uv", STACKS["0.6.3"]) == "python3"
    assert interpreter("venv", STACKS["0.17.0"]) == "python3"


def test_environment_base_is_stable_and_depends_on_lock_manager_and_python():
    stack = STACKS["0.6.3"]
    path = environment_base("/opt/vllm", stack, "uv", "python3")
    # Pinned: a change here (or to locks/stacks/vllm-0.6.3.txt) moves every host to a new
    # environment on its next run.
    assert path == "/opt/vllm/envs/vllm-0.6.3-e8a11ed0"
    assert environment_base("/opt/vllm", dataclasses.replace(stack), "uv", "python3") == path
    others = {
        environment_base("/opt/vllm", stack, "venv", "python3"),
        environment_base("/opt/vllm", stack, "conda", "3.10"),
        environment_base("/opt/vllm", stack, "conda", "3.11"),
        environment_base("/opt/vllm", STACKS["0.17.0"], "uv", "python3"),
    }
    assert len(others) == 4 and path not in others
    assert environment_base("/srv/vllm", stack, "uv", "python3").startswith("/srv/vllm/envs/")


STACK = STACKS["0.6.3"]
BASE = environment_base("/opt/vllm", STACK, "uv", "python3")


def built(state="intact", sha=None, vllm="0.6.3", when=100, **integrity):
    return {"marker": {"requirements_sha256": sha or read_lock(STACK).sha256},
            "installed": {"vllm": vllm}, "built": when,
            "integrity": {"state": state, **integrity}}


def test_environment_path_is_the_base_on_a_bare_host_and_a_proven_one_after():
    bare = {"current": None, "envs": {}}
    assert environment_path("/opt/vllm", STACK, "uv", "python3", bare) == BASE
    proven_host = {"current": BASE, "envs": {BASE: built()}}
    assert environment_path("/opt/vllm", STACK, "uv", "python3", proven_host) == BASE


def test_a_changed_environment_is_rebuilt_beside_it_never_over_it():
    changed = {"current": BASE, "envs": {BASE: built("changed", packages=["x 1 removed"])}}
    assert environment_path("/opt/vllm", STACK, "uv", "python3", changed) == BASE + "-g2"
    # The rebuild proven: it is used, and the changed one is not chosen again.
    changed["envs"][BASE + "-g2"] = built(when=200)
    assert environment_path("/opt/vllm", STACK, "uv", "python3", changed) == BASE + "-g2"
    # Both changed: a third generation.
    changed["envs"][BASE + "-g2"] = built("changed", when=200)
    assert environment_path("/opt/vllm", STACK, "uv", "python3", changed) == BASE + "-g3"
    assert generations(changed, BASE) == [BASE, BASE + "-g2"]
    # Without its manifest an environment is not trusted either.
    unrecorded = {"current": BASE, "envs": {BASE: built("unrecorded")}}
    assert environment_path("/opt/vllm", STACK, "uv", "python3", unrecorded) == BASE + "-g2"


def test_the_proven_generation_current_points_at_is_preferred():
    both = {"current": BASE, "envs": {BASE: built(), BASE + "-g2": built(when=200)}}
    assert environment_path("/opt/vllm", STACK, "uv", "python3", both) == BASE
    both["current"] = "/opt/vllm/envs/other"
    assert environment_path("/opt/vllm", STACK, "uv", "python3", both) == BASE + "-g2"


def test_a_move_to_a_kept_environment_is_told_from_a_new_one_and_from_current():
    other = "/opt/vllm/envs/vllm-0.33.0-0badcafe"
    kept = {"current": other, "envs": {BASE: built(), other: built(when=200)}}
    assert returns_to_kept(kept, BASE, STACK)  # the rollback: built, proven, not current
    assert not returns_to_kept({**kept, "current": BASE}, BASE, STACK)  # converged
    assert not returns_to_kept({"current": other, "envs": {other: built()}}, BASE, STACK)
    # Changed by hand since: not kept, rebuilt beside it.
    assert not returns_to_kept({"current": other, "envs": {BASE: built("changed")}},
                               BASE, STACK)


def test_integrity_problem_names_the_packages():
    envs = {"current": BASE, "envs": {BASE: built(
        "changed", packages=["transformers 4.45.2 -> 4.46.0"], files=["lib/x"])}}
    assert integrity_problem(envs, BASE) == "transformers 4.45.2 -> 4.46.0"
    assert integrity_problem({"current": None, "envs": {BASE: built()}}, BASE) is None
    assert integrity_problem({"current": None, "envs": {}}, BASE) is None


def test_prunable_keeps_the_wanted_the_current_and_the_newest_others():
    envs = {"current": "/opt/vllm/envs/c", "envs": {
        "/opt/vllm/envs/a": built(when=1), "/opt/vllm/envs/b": built(when=2),
        "/opt/vllm/envs/c": built(when=3), "/opt/vllm/envs/d": built(when=4),
        "/opt/vllm/envs/w": built(when=5)}}
    assert prunable(envs, 1, "/opt/vllm/envs/w") == ["/opt/vllm/envs/a", "/opt/vllm/envs/b"]
    assert prunable(envs, 0, "/opt/vllm/envs/w") == [
        "/opt/vllm/envs/a", "/opt/vllm/envs/b", "/opt/vllm/envs/d"]
    assert prunable(envs, 5, "/opt/vllm/envs/w") == []


def test_download_env_adds_ca_and_proxy_only_when_set():
    plain = env_file_text(download_env("https://pypi.org/simple", None, None)).decode()
    plain = plain.splitlines()
    assert "PIP_INDEX_URL=https://pypi.org/simple" in plain
    assert not any("PROXY" in line.upper() or "CERT" in line for line in plain)
    full = env_file_text(download_env("https://m/simple", "/ca.pem", "http://u:pw@p:3128"))
    full = full.decode().splitlines()
    for wanted in ("PIP_CERT=/ca.pem", "SSL_CERT_FILE=/ca.pem", "CURL_CA_BUNDLE=/ca.pem",
                   "HTTPS_PROXY=http://u:pw@p:3128", "https_proxy=http://u:pw@p:3128",
                   "UV_DEFAULT_INDEX=https://m/simple"):
        assert wanted in full
    # Read by a POSIX shell with `set -a; . FILE`: a value with shell syntax stays a value.
    assert env_file_text({"PIP_INDEX_URL": "https://u:p;w@x/$HOME"}) == (
        b"PIP_INDEX_URL='https://u:p;w@x/$HOME'\n")


# --- the probe's flags ----------------------------------------------------------------
def test_server_flags_on_the_recorded_063_help():
    flags = server_flags(HELP_063.read_text())
    # 115 = 114 options vLLM 0.6.3's api_server defines + "--tool-call-parserto" (vLLM's
    # own help text runs that option into the next word). The pieces of options argparse
    # wraps after a hyphen ("--max-seq-len-to-" / "capture") are not counted;
    # tests/e2e/test_engine_stages.py pins the same 115.
    assert len(flags) == 115
    assert flags == sorted(set(flags))
    for flag in ("--tensor-parallel-size", "--enable-chunked-prefill",
                 "--disable-custom-all-reduce", "--served-model-name", "--max-model-len",
                 "--block-size", "--help", "--max-seq-len-to-capture"):
        assert flag in flags
    assert [flag for flag in flags if flag.endswith("-")] == []
    assert "--" not in flags and all(len(flag) > 3 for flag in flags)


def test_server_flags_ignores_single_dash_and_embedded_dashes():
    text = "usage: [-h] [--port PORT] a--b --x=1 (see --seed.) --Upper ---triple -- end"
    assert server_flags(text) == ["--port", "--seed", "--x"]


# --- the server's --help, in the probe's interpreter --------------------------------------
SERVER_MODULE = """\
import argparse
import sys

parser = argparse.ArgumentParser(prog="server")
parser.add_argument("--tensor-parallel-size", type=int)
parser.add_argument("--max-model-len", type=int)
if __name__ == "__main__":
    if "fail" in __file__:  # the module named probe_server_fail
        sys.exit(2)
    args = parser.parse_args()
    raise RuntimeError("a server would start here")
"""


@pytest.fixture
def server_module(tmp_path, monkeypatch):
    """A module that, run as __main__, builds an argparse parser as the server does."""
    def make(name: str) -> None:
        (tmp_path / f"{name}.py").write_text(SERVER_MODULE)
        monkeypatch.setattr(vllm_probe, "SERVER", name)
    monkeypatch.syspath_prepend(str(tmp_path))
    return make


def test_server_help_runs_the_module_as_main_and_returns_its_help(server_module):
    server_module("probe_server_ok")
    argv = list(sys.argv)
    text = vllm_probe.server_help()
    assert text.startswith("usage: server [-h] [--tensor-parallel-size TENSOR_PARALLEL_SIZE]")
    assert server_flags(text) == ["--help", "--max-model-len", "--tensor-parallel-size"]
    # The probe's own arguments are back for what follows.
    assert sys.argv == argv


def test_server_help_that_exits_non_zero_is_the_probe_failing(server_module):
    server_module("probe_server_fail")
    argv = list(sys.argv)
    with pytest.raises(RuntimeError, match="probe_server_fail --help exited 2"):
        vllm_probe.server_help()
    assert sys.argv == argv


# --- the host's python3 -----------------------------------------------------------------
def test_python_problem_without_python3():
    problem = python_problem(None, ["3.9", "3.12"], "uv")
    assert problem is not None
    assert "python_env_manager=uv" in problem and "there is none" in problem
    assert "python_env_manager=conda" in problem


def test_python_problem_inside_the_range():
    assert python_problem("3.11.2", STACKS["0.6.3"].python_range, "uv") is None
    assert python_problem("3.12.9", STACKS["0.6.3"].python_range, "venv") is None
    assert python_problem("3.9.0", STACKS["0.6.3"].python_range, "venv") is None
    # numpy 1.26.4, a pin of the row, needs 3.9: Python 3.8 cannot carry it.
    assert python_problem("3.8.10", STACKS["0.6.3"].python_range, "venv") is not None


def test_python_problem_outside_the_range():
    problem = python_problem("3.13.1", STACKS["0.6.3"].python_range, "venv")
    assert problem is not None
    assert "3.13.1" in problem and "3.9..3.12" in problem
    assert "python_env_manager=conda" in problem
    assert python_problem("3.9.2", STACKS["0.17.0"].python_range, "uv") is not None
