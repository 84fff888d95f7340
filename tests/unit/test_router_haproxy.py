"""The rendered front door under the real HAProxy of this machine (Debian's, the package a
router host gets): ``haproxy -c``, then HAProxy in the foreground on loopback in front of
two TLS gateways of this test, each answering /health and /v1 as the test says.

Root only: HAProxy's configuration chroots its workers and runs them as haproxy, as on a
router host.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pyinfra_vllm.plans import router

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="HAProxy's chroot and user need root")

KEY = "sk-router-" + "0123456789abcdef" * 2
HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def certificate(where: Path, name: str) -> tuple[Path, Path]:
    """A throwaway self-signed certificate for localhost and 127.0.0.1, and its key."""
    cert, key = where / f"{name}.pem", where / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", f"/CN={name}", "-addext",
         "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    key.chmod(0o600)
    return cert, key


class Gateway:
    """A TLS server in the place of a host's nginx gateway: /health answers ``health``,
    /v1/... answers ``v1`` (200: its name in JSON), and it keeps what it was sent."""

    def __init__(self, name: str, cert: Path, key: Path) -> None:
        self.name, self.health, self.v1 = name, 200, 200
        self.seen: list[tuple[str, str | None]] = []
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                if self.path == "/health":
                    status, body = gateway.health, b""
                else:
                    gateway.seen.append((self.path, self.headers.get("Authorization")))
                    status = gateway.v1
                    body = json.dumps({"served_by": gateway.name}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer  # noqa: N815 - http.server's names

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class FrontDoor:
    """The rendered front door in ``root``: its configuration with the live paths moved
    into ``root``, the key hashes, the TLS files, and the gateways' trust."""

    def __init__(self, root: Path, gateways: list[Gateway], gateway_cert: Path,
                 keys: list[str], prefix_bytes: int = 256) -> None:
        self.root, self.port, self.metrics_port = root, free_port(), free_port()
        cert, key = certificate(root, "front")
        self.client_tls = ssl.create_default_context(cafile=str(cert))
        text = router.render_config(
            backends=[router.backend_of(g.name, "127.0.0.1", None, g.port) for g in gateways],
            router_port=self.port, metrics_port=self.metrics_port,
            metrics_allow=["127.0.0.1/32"], key_check=bool(keys), prefix_bytes=prefix_bytes,
            buffer_kib=64, max_connections=100, check_interval_ms=200, proxy_timeout_s=60,
            bind_address="127.0.0.1",
        )
        self.socket = root / "stats.sock"
        for live, here in ((router.TLS_CERT_PATH, root / "front.pem"),
                           (router.GATEWAY_CA_PATH, gateway_cert),
                           (router.KEYS_PATH, root / "keys.lst"),
                           (router.STATS_SOCKET, self.socket)):
            text = text.replace(live, str(here))
        shutil.copy(key, root / "front.pem.key")
        (root / "keys.lst").write_text(router.key_hashes(keys))
        (root / "keys.lst").chmod(0o600)
        self.config = root / "haproxy.cfg"
        self.config.write_text(text)

    def check(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run([HAPROXY, "-c", "-f", str(self.config)],
                              capture_output=True, text=True, timeout=30)

    @contextmanager
    def running(self) -> Iterator[None]:
        proc = subprocess.Popen([HAPROXY, "-db", "-f", str(self.config)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 10
            while not self.socket.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    out = proc.stdout.read() if proc.stdout else ""
                    pytest.fail(f"haproxy did not start: {out}")
                time.sleep(0.05)
            yield
        finally:
            proc.terminate()
            proc.wait(timeout=10)

    def ask(self, path: str = "/v1/chat/completions", body: bytes = b"{}",
            authorization: str | None = f"Bearer {KEY}") -> tuple[int, str]:
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, timeout=10,
                                           context=self.client_tls)
        headers = {"Content-Type": "application/json"}
        if authorization is not None:
            headers["Authorization"] = authorization
        conn.request("POST", path, body, headers)
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
        if resp.getheader("Content-Type") != "application/json":
            return resp.status, text
        return resp.status, json.loads(text).get("served_by", text)

    def pool(self) -> dict[str, bool]:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(self.socket))
            sock.sendall(b"show stat\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return {entry["host"]: entry["in_pool"]
                for entry in router.pool_view(b"".join(chunks).decode())}

    def wait_pool(self, wanted: dict[str, bool], within_s: float = 5) -> None:
        deadline = time.monotonic() + within_s
        while self.pool() != wanted:
            if time.monotonic() > deadline:
                pytest.fail(f"the pool is {self.pool()}, not {wanted}, after {within_s} s")
            time.sleep(0.1)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[FrontDoor, Gateway, Gateway]]:
    cert, key = certificate(tmp_path, "localhost")
    one, two = Gateway("gpu-1", cert, key), Gateway("gpu-2", cert, key)
    door = FrontDoor(tmp_path, [one, two], cert, [KEY])
    try:
        with door.running():
            door.wait_pool({"gpu-1": True, "gpu-2": True})
            yield door, one, two
    finally:
        one.close()
        two.close()


def test_the_rendered_configuration_passes_haproxy_c(tmp_path):
    cert, key = certificate(tmp_path, "localhost")
    gateway = Gateway("gpu-1", cert, key)
    try:
        for keys in ([KEY], []):
            result = FrontDoor(tmp_path, [gateway], cert, keys).check()
            assert result.returncode == 0, result.stdout + result.stderr
    finally:
        gateway.close()


def test_a_front_door_certificate_without_its_key_fails_haproxy_c(tmp_path):
    # The stage's checked swap relies on haproxy -c refusing what HAProxy could not serve.
    cert, key = certificate(tmp_path, "localhost")
    gateway = Gateway("gpu-1", cert, key)
    try:
        door = FrontDoor(tmp_path, [gateway], cert, [KEY])
        (tmp_path / "front.pem.key").unlink()
        result = door.check()
        assert result.returncode != 0
        assert "front.pem" in result.stdout + result.stderr
    finally:
        gateway.close()


def test_a_bad_key_is_refused_at_the_front_door_and_reaches_no_gateway(fleet):
    door, one, two = fleet
    assert door.ask(authorization=f"Bearer {KEY}x")[0] == 401
    assert door.ask(authorization=None)[0] == 401
    assert door.ask(authorization=KEY)[0] == 401  # without "Bearer "
    assert one.seen == [] and two.seen == []
    status, served_by = door.ask()
    assert status == 200 and served_by in ("gpu-1", "gpu-2")
    # The client's header goes on to the gateway, which checks it again.
    assert (one.seen + two.seen) == [("/v1/chat/completions", f"Bearer {KEY}")]


def test_failed_key_checks_are_rate_limited_and_good_keys_never(fleet):
    door, one, two = fleet
    statuses = [door.ask(authorization=f"Bearer {KEY}{n}")[0] for n in range(14)]
    assert statuses[:10] == [401] * 10 and statuses[-1] == 429
    assert door.ask()[0] == 200  # from the same address, at once
    assert len(one.seen) + len(two.seen) == 1


def test_only_v1_is_reached_through_the_front_door(fleet):
    door, one, two = fleet
    for path in ("/metrics", "/health/../metrics", "/v1/../metrics", "/v1/%2e%2e/metrics",
                 "/v1", "/node-metrics", "/v1/models/../../metrics"):
        assert door.ask(path)[0] == 404, path
    assert one.seen == [] and two.seen == []
    assert door.ask("/v1/models")[0] == 200


def test_requests_sharing_a_prefix_land_on_one_host_and_others_spread(fleet):
    door, one, two = fleet
    prefix = b'{"messages": [{"role": "system", "content": "' + b"You are terse. " * 20
    hosts = {door.ask(body=prefix + f' question {n}"}}]}}'.encode())[1] for n in range(12)}
    assert len(hosts) == 1
    spread = {door.ask(body=f'{{"messages": "{n} {"x" * 300}"}}'.encode())[1]
              for n in range(40)}
    assert spread == {"gpu-1", "gpu-2"}


@pytest.mark.parametrize("status", [503, 502, 504])
def test_a_gateway_s_503_502_or_504_is_retried_on_the_other_before_it_leaves_the_pool(
        fleet, status):
    # 503: drained or rotated out, /v1 refused at once while /health is not yet seen
    # failing; 502 or 504: its engine died or stalled under the request.
    door, one, two = fleet
    one.v1 = status
    answers = [door.ask(body=f'{{"n": {n}}}'.encode()) for n in range(20)]
    assert answers == [(200, "gpu-2")] * 20


def test_a_gateway_s_own_refusal_is_passed_on_never_retried(fleet):
    # A key the front door knows but a gateway does not: the gateway's 401 is the answer,
    # and no other host is asked.
    door, one, two = fleet
    one.v1 = two.v1 = 401
    assert door.ask()[0] == 401
    assert len(one.seen) + len(two.seen) == 1


def test_a_gateway_whose_health_fails_leaves_the_pool_and_returns(fleet):
    door, one, two = fleet
    one.health = 503  # drained, rotated out by the sentinel, or the engine not ready
    door.wait_pool({"gpu-1": False, "gpu-2": True})
    assert {door.ask(body=f'{{"n": {n}}}'.encode())[1] for n in range(10)} == {"gpu-2"}
    one.health = 200
    door.wait_pool({"gpu-1": True, "gpu-2": True})


def test_a_gateway_that_is_gone_is_retried_on_the_other(fleet):
    door, one, two = fleet
    one.close()  # connection refused from now on, before any check saw it
    answers = [door.ask(body=f'{{"n": {n}}}'.encode()) for n in range(20)]
    assert answers == [(200, "gpu-2")] * 20


def test_the_front_door_s_health_is_503_with_an_empty_pool(fleet):
    door, one, two = fleet
    assert door.ask("/health", authorization=None)[0] == 200
    one.health = two.health = 503
    door.wait_pool({"gpu-1": False, "gpu-2": False})
    assert door.ask("/health", authorization=None)[0] == 503
    assert door.ask()[0] == 503


def test_the_metrics_port_serves_haproxy_s_exporter_and_nothing_else(fleet):
    # The names monitoring/router-alerts.yml reads, from the real exporter.
    door, one, two = fleet
    one.health = 503
    door.wait_pool({"gpu-1": False, "gpu-2": True})

    def get(path: str) -> tuple[int, str]:
        conn = http.client.HTTPSConnection("127.0.0.1", door.metrics_port, timeout=10,
                                           context=door.client_tls)
        conn.request("GET", path)
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
        return resp.status, text

    status, text = get("/metrics")
    assert status == 200
    assert 'haproxy_backend_active_servers{proxy="vllm_gateways"} 1' in text
    assert 'haproxy_server_status{proxy="vllm_gateways",server="gpu-1",state="UP"} 0' in text
    assert 'haproxy_server_status{proxy="vllm_gateways",server="gpu-2",state="UP"} 1' in text
    assert get("/v1/models")[0] == 404 and get("/stats")[0] == 404
    assert one.seen == [] and two.seen == []


def test_the_master_stops_its_workers_with_the_drop_in_s_capabilities_alone(fleet):
    """HAProxy in master-worker mode (``-W``, as the unit's ``-Ws``), root with only the
    capabilities the drop-in's CapabilityBoundingSet leaves, its workers haproxy's: a
    SIGTERM stops the whole of it at once. Without CAP_KILL the master's kill(2) of its
    workers fails with EPERM and the stop waited out systemd's 90 s (a sandbox host)."""
    front, _one, _two = fleet
    [line] = [line for line in router.render_dropin().splitlines()
              if line.startswith("CapabilityBoundingSet=")]
    caps = ",".join("+" + cap.removeprefix("CAP_").lower() for cap in line.split("=")[1].split())
    proc = subprocess.Popen(["setpriv", f"--bounding-set=-all,{caps}", "--", HAPROXY, "-W",
                             "-db", "-f", str(front.config)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not front.socket.exists() or not _workers(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, "haproxy did not start"
            time.sleep(0.05)
        workers = _workers(proc.pid)
        assert {_owner(pid) for pid in workers} == {"haproxy"}
        proc.terminate()
        assert proc.wait(timeout=5) is not None
        assert [pid for pid in workers if Path(f"/proc/{pid}").exists()] == []
    finally:
        if proc.poll() is None:
            subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)], check=False)
            proc.kill()
            proc.wait()


def _workers(master: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(master)], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def _owner(pid: int) -> str:
    import pwd

    return pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name


@pytest.mark.skipif(shutil.which("testssl") is None,
                    reason="testssl is not installed (make system-deps installs it)")
def test_testssl_finds_the_front_door_s_tls_as_the_gateway_s(fleet, tmp_path):
    """The front door's TLS for clients, scanned as the gateway's is
    (tests/unit/test_gateway_analyzers.py): TLS 1.2 and 1.3 only, ECDHE with AEAD suites,
    HSTS for two years on its own answers too (here a 401: no key), no Server banner, and
    nothing flagged but the headers a browser's HTML page would want. About 25 s."""
    from tests.unit.test_gateway_analyzers import TLS13_SUITES, offered_suites, scan_with_testssl

    door, _one, _two = fleet
    report = scan_with_testssl(f"https://127.0.0.1:{door.port}/v1/models",
                               tmp_path / "testssl.json")
    findings = {item["id"]: item for item in report}
    flagged = {item["id"]: item["severity"] for item in report
               if item["severity"] not in ("OK", "INFO") and item["id"] != "engine_problem"}
    assert flagged == {"security_headers": "MEDIUM"}, flagged
    assert offered_suites(report, "tls1_2") == {
        "ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-ECDSA-AES256-GCM-SHA384",
        "ECDHE-ECDSA-CHACHA20-POLY1305"}
    assert offered_suites(report, "tls1_3") == TLS13_SUITES
    for name in ("SSLv2", "SSLv3", "TLS1", "TLS1_1"):
        assert findings[name]["finding"] == "not offered", findings[name]
    assert findings["HSTS_time"]["finding"] == "730 days (=63072000 seconds) > 15552000 seconds"
    assert findings["banner_server"]["finding"] == "No Server banner line in header, interesting!"
    assert findings["LUCKY13"]["severity"] == "OK"
