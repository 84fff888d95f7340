"""The audit's reports per pyinfra run: written once, when the last of the run's hosts is
recorded (or at exit, for a run cut short), each run on its own; and the entry of a host
whose settings are invalid, refused with each problem, in every report."""

from __future__ import annotations

import json

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.context import ctx_host

from pyinfra_vllm.core.settings import SettingsError, validate
from pyinfra_vllm.report import runs as report_module
from pyinfra_vllm.report.html_page import host_status, render_html
from pyinfra_vllm.report.markdown import render_markdown
from pyinfra_vllm.report.summary import summary_rows, summary_table
from pyinfra_vllm.report.verdicts import settings_problems, settings_refusal
from pyinfra_vllm.stages import audit as audit_stage
from tests.unit.fleet_reports import connected_state, fleet, h200_state

FIX = ("Fix the value in the inventory's host data, group_data/*.py or --data KEY=VALUE; "
       "docs/settings.md lists every key with what it allows.")
NO_KEY = ("api_keys is empty: the gateway would serve /v1/ to anyone; set api_keys or "
          "api_keys_file, or gateway_open=true to serve without a key")


def settings_message(data: dict) -> str:
    with pytest.raises(SettingsError) as raised:
        validate(data, where="host gpu-bad-01")
    return str(raised.value)


@pytest.fixture
def at_exit(monkeypatch) -> list:
    """The handlers the reports register to run at exit, not run by this process."""
    registered: list = []
    monkeypatch.setattr(report_module.atexit, "register",
                        lambda func, *args: registered.append((func, args)))
    return registered


@pytest.fixture
def writes(monkeypatch) -> list:
    """The runs whose reports were written, once per write."""
    written: list = []
    write = report_module._write

    def counted(run):
        written.append(run)
        write(run)

    monkeypatch.setattr(report_module, "_write", counted)
    return written


def test_the_reports_are_written_once_when_the_last_host_is_recorded(tmp_path, at_exit,
                                                                      writes, capsys):
    hosts = fleet()["hosts"]
    run_state = connected_state(["gpu-dgx-01", "gpu-h200-01"])
    report_module.record(run_state, "gpu-dgx-01", hosts["gpu-dgx-01"], str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    report_module.record(run_state, "gpu-h200-01", hosts["gpu-h200-01"], str(tmp_path))
    run = report_module.audit_run(run_state, str(tmp_path))
    assert writes == [run]
    stamp = run.json_path.stem
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"{stamp}.html", f"{stamp}.json", f"{stamp}.md", "latest.html", "latest.json",
        "latest.md"]
    written = json.loads(run.json_path.read_text())
    assert sorted(written["hosts"]) == ["gpu-dgx-01", "gpu-h200-01"]
    assert written["generated_at"] == run.generated_at
    # At exit: the table, and no second write.
    (handler, args), = at_exit
    handler(*args)
    assert writes == [run]
    err = capsys.readouterr().err
    assert summary_table(run.report()) in err
    assert f"Audit reports written to {run.json_path} and {run.md_path}" in err


def test_each_run_writes_its_own_reports(tmp_path, at_exit, writes):
    entry = fleet()["hosts"]["gpu-h200-01"]
    first, second = connected_state(["gpu-h200-01"]), connected_state(["gpu-h200-01"])
    report_module.record(first, "gpu-h200-01", entry, str(tmp_path / "first"))
    report_module.record(second, "gpu-h200-01", entry, str(tmp_path / "second"))
    runs = [report_module.audit_run(state, "unused") for state in (first, second)]
    assert writes == runs and runs[0] is not runs[1]
    assert [run.json_path.parent.name for run in runs] == ["first", "second"]
    assert len(at_exit) == 2


def test_a_run_cut_short_writes_what_it_read_at_exit(tmp_path, at_exit, writes):
    run_state = connected_state(["gpu-dgx-01", "gpu-h200-01"])
    report_module.record(run_state, "gpu-h200-01", fleet()["hosts"]["gpu-h200-01"],
                         str(tmp_path))
    assert writes == []
    (handler, args), = at_exit
    handler(*args)
    (run,) = writes
    assert list(json.loads(run.json_path.read_text())["hosts"]) == ["gpu-h200-01"]


def test_the_run_reads_its_hosts_from_pyinfra_state():
    # record() knows the run's last host from State.active_hosts: the hosts pyinfra
    # prepares each deploy file for (inventory.get_active_hosts).
    run_state = connected_state(["a", "b"])
    assert {host.name for host in run_state.active_hosts} == {"a", "b"}
    assert set(run_state.inventory.get_active_hosts()) == run_state.active_hosts


def test_settings_problems_in_the_settings_own_words():
    assert settings_problems(settings_message({})) == [("api_keys", NO_KEY)]
    assert settings_problems(settings_message({"block_size": 24, "gateway_open": True})) == [
        ("block_size", "block_size = 24: Input should be 8, 16 or 32 (allowed: 8, 16, 32)")]
    assert settings_problems(settings_message({"blok_size": 16, "gateway_open": True})) == [
        ("blok_size", "unknown setting; did you mean block_size?")]
    # A rule across settings, placed on no key: named by the setting it begins with.
    deep = settings_message({"model_verify": "deep", "skip_stages": ["model"],
                             "gateway_open": True})
    assert settings_problems(deep) == [(
        "model_verify", "model_verify deep re-hashes the model in the model stage, which "
        "skip_stages skips: remove model from skip_stages, or leave model_verify stat and "
        "model_repair false")]
    assert settings_problems("invalid settings: something else") == [
        (None, "invalid settings: something else")]


def test_a_host_with_invalid_settings_is_refused_in_every_report():
    reason = f"settings: api_keys: {NO_KEY}"
    entry = settings_refusal(h200_state(), settings_message({}))
    assert entry["refused"] == [reason]
    assert entry["checks"] == [{"name": "settings", "ok": False, "severity": "error",
                                "detail": reason, "fix": FIX}]
    assert (entry["drift"], entry["gpu_health"]) == (None, {})
    assert entry["summary"]["verdict"] == reason
    assert (entry["summary"]["gpu_count"], entry["summary"]["tensor_parallel_size"]) == (1, None)
    others = fleet()["hosts"]
    report = {"generated_at": "2026-12-01T10:00:00+00:00",
              "hosts": {"gpu-bad-01": entry, "gpu-h200-01": others["gpu-h200-01"]}}
    rows = summary_rows(report)
    bad = dict(zip(rows[0], rows[1], strict=True))
    # The topology was read, but no tensor-parallel size is known to judge it with.
    assert (bad["GPUs"], bad["TP GPUs"], bad["health"], bad["verdict"], bad["drift"]) == (
        "1x NVIDIA H200", "-", "-", reason, "refused")
    assert rows[2][0] == "gpu-h200-01" and rows[2][-1] == "converged"  # audited as ever
    markdown = render_markdown(report)
    assert ("not checked: the settings are invalid, so no stage was planned\n\n"
            f"- Refused: {reason}\n") in markdown
    assert f"| settings | NO | {reason} | {FIX} |" in markdown
    assert host_status(entry) == "refused"
    page = render_html(report, rows)
    assert f"<p>Refused:</p><ul><li>{reason}</li></ul>" in page
    assert '<span class="pill refused">refused</span>' in page


def test_the_reports_of_a_host_with_invalid_settings_go_where_its_data_says():
    inventory = Inventory(([("given", {"audit_report_dir": "/srv/audit",
                                       "audit_report_keep": 5}), "bare"], {}))
    State(inventory, Config())
    with ctx_host.use(inventory.get_host("given")):
        assert audit_stage._report_place({"api_keys"}) == ("/srv/audit", 5)
        # A report setting among the problems: its default stands in.
        assert audit_stage._report_place({"audit_report_keep"}) == ("/srv/audit", 30)
        assert audit_stage._report_place({"audit_report_dir"}) == ("reports", 5)
    with ctx_host.use(inventory.get_host("bare")):
        assert audit_stage._report_place({"api_keys"}) == ("reports", 30)


def test_a_second_audit_in_the_same_second_never_overwrites_the_first(tmp_path):
    # Reports are named to the second: the second audit of a second waits for the next.
    from datetime import datetime, timezone

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    (tmp_path / f"audit-{stamp}.json").write_text("{}")
    json_path, md_path = report_module._paths(str(tmp_path))
    assert json_path.name > f"audit-{stamp}.json"
    assert md_path == json_path.with_suffix(".md") and not json_path.exists()
