"""The audit's view of the front door: a router host's pool read from HAProxy's runtime API
(facts/router.py RouterPool, its fixtures recorded from HAProxy 2.6.12), its verdict, its
files and secrets compared as the router stage writes them, and the front door's view of
each serving host beside its own verdict in every report (JSON, Markdown, HTML, terminal).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pyinfra
import pytest
from pyinfra.api import Config, State
from pyinfra.api.state import StateStage
from pyinfra.context import ctx_host, ctx_state

from facts.router import RouterPool, parse_pool
from pyinfra_vllm.core.settings import load_settings
from pyinfra_vllm.plans import access
from pyinfra_vllm.plans import router as router_plan
from pyinfra_vllm.plans.gateway import sha1
from pyinfra_vllm.report import runs as report_runs
from pyinfra_vllm.report.front_door import with_front_door
from pyinfra_vllm.report.html_page import render_html
from pyinfra_vllm.report.markdown import render_markdown
from pyinfra_vllm.report.summary import summary_rows
from pyinfra_vllm.report.verdicts import router_summary
from pyinfra_vllm.stages import audit as audit_stage
from pyinfra_vllm.stages import full as full_stage
from pyinfra_vllm.stages.router import front_door_files
from tests.unit.fleet_reports import connected_state, h200_state, host_entry
from tests.unit.test_engine_plan import bare_host
from tests.unit.test_router import router_inventory
from tests.unit.test_router_haproxy import fleet  # noqa: F401 - the real HAProxy's fixture
from tools.audit import verdict

KEY = "sk-router-" + "0123456789abcdef" * 2
POOLS = Path(__file__).resolve().parents[1] / "facts" / "router.RouterPool"
ACTIVE = {"active": "active", "enabled": "enabled", "start_to_active_s": 0.1}
GPU2 = "gpu-2.example.internal"
ROUTER_STATE = {"os": {"name": "Debian", "major": 12,
                       "release_meta": {"PRETTY_NAME": "Debian GNU/Linux 12 (bookworm)"}},
                "kernel": "6.1.0-28-amd64"}


def pool(name: str) -> dict[str, Any] | None:
    """What RouterPool returns for its recorded output ``name`` (tests/facts/...)."""
    return json.loads((POOLS / f"{name}.json").read_text())["fact"]


# --- the fact and the verdict ------------------------------------------------------------
def test_a_gateway_whose_check_is_running_is_out_with_its_last_words_not_code_0():
    # HAProxy 2.6 marks the status "* " and its code 0 while the next check runs.
    assert pool("one-out") == {"servers": [
        {"host": "gpu-1", "in_pool": False, "status": "DOWN", "why": "L7STS Layer7 wrong status"},
        {"host": GPU2, "in_pool": True, "status": "UP", "why": "L7OK Layer7 check passed"}]}


@pytest.mark.parametrize("output", [["--- absent ---", "x"], ["", "--- unreadable ---"]])
def test_the_fact_never_reads_a_marker_beside_other_words_as_a_pool(output):
    found = parse_pool(output)
    assert found is not None and "error" in found


@pytest.mark.parametrize(("name", "active", "state", "ok", "reason"), [
    ("full", ACTIVE, "ok", True, "2 of 2 serving host(s) in the pool"),
    ("one-out", ACTIVE, "ok", True, "1 of 2 serving host(s) in the pool; gpu-1 out (DOWN "
     "L7STS Layer7 wrong status)"),
    ("empty", ACTIVE, "empty", False, "no serving host in the pool: gpu-1 out (DOWN L7STS "
     f"503 Service Unavailable); {GPU2} out (DOWN L7STS 503 Service Unavailable)"),
    ("unreadable", ACTIVE, "unknown", False,
     "HAProxy's runtime API cannot be asked: [Errno 111] Connection refused"),
    ("not-show-stat", ACTIVE, "unknown", False, "HAProxy's runtime API gave no pool: not "
     "HAProxy's show stat output (no '# pxname,svname,' header)"),
    ("absent", ACTIVE, "unknown", False, "no stats socket at /run/haproxy/vllm-router.sock: "
     "HAProxy does not run the front door's configuration"),
    ("full", {"active": "failed", "enabled": "enabled", "start_to_active_s": None},
     "inactive", False, "haproxy.service is failed"),
    ("absent", None, "inactive", False, "haproxy.service is not installed"),
])
def test_the_front_door_s_verdict(name, active, state, ok, reason):
    judged = router_plan.verdict(pool(name), active)
    assert (judged["state"], judged["ok"], judged["reason"]) == (state, ok, reason)


def test_a_file_changed_by_hand_or_missing_is_named_and_nothing_of_its_content():
    wanted = {router_plan.CONFIG_PATH: "global\n", router_plan.TLS_KEY_PATH: "SECRET KEY\n",
              router_plan.DROPIN_PATH: "[Service]\n"}
    live = {router_plan.CONFIG_PATH: sha1("global\n# by hand\n"),
            router_plan.TLS_KEY_PATH: sha1("SECRET KEY\n")}
    assert router_plan.file_findings(wanted, live) == [
        "router: /etc/haproxy/vllm-router.cfg (HAProxy's configuration) is not what the "
        "router stage writes (changed by hand): the next run puts it back",
        "router: /etc/systemd/system/haproxy.service.d/pyinfra-vllm.conf (haproxy's drop-in) "
        "is missing: the next run writes it",
    ]


# --- the access table's rows of a router host ---------------------------------------------
def test_the_router_s_secrets_are_rows_of_the_access_table_kept_by_the_router_stage():
    rows = {row.path: (row.owner, row.group, row.mode, row.kind, row.stage)
            for row in access.TABLE if row.stage == access.ROUTER_STAGE}
    assert rows == {
        "/etc/haproxy/vllm-router-keys.lst": ("root", "root", "600", "file", "router"),
        "/etc/haproxy/vllm-router-tls/cert.pem.key": ("root", "root", "600", "file", "router"),
        "/etc/haproxy/vllm-router-tls": ("root", "root", "755", "directory", "router"),
        "/etc/haproxy/.pyinfra-vllm-staging": ("root", "root", "700", "directory", "router"),
    }
    # A serving host's audit reads none of them.
    assert access.STAGES == ("gateway", "vllm_service")
    assert "| `/etc/haproxy/vllm-router-keys.lst` | root:root | 0600 | file | router |" in (
        access.markdown())


# --- the audit planned for a router host of a real inventory ------------------------------
@pytest.fixture
def audited(monkeypatch, tmp_path):
    """``audited(answers, sha1s)``: deploys/full.py then the audit planned for the router
    host rt-1 of an inventory of two serving hosts and it, each fact answered from
    ``answers`` (by name) or as a bare host's, Sha1File from ``sha1s`` (by path): its
    entry in the JSON report the audit wrote, its context and the facts read."""
    monkeypatch.setattr(pyinfra, "is_cli", True)
    monkeypatch.setattr(report_runs.atexit, "register", lambda *args, **kwargs: None)

    def audit(answers: dict[str, Any], sha1s: dict[str, str] | None = None):
        inventory = router_inventory(tmp_path, tmp_path / "reports")
        reads = bare_host(monkeypatch, {"LinuxDistribution": ROUTER_STATE["os"], **answers,
                                        "Sha1File": lambda path, **_: (sha1s or {}).get(path)})
        state = State(inventory, Config())
        state.set_stage(StateStage.Prepare)
        host = inventory.get_host("rt-1")
        state.activate_host(host)
        with ctx_state.use(state), ctx_host.use(host):
            full_stage.full()
            audit_stage.audit()
            _problems, files = front_door_files(load_settings(host), "rt-1")
        run = report_runs.audit_run(state, str(tmp_path / "reports"))
        report = json.loads(run.json_path.read_text())
        return report["hosts"]["rt-1"], [name for name, _ in reads], files

    return audit


def _converged_files(files: dict[str, str]) -> dict[str, str]:
    return {path: sha1(content) for path, content in files.items()}


def test_a_router_host_is_audited_as_a_front_door_not_as_a_serving_host(audited):
    _entry, _made, files = audited({})
    entry, made, _files = audited({"RouterPool": pool("full"), "UnitActivation": ACTIVE},
                                  _converged_files(files))
    assert entry["role"] == "router"
    assert entry["router"]["state"] == "ok" and entry["summary"]["verdict"] == "ok"
    assert [check["name"] for check in entry["checks"]] == ["os", "front_door"]
    assert entry["refused"] == [] and entry["findings"] == []
    assert entry["gpu_health"] == {} and "engine" not in entry and "bench" not in entry
    # Nothing of a serving host's is read on it.
    assert not {"EngineServing", "EngineProcess", "NginxServers", "BenchRecord",
                "SentinelState", "VllmEnvironments"} & set(made)
    assert "RouterPool" in made


@pytest.mark.parametrize(("name", "active", "words"), [
    ("one-out", ACTIVE, None),
    ("empty", ACTIVE, "empty: no serving host in the pool: gpu-1 out (DOWN L7STS 503 Service "
     f"Unavailable); {GPU2} out (DOWN L7STS 503 Service Unavailable)"),
    ("unreadable", ACTIVE,
     "unknown: HAProxy's runtime API cannot be asked: [Errno 111] Connection refused"),
    ("full", {"active": "inactive", "enabled": "enabled", "start_to_active_s": None},
     "inactive: haproxy.service is inactive"),
])
def test_a_front_door_that_cannot_serve_is_refused_named(audited, name, active, words):
    entry, _made, _files = audited({"RouterPool": pool(name), "UnitActivation": active})
    refusal = [reason for reason in entry["refused"] if reason.startswith("router: rt-1")]
    if words is None:  # one host out of two: the front door serves
        assert refusal == [] and entry["router"]["ok"] is True
        return
    assert refusal == [f"router: rt-1: the front door cannot serve ({words}): journalctl -u "
                       "haproxy.service; each gateway's /health"]
    assert entry["summary"]["verdict"] == words.partition(": ")[2]


def test_a_hand_edit_a_secret_s_mode_and_a_foreign_drop_in_are_named(audited):
    _entry, _made, files = audited({})
    sums = _converged_files(files)
    sums[router_plan.CONFIG_PATH] = sha1("edited by hand\n")
    entry, _made, _files = audited({
        "RouterPool": pool("full"), "UnitActivation": ACTIVE,
        "PathModes": {router_plan.KEYS_PATH: {"owner": "root", "group": "root",
                                              "mode": "644", "kind": "file"}},
        "UnitDropIns": [{"path": router_plan.DROPIN_PATH, "loaded": True, "on_disk": True},
                        {"path": "/etc/systemd/system/haproxy.service.d/override.conf",
                         "loaded": True, "on_disk": True}],
    }, sums)
    assert entry["findings"] == [
        "router: /etc/haproxy/vllm-router.cfg (HAProxy's configuration) is not what the "
        "router stage writes (changed by hand): the next run puts it back",
        "access: /etc/haproxy/vllm-router-keys.lst is root:root 0644, should be root:root "
        "0600 (the front door's key list (the sha256 of each accepted header))",
        "foreign drop-in for haproxy.service: "
        "/etc/systemd/system/haproxy.service.d/override.conf",
    ]
    drift = {(d["stage"], d["operation"]) for d in entry["drift"]}
    assert ("router", "Router: HAProxy's configuration, key hashes and TLS files (haproxy -c "
            "before going live)") in drift
    assert ("router", "Router: owner and mode of its key files and directories") in drift
    assert KEY not in json.dumps(entry)


def test_the_wrapper_exits_1_naming_a_front_door_with_an_empty_pool():
    router = router_summary(ROUTER_STATE, router_plan.verdict(pool("empty"), ACTIVE))
    reason = router_plan.refusal("rt-1", router["router"])
    router.update(drift=[], conditional=[], refused=[reason], drift_note=None, findings=[])
    report = {"hosts": {"rt-1": router, "gpu-1": host_entry("gpu-1", h200_state(), [], [])}}
    code, lines = verdict(report, {"plan": [{"hosts_with_change": ["rt-1"]}]})
    assert code == 1
    assert lines == [f"drift: host rt-1: refused: {reason}",
                     "audit: 1 of 2 host(s) drifted or refused"]


# --- the front door's view beside each serving host's verdict -----------------------------
def _fleet(router_pool: str) -> dict[str, dict[str, Any]]:
    router = router_summary(ROUTER_STATE, router_plan.verdict(pool(router_pool), ACTIVE))
    router.update(drift=[], conditional=[], refused=[], drift_note=None, findings=[])
    return {"gpu-1": host_entry("gpu-1", h200_state(), [], []),
            GPU2: host_entry(GPU2, h200_state(), [], []),
            "gpu-3": host_entry("gpu-3", h200_state(), [], []), "rt-1": router}


def test_the_json_report_carries_the_front_door_s_view_of_each_serving_host(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setattr(report_runs.atexit, "register", lambda *args, **kwargs: None)
    hosts = _fleet("one-out")
    run_state = connected_state(sorted(hosts))
    for name, entry in hosts.items():
        report_runs.record(run_state, name, entry, str(tmp_path))
    written = json.loads(report_runs.audit_run(run_state, str(tmp_path)).json_path.read_text())
    views = {name: entry.get("front_door") for name, entry in written["hosts"].items()}
    assert views == {
        "gpu-1": [{"router": "rt-1", "in_pool": False, "status": "DOWN",
                   "why": "L7STS Layer7 wrong status"}],
        GPU2: [{"router": "rt-1", "in_pool": True, "status": "UP",
                "why": "L7OK Layer7 check passed"}],
        "gpu-3": [{"router": "rt-1", "in_pool": False, "status": "absent",
                   "why": "from the front door's running configuration"}],
        "rt-1": None,
    }
    assert written["hosts"]["rt-1"]["router"]["servers"] == pool("one-out")["servers"]


def test_the_markdown_html_and_terminal_reports_show_the_front_door_column():
    report = {"generated_at": "2026-12-08T10:00:00+00:00", "hosts": with_front_door(
        _fleet("one-out"))}
    rows = summary_rows(report)
    assert rows[0][10:13] == ("verdict", "front door", "drift")
    cells = {row[0]: row[11] for row in rows[1:]}
    assert cells == {"gpu-1": "out: DOWN L7STS Layer7 wrong status",
                     GPU2: "in pool: UP L7OK Layer7 check passed",
                     "gpu-3": "out: absent from the front door's running configuration",
                     "rt-1": "ok: 1 of 2 serving host(s) in the pool; gpu-1 out (DOWN L7STS "
                             "Layer7 wrong status)"}
    assert rows[-1][2:10] == ("-",) * 8  # no GPU judged on the front door
    text = render_markdown(report)
    assert "Front door: out: DOWN L7STS Layer7 wrong status\n" in text
    assert "| gpu-1 | NO | DOWN L7STS Layer7 wrong status |" in text
    page = render_html(report, rows)
    assert "<th>front door</th>" in page and "<h3>Front door's pool</h3>" in page
    assert "<td>gpu-1</td><td>NO</td><td>DOWN L7STS Layer7 wrong status</td>" in page


def test_a_front_door_whose_pool_was_not_read_says_so_beside_each_host():
    hosts = with_front_door(_fleet("unreadable"))
    assert hosts["gpu-1"]["front_door"] == [{
        "router": "rt-1", "in_pool": None, "status": "unknown",
        "why": "the front door's pool was not read: HAProxy's runtime API cannot be asked: "
               "[Errno 111] Connection refused"}]


def test_without_a_router_host_the_reports_are_as_they_were():
    hosts = {name: entry for name, entry in _fleet("full").items() if name != "rt-1"}
    assert with_front_door(hosts) is hosts
    header = summary_rows({"generated_at": "-", "hosts": hosts})[0]
    assert "front door" not in header and header[-1] == "drift"
    assert "Front door" not in render_markdown({"generated_at": "-", "hosts": hosts})


# --- the fact's own command, against the real HAProxy ---------------------------------------
@pytest.mark.skipif(os.geteuid() != 0, reason="HAProxy's chroot and user need root")
def test_the_fact_s_command_reads_the_real_haproxy_s_pool(fleet):  # noqa: F811
    door, one, _two = fleet

    def read() -> dict[str, Any] | None:
        command = RouterPool().command(socket=str(door.socket)).get_raw_value()
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                              timeout=30, check=True)
        return parse_pool(done.stdout.splitlines())

    found = read()
    assert found is not None
    assert [(s["host"], s["in_pool"], s["status"]) for s in found["servers"]] == [
        ("gpu-1", True, "UP"), ("gpu-2", True, "UP")]
    one.health = 503
    door.wait_pool({"gpu-1": False, "gpu-2": True})
    out = read()
    assert out is not None
    assert out["servers"][0]["in_pool"] is False and out["servers"][0]["why"].startswith("L7STS")
