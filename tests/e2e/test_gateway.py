"""The gateway on a real sandbox host: nginx from Debian in front of a streaming stub.

One `seed` host. files/openai_stub.py stands in for the engine on its Unix socket,
/run/vllm-engine/engine.sock in a directory of group www-data (a transient systemd unit); deploys/gateway.py installs nginx and the site with one API key.
Checked from inside the host against 127.0.0.1:8001: SSE chunks pass through unbuffered,
the key check, the body limit, /health and /metrics; from this machine, /metrics is
refused. Then: a second run changes nothing and does not reload nginx, and a config that
nginx -t rejects leaves the old one serving and fails the run with nginx's message. The
key must appear in no pyinfra output and no nginx log. Debian's default site, which
nginx's package enables as the first run installs it, is set aside by that run. Last,
TLS: a self-signed certificate made here, the gateway on https (checked with curl
--cacert from this machine) and a plain HTTP port that only redirects; testssl.sh's scan
of it finds nothing but the accepted (tests/unit/test_gateway_analyzers.py).
"""

from __future__ import annotations

import base64
import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pyinfra_vllm.plans.gateway import SITE_PATH, body_limit_mib
from tests.e2e.conftest import booted
from tests.unit.test_gateway_analyzers import TESTSSL, check_testssl_findings, scan_with_testssl

pytestmark = pytest.mark.e2e

# At least 32 characters: the settings refuse a shorter key. The sandbox inventory's
# api_keys_file adds a second key; this one is the one the probes send.
KEY = "sk-e2e-gateway-0123456789abcdefghijkl"
DATA = ["--data", f'api_keys=["{KEY}"]']
STUB = Path(__file__).resolve().parents[2] / "files" / "openai_stub.py"
CHUNKS, INTERVAL = 10, 0.2  # the stub's stream: 2 s in all

# Runs inside the host: first-byte times and status codes, printed as one JSON line.
PROBE = r'''
import http.client, json, socket, sys, time
KEY, LIMIT = sys.argv[1], int(sys.argv[2])

class UnixConnection(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(30)
        self.sock.connect("/run/vllm-engine/engine.sock")

def first_chunk(port, key):
    conn = (UnixConnection("localhost", timeout=30) if port is None else
            http.client.HTTPConnection("127.0.0.1", port, timeout=30))
    body = json.dumps({"model": "m", "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]})
    start = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body,
                 {"Content-Type": "application/json", "Authorization": "Bearer " + key})
    resp = conn.getresponse()
    first = None
    lines = []
    while True:
        line = resp.readline()
        if not line:
            break
        if line.startswith(b"data:"):
            if first is None:
                first = time.monotonic() - start
            lines.append(line.strip())
    return {"status": resp.status, "first": first, "total": time.monotonic() - start,
            "events": len(lines), "last": lines[-1].decode() if lines else None}

def status(method, path, key=None, size=None):
    conn = http.client.HTTPConnection("127.0.0.1", 8001, timeout=30)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = "Bearer " + key
    body = None
    if size is not None:
        prefix, suffix = '{"model": "m", "prompt": "', '"}'
        body = (prefix + "x" * (size - len(prefix) - len(suffix)) + suffix).encode()
    try:
        conn.request(method, path, body, headers)
        return conn.getresponse().status
    except (BrokenPipeError, ConnectionResetError) as exc:
        return repr(exc)

out = {
    "nginx": first_chunk(8001, KEY),
    "direct": first_chunk(None, KEY),
    "no_key": status("POST", "/v1/completions", size=100),
    "wrong_key": status("POST", "/v1/completions", key="sk-wrong", size=100),
    "wrong_case": status("POST", "/v1/completions", key=KEY.upper(), size=100),
    "good_key": status("POST", "/v1/completions", key=KEY, size=100),
    "prompt_128k": status("POST", "/v1/completions", key=KEY, size=131072 * 12),
    "too_big": status("POST", "/v1/completions", key=KEY, size=LIMIT + 1),
    "health": status("GET", "/health"),
    "metrics": status("GET", "/metrics"),
    "elsewhere": status("GET", "/", key=KEY),
}
print(json.dumps(out))
'''


def upload(sandbox, host, path: str, text: str) -> None:
    encoded = base64.b64encode(text.encode()).decode()
    sandbox.ssh(host, f"echo {encoded} | base64 -d > {path}")


def run(sandbox, *extra: str):
    proc = sandbox.pyinfra("--json", *DATA, *extra, "deploys/gateway.py", timeout=240)
    return proc, (json.loads(proc.stdout) if proc.stdout.strip() else None)


def nginx_pids(sandbox, host) -> tuple[str, str]:
    main = sandbox.ssh(host, "systemctl show nginx -p MainPID --value").stdout.strip()
    workers = sandbox.ssh(host, f"pgrep -P {main} | sort | tr '\\n' ' '").stdout.strip()
    return main, workers


@pytest.fixture(scope="module")
def gateway():
    with booted(["seed"]) as sandbox:
        host = sandbox.hosts[0]
        upload(sandbox, host, "/root/openai_stub.py", STUB.read_text())
        upload(sandbox, host, "/root/probe.py", PROBE)
        sandbox.ssh(
            host,
            "install -d -g www-data -m 0750 /run/vllm-engine && "
            "systemd-run --unit openai-stub python3 /root/openai_stub.py "
            "--uds /run/vllm-engine/engine.sock "
            f"--chunks {CHUNKS} --interval {INTERVAL}",
        )
        first, first_json = run(sandbox)
        if first_json is None or first.returncode != 0:
            pytest.fail(f"first run failed (exit {first.returncode}):\n{first.stderr[-4000:]}")
        yield sandbox, host, first, first_json


def probe(sandbox, host) -> dict:
    limit = body_limit_mib(131072) * 1024 * 1024
    out = sandbox.ssh(host, f"python3 /root/probe.py {KEY} {limit}").stdout
    return json.loads(out)


def test_first_run_installs_and_serves(gateway):
    sandbox, host, first, first_json = gateway
    assert first_json["results"]["totals"]["success"] > 0
    modes = sandbox.ssh(host, "stat -c '%a %U %G' /etc/nginx/vllm-api-keys.conf").stdout
    assert modes.strip() == "600 root root"
    result = probe(sandbox, host)
    print("\ngateway probe:", json.dumps(result))
    total = CHUNKS * INTERVAL
    for path in ("nginx", "direct"):
        stream = result[path]
        assert stream["status"] == 200
        assert stream["events"] == CHUNKS + 1 and stream["last"] == "data: [DONE]"
        # The first chunk arrives long before the stream ends: nginx does not buffer it.
        assert stream["first"] < total / 4, stream
        assert stream["total"] >= total * 0.9
    assert result["no_key"] == 401
    assert result["wrong_key"] == 401
    assert result["wrong_case"] == 401  # keys compare case-sensitively
    assert result["good_key"] == 200
    assert result["prompt_128k"] == 200
    assert result["too_big"] == 413
    assert result["health"] == 200
    assert result["metrics"] == 200
    assert result["elsewhere"] == 404


def test_the_first_run_set_debians_default_site_aside(gateway):
    # nginx's package enabled its welcome page as this run installed it (port 80, every
    # address, nginx's version): moved, a symlink as a symlink, its target kept.
    sandbox, host, _, _ = gateway
    kept = "/var/lib/pyinfra-vllm/nginx-disabled/etc/nginx/sites-enabled/default"
    found = sandbox.ssh(host, "test -e /etc/nginx/sites-enabled/default && echo enabled; "
                              f"readlink {kept}; test -f /etc/nginx/sites-available/default "
                              "&& echo available").stdout.split()
    assert found == ["/etc/nginx/sites-available/default", "available"]
    port_80 = sandbox.ssh(host, "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:80/",
                          check=False).stdout
    assert port_80 == "000"


def test_metrics_refused_from_outside_the_host(gateway):
    _, host, _, _ = gateway
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://{host.address}:8001/metrics", timeout=10)
    assert refused.value.code == 403
    # /health is open to everyone.
    with urllib.request.urlopen(f"http://{host.address}:8001/health", timeout=10) as resp:
        assert resp.status == 200


def test_second_run_changes_nothing_and_does_not_reload(gateway):
    sandbox, host, first, _ = gateway
    before = nginx_pids(sandbox, host)
    second, second_json = run(sandbox)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second_json["results"]["totals"]["success"] == 0
    assert nginx_pids(sandbox, host) == before
    for proc in (first, second):
        assert KEY not in proc.stdout + proc.stderr


def test_rejected_config_keeps_the_old_one_serving(gateway):
    sandbox, host, _, _ = gateway
    live = sandbox.ssh(host, f"sha1sum {SITE_PATH}").stdout
    before = nginx_pids(sandbox, host)
    # An allowed directive with a value of an allowed shape (the settings pass it) that
    # nginx -t rejects: no zero buffers.
    broken, _ = run(sandbox, "--data", 'gateway_extra_directives=["gzip_buffers 0 8k;"]')
    assert broken.returncode == 1
    assert '"gzip_buffers" directive invalid value' in broken.stderr
    assert "nginx -t rejected the new configuration" in broken.stderr
    assert KEY not in broken.stdout + broken.stderr
    assert sandbox.ssh(host, f"sha1sum {SITE_PATH}").stdout == live
    assert nginx_pids(sandbox, host) == before
    status = sandbox.ssh(
        host,
        "curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer " + KEY + "' "
        "-d '{\"prompt\": \"hi\"}' http://127.0.0.1:8001/v1/completions",
    ).stdout
    assert status == "200"


def test_key_never_in_nginx_logs(gateway):
    sandbox, host, _, _ = gateway
    found = sandbox.ssh(host, f"grep -rl -- {KEY} /var/log/nginx/", check=False)
    assert found.returncode == 1, found.stdout
    lines = sandbox.ssh(host, "tail -n 3 /var/log/nginx/vllm-access.log").stdout
    assert "rt=" in lines and "urt=" in lines


def make_certificate(where: Path, address: str) -> tuple[Path, Path]:
    """A throwaway self-signed certificate for the host's address, and its key (0600)."""
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
         "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", f"subjectAltName=IP:{address},IP:127.0.0.1,DNS:localhost",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    key.chmod(0o600)
    return cert, key


def curl(*args: str) -> str:
    """curl from this machine: the status code (and what -w adds)."""
    return subprocess.run(
        ["curl", "-s", "-o", "/dev/null", "--max-time", "20", *args],
        capture_output=True, text=True, timeout=30,
    ).stdout


def test_tls_and_the_redirect_port(gateway, tmp_path):
    sandbox, host, _, _ = gateway
    cert, key = make_certificate(tmp_path, host.address)
    tls = ["--data", f"gateway_tls_cert={cert}", "--data", f"gateway_tls_key={key}",
           "--data", "gateway_http_redirect_port=8080"]
    first, first_json = run(sandbox, *tls)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first_json["results"]["totals"]["success"] > 0
    # Neither the API key nor the private key shows in the output.
    key_body = key.read_text().splitlines()[1]
    assert KEY not in first.stdout + first.stderr
    assert key_body not in first.stdout + first.stderr
    modes = sandbox.ssh(
        host, "stat -c '%n %a %U %G' /etc/nginx/vllm-tls/cert.pem /etc/nginx/vllm-tls/key.pem"
    ).stdout.split("\n")
    assert modes[0] == "/etc/nginx/vllm-tls/cert.pem 644 root root"
    assert modes[1] == "/etc/nginx/vllm-tls/key.pem 600 root root"

    base = f"https://{host.address}:8001"
    auth = ["-H", f"Authorization: Bearer {KEY}", "-d", '{"prompt": "hi"}']
    assert curl("--cacert", str(cert), "-w", "%{http_code}", *auth,
                f"{base}/v1/completions") == "200"
    assert curl("--cacert", str(cert), "-w", "%{http_code}", "-H",
                "Authorization: Bearer sk-wrong", f"{base}/v1/completions") == "401"
    assert curl("--cacert", str(cert), "-w", "%{http_code}", f"{base}/health") == "200"
    # TLS 1.1 is refused (SECLEVEL=0 lets this curl offer it; the server says no); plain
    # HTTP on the TLS port is an error, never served.
    assert curl("--cacert", str(cert), "--tlsv1.1", "--tls-max", "1.1", "--ciphers",
                "DEFAULT:@SECLEVEL=0", "-w", "%{http_code}", f"{base}/health") == "000"
    assert curl("-w", "%{http_code}", *auth,
                f"http://{host.address}:8001/v1/completions") == "400"
    # The redirect port: a 301 to https for everything, nothing proxied.
    for path in ("/v1/completions?x=1", "/health", "/metrics"):
        assert curl("-w", "%{http_code} %{redirect_url}",
                    f"http://{host.address}:8080{path}") == (
            f"301 https://{host.address}:8001{path}"
        )
    # No per-host scrape job: the operator's Prometheus gets the fleet's from
    # tools.scrape_config, which scrapes this host over https.
    assert sandbox.ssh(host, "test -e /etc/prometheus/scrape.d/vllm.yml",
                       check=False).returncode == 1

    # Converged: a second run with the same files changes nothing.
    second, second_json = run(sandbox, *tls)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second_json["results"]["totals"]["success"] == 0
    assert KEY not in second.stdout + second.stderr


@pytest.mark.skipif(TESTSSL is None, reason="testssl is not installed (make system-deps)")
def test_testssl_finds_nothing_but_the_accepted_on_the_tls_gateway(gateway, tmp_path):
    # The same scan and accepted findings as tests/unit/test_gateway_analyzers.py, from
    # this machine against the host's gateway, with an ECDSA certificate: the profile's
    # three ECDHE-ECDSA suites in TLS 1.2.
    sandbox, host, _, _ = gateway
    cert, key = make_certificate(tmp_path, host.address)
    deployed, _ = run(sandbox, "--data", f"gateway_tls_cert={cert}", "--data",
                      f"gateway_tls_key={key}")
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    report = scan_with_testssl(f"https://{host.address}:8001/", tmp_path / "testssl.json")
    check_testssl_findings(report, {"ECDHE-ECDSA-AES128-GCM-SHA256",
                                    "ECDHE-ECDSA-AES256-GCM-SHA384",
                                    "ECDHE-ECDSA-CHACHA20-POLY1305"})
