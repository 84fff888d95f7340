"""Every fact a stage reads of a converged host is one it declares: planned against a
converged host (tests/unit/converged_host.py), no stage reads anything outside the run's
one read (pyinfra_vllm/run/host_reads.py).

Each stage declares what it reads (``stage(reads=...)``, kept in ``STAGE_READS``): the
same facts and arguments its operations ask ``host.get_fact`` for. The run reads them all
in one remote command; a read that differs from every declared one is read on its own,
one more remote command, and nothing else says so. Here each deploy is planned as the
pyinfra CLI plans it (``deploys/full.py``, each stage's own file, ``deploys/audit.py``,
and full then audit in one run, as ``python -m tools.audit`` runs them), for several
settings, with pyinfra's real State, host and operations and the suite's own run
context; only the host's answers are made here: the one read's (``host_reads.read_all``)
with what a converged host returns, and every other read recorded with the stage that
made it, then answered the same. The host must come out converged (no operation would
change it, no stage refuses it): otherwise the stages took a path that the declared
reads do not describe (a host that needs work pays for its reads with the work), and
the test says which operation.
"""

from __future__ import annotations

import gc
import json
import runpy
import weakref
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyinfra
import pytest
from pyinfra.api import Config, FactBase, Inventory, State
from pyinfra.api.facts import ShortFactBase
from pyinfra.api.host import Host
from pyinfra.api.state import StateStage
from pyinfra.context import ctx_host, ctx_state

import pyinfra_vllm.stages.audit  # noqa: F401  (declares the audit's reads)
from pyinfra_vllm.core.locks import load_lock
from pyinfra_vllm.core.settings import STAGES, validate
from pyinfra_vllm.plans.engine_access import endpoint
from pyinfra_vllm.run import host_reads
from pyinfra_vllm.run.context import HostContext, context
from tests.unit.converged_host import ConvergedHost
from tools.model_lock import build_lock, git_blob_sha1, write_lock

REPOSITORY = Path(__file__).resolve().parents[2]
CONFIG = REPOSITORY / "tests" / "fixtures" / "hf" / "qwen3.6-27b" / "config.json"
MODEL_ID = "Qwen/Qwen3.6-27B"
HOST = "gpu-a100-01.example.internal"
# The deep checks (model_verify and python_env_verify deep) read every byte of the model
# and of the environment, each in a command of its own, after the one read: their
# arguments are not the settings' alone (the model lock; the environment the one read
# found).
DEEP_CHECKS = {"ModelContent", "EnvironmentContent"}


@dataclass
class Planned:
    """What planning one run on the converged host found."""

    # Each read the one read did not answer: the stage that made it, the fact, its
    # arguments by name.
    alone: list[tuple[str, type[FactBase], dict[str, Any]]] = field(default_factory=list)
    # The operations that would change the host (those with ``_if`` left out: pyinfra
    # asks their condition only when the run executes), the stages that planned
    # operations, and the reasons a stage refused the host.
    changes: list[str] = field(default_factory=list)
    stages: set[str] = field(default_factory=set)
    refused: list[str] = field(default_factory=list)
    # The run's context for the host, as long as something keeps it.
    context: weakref.ref[HostContext] | None = None

    def alone_keys(self) -> set[tuple[type, str]]:
        return {host_reads.read_key(fact, (), named) for _stage, fact, named in self.alone}


class OneRead(dict):
    """The one read's values, keyed as host_reads keys them; each value is the
    converged host's when it is served (the host knows what a file of the suite holds
    once the operation that writes it was called)."""

    def __init__(self, converged: ConvergedHost, reads: list[host_reads.Read]):
        # As host_reads.read_all: pyinfra derives a short fact from another one.
        super().__init__({read.key(): read for read in reads
                          if not issubclass(read.fact, ShortFactBase)})
        self.converged = converged

    def __getitem__(self, key: tuple[type, str]) -> Any:
        read = dict.__getitem__(self, key)
        return self.converged.value(read.fact, read.kwargs)


def plan(monkeypatch, data: dict[str, Any], deploy_files: list[str]) -> Planned:
    """Plan ``deploy_files`` (paths in the repository) for one host with ``data``, as the
    pyinfra CLI prepares them before it executes anything."""
    monkeypatch.chdir(REPOSITORY)
    settings = validate(dict(data))
    lock = load_lock(settings, required="model" not in settings.skip_stages)
    converged = ConvergedHost(settings, lock)
    planned = Planned()

    def read_alone(host: Host, fact: type[FactBase], *args: Any, **kwargs: Any) -> Any:
        named = host_reads.named_arguments(fact, args, kwargs)
        stage = (host.current_deploy_name or "").split(" | ")[-1]
        planned.alone.append((stage, fact, named))
        return converged.value(fact, named)

    monkeypatch.setattr(host_reads, "read_all",
                        lambda host, reads: OneRead(converged, list(reads)))
    # What host_reads.answer_from falls back to for a read the one read did not make.
    monkeypatch.setattr(Host, "get_fact", read_alone)
    inventory = Inventory(([(HOST, data)], {}))
    state = State(inventory, Config())
    state.set_stage(StateStage.Prepare)
    host = inventory.get_host(HOST)
    state.activate_host(host)
    with converged.learn(monkeypatch), ctx_state.use(state), ctx_host.use(host):
        for deploy_file in deploy_files:
            runpy.run_path(str(REPOSITORY / deploy_file))
        made = context(pyinfra.host)
        planned.refused, planned.context = list(made.refused), weakref.ref(made)
    for op_hash, op_data in state.ops[host].items():
        names = sorted(state.op_meta[op_hash].names)
        planned.stages.update(name.split(" | ")[-2] for name in names)
        if op_data.operation_meta.will_change and not op_data.global_arguments["_if"]:
            planned.changes += names
    return planned


def assert_declared(planned: Planned, allowed: AbstractSet[tuple[type, str]] = frozenset(),
                    allowed_facts: AbstractSet[str] = frozenset()) -> None:
    """The host came out converged, and every read but the ``allowed`` ones (keys, or
    whole facts by name) was answered by the one read; else each stage's read made on
    its own, named with the fact and its arguments."""
    assert planned.refused == [], "tests/unit/converged_host.py: the converged host was refused"
    assert planned.changes == [], "tests/unit/converged_host.py: the converged host would change"
    alone = [f"stage {stage}: {fact.__name__}({words(named)})"
             for stage, fact, named in planned.alone
             if host_reads.read_key(fact, (), named) not in allowed
             and fact.__name__ not in allowed_facts]
    assert alone == [], (
        "read on its own, not in the run's one read: declare it in the stage's reads= "
        "(the same fact and arguments; pyinfra_vllm/run/host_reads.py):\n" + "\n".join(alone))


def words(named: dict[str, Any]) -> str:
    """A read's arguments, each cut short (a model lock is long)."""
    return ", ".join(f"{key}={value!r:.120}" for key, value in named.items())


def write_model_lock(path: Path) -> None:
    """A lock of Qwen3.6-27B as python -m tools.model_lock writes it: the model's recorded
    config.json and two weight files."""
    config = CONFIG.read_bytes()
    weights = [{"rfilename": f"model-0000{number}-of-00002.safetensors", "size": size,
                "lfs": {"sha256": f"{number}" * 64, "size": size}}
               for number, size in ((1, 30_000_000_000), (2, 25_600_000_000))]
    answer = {"sha": "5f1e0c3a9b7d2e4f6a8c0b1d3e5f7a9c2b4d6e8f", "siblings": [
        {"rfilename": "config.json", "size": len(config), "blobId": git_blob_sha1(config)},
        *weights]}
    lock = build_lock(answer, model_id=MODEL_ID, revision="main",
                      base_url="https://huggingface.co", now="2026-12-01T10:00:00Z")
    lock["config"] = json.loads(config)
    write_lock(lock, path)


def example_fleet() -> dict[str, Any]:
    """The example fleet's first host's data as pyinfra merges it: group_data/all.py,
    group_data/a100_nvlink.py, then its own in inventory.py."""
    data: dict[str, Any] = {}
    for path in ("group_data/all.py", "group_data/a100_nvlink.py"):
        found = runpy.run_path(str(REPOSITORY / path))
        data.update({key: value for key, value in found.items() if not key.startswith("_")})
    _name, own = runpy.run_path(str(REPOSITORY / "inventory.py"))["a100_nvlink"][0]
    return {**data, **own}


CERT_PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
KEY_PEM = "-----BEGIN PRIVATE KEY-----\nMIGH\n-----END PRIVATE KEY-----\n"


@pytest.fixture()
def operator_files(tmp_path) -> dict[str, str]:
    """The settings that name the operator's files: the model lock, an API key file and
    a TLS certificate and key (the secrets their owner's alone), the reports' directory."""
    lock = tmp_path / "qwen3.6-27b.json"
    write_model_lock(lock)
    keys, cert, key = tmp_path / "api-keys", tmp_path / "cert.pem", tmp_path / "key.pem"
    for path, text in ((keys, "sk-" + "k" * 40 + "\n"), (key, KEY_PEM)):
        path.touch(0o600)
        path.write_text(text)
    cert.write_text(CERT_PEM)
    return {"model_lock": str(lock), "api_keys_file": str(keys),
            "audit_report_dir": str(tmp_path / "reports"),
            "gateway_tls_cert": str(cert), "gateway_tls_key": str(key)}


def scenario(name: str, files: dict[str, str]) -> dict[str, Any]:
    """The host data of scenario ``name``, the operator's ``files`` named."""
    common = {key: files[key] for key in ("model_lock", "api_keys_file", "audit_report_dir")}
    tls = {key: files[key] for key in ("gateway_tls_cert", "gateway_tls_key")}
    fleet = {**example_fleet(), **common}
    return {
        # The example fleet: vLLM 0.33.0 on CUDA on a Unix socket, its volume for the
        # model, no TLS, node_exporter.
        "fleet": fleet,
        # The same with both deep checks (python -m tools.audit --deep).
        "deep": {**fleet, "model_verify": "deep", "python_env_verify": "deep"},
        # vLLM's CPU build on a Unix socket on a host without GPUs, TLS with a redirect
        # from plain HTTP.
        "cpu_tls": {**common, **tls, "vllm_device": "cpu", "vllm_version": "0.32.0",
                    "vllm_cpu_kvcache_space_gib": 8, "gateway_http_redirect_port": 8080},
        # The fleet's stack on TCP beyond loopback (its firewall, an allow list),
        # persistence mode off, no canary, no metrics stage.
        "tcp": {**common, "vllm_version": fleet["vllm_version"],
                "nvidia_driver_branch": fleet["nvidia_driver_branch"],
                "vllm_host": "10.0.0.5", "vllm_listen_beyond_loopback": True,
                "vllm_engine_allow": ["10.0.0.0/24"], "persistence_mode": False,
                "rollout_canary": False, "skip_stages": ["metrics"]},
        # The defaults' vLLM 0.6.3 on TCP on loopback, built with uv, enabled but not
        # started (as on the sandbox's GPU hosts), TLS, no model stage and no lock,
        # node_exporter not installed, no sentinel.
        "no_model": {**common, **tls, "model_lock": None, "python_env_manager": "uv",
                     "vllm_start": False, "skip_stages": ["model"],
                     "node_exporter_install": False, "sentinel": False},
    }[name]


GPU_STAGES = {"driver", "mig", "persistence"}
# The stages that plan operations on the converged host, per scenario: the preflight
# plans only the GPUs' health file (none without the metrics stage, none without GPUs).
PLANNING = {
    "fleet": set(STAGES),
    "deep": set(STAGES),
    "cpu_tls": set(STAGES) - GPU_STAGES - {"preflight"},
    "tcp": set(STAGES) - {"metrics", "preflight"},
    "no_model": set(STAGES) - {"model"},
}
SCENARIOS = sorted(PLANNING)


def allowed_facts(name: str) -> set[str]:
    return DEEP_CHECKS if name == "deep" else set()


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_whole_run_reads_only_what_its_stages_declare(monkeypatch, operator_files, name):
    planned = plan(monkeypatch, scenario(name, operator_files), ["deploys/full.py"])
    assert planned.stages == PLANNING[name]
    assert_declared(planned, allowed_facts=allowed_facts(name))


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.parametrize("deploy", [*STAGES, "audit"])
def test_each_stage_alone_reads_only_what_it_declares(monkeypatch, operator_files, name,
                                                      deploy):
    planned = plan(monkeypatch, scenario(name, operator_files), [f"deploys/{deploy}.py"])
    assert planned.stages == ({deploy} & PLANNING[name])
    assert_declared(planned, allowed_facts=allowed_facts(name))


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_audit_after_the_whole_run_reads_alone_only_what_the_audit_adds(
        monkeypatch, operator_files, name):
    # python -m tools.audit plans deploys/full.py, then deploys/audit.py, in one run: the
    # run's context, made by the first, read the whole run's declared reads; what only
    # the audit reads (what the engine serves; the last benchmark, where the run has no
    # canary) is read on its own then, as the audit's own declaration has it.
    data = scenario(name, operator_files)
    planned = plan(monkeypatch, data, ["deploys/full.py", "deploys/audit.py"])
    settings = validate(dict(data))
    place = endpoint(settings)
    whole = {read.key() for read in
             host_reads.stage_reads(settings, ("preflight", *STAGES), place)}
    added = {read.key() for read in host_reads.STAGE_READS["audit"](settings, place)} - whole
    assert_declared(planned, allowed=added, allowed_facts=allowed_facts(name))
    assert {key for key in planned.alone_keys()
            if key[0].__name__ not in allowed_facts(name)} == added
    assert len(added) == {"tcp": 2}.get(name, 1)


def test_a_run_s_context_goes_with_its_host(monkeypatch, operator_files):
    # The stages pass pyinfra's ``host``, one proxy for every host: the context is kept
    # for the Host itself and goes with it, so a later run (each test above) never gets
    # an earlier host's context, with that host's settings and state.
    planned = plan(monkeypatch, scenario("fleet", operator_files), ["deploys/sysctl.py"])
    gc.collect()
    assert planned.context is not None and planned.context() is None
