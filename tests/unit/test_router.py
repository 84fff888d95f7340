"""The front door's plan: its pool from the inventory, the rendered HAProxy configuration,
the key hashes, the trust for the gateways, the refusals, and the pool read back
(pyinfra_vllm/plans/router.py); the whole run's router branch (pyinfra_vllm/stages/full.py).
The rendered configuration under the real HAProxy: tests/unit/test_router_haproxy.py."""

from __future__ import annotations

import ast
import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from pyinfra_vllm.plans import router
from pyinfra_vllm.stages.router import is_router

KEY = "sk-router-" + "0123456789abcdef" * 2


def render(**overrides: object) -> str:
    values: dict = {
        "backends": [router.backend_of("gpu-1", None, "10.0.0.11", 8001),
                     router.backend_of("gpu-2", None, None, 8001),
                     router.backend_of("gpu-3", "fd00::13", None, 9001)],
        "router_port": 8443, "metrics_port": 8405, "metrics_allow": ["10.9.0.0/16"],
        "key_check": True, "prefix_bytes": 2048, "buffer_kib": 256,
        "max_connections": 2000, "check_interval_ms": 1000, "proxy_timeout_s": 3600,
    }
    values.update(overrides)
    return router.render_config(**values)  # type: ignore[arg-type]


def server_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("server ")]


def test_each_gateway_is_reached_at_its_address_and_checked_against_its_name():
    # An inventory name is a DNS name: sent as SNI and checked against the certificate;
    # an IP address has no name to check (the trust is the CA file's alone).
    assert server_lines(render()) == [
        "server gpu-1 10.0.0.11:8001",
        "server gpu-2 gpu-2:8001 sni str(gpu-2) verifyhost gpu-2",
        "server gpu-3 ipv6@fd00::13:9001",
    ]


def test_every_gateway_is_verified_health_checked_and_retried_on_another():
    text = render()
    assert ("default-server check check-ssl ssl verify required ca-file "
            f"{router.GATEWAY_CA_PATH} alpn http/1.1 inter 1000 fastinter 1000 downinter 1000 "
            "fall 2 rise 2") in text
    assert "http-check send meth GET uri /health ver HTTP/1.1 hdr Host vllm-router" in text
    assert "http-check expect status 200" in text
    assert "retry-on conn-failure empty-response 502 503 504" in text
    assert "option redispatch 1" in text
    assert "balance hash req.body,bytes(0,2048)" in text
    assert "hash-type consistent" in text
    assert "tune.bufsize 262144" in text
    assert "verify none" not in text


def test_clients_get_tls_only_v1_and_the_key_check():
    text = render()
    assert f"bind :8443 ssl crt {router.TLS_CERT_PATH} alpn http/1.1" in text
    assert "acl vllm_api path_reg ^/v1(/[A-Za-z0-9_-]+)+$" in text
    assert (f"acl vllm_key_ok req.fhdr(authorization),sha2(256),hex -m str -f "
            f"{router.KEYS_PATH}") in text
    assert "return status 401" in text
    # The runtime API: a root-only Unix socket at user level, no TCP stats or admin page.
    assert f"stats socket {router.STATS_SOCKET} mode 600 level user" in text
    assert "level admin" not in text and "stats uri" not in text and "stats enable" not in text


def test_without_keys_the_front_door_checks_none():
    # gateway_open: the gateways serve without keys, and so does the front door.
    text = render(key_check=False)
    assert "vllm_key_ok" not in text and "return status 401" not in text
    assert router.key_hashes([]) == ""


def test_metrics_answer_only_the_allowed_networks_on_their_own_port():
    text = render(metrics_allow=["127.0.0.1/32", "10.9.0.0/16"])
    assert f"bind :8405 ssl crt {router.TLS_CERT_PATH} alpn http/1.1" in text
    assert "acl metrics_allowed src 127.0.0.1/32 10.9.0.0/16" in text
    assert "http-request deny deny_status 403 unless metrics_allowed" in text


def test_the_key_list_holds_hashes_never_a_key():
    text = router.key_hashes([KEY, "k" * 40])
    expected = hashlib.sha256(f"Bearer {KEY}".encode()).hexdigest().upper()
    assert text.splitlines() == [expected,
                                 hashlib.sha256(b"Bearer " + b"k" * 40).hexdigest().upper()]
    assert KEY not in text and KEY not in render()


def test_a_gateway_is_at_its_gateway_address_then_ssh_hostname_then_name():
    assert router.backend_of("gpu-1", "gw.example", "10.0.0.1", 8001).address == "gw.example"
    assert router.backend_of("gpu-1", None, "10.0.0.1", 8001).address == "10.0.0.1"
    assert router.backend_of("gpu-1", None, None, 8002) == router.Backend("gpu-1", "gpu-1", 8002)


def test_the_gateways_trust_is_the_ca_else_each_certificate_once():
    one, two = "-----BEGIN CERTIFICATE-----\nA\n", "-----BEGIN CERTIFICATE-----\nB"
    assert router.gateway_trust(None, [one, two, one]) == one + two + "\n"
    assert router.gateway_trust("CA", [one]) == "CA"


def test_a_router_without_a_pool_tls_or_a_fit_name_is_refused_with_each_reason():
    assert router.pool_problems("rt-1", [], [], tls=True) == [
        "router rt-1: the inventory has no serving host (a host outside the routers group) "
        "for the front door to send requests to"]
    problems = router.pool_problems(
        "rt-1", [router.Backend("gpu 1", "10.0.0.1", 8001)], ["gpu 1"], tls=False)
    assert problems == [
        "router rt-1: the gateway of gpu 1 has no TLS (gateway_tls_cert, gateway_tls_key): the "
        "front door sends client keys only over TLS; set them for that host",
        "router rt-1: router_tls_cert and router_tls_key are not set: the front door serves "
        "clients only over TLS; set both",
        "router rt-1: the host name 'gpu 1' is not one HAProxy takes as a server name "
        "(letters, digits and _.:-, at most 64); rename the host in the inventory",
    ]
    assert router.pool_problems("rt-1", [router.Backend("gpu-1", "gpu-1", 8001)], [],
                                tls=True) == []


def test_a_serving_host_that_leaves_too_briefly_for_two_checks_refuses_the_router(tmp_path):
    """Each serving host's drain_leave_s against the front door's two failed health checks
    (router_check_interval_ms x 2): the router stage's refusal, read from the settings of
    a real inventory's hosts."""
    from pyinfra.api import Config, Inventory, State
    from pyinfra.context import ctx_host, ctx_state

    from pyinfra_vllm.core.settings import load_settings
    from pyinfra_vllm.core.settings_checks_router import leave_problems
    from pyinfra_vllm.stages import router as router_stage

    # The defaults (3 s, 1000 ms) agree, and 2 s is exactly two checks of 1 s.
    assert leave_problems("rt-1", {"gpu-1": 3, "gpu-2": 2}, 1000) == []
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\nMIGH\n-----END PRIVATE KEY-----\n")
    key.chmod(0o600)
    tls = {"gateway_tls_cert": str(cert), "gateway_tls_key": str(key)}
    hosts = [("gpu-1", tls), ("gpu-2", {**tls, "drain_leave_s": 2}),
             ("rt-1", {"router_tls_cert": str(cert), "router_tls_key": str(key),
                       "router_check_interval_ms": 1500})]
    inventory = Inventory((hosts, {"api_keys": [KEY]}), routers=(hosts[2:], {}))
    front_door = inventory.get_host("rt-1")
    with ctx_state.use(State(inventory, Config())), ctx_host.use(front_door):
        problems, files = router_stage.front_door_files(load_settings(front_door), "rt-1")
    assert problems == [
        "router rt-1: drain_leave_s of gpu-2 is 2 s, shorter than the front door's two failed "
        "health checks (router_check_interval_ms 1500 x 2) that take a host out: a request "
        "larger than router_buffer_kib sent to it then gets its drain's 503; set "
        "drain_leave_s to at least 3 for that host (a second more for margin) or lower "
        "router_check_interval_ms"]
    assert files == {}


SHOW_STAT = """\
# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,status,weight,act,bck,chkfail,chkdown,lastchg,downtime,qlimit,pid,iid,sid,throttle,lbtot,tracked,type,rate,rate_lim,rate_max,check_status,check_code,check_duration,hrsp_1xx,hrsp_2xx,hrsp_3xx,hrsp_4xx,hrsp_5xx,hrsp_other,hanafail,req_rate,req_rate_max,req_tot,cli_abrt,srv_abrt,comp_in,comp_out,comp_byp,comp_rsp,lastsess,last_chk,last_agt,qtime,ctime,rtime,ttime
vllm_front_door,FRONTEND,,,0,1,2000,3,0,0,0,0,0,,,,,OPEN,,,,,,,,,1,2,0,,,,0,0,0,1,,,,0,3,0,0,0,0,,0,1,3,,,0,0,0,0,,,,,,,,
vllm_gateways,gpu-1,0,0,0,1,,2,0,0,,0,,0,0,0,0,UP,1,1,0,0,0,20,0,,1,3,1,,2,,2,0,,1,L7OK,200,1,0,2,0,0,0,0,,,,2,0,0,,,,,1,,,0,0,0,1
vllm_gateways,gpu-2,0,0,0,0,,0,0,0,,0,,0,0,0,0,DOWN,1,1,0,2,1,3,3,,1,3,2,,0,,2,0,,0,L7STS,503,1,0,0,0,0,0,0,,,,0,0,0,,,,,-1,<html>503</html>,,0,0,0,0
vllm_gateways,gpu-3,0,0,0,0,,0,0,0,,0,,0,0,0,0,UP 1/2,1,1,0,1,0,3,0,,1,3,3,,0,,2,0,,0,L4CON,,0,0,0,0,0,0,0,,,,0,0,0,,,,,-1,Connection refused,,0,0,0,0
vllm_gateways,BACKEND,0,0,0,1,200,2,0,0,0,0,,0,0,0,0,UP,2,2,0,,0,20,0,,1,3,0,,2,,1,0,,1,,,,0,2,0,0,0,0,,,,2,0,0,0,0,0,0,1,,,0,0,0,1
"""


def test_the_pool_as_haproxy_sees_it_each_host_in_or_out_and_why():
    assert router.pool_view(SHOW_STAT) == [
        {"host": "gpu-1", "in_pool": True, "status": "UP", "why": "L7OK 200"},
        {"host": "gpu-2", "in_pool": False, "status": "DOWN", "why": "L7STS 503 <html>503</html>"},
        {"host": "gpu-3", "in_pool": True, "status": "UP 1/2", "why": "L4CON Connection refused"},
    ]


@pytest.mark.parametrize("text", ["", "Unknown command\n", "# pxname,svname,qcur\nx,y,z\n"])
def test_an_answer_that_is_not_show_stat_is_never_an_empty_healthy_pool(text):
    with pytest.raises(ValueError):
        router.pool_view(text)


PACKAGE_UNIT = Path("/lib/systemd/system/haproxy.service")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed")
def test_the_drop_in_hardens_debian_s_unit(tmp_path):
    # Debian 12's haproxy.service with the suite's drop-in, as systemd reads them together;
    # `systemd-analyze security --offline=true` (systemd 252) rates the package's unit
    # alone 9.6 UNSAFE.
    unit = tmp_path / "haproxy.service"
    unit.write_text(PACKAGE_UNIT.read_text() + router.render_dropin())
    result = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager",
                             str(unit)], capture_output=True, text=True, timeout=120)
    assert "Unknown key" not in result.stderr, result.stderr
    assert "Overall exposure level for haproxy.service: 3.0 OK" in result.stdout, result.stdout
    dropin = router.render_dropin()
    assert f"ExecStart=\nExecStart=/usr/sbin/haproxy -Ws -f {router.CONFIG_PATH} " in dropin
    assert " -S " not in dropin  # no master CLI


class _Host:
    def __init__(self, *groups: str) -> None:
        self.groups = list(groups)


def test_a_host_is_a_router_by_the_routers_group_alone():
    assert is_router(_Host("routers"))
    assert not is_router(_Host("a100_nvlink"))
    assert not is_router(_Host())


def test_the_whole_run_gives_a_router_host_the_router_stage_alone():
    # full's first statement sends a router host to the router stage and returns before
    # the run's context, preflight or any serving stage.
    tree = ast.parse(Path("pyinfra_vllm/stages/full.py").read_text())
    full = next(node for node in tree.body
                if isinstance(node, ast.FunctionDef) and node.name == "full")
    branch = full.body[1]
    assert isinstance(branch, ast.If)
    assert ast.unparse(branch.test) == "is_router(host)"
    assert [ast.unparse(statement) for statement in branch.body] == ["router()", "return"]


# --- the router stage planned for a router host of a real inventory ----------------------
def router_inventory(tmp_path: Path, reports: Path):
    """A real inventory of two serving hosts (gpu-1 at 10.0.0.11, gpu-2.example.internal)
    with TLS gateways and one router host, rt-1, in the routers group: their certificate
    and key files made in ``tmp_path`` (the key 0600), the audit's reports in ``reports``."""
    from pyinfra.api import Inventory

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\nMIGH\n-----END PRIVATE KEY-----\n")
    key.chmod(0o600)
    common = {"api_keys": [KEY], "audit_report_dir": str(reports), "skip_stages": ["model"]}
    gateway_tls = {"gateway_tls_cert": str(cert), "gateway_tls_key": str(key)}
    hosts = [("gpu-1", {"ssh_hostname": "10.0.0.11", **gateway_tls}),
             ("gpu-2.example.internal", gateway_tls),
             ("rt-1", {"router_tls_cert": str(cert), "router_tls_key": str(key)})]
    return Inventory((hosts, common), serving=(hosts[:2], {}), routers=(hosts[2:], {}))


@pytest.fixture
def planned_router(monkeypatch, tmp_path):
    """``planned_router(name)``: the whole run (deploys/full.py's ``full``) planned for the
    host ``name`` of an inventory of two serving hosts and one router (rt-1), each fact
    answered as a bare host's: the names of the operations it got, and the arguments of
    the gateway's checked swap."""
    import pyinfra
    from pyinfra.api import Config, State
    from pyinfra.api.state import StateStage
    from pyinfra.context import ctx_host, ctx_state

    from pyinfra_vllm.operations import gateway as gateway_ops
    from pyinfra_vllm.report import runs as report_runs
    from pyinfra_vllm.stages import full as full_stage
    from tests.unit.test_engine_plan import bare_host, counted

    monkeypatch.setattr(pyinfra, "is_cli", True)
    monkeypatch.setattr(report_runs.atexit, "register", lambda *args, **kwargs: None)
    inventory = router_inventory(tmp_path, tmp_path)
    bare_host(monkeypatch, {})

    def plan(name: str, whole=None) -> tuple[list[str], dict]:
        state = State(inventory, Config())
        state.set_stage(StateStage.Prepare)
        host = inventory.get_host(name)
        state.activate_host(host)
        with ctx_state.use(state), ctx_host.use(host):
            _calls, seen = counted(monkeypatch, [(gateway_ops, "site")])
            (whole or full_stage.full)()
        names = [list(state.op_meta[op].names)[0] for op in state.get_op_order()
                 if op in host.op_hash_order]
        return names, seen

    return plan


def test_a_router_host_is_not_benchmarked(planned_router):
    from pyinfra_vllm.stages.bench import bench

    names, seen = planned_router("rt-1", bench)
    assert names == [] and not seen.get("site")


def test_a_router_host_is_planned_the_router_stage_alone(planned_router):
    names, seen = planned_router("rt-1")
    # No preflight, engine, gateway or sentinel: the router stage's operations alone.
    assert [name.removeprefix("full | router | ") for name in names] == [
        "Router: haproxy installed",
        "Router: HAProxy's configuration, key hashes and TLS files (haproxy -c before going "
        "live)",
        "Router: owner and mode of its key files and directories",
        "Router: no foreign drop-in for haproxy",
        "Router: haproxy runs the front door's configuration, hardened",
        "Router: reload systemd units",
        "Router: restart haproxy with its new command line",
        "Router: haproxy enabled and running",
    ]
    [(_args, swap)] = seen["site"]
    assert swap["check"] == router.CHECK_COMMAND
    assert swap["site_path"] == router.CONFIG_PATH and swap["service"] == "haproxy"
    assert [line.strip() for line in swap["site_content"].splitlines()
            if line.strip().startswith("server ")] == [
        "server gpu-1 10.0.0.11:8001",
        "server gpu-2.example.internal gpu-2.example.internal:8001 "
        "sni str(gpu-2.example.internal) verifyhost gpu-2.example.internal",
    ]
    assert KEY not in swap["site_content"] and KEY not in swap["keys_content"]
    assert swap["extra_files"][router.TLS_KEY_PATH][1] == "600"


def test_a_serving_host_is_planned_no_router_operation(planned_router):
    names, seen = planned_router("gpu-1")
    assert names and not any("| router |" in name or "Router:" in name for name in names)
    assert all(swap["service"] != "haproxy" for _args, swap in seen.get("site", []))


# --- the front door's scrape job and alert rules ---------------------------------------
PROMTOOL = shutil.which("promtool")
MONITORING = Path(__file__).resolve().parents[2] / "monitoring"


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is absent (make system-deps)")
def test_the_router_rules_pass_promtool_and_fire_where_they_must():
    checked = subprocess.run([PROMTOOL, "check", "rules", "router-alerts.yml"],
                             cwd=MONITORING, capture_output=True, text=True, check=False)
    assert checked.returncode == 0 and "SUCCESS: 3 rules found" in checked.stdout, checked
    tested = subprocess.run([PROMTOOL, "test", "rules", "router-alerts.test.yml"],
                            cwd=MONITORING, capture_output=True, text=True, check=False)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_front_doors_get_a_scrape_job_of_their_own_and_none_of_the_engines():
    import yaml

    from tools import scrape_config

    open_host = {"gateway_open": True}
    hosts = [("gpu-1", {**open_host, "ssh_hostname": "10.0.0.21"}),
             ("rt-1", {**open_host, "ssh_hostname": "10.0.0.31"})]
    targets = scrape_config.fleet_targets(hosts, {"rt-1"})
    assert [target["instance"] for target in targets] == ["gpu-1"]
    fronts = scrape_config.router_targets(hosts, {"rt-1"})
    assert fronts == [{"instance": "rt-1", "scheme": "https", "address": "10.0.0.31:8405"}]
    jobs = yaml.safe_load(scrape_config.render(targets, routers=fronts))["scrape_configs"]
    assert [job["job_name"] for job in jobs] == ["vllm", "vllm-node", "vllm-router"]
    assert jobs[2]["static_configs"] == [{"targets": ["10.0.0.31:8405"], "labels": {
        "instance": "rt-1", "__scheme__": "https"}}]
    # Without a front door the configuration is what it was: two jobs.
    assert len(yaml.safe_load(scrape_config.render(targets))["scrape_configs"]) == 2
