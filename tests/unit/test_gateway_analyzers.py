"""The gateway's nginx configuration under the field's own analyzers.

gixy-ng (a static analyzer of nginx configurations, requirements.lock) reads the site as
the gateway stage renders it, plain HTTP and TLS, inside Debian 12's nginx.conf; testssl
(Debian's testssl.sh, ``make system-deps``) scans the rendered TLS gateway under this
machine's nginx on loopback, in front of a stand-in engine (tests/unit/test_gateway_nginx.py).
Each has a list of accepted findings, each with its reason: any other finding fails the
test, and so does an accepted one no longer found (the list would be stale).
tests/e2e/test_gateway.py runs the same scan against a sandbox host's gateway.

Skipped, with the reason, where an analyzer (or nginx and openssl) is not installed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyinfra_vllm.plans.gateway import render_keys_map, render_site
from tests.unit.test_gateway_nginx import KEY, NGINX, Gateway, engine, free_port

GIXY = shutil.which("gixy", path=str(Path(sys.executable).parent)) or shutil.which("gixy")
TESTSSL = shutil.which("testssl")

# Debian 12's /etc/nginx/nginx.conf (nginx-common 1.22.1-9), without its comments, its
# include paths under ROOT: the file every gateway site is read inside.
DEBIAN_NGINX_CONF = """user www-data;
worker_processes auto;
pid /run/nginx.pid;
error_log /var/log/nginx/error.log;
events {
\tworker_connections 768;
}
http {
\tsendfile on;
\ttcp_nopush on;
\ttypes_hash_max_size 2048;
\tinclude ROOT/mime.types;
\tdefault_type application/octet-stream;
\tssl_protocols TLSv1 TLSv1.1 TLSv1.2 TLSv1.3; # Dropping SSLv3, ref: POODLE
\tssl_prefer_server_ciphers on;
\taccess_log /var/log/nginx/access.log;
\tgzip on;
\tinclude ROOT/conf.d/*.conf;
\tinclude ROOT/sites-enabled/*;
}
"""

# What Debian's nginx.conf sets in http {} and the gateway's TLS server sets again for
# itself (nginx uses a server's own directive over http's). The site cannot set these
# in http {} (a second one fails nginx -t), and nginx.conf is Debian's, not the suite's.
DEBIAN_SETS_IN_HTTP = ("Debian's nginx.conf, in http {}: the gateway's TLS server sets "
                       "its own (TLS 1.2 and 1.3, the client's preference among "
                       "Mozilla's intermediate suites), which nginx uses there")
# (gixy's check, the file, its summary): why the finding is accepted.
GIXY_ACCEPTED = {
    ("weak_ssl_tls", "nginx.conf", "Insecure TLS protocols enabled"): DEBIAN_SETS_IN_HTTP,
    ("weak_ssl_tls", "nginx.conf", "Server cipher preference enabled unnecessarily"):
        DEBIAN_SETS_IN_HTTP,
    ("worker_rlimit_nofile_vs_connections", "nginx.conf",
     "The worker_rlimit_nofile should be at least twice than worker_connections."):
        "Debian's nginx.conf: 768 connections per worker, far above one engine's "
        "clients; the suite does not manage nginx.conf",
    ("proxy_pass_normalized", "vllm.conf",
     "Detect path after host in proxy_pass (potential URL decoding issue)"):
        "on purpose: nginx sends the engine the normalised path it chose the location by; "
        "the path as the client wrote it reached vLLM's /metrics through the open /health "
        "(/metrics/../health; tests/unit/test_gateway_nginx.py AROUND_METRICS)",
}

# testssl's notes on the scanning machine, nothing of the server's, whether or not they
# come: its openssl without a GOST engine (Debian 12's).
TESTSSL_SCANNER_NOTES = ("engine_problem",)
# testssl's findings other than OK and INFO, by id: (severity, why it is accepted).
TESTSSL_ACCEPTED = {
    "cipher_order": ("HIGH", "Mozilla's intermediate profile leaves the choice to the client "
                             "(server_preferred_order false): every suite offered is ECDHE "
                             "with an AEAD cipher (checked below), so any the client picks "
                             "is one of them (ChaCha20 where it has no AES instructions); "
                             "testssl 3.0 rates every server without an order HIGH"),
    "security_headers": ("MEDIUM", "the headers testssl looks for (X-Frame-Options, "
                                   "Content-Security-Policy, ...) protect HTML pages in a "
                                   "browser; the gateway answers JSON to API clients"),
}
# The TLS 1.3 suites, OpenSSL's defaults and Mozilla's intermediate profile's.
TLS13_SUITES = {"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384",
                "TLS_CHACHA20_POLY1305_SHA256"}
# testssl's checks: protocols, the suites offered per protocol, the server's preference,
# the HTTP headers (HSTS, Server), the vulnerabilities (Lucky 13, ROBOT, BREACH, ...). Not
# the certificate's (-S): it is the operator's, made for the test here.
TESTSSL_CHECKS = ["--protocols", "--cipher-per-proto", "--server-preference", "--headers",
                  "--vulnerable"]


def render_into(root: Path, **settings: object) -> Path:
    """The site and its key files rendered into ``root`` inside Debian's nginx.conf."""
    for sub in ("conf.d", "sites-enabled"):
        (root / sub).mkdir(parents=True)
    (root / "mime.types").write_text("types {\n    application/json json;\n}\n")
    (root / "keys.conf").write_text(render_keys_map(["sk-" + "a" * 40]))
    (root / "engine-key.conf").write_text(
        'map "" $vllm_upstream_authorization {\n    default "Bearer x";\n}\n')
    (root / "conf.d" / "vllm.conf").write_text(render_site(
        upstream="unix:/run/vllm-engine/engine.sock", gateway_port=8001,
        metrics_allow=["10.0.0.0/8"], body_mib=2, proxy_timeout_s=3600,
        keys_path=str(root / "keys.conf"), engine_key_path=str(root / "engine-key.conf"),
        node_exporter_port=9100, **settings))  # type: ignore[arg-type]
    conf = root / "nginx.conf"
    conf.write_text(DEBIAN_NGINX_CONF.replace("ROOT", str(root)))
    return conf


def gixy_findings(conf: Path) -> set[tuple[str, str, str]]:
    """gixy-ng's findings on ``conf``: (check, file name, summary) each."""
    assert GIXY is not None
    done = subprocess.run([GIXY, "--format", "json", str(conf)], capture_output=True,
                          text=True, timeout=120)
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"gixy printed no report (exit {done.returncode}): {done.stderr[-2000:]}")
    return {(item["plugin"], Path(item["file"]).name, item["summary"]) for item in report}


needs_gixy = pytest.mark.skipif(
    GIXY is None, reason="gixy-ng is not installed (requirements.lock installs it)")


@needs_gixy
@pytest.mark.parametrize("settings", [{}, {"tls": True, "http_redirect_port": 8080}],
                         ids=["plain-http", "tls"])
def test_gixy_finds_nothing_but_the_accepted(tmp_path, settings):
    found = gixy_findings(render_into(tmp_path, **settings))
    unexpected = sorted(found - set(GIXY_ACCEPTED))
    assert unexpected == [], f"gixy-ng findings no one accepted: {unexpected}"
    assert found == set(GIXY_ACCEPTED), f"accepted, no longer found: {set(GIXY_ACCEPTED) - found}"


@needs_gixy
def test_gixy_reads_the_site_a_missing_hsts_header_is_found(tmp_path):
    # The control: the same TLS site without its HSTS line is reported.
    conf = render_into(tmp_path, tls=True)
    site = tmp_path / "conf.d" / "vllm.conf"
    text = site.read_text()
    site.write_text(re.sub(r"\n *add_header Strict-Transport-Security [^\n]*", "", text))
    found = gixy_findings(conf)
    assert ("hsts_header", "vllm.conf", "Missing HSTS header") in found


def scan_with_testssl(url: str, out: Path) -> list[dict]:
    """testssl's findings on ``url`` (its JSON file at ``out``): batch mode, no colour."""
    assert TESTSSL is not None
    done = subprocess.run(
        [TESTSSL, "--quiet", "--color", "0", "--warnings", "batch", "--connect-timeout", "10",
         "--openssl-timeout", "10", "--jsonfile", str(out), *TESTSSL_CHECKS, url],
        capture_output=True, text=True, timeout=600,
    )
    assert out.exists(), f"testssl wrote no report (exit {done.returncode}): {done.stdout[-3000:]}"
    return json.loads(out.read_text())


def offered_suites(report: list[dict], protocol: str) -> set[str]:
    """The suites testssl found offered for ``protocol`` ("tls1_2", "tls1_3")."""
    return {item["finding"].split()[3] for item in report
            if item["id"].startswith(f"cipher-{protocol}_")}


def check_testssl_findings(report: list[dict], tls12_suites: set[str]) -> None:
    """Only the accepted findings, the suites ``tls12_suites`` and TLS 1.3's, HSTS for
    two years, no version in the Server header."""
    findings = {item["id"]: item for item in report}
    flagged = {item["id"]: item["severity"] for item in report
               if item["severity"] not in ("OK", "INFO")
               and item["id"] not in TESTSSL_SCANNER_NOTES}
    accepted = {name: severity for name, (severity, _why) in TESTSSL_ACCEPTED.items()}
    unexpected = {name: findings[name]["finding"] for name in flagged
                  if accepted.get(name) != flagged[name]}
    assert unexpected == {}, f"testssl findings no one accepted: {unexpected}"
    assert flagged == accepted, f"accepted, no longer found: {set(accepted) - set(flagged)}"
    assert offered_suites(report, "tls1_2") == tls12_suites
    assert offered_suites(report, "tls1_3") == TLS13_SUITES
    for name in ("SSLv2", "SSLv3", "TLS1", "TLS1_1"):
        assert findings[name]["finding"] == "not offered", findings[name]
    assert (findings["HSTS_time"]["severity"], findings["HSTS_time"]["finding"]) == (
        "OK", "730 days (=63072000 seconds) > 15552000 seconds")
    assert findings["banner_server"]["finding"] == "nginx"
    assert findings["LUCKY13"]["severity"] == "OK"


@pytest.fixture(scope="module")
def testssl_certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed RSA certificate for 127.0.0.1 and its key (0600): with RSA the
    server could offer static RSA key exchange, which it must not. The scan leaves the
    certificate itself alone (it is the operator's)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate for the TLS scan")
    where = tmp_path_factory.mktemp("testssl")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "90",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    key.chmod(0o600)
    return cert, key


@pytest.mark.skipif(TESTSSL is None or NGINX is None,
                    reason="testssl or nginx is not installed (make system-deps installs both)")
def test_testssl_finds_nothing_but_the_accepted(tmp_path, testssl_certificate):
    # About 30 s on a 2-core machine: the checks of TESTSSL_CHECKS only.
    with engine() as engine_port:
        gateway = Gateway(tmp_path, keys=[KEY], vllm_port=engine_port,
                          tls=testssl_certificate, gateway_port=free_port())
        with gateway.running():
            report = scan_with_testssl(f"https://127.0.0.1:{gateway.gateway_port}/",
                                    tmp_path / "testssl.json")
    check_testssl_findings(report, {"ECDHE-RSA-AES128-GCM-SHA256", "ECDHE-RSA-AES256-GCM-SHA384",
                                  "ECDHE-RSA-CHACHA20-POLY1305"})
