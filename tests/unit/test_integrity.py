"""Hand changes around the suite: foreign drop-ins, foreign nginx servers on the gateway's
port, an engine running with another configuration than its unit (facts/units.py
UnitDropIns, facts/nginx.py NginxServers, facts/vllm_service.py EngineProcess, and the
comparisons of pyinfra_vllm/operations/ and pyinfra_vllm/report/verdicts.py).

nginx outputs are real ``nginx -T`` dumps (tests/fixtures/nginx/, record.py there);
the /proc reader runs for real against a process this test starts.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from facts.nginx import NginxServers
from facts.vllm_service import STATUS_KEYS, EngineProcess, parse_process, process_snippet
from pyinfra_vllm.core.settings import validate
from pyinfra_vllm.plans.engine_access import endpoint
from pyinfra_vllm.plans.engine_plan import engine_expected, engine_plan, render_unit
from pyinfra_vllm.plans.gateway import (
    foreign_servers,
    http_server_tokens,
    listen_port,
    server_ports,
)
from pyinfra_vllm.plans.vllm_service import (
    ENGINE_ENV_KEYS,
    HARDENING_EXPECTED,
    SECRET_ENV_KEYS,
    difference_words,
    engine_differences,
    environment_pairs,
    hardening_differences,
)
from pyinfra_vllm.report.markdown import render_markdown
from pyinfra_vllm.report.verdicts import integrity, integrity_problems

TESTS = Path(__file__).parents[1]
RAW = TESTS / "fixtures" / "nginx"
FACTS = TESTS / "facts" / "nginx.NginxServers"
# record.py's API key, "sk-recorded.Key+1": in the raw dumps (the key map, "." and "+"
# escaped), never in what the fact's command prints.
RECORDED_KEY = "sk-recorded"
PYTHON = "/opt/vllm/envs/e/bin/python"
MODEL = "/srv/models/m"


def recorded(case: str) -> dict:
    return json.loads((FACTS / f"{case}.json").read_text())


def at_etc(case: str) -> dict:
    """A recorded fact with the recording's prefix taken off: /etc/nginx/... as on a host."""
    text = json.dumps(recorded(case)["fact"])
    return json.loads(text.replace(f"/tmp/pyinfra-vllm-nginx/{case}", ""))


def own_site(case: str) -> tuple[str, ...]:
    return (f"/tmp/pyinfra-vllm-nginx/{case}/etc/nginx/conf.d/vllm.conf",)


# --- nginx ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["converged", "debian-default-on-80", "debian-default-beside",
                                  "server-tokens-in-nginx-conf", "foreign-conf-d",
                                  "foreign-mixed-file"])
def test_the_fact_reduces_a_real_dump_to_structure_without_any_value(case):
    # The command as the host runs it, nginx -T's output read from the recorded dump. The
    # recorded tree is gone, so no path is a symlink here: F R for every file.
    command = NginxServers().command().get_raw_value()
    out = subprocess.run(["sh", "-c", command.replace("nginx -T 2>/dev/null",
                                                      f"cat {RAW / f'{case}.txt'}")],
                         capture_output=True, text=True, check=True).stdout
    assert RECORDED_KEY in (RAW / f"{case}.txt").read_text()
    assert RECORDED_KEY not in out and "Bearer" not in out and "not-a-key" not in out
    assert [re.sub(r"^F [LR] ", "F ", line) for line in out.splitlines()] == [
        re.sub(r"^F [LR] ", "F ", line) for line in recorded(case)["output"]]


def default_site(case: str) -> str:
    return f"/tmp/pyinfra-vllm-nginx/{case}/etc/nginx/sites-enabled/default"


def test_the_gateway_alone_has_nothing_foreign():
    found = recorded("converged")["fact"]
    assert foreign_servers(found, [8001], own_site("converged"),
                           default_site("converged")) == []


def test_debians_default_site_on_another_port_is_foreign_and_can_go():
    # Port 80 on every address, the welcome page and nginx's version: the suite owns
    # nginx on a gateway host.
    found = recorded("debian-default-beside")["fact"]
    default = found["files"][-1]
    assert default["path"] == default_site("debian-default-beside")
    assert default["symlink"] is True and server_ports(default["servers"][0]) == [80]
    assert foreign_servers(found, [8001], own_site("debian-default-beside"),
                           default_site("debian-default-beside")) == [{
        "path": default_site("debian-default-beside"),
        "symlink": True,
        "servers": [{"line": 21, "listen": ["80 default_server", "[::]:80 default_server"],
                     "server_name": ["_"]}],
        "unsafe": None,
    }]
    # On a host, by its own path.
    (entry,) = foreign_servers(at_etc("debian-default-beside"), [8001])
    assert entry["path"] == "/etc/nginx/sites-enabled/default" and entry["unsafe"] is None


def test_server_tokens_in_nginx_conf_is_read_and_the_site_leaves_its_own_out():
    found = recorded("server-tokens-in-nginx-conf")["fact"]
    assert found["server_tokens"] == [{
        "path": "/tmp/pyinfra-vllm-nginx/server-tokens-in-nginx-conf/etc/nginx/nginx.conf",
        "line": 21, "value": "off"}]
    assert http_server_tokens(found) == (False, [])
    # The site's own, at http level: its server blocks' are not counted.
    converged = recorded("converged")["fact"]
    assert [(e["path"].rpartition("/")[2], e["value"]) for e in converged["server_tokens"]] == [
        ("vllm.conf", "off")]
    assert http_server_tokens(converged, own_site("converged")) == (True, [])


def test_debians_default_site_on_the_gateways_port_is_foreign_and_can_go():
    found = foreign_servers(recorded("debian-default-on-80")["fact"], [80],
                            own_site("debian-default-on-80"))
    assert found == [{
        "path": "/tmp/pyinfra-vllm-nginx/debian-default-on-80/etc/nginx/sites-enabled/default",
        "symlink": True,
        "servers": [{"line": 21, "listen": ["80 default_server", "[::]:80 default_server"],
                     "server_name": ["_"]}],
        "unsafe": None,
    }]


def test_a_hand_made_site_on_one_address_of_the_gateways_port_is_foreign():
    (found,) = foreign_servers(recorded("foreign-conf-d")["fact"], [8001],
                               own_site("foreign-conf-d"))
    assert found["path"].endswith("/etc/nginx/conf.d/api.conf")
    assert (found["symlink"], found["unsafe"]) == (False, None)
    assert found["servers"] == [{"line": 1, "listen": ["127.0.0.1:8001"],
                                 "server_name": ["api.example.com"]}]


def test_a_file_that_also_serves_another_port_cannot_be_set_aside():
    (found,) = foreign_servers(recorded("foreign-mixed-file")["fact"], [8001],
                               own_site("foreign-mixed-file"))
    assert found["servers"] == [{"line": 1, "listen": ["8001 default_server"],
                                 "server_name": []}]
    assert found["unsafe"] == "it also holds server(s) on other ports (line 5)"


def test_a_server_in_nginx_conf_itself_cannot_be_set_aside():
    found = {"files": [{"path": "/etc/nginx/nginx.conf", "symlink": False, "main": True,
                        "servers": [{"line": 40, "listen": [], "server_name": [],
                                     "locations": ["/"]}]}]}
    (entry,) = foreign_servers(found, [80])
    assert entry["unsafe"] == "it is nginx's main configuration file"
    assert foreign_servers(found, [8001]) == []
    assert foreign_servers(None, [8001]) == []


@pytest.mark.parametrize(("args", "port"), [
    ("8001", 8001), ("127.0.0.1:8001", 8001), ("[::]:8001 ssl default_server", 8001),
    ("*:443 ssl", 443), ("localhost", 80), ("127.0.0.1", 80), ("[::1]", 80),
    ("unix:/run/nginx.sock", None),
])
def test_listen_port(args, port):
    assert listen_port(args) == port


# --- the engine's process ---------------------------------------------------------------
def test_the_proc_reader_prints_watched_variables_and_only_digests_of_secrets():
    secret = "sk-in-environ=and;quotes'\""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "--model", MODEL],
        env={"CUDA_VISIBLE_DEVICES": "1", "VLLM_API_KEY": secret, "PATH": "/usr/bin"},
    )
    try:
        snippet = process_snippet(list(ENGINE_ENV_KEYS), list(SECRET_ENV_KEYS))
        out = subprocess.run(["sh", "-c", f"pid={child.pid}; {snippet.get_raw_value()}"],
                             capture_output=True, text=True, check=True).stdout
        lines = Path(f"/proc/{child.pid}/status").read_text().splitlines()
        status = {name: value.strip() for name, _, value in
                  (line.partition(":") for line in lines) if name in STATUS_KEYS}
    finally:
        child.kill()
        child.wait()
    assert secret not in out and "sk-in-environ" not in out
    assert parse_process(out.splitlines()) == {
        "pid": child.pid,
        "argv": [sys.executable, "-c", "import time; time.sleep(60)", "--model", MODEL],
        "env": {"CUDA_VISIBLE_DEVICES": "1"},  # PATH is not watched
        "secret_sha256": {"VLLM_API_KEY": hashlib.sha256(secret.encode()).hexdigest()},
        "status": status,
    }
    assert {"NoNewPrivs", "Seccomp", "CapEff", "CapBnd"} <= set(status)


def test_the_proc_reader_prints_nothing_of_a_status_it_cannot_read():
    snippet = process_snippet(["HOME"], ["VLLM_API_KEY"]).get_raw_value()
    done = subprocess.run(["sh", "-c", f"pid=999999999; {snippet}"],
                          capture_output=True, text=True)
    assert done.returncode == 0
    assert "status" not in done.stdout and "status" not in done.stderr
    assert parse_process(done.stdout.splitlines())["status"] == {}


def test_the_fact_reads_nothing_without_a_main_process():
    command = EngineProcess().command(unit="vllm.service", keys=["HOME"],
                                      secret_keys=["VLLM_API_KEY"]).get_raw_value()
    assert command.startswith("pid=$(systemctl show --property=MainPID --value -- vllm.service")
    assert parse_process([]) is None


def _exec_start_words(unit: str) -> list[str]:
    """ExecStart's words as systemd splits them (double-quoted, backslash line joins)."""
    text = unit.replace("\\\n", "")
    line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    return [word.replace('\\"', '"').replace("\\\\", "\\").replace("%%", "%").replace("$$", "$")
            for word in re.findall(r'"((?:[^"\\]|\\.)*)"', line)]


def _environment(unit: str) -> dict[str, str]:
    pairs = [re.fullmatch(r'Environment="(.*)"', line).group(1)
             for line in unit.splitlines() if line.startswith("Environment=")]
    return dict(pair.split("=", 1) for pair in pairs)


@pytest.mark.parametrize("data", [
    {"gateway_open": True, "nccl_p2p_level": "NVL"},
    {"gateway_open": True, "vllm_device": "cpu", "vllm_version": "0.17.0",
     "tensor_parallel_size": 2},
])
def test_expected_argv_and_environment_are_the_rendered_units(data):
    settings = validate(data)
    bind = "0|1" if settings.vllm_device == "cpu" else None
    engine = engine_plan(settings, python=PYTHON, model_path=MODEL, devices=[0, 1],
                         threads_bind=bind, place=endpoint(settings))
    unit = render_unit(engine)
    expected = engine_expected(engine)
    assert expected["argv"] == _exec_start_words(unit)
    assert expected["argv"][:3] == [PYTHON, "-m", "vllm.entrypoints.openai.api_server"]
    assert expected["env"] == _environment(unit)
    assert set(expected["env"]) <= set(ENGINE_ENV_KEYS)
    assert expected["secret_sha256"] == {}


def test_every_variable_the_unit_can_render_is_watched():
    for data in ({"gateway_open": True, "nccl_p2p_level": "NVL"},
                 {"gateway_open": True, "vllm_device": "cpu", "vllm_version": "0.17.0"}):
        settings = validate(data)
        names = {name for name, _ in environment_pairs(settings, "/opt/vllm/envs/e/bin/python", [0, 1], "auto")}
        assert names <= set(ENGINE_ENV_KEYS)


def _engine(settings):
    expected = engine_expected(engine_plan(settings, python=PYTHON, model_path=MODEL,
                                           devices=[0, 1], place=endpoint(settings)))
    running = {"pid": 4242, "argv": list(expected["argv"]), "env": dict(expected["env"]),
               "secret_sha256": dict(expected["secret_sha256"])}
    return expected, running


def test_an_engine_started_from_its_unit_agrees():
    expected, running = _engine(validate({"gateway_open": True}))
    assert engine_differences(running, expected) == {"argv": [], "env": [], "hardening": []}
    assert engine_differences(None, expected) is None


def test_differences_name_flags_and_keys_and_mask_secrets():
    keys = ["sk-first-" + "1" * 32]
    settings = validate({"vllm_listen_beyond_loopback": True, "vllm_host": "10.0.0.5",
                         "vllm_engine_allow": ["10.0.0.7"], "api_keys": keys})
    expected, running = _engine(settings)
    # The engine's own key, by its digest (facts.vllm_service.EngineKey); never a client's.
    expected["secret_sha256"] = {"VLLM_API_KEY": hashlib.sha256(b"engine-own").hexdigest()}
    index = running["argv"].index("--max-model-len")
    running["argv"][index + 1] = "4096"
    running["argv"] += ["--api-key", "sk-typed-by-hand"]
    running["env"]["CUDA_VISIBLE_DEVICES"] = "1"
    running["env"]["NCCL_P2P_LEVEL"] = "LOC"
    running["secret_sha256"] = {"VLLM_API_KEY": hashlib.sha256(b"sk-old").hexdigest(),
                                "HF_TOKEN": hashlib.sha256(b"hf_x").hexdigest()}
    differences = engine_differences(running, expected)
    assert differences == {
        "argv": [
            {"flag": "--api-key", "running": "(secret)", "unit": None},
            {"flag": "--max-model-len", "running": "4096", "unit": str(settings.max_model_len)},
        ],
        "env": [
            {"key": "CUDA_VISIBLE_DEVICES", "running": "1", "unit": "0,1"},
            {"key": "NCCL_P2P_LEVEL", "running": "LOC", "unit": None},
            {"key": "HF_TOKEN", "running": "(secret)", "unit": None},
            {"key": "VLLM_API_KEY", "running": "(secret)", "unit": "(secret)"},
        ],
        "hardening": [],
    }
    assert "sk-" not in json.dumps(differences)


def test_another_interpreter_is_a_command_difference():
    expected, running = _engine(validate({"gateway_open": True}))
    running["argv"][0] = "/opt/vllm/envs/old/bin/python"
    assert engine_differences(running, expected)["argv"] == [{
        "flag": "(command)",
        "running": "/opt/vllm/envs/old/bin/python -m vllm.entrypoints.openai.api_server",
        "unit": f"{PYTHON} -m vllm.entrypoints.openai.api_server"}]


# --- the engine's hardening (/proc/PID/status) -------------------------------------------
HARDENED = {"NoNewPrivs": "1", "Seccomp": "2", "CapEff": "0000000000000000",
            "CapPrm": "0000000000000000", "CapBnd": "0000000000000000",
            "CapAmb": "0000000000000000"}


def test_the_unit_promises_no_new_privileges_a_seccomp_filter_and_no_capabilities():
    settings = validate({"gateway_open": True})
    unit = render_unit(engine_plan(settings, python=PYTHON, model_path=MODEL, devices=[0, 1],
                                   place=endpoint(settings)))
    for line in ("NoNewPrivileges=yes", "CapabilityBoundingSet=", "AmbientCapabilities="):
        assert line in unit.splitlines()
    assert any(line.startswith("SystemCallFilter=") for line in unit.splitlines())
    assert HARDENING_EXPECTED == HARDENED
    assert tuple(HARDENING_EXPECTED) == STATUS_KEYS


def test_a_hardened_process_agrees_whatever_the_width_of_its_masks():
    assert hardening_differences(HARDENED) == []
    narrow = dict(HARDENED, CapEff="0", CapPrm="00000000", CapBnd="0", CapAmb="0000")
    assert hardening_differences(narrow) == []


def test_a_process_without_no_new_privs_differs():
    assert hardening_differences(dict(HARDENED, NoNewPrivs="0")) == [
        {"key": "NoNewPrivs", "running": "0", "unit": "1"}]


def test_a_process_without_a_seccomp_filter_differs():
    assert hardening_differences(dict(HARDENED, Seccomp="0")) == [
        {"key": "Seccomp", "running": "0", "unit": "2"}]
    assert hardening_differences(dict(HARDENED, Seccomp="1")) == [
        {"key": "Seccomp", "running": "1", "unit": "2"}]


def test_a_capability_in_a_set_differs():
    # cap_net_bind_service (bit 10) effective; the full bounding set of a 6.x kernel.
    assert hardening_differences(dict(HARDENED, CapEff="0000000000000400",
                                      CapBnd="000001ffffffffff")) == [
        {"key": "CapEff", "running": "0000000000000400", "unit": "0000000000000000"},
        {"key": "CapBnd", "running": "000001ffffffffff", "unit": "0000000000000000"},
    ]
    assert hardening_differences(dict(HARDENED, CapAmb="not-hex")) == [
        {"key": "CapAmb", "running": "not-hex", "unit": "0000000000000000"}]


def test_a_status_not_read_is_no_difference():
    assert hardening_differences({}) == []
    assert hardening_differences(None) == []
    # A kernel that does not print a line: the others are still compared.
    assert hardening_differences({"Seccomp": "0"}) == [
        {"key": "Seccomp", "running": "0", "unit": "2"}]
    expected, running = _engine(validate({"gateway_open": True}))
    assert "status" not in running  # as an older EngineProcess gave it
    assert engine_differences(running, expected)["hardening"] == []
    running["status"] = {}
    assert engine_differences(running, expected)["hardening"] == []


def test_the_engine_differs_from_its_unit_by_its_hardening():
    expected, running = _engine(validate({"gateway_open": True}))
    running["status"] = dict(HARDENED, NoNewPrivs="0")
    differences = engine_differences(running, expected)
    assert differences == {"argv": [], "env": [], "hardening": [
        {"key": "NoNewPrivs", "running": "0", "unit": "1"}]}
    assert difference_words(differences) == "NoNewPrivs (0, unit 1)"
    running["status"] = dict(HARDENED)
    assert engine_differences(running, expected)["hardening"] == []


def test_the_audit_names_a_hardening_difference():
    expected, running = _engine(validate({"gateway_open": True}))
    running["status"] = dict(HARDENED, CapBnd="000001ffffffffff")
    found = integrity({"vllm.service": []}, {}, None, None, running, expected)
    assert found["engine"]["hardening"] == [
        {"key": "CapBnd", "running": "000001ffffffffff", "unit": "0000000000000000"}]
    problems = integrity_problems({"integrity": found})
    assert problems == ["engine runs with another configuration than its unit: CapBnd "
                        "(000001ffffffffff, unit 0000000000000000)"]
    from tests.unit.test_audit import entry

    md = render_markdown({"generated_at": "t", "hosts": {"gpu-1": {
        **entry([], []), "integrity": found}}})
    section = md.split("### Hand changes\n\n", 1)[1].split("\n\n", 1)[0]
    assert section.startswith("- engine runs with another configuration than its unit: "
                              "CapBnd (000001ffffffffff, unit 0000000000000000)")


def test_a_report_written_before_hardening_was_read_still_renders():
    expected, running = _engine(validate({"gateway_open": True}))
    running["env"]["CUDA_VISIBLE_DEVICES"] = "1"
    found = integrity({"vllm.service": []}, {}, None, None, running, expected)
    del found["engine"]["hardening"]
    assert integrity_problems({"integrity": found}) == [
        "engine runs with another configuration than its unit: CUDA_VISIBLE_DEVICES "
        "(1, unit 0,1)"]


# --- the audit's field -------------------------------------------------------------------
OWN = "/etc/systemd/system/nvidia-persistenced.service.d/50-pyinfra-vllm.conf"


def test_the_audit_names_every_hand_change():
    expected, running = _engine(validate({"gateway_open": True}))
    running["env"]["CUDA_VISIBLE_DEVICES"] = "1"
    found = integrity(
        {"vllm.service": [{"path": "/etc/systemd/system/vllm.service.d/override.conf",
                           "loaded": False, "on_disk": True}],
         "nvidia-persistenced.service": [{"path": OWN, "loaded": True, "on_disk": True}]},
        {"nvidia-persistenced.service": [OWN]},
        at_etc("foreign-conf-d"), [8001], running, expected,
    )
    assert found["drop_ins"] == {
        "nvidia-persistenced.service": [],
        "vllm.service": ["/etc/systemd/system/vllm.service.d/override.conf"]}
    assert [item["path"].rpartition("/")[2] for item in found["nginx"]] == ["api.conf"]
    assert found["engine"]["env"] == [{"key": "CUDA_VISIBLE_DEVICES", "running": "1",
                                       "unit": "0,1"}]
    entry = {"integrity": found}
    problems = integrity_problems(entry)
    assert problems == [
        "foreign drop-in for vllm.service: /etc/systemd/system/vllm.service.d/override.conf",
        "foreign nginx server: /etc/nginx/conf.d/api.conf: line 1: listen 127.0.0.1:8001 server_name api.example.com",
        "engine runs with another configuration than its unit: CUDA_VISIBLE_DEVICES "
        "(1, unit 0,1)",
    ]


def test_the_markdown_report_has_a_hand_changes_section():
    from tests.unit.test_audit import entry

    found = integrity({"vllm.service": []}, {}, None, [8001], None, None)
    assert found == {"drop_ins": {"vllm.service": []}, "nginx": [], "engine": None,
                     "engine_note": "not checked: the vllm_service stage did not plan in "
                                    "this run"}
    md = render_markdown({"generated_at": "t", "hosts": {"gpu-1": {
        **entry([], []), "integrity": found}}})
    section = md.split("### Hand changes\n\n", 1)[1].split("\n\n", 1)[0].rstrip("\n")
    assert section == (
        "No foreign drop-in, no foreign nginx server on the gateway's port, and the engine "
        "runs with its unit's configuration.\n"
        "- Engine: not checked: the vllm_service stage did not plan in this run")
    assert "### Hand changes" not in render_markdown(
        {"generated_at": "t", "hosts": {"gpu-1": entry([], [])}})
