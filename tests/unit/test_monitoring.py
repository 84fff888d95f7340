"""Monitoring: node_exporter's drop-in, the gateway's /node-metrics, the fleet's scrape
jobs (tools.scrape_config) and the alert rules, checked by the real promtool
(Debian's prometheus package: make system-deps installs it)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from facts.files import PathComponents
from pyinfra_vllm.core.settings import SettingsError, validate
from pyinfra_vllm.plans import gateway as gateway_plan
from pyinfra_vllm.plans.metrics import TEXTFILE_DIR, render_drop_in, textfile_dir_problem
from tools import scrape_config

ROOT = Path(__file__).parents[2]
RULES = ROOT / "monitoring" / "vllm-alerts.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is absent (Debian's prometheus package; make system-deps)"
)
OPEN = {"gateway_open": True}


def _site(**extra):
    return gateway_plan.render_site(upstream="127.0.0.1:8000", gateway_port=8001,
                                   metrics_allow=["127.0.0.1/32", "10.9.0.5"], body_mib=2,
                                   proxy_timeout_s=3600, **extra)


def components(path: Path) -> list[dict]:
    """facts.files.PathComponents of ``path``, its real command run on this machine."""
    fact = PathComponents()
    output = subprocess.run(["sh", "-c", fact.command(str(path)).get_raw_value()],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    return fact.process(output)


@pytest.mark.skipif(os.geteuid() != 0, reason="chowns a directory to nobody: needs root")
def test_a_textfile_directory_another_account_can_change_is_refused(tmp_path):
    # Debian's layout: /var/lib/prometheus is prometheus's (nobody here), node-exporter in
    # it root's; then the account swaps node-exporter for a link to root's directory.
    prometheus = tmp_path / "prometheus"
    textfiles = prometheus / "node-exporter"
    textfiles.mkdir(parents=True)
    os.chown(prometheus, 65534, 65534)
    advice = ("Set textfile_collector_dir to a directory of the suite's own (the default, "
              "/var/lib/pyinfra-vllm-metrics: the metrics stage makes it root's, 0755, and "
              "points node_exporter at it), or make every directory of the path root's and "
              "writable by root alone (chown root:root DIR; chmod 755 DIR)")
    found = components(textfiles)
    assert [c["path"] for c in found][-2:] == [str(prometheus), str(textfiles)]
    assert found[-2]["owner"] == "nobody" and found[-2]["uid"] == 65534
    assert textfile_dir_problem(str(textfiles), found) == (
        f"textfile_collector_dir {textfiles}: {prometheus} is owned by nobody, who can swap "
        "what is in it for a symbolic link, and so steer what root writes there (another "
        f"file, or its mode); nothing is written there. {advice}")
    elsewhere = tmp_path / "etc"
    elsewhere.mkdir()
    textfiles.rename(prometheus / "old")
    textfiles.symlink_to(elsewhere)
    os.lchown(textfiles, 65534, 65534)
    assert f"{prometheus} is owned by nobody" in textfile_dir_problem(
        str(textfiles), components(textfiles))
    # The link alone, in a directory of root's, is refused too.
    os.chown(prometheus, 0, 0)
    assert f"{textfiles} is a symbolic link (owned by nobody)" in textfile_dir_problem(
        str(textfiles), components(textfiles))


def test_the_suite_s_own_textfile_directory_is_taken_and_made_where_missing(tmp_path):
    # Root's all the way down (a sticky /tmp above the test's directories): taken, and a
    # missing directory below them is the suite's to make.
    assert textfile_dir_problem(str(tmp_path), components(tmp_path)) is None
    assert textfile_dir_problem(str(tmp_path / "a" / "b"), components(tmp_path / "a" / "b")) is None
    tmp_path.chmod(0o1777)  # others may write it, and make the missing one first
    assert "is missing in a directory others may write: one could make it first" in (
        textfile_dir_problem(str(tmp_path / "a"), components(tmp_path / "a")))
    tmp_path.chmod(0o775)
    assert f"{tmp_path} is writable by its group or others (mode 0775)" in (
        textfile_dir_problem(str(tmp_path), components(tmp_path)))
    assert validate(OPEN).textfile_collector_dir == TEXTFILE_DIR == "/var/lib/pyinfra-vllm-metrics"


def test_node_exporter_listens_on_loopback_and_reads_the_textfile_dir():
    text = render_drop_in(9200, "/srv/textfiles")
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert lines == [
        "[Service]",
        "ExecStart=",
        "ExecStart=/usr/bin/prometheus-node-exporter --web.listen-address=127.0.0.1:9200 "
        "--collector.textfile.directory=/srv/textfiles --collector.systemd "
        "--collector.systemd.unit-include=(vllm|nginx|nvidia-persistenced|"
        "prometheus-node-exporter)[.]service $ARGS",
    ]
    # systemd reads a backslash in ExecStart= as an escape: none in the command.
    assert "\\" not in lines[2]


def test_the_gateway_serves_node_metrics_to_the_metrics_readers_only():
    site = _site(node_exporter_port=9100)
    block = site[site.index("location = /node-metrics {"):]
    block = block[:block.index("}") + 1]
    assert block.split("\n")[1:] == [
        "        allow 127.0.0.1/32;",
        "        allow 10.9.0.5/32;",
        "        deny all;",
        "        proxy_pass http://127.0.0.1:9100/metrics;",
        "    }",
    ]
    # It sets no proxy_set_header, so it inherits the server's, whose Authorization is
    # empty: the engine's key is set in location /v1/ alone.
    assert '\n    proxy_set_header Authorization "";\n' in site
    assert "/node-metrics" not in _site()


def test_prometheus_servers_join_the_allow_list_once():
    settings = validate({**OPEN, "metrics_allow": ["127.0.0.1/32", "10.0.0.7/24"],
                         "prometheus_servers": ["10.0.0.9/24", "192.0.2.10"]})
    assert settings.metrics_networks == ["127.0.0.1/32", "10.0.0.0/24", "192.0.2.10/32"]
    assert settings.node_exporter_served is True
    assert validate({**OPEN, "skip_stages": ["metrics"]}).node_exporter_served is False


@pytest.mark.parametrize(("data", "message"), [
    ({"prometheus_servers": ["prometheus.internal"]},
     "prometheus_servers[0] 'prometheus.internal' is not an IPv4 or IPv6 network"),
    ({"prometheus_servers": ["fe80::1%eth0"]}, "prometheus_servers[0] 'fe80::1%eth0' has an IPv6 scope id"),
    ({"metrics_address": "https://gpu1:8001"}, "not a host name or IP address literal"),
    ({"metrics_address": "gpu_1.example"}, "not a host name or IP address literal"),
    ({"node_exporter_port": 0}, "node_exporter_port = 0"),
])
def test_bad_monitoring_settings_are_refused_by_name(data, message):
    with pytest.raises(SettingsError) as raised:
        validate({**OPEN, **data})
    assert message in str(raised.value)


def test_metrics_address_accepts_names_and_addresses():
    assert validate({**OPEN, "metrics_address": "gpu-a100-01.example.internal"}).metrics_address
    assert validate({**OPEN, "metrics_address": "fd00::7"}).metrics_address == "fd00::7"


def _targets():
    return scrape_config.fleet_targets([
        ("gpu-1", {**OPEN, "ssh_hostname": "10.0.0.21"}),
        ("gpu-2", {**OPEN, "metrics_address": "fd00::22", "gateway_port": 8443,
                   "node_exporter_install": False}),
        ("gpu-3.example.internal", OPEN),
    ])


def test_each_host_is_reached_at_its_address_with_its_own_instance_label():
    assert _targets() == [
        {"instance": "gpu-1", "address": "10.0.0.21:8001", "scheme": "http", "node": True},
        {"instance": "gpu-2", "address": "[fd00::22]:8443", "scheme": "http", "node": False},
        {"instance": "gpu-3.example.internal", "address": "gpu-3.example.internal:8001",
         "scheme": "http", "node": True},
    ]


def test_a_host_with_tls_is_scraped_over_https(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\nx\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\nx\n")
    key.chmod(0o600)
    [target] = scrape_config.fleet_targets([
        ("gpu-1", {**OPEN, "gateway_tls_cert": str(cert), "gateway_tls_key": str(key)})])
    assert target["scheme"] == "https"


def test_a_bad_setting_names_the_host():
    with pytest.raises(SettingsError, match="invalid settings for host gpu-9"):
        scrape_config.fleet_targets([("gpu-9", {**OPEN, "prometheus_servers": ["x"]})])


def test_the_scrape_config_has_both_jobs_per_host():
    config = yaml.safe_load(scrape_config.render(_targets(), ca_file="/etc/prometheus/ca.pem"))
    engine, node = config["scrape_configs"]
    assert (engine["job_name"], engine["metrics_path"]) == ("vllm", "/metrics")
    assert (node["job_name"], node["metrics_path"]) == ("vllm-node", "/node-metrics")
    assert engine["tls_config"] == {"ca_file": "/etc/prometheus/ca.pem"}
    assert [group["targets"] for group in engine["static_configs"]] == [
        ["10.0.0.21:8001"], ["[fd00::22]:8443"], ["gpu-3.example.internal:8001"]]
    # gpu-2 runs no node_exporter of the suite's.
    assert [group["labels"]["instance"] for group in node["static_configs"]] == [
        "gpu-1", "gpu-3.example.internal"]
    assert node["static_configs"][0]["labels"]["__scheme__"] == "http"


def test_the_tool_reads_the_inventory_and_group_data(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code = scrape_config.main(["inventory.py", "--data", "gateway_open=true"])
    out = capsys.readouterr().out
    assert code == 0
    config = yaml.safe_load(out)
    assert config["scrape_configs"][0]["static_configs"][1]["targets"] == [
        "gpu-a100-02.example.internal:8001"]


def test_the_tool_exits_2_on_bad_settings(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert scrape_config.main(["inventory.py"]) == 2
    assert "api_keys is empty" in capsys.readouterr().err


@needs_promtool
def test_promtool_accepts_the_rules():
    result = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 31 rules found" in result.stdout


@needs_promtool
@pytest.mark.parametrize("tests", ["vllm-alerts.test.yml", "gpu-health-alerts.test.yml",
                                   "bench-alerts.test.yml", "sentinel-alerts.test.yml"])
def test_the_rules_fire_where_they_must_and_only_there(tests):
    # Each file says what it checks: the serving alerts, each GPU-health reason, the
    # benchmark below its thresholds, each state of the sentinel.
    result = subprocess.run([PROMTOOL, "test", "rules", tests],
                            cwd=RULES.parent, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_promtool_accepts_the_generated_config(tmp_path):
    shutil.copy(RULES, tmp_path / "vllm-alerts.yml")
    config = tmp_path / "vllm-fleet.yml"
    config.write_text(scrape_config.render(_targets(), rules=["vllm-alerts.yml"]))
    result = subprocess.run([PROMTOOL, "check", "config", str(config)], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout


def test_every_rule_has_for_severity_and_summary():
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"]
             for rule in group["rules"]]
    assert len(rules) == 31
    for rule in rules:
        assert rule["for"], rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
