"""The audit's drift: what a --dry plan would change per host, read from a real pyinfra
State prepared as the CLI prepares it (no connection: the operations below read no
facts), the verdict of python -m tools.audit, and the reports' rendering."""

from __future__ import annotations

import json
from pathlib import Path

import pyinfra
import pytest
from pyinfra.api import Config, Inventory, State, operation
from pyinfra.api.state import StateStage
from pyinfra.context import ctx_host, ctx_state

from pyinfra_vllm.core.settings import validate
from pyinfra_vllm.operations import gate
from pyinfra_vllm.operations.util.refusals import log_reasons
from pyinfra_vllm.plans.engine_access import endpoint
from pyinfra_vllm.report.drift import host_plan, split_op_name
from pyinfra_vllm.report.markdown import render_markdown
from pyinfra_vllm.report.summary import summary_table
from pyinfra_vllm.report.verdicts import model_integrity, model_plans
from pyinfra_vllm.run.context import HostContext
from tools.audit import UsageError, parse_args, plan_hosts, pyinfra_command, verdict

CONFIG = Path(__file__).resolve().parents[1] / "fixtures/hf/qwen3.6-27b/config.json"


@operation()
def demo(change: bool):
    """
    Yield one command when ``change``, none otherwise.

    + change: whether the host differs from what the operation wants
    """
    if change:
        yield "true"


@pytest.fixture(autouse=True)
def cli_mode(monkeypatch):
    # As under the pyinfra CLI: an operation's hash comes from the lines of its call
    # stack, so one line gives one operation on every host that reaches it.
    monkeypatch.setattr(pyinfra, "is_cli", True)


def fleet(check_for_changes: bool = True) -> tuple[State, dict]:
    inventory = Inventory((["gpu-1", "gpu-2", "gpu-3"], {}))
    state = State(inventory, Config(), check_for_changes=check_for_changes)
    state.set_stage(StateStage.Prepare)
    return state, {h.name: h for h in inventory}


def stage_op(state, host, stage: str, op, **kwargs):
    """Prepare ``op`` for one host, named the way deploys/full.py's local.include names it."""
    with ctx_state.use(state), ctx_host.use(host):
        with host.deploy(f"deploys/{stage}.py", None, None, in_deploy=False):
            return op(**kwargs)


REFUSALS: list = []  # what gate.refuse returned for gpu-3, as HostContext.refusals keeps it


def planned_fleet(check_for_changes: bool = True) -> tuple[State, dict]:
    """gpu-1 converged, gpu-2 drifted in sysctl and gateway, gpu-3 refused by the driver
    stage after an install it would make."""
    state, hosts = fleet(check_for_changes)
    for name, changes in {"gpu-1": (False, False), "gpu-2": (True, True)}.items():
        host = hosts[name]
        stage_op(state, host, "driver", demo, name="Driver: hold the NVIDIA and CUDA packages",
                 change=False)
        stage_op(state, host, "sysctl", demo, name="Sysctl: kernel parameters persisted and "
                 "applied", change=changes[0])
        stage_op(state, host, "persistence", demo, name="Persistence: reload systemd units",
                 change=True, _if=lambda: False)
        stage_op(state, host, "gateway", demo, name="Gateway: nginx enabled and running",
                 change=changes[1])
    bare = hosts["gpu-3"]
    stage_op(state, bare, "driver", demo, name="Driver: install nvidia-headless-535-server",
             change=True)
    REFUSALS[:] = [stage_op(state, bare, "driver", gate.refuse, name="Driver: reboot required",
                            reasons=["driver 535-server installed; reboot required"])]
    return state, hosts


def test_split_op_name():
    assert split_op_name("deploys/sysctl.py | Sysctl: kernel parameters") == (
        "sysctl", "Sysctl: kernel parameters")
    assert split_op_name("deploys/full.py | deploys/model_volume.py | Model volume: XFS") == (
        "model_volume", "Model volume: XFS")
    assert split_op_name("Model volume: XFS mounted") == ("model_volume", "Model volume: XFS mounted")
    # The stages as @deploy functions, run by deploys/full.py or alone.
    assert split_op_name("full | model_volume | Model volume: XFS") == (
        "model_volume", "Model volume: XFS")
    assert split_op_name("sysctl | Sysctl: kernel parameters") == (
        "sysctl", "Sysctl: kernel parameters")
    assert split_op_name("apt.packages") == (None, "apt.packages")


def test_drift_per_host_from_pyinfra_state():
    state, hosts = planned_fleet()
    assert host_plan(state, hosts["gpu-1"], []) == {
        "drift": [],
        "conditional": [{"operation": "Persistence: reload systemd units",
                         "stage": "persistence"}],
        "refused": [],
        "drift_note": None,
    }
    assert host_plan(state, hosts["gpu-2"], [])["drift"] == [
        {"operation": "Sysctl: kernel parameters persisted and applied", "stage": "sysctl"},
        {"operation": "Gateway: nginx enabled and running", "stage": "gateway"},
    ]
    refused = host_plan(state, hosts["gpu-3"], ["driver 535-server installed; reboot required"],
                        REFUSALS)
    # The refusal (pyinfra_vllm/operations/gate.py) is pyinfra's "change", not drift.
    assert refused["drift"] == [
        {"operation": "Driver: install nvidia-headless-535-server", "stage": "driver"}
    ]
    assert refused["refused"] == ["driver 535-server installed; reboot required"]
    # Known by the operation pyinfra returned, not by its name: unrecorded, it is drift.
    assert host_plan(state, hosts["gpu-3"], [])["drift"][1] == {
        "operation": "Driver: reboot required", "stage": "driver"}


@pytest.mark.parametrize(("stage", "operation"), [
    ("model", "Model: host refused"), ("gateway", "Gateway: host refused")])
def test_a_refusal_through_the_context_is_refused_not_drift(stage, operation):
    state, hosts = fleet()
    settings = validate({"gateway_open": True})
    ctx = HostContext(settings=settings, state={}, endpoint=endpoint(settings))
    reason = f"{stage}: the host cannot take this stage"
    with ctx_state.use(state), ctx_host.use(hosts["gpu-1"]):
        with hosts["gpu-1"].deploy(f"deploys/{stage}.py", None, None, in_deploy=False):
            ctx.refuse(operation, [reason])
    plan = host_plan(state, hosts["gpu-1"], ctx.refused, ctx.refusals)
    assert (plan["drift"], plan["refused"]) == ([], [reason])


def test_drift_is_not_claimed_without_a_plan():
    state, hosts = planned_fleet(check_for_changes=False)  # pyinfra -y
    plan = host_plan(state, hosts["gpu-2"], [])
    assert (plan["drift"], plan["refused"]) == (None, None)
    assert "-y" in plan["drift_note"]
    state, hosts = planned_fleet()
    # deploys/audit.py alone: no stage asked HostContext.proceed before it.
    assert "ran alone" in host_plan(state, hosts["gpu-2"], [], planned=False)["drift_note"]


def test_drift_is_not_claimed_on_an_untested_pyinfra(monkeypatch):
    state, hosts = planned_fleet()
    monkeypatch.setattr("pyinfra.version.__version__", "3.11.0")
    plan = host_plan(state, hosts["gpu-2"], [])
    assert (plan["drift"], plan["refused"]) == (None, None)
    assert plan["drift_note"].startswith(
        "not checked: pyinfra 3.11.0 is outside the versions the audit was tested with "
        "(>=3.10,<3.11)")


def entry(drift, refused, conditional=()):
    return {
        "summary": {"os": "Ubuntu 22.04.4 LTS", "driver_present": True, "driver_version":
                    "535.129.03", "cuda_version": "12.2", "kernel_module": None, "gpu_count": 2,
                    "gpu_names": ["NVIDIA A100 80GB PCIe"], "mig": [], "persistence": [],
                    "tensor_parallel_size": 2, "tp_link": None, "module_mismatch": None,
                    "verdict": "ok"},
        "checks": [],
        "state": {"topology": None, "nvlink": None},
        "drift": drift, "conditional": list(conditional), "refused": refused,
        "drift_note": None,
    }


SYSCTL = {"operation": "Sysctl: kernel parameters persisted and applied", "stage": "sysctl"}
REPORT = {
    "generated_at": "2026-11-29T10:00:00+00:00",
    "hosts": {
        "gpu-1": entry([], []),
        "gpu-2": entry([SYSCTL], []),
        "gpu-3": entry([], ["preflight tp_nvlink: no 2 GPUs are joined by NVLink"]),
    },
}


def test_terminal_table_has_a_drift_column():
    table = summary_table(REPORT).splitlines()
    assert table[0].endswith("verdict  drift")
    assert table[1].startswith("gpu-1") and table[1].endswith("ok       converged")
    assert table[2].endswith("ok       1 change(s)")
    assert table[3].endswith("ok       refused")


def test_markdown_drift_sections():
    md = render_markdown(REPORT)
    assert "| gpu-2 | 1 change(s) | Sysctl: kernel parameters persisted and applied [sysctl] | - |" in md
    assert "| gpu-3 | refused | - | preflight tp_nvlink: no 2 GPUs are joined by NVLink |" in md
    assert "Converged: `deploys/full.py` would change nothing." in md
    assert "| sysctl | Sysctl: kernel parameters persisted and applied |" in md
    assert "- Refused: preflight tp_nvlink: no 2 GPUs are joined by NVLink" in md


def test_verdict_exit_codes_and_lines():
    plan = {"plan": [{"name": "x", "hosts_with_change": ["gpu-2", "gpu-3"],
                      "hosts_with_conditional_change": ["gpu-1"]}], "results": None}
    code, lines = verdict(REPORT, plan)
    assert code == 1
    assert lines == [
        "drift: host gpu-2: 1 operation(s) would change: "
        "Sysctl: kernel parameters persisted and applied [sysctl]",
        "drift: host gpu-3: refused: preflight tp_nvlink: no 2 GPUs are joined by NVLink",
        "audit: 2 of 3 host(s) drifted or refused",
    ]
    converged = {"generated_at": "t", "hosts": {"gpu-1": entry([], [])}}
    assert verdict(converged, {"plan": []}) == (0, ["audit: 1 host(s) converged, none refused"])
    # pyinfra says gpu-1 would change but the audit found nothing: never "converged".
    code, lines = verdict(converged, {"plan": [{"hosts_with_change": ["gpu-1"]}]})
    assert code == 2 and "disagree" in lines[-1]
    assert verdict(converged, None)[0] == 2
    unchecked = {"hosts": {"gpu-1": {**entry(None, None), "drift_note": "not checked: -y"}}}
    assert verdict(unchecked, {"plan": []}) == (2, ["audit: host gpu-1: not checked: -y"])


def test_plan_hosts_ignores_conditional_changes():
    assert plan_hosts({"plan": [{"hosts_with_change": ["a"],
                                 "hosts_with_conditional_change": ["b"]}]}) == {"a"}
    with pytest.raises(ValueError):
        plan_hosts({"results": None})


def test_wrapper_arguments():
    assert parse_args(["inventory.py", "--data", "x=1", "--deploy", "deploys/sysctl.py"]) == (
        "inventory.py", "deploys/sysctl.py", ["--data", "x=1"])
    assert parse_args(["@local"])[1] == "deploys/full.py"
    # --deep is the deep check of the model and of the environment for this audit, in
    # pyinfra's own --data words.
    assert parse_args(["inventory.py", "--limit", "h", "--deep"]) == (
        "inventory.py", "deploys/full.py", ["--data", "model_verify=deep", "--data",
                                            "python_env_verify=deep", "--limit", "h"])
    for bad in ([], ["--limit", "h", "inv.py"], ["inv.py", "-y"], ["inv.py", "--deploy"]):
        with pytest.raises(UsageError):
            parse_args(bad)
    command = pyinfra_command("@local", "deploys/full.py", ["--limit", "h"])
    assert command[1:] == ["-m", "pyinfra", "--dry", "--json", "--limit", "h", "@local",
                           "deploys/full.py", "deploys/audit.py"]


def test_model_plans_without_a_lock():
    settings = validate({"gateway_open": True})
    assert model_plans(settings, None, {}) == {
        "compatibility": None,
        "capacity": None,
        "why": "no model lock: python -m tools.model_lock writes one (setting model_lock)",
    }


def test_model_plans_qwen36_on_two_a100():
    config = json.loads(CONFIG.read_text())
    lock = {"model_id": "Qwen/Qwen3.6-27B", "config": config,
            "files": [{"path": "model-00001-of-00002.safetensors", "size": 30_000_000_000},
                      {"path": "model-00002-of-00002.safetensors", "size": 25_600_000_000},
                      {"path": "config.json", "size": 1234}]}
    state = {"driver": {"driver_version": "535.129.03"},
             "gpus": [{"index": 0, "memory_total_mib": 81920},
                      {"index": 1, "memory_total_mib": 81920}]}
    plans = model_plans(validate({"gateway_open": True}), lock, state)  # the seed's vLLM 0.6.3
    arch, context_length, fits = plans["compatibility"]
    assert (arch["name"], arch["ok"]) == ("model_architecture", False)
    assert "0.17.0" in arch["detail"]
    assert (context_length["name"], context_length["ok"]) == ("context_length", True)
    assert (fits["name"], fits["ok"]) == ("capacity", True)
    capacity = plans["capacity"]
    assert (capacity["weights_bytes"], capacity["weights_source"]) == (55_600_000_000, "lock")
    assert (capacity["gpu_memory_mib"], capacity["gpu_memory_source"]) == (81920, "host")
    # 16 full-attention layers x 4 KV heads x head_dim 256 x 2 (K, V) x 2 bytes.
    assert capacity["kv_bytes_per_token"] == 65536
    assert capacity["check"]["ok"] is True and capacity["sequences"] >= 1
    md = render_markdown({"generated_at": "t", "hosts": {"gpu-1": {
        **entry([], []), **plans, "model_note": None}}})
    assert "| model_architecture | NO |" in md
    assert "- Capacity at 81920 MiB per GPU (host):" in md


def test_model_plans_report_a_config_they_cannot_plan():
    plans = model_plans(validate({"gateway_open": True}), {"config": {"architectures": ["X"]}, "files": []}, {})
    assert plans["capacity"]["error"].startswith("config.json cannot be planned: KeyError")
    assert plans["capacity"]["gpu_memory_source"].startswith("min_gpu_memory_mib")


def test_the_engine_column_shows_what_the_engine_serves():
    serving = {"models": [{"id": "sandbox/tiny-qwen2", "max_model_len": 131072}],
               "metrics": {"vllm:num_requests_running": 1.0, "vllm:kv_cache_usage_perc": 0.25,
                           "vllm:prompt_tokens_total": 6176.0}}
    report = {**REPORT, "hosts": {name: dict(entry) for name, entry in REPORT["hosts"].items()}}
    first, *others = sorted(report["hosts"])
    report["hosts"][first]["engine"] = serving
    for name in others:
        report["hosts"][name]["engine"] = None
    table = summary_table(report).splitlines()
    assert table[0].split()[-1] == "engine"
    assert table[1].endswith("sandbox/tiny-qwen2 (131072), 1 running, KV 25%")
    assert all(line.endswith("not answering") for line in table[2:])
    markdown = render_markdown(report)
    assert "Engine: sandbox/tiny-qwen2 (131072), 1 running, KV 25%" in markdown
    assert "| `vllm:prompt_tokens_total` | 6176 |" in markdown


@pytest.mark.parametrize("version", ["3.9.2", "3.11.0", "4.0.0"])
def test_the_wrapper_refuses_an_untested_pyinfra_before_running_it(monkeypatch, capsys, version):
    import tools.audit

    monkeypatch.setattr(tools.audit.importlib.metadata, "version", lambda name: version)
    started = []
    monkeypatch.setattr(tools.audit.subprocess, "Popen", lambda *a, **k: started.append(a))
    assert tools.audit.run(["inventory.py"]) == 2
    assert started == []
    assert capsys.readouterr().err == (
        f"audit: pyinfra {version} is outside the versions the audit was tested with "
        "(>=3.10,<3.11): its drift could read a changed pyinfra wrongly; install the pinned "
        "one (pip install -r requirements.lock)\n")


MODEL_DIR = "/srv/models/Qwen/Qwen3.6-27B"


def test_the_deep_check_names_each_corrupt_file_per_host():
    # ModelContent's value for a host with shard 2 rewritten in place and config.json gone.
    content = {"files": 3, "bytes": 73400320, "seconds": 0.074, "jobs": 2, "error": None,
               "problems": {"model-00002-of-00002.safetensors": "mismatch",
                            "config.json": "missing"}}
    found = model_integrity(content, MODEL_DIR)
    assert found == {"path": MODEL_DIR, "present": True, "files": 3, "bytes": 73400320,
                     "seconds": 0.074, "error": None,
                     "problems": {"config.json": "missing",
                                  "model-00002-of-00002.safetensors": "mismatch"}}
    sound = model_integrity(dict(content, problems={}), MODEL_DIR)
    report = {"generated_at": "t", "hosts": {
        "gpu-1": {**entry([], []), "model_integrity": found},
        "gpu-2": {**entry([], []), "model_integrity": sound},
        "gpu-3": {**entry([], []), "model_integrity": model_integrity(None, MODEL_DIR)},
        "gpu-4": {**entry([], [])},
    }}
    md = render_markdown(report)
    one, two, three, four = (md.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
                             for name in ("gpu-1", "gpu-2", "gpu-3", "gpu-4"))
    assert ("### Model files, re-hashed\n\n3 file(s), 73400320 bytes in "
            "`/srv/models/Qwen/Qwen3.6-27B`, hashed in 0.074 s (946 MiB/s).\n\n"
            "| file | problem |\n|---|---|\n| config.json | missing |\n"
            "| model-00002-of-00002.safetensors | mismatch |\n") in one
    assert "Every file matches the lock." in two and "| file | problem |" not in two
    assert "No model directory at `/srv/models/Qwen/Qwen3.6-27B`: nothing to check." in three
    assert "re-hashed" not in four  # model_verify stat: no section


def test_the_deep_check_that_did_not_run_says_why():
    content = {"files": 0, "bytes": 0, "seconds": 0.0, "jobs": 0, "problems": {},
               "error": "no python3"}
    found = model_integrity(content, MODEL_DIR)
    assert found["error"] == "no python3" and found["present"] is True
    md = render_markdown({"generated_at": "t", "hosts": {
        "gpu-1": {**entry([], []), "model_integrity": found}}})
    assert "### Model files, re-hashed\n\nNot checked: no python3\n" in md


def test_every_refusal_reason_is_logged_once(caplog):
    """A stage's reasons are logged while the run is planned and not again when its
    refusal runs; a refusal made inside another operation logs its reasons when it runs."""
    state, hosts = fleet()
    planned, inner = hosts["gpu-1"], hosts["gpu-2"]
    with caplog.at_level("ERROR", logger="pyinfra"):
        log_reasons(planned, ["preflight nvlink: no bridge; fit it"])
        assert gate._refuse(state, planned, ["preflight nvlink: no bridge; fit it"]) is False
        assert gate._refuse(state, inner, ["mig: GPU 0 is busy (pid 42)"]) is False
    lines = [record.getMessage() for record in caplog.records]
    assert sum("no bridge" in line for line in lines) == 1
    assert sum("pid 42" in line for line in lines) == 1
