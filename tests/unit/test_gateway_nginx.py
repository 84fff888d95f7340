"""The rendered gateway under the real nginx of this machine: ``nginx -t``, then requests.

The site and the key file are rendered as the gateway stage renders them, with paths moved
into a temporary prefix, and included in a minimal nginx.conf (Debian's includes conf.d/
the same way, inside http {}). Request tests run that nginx in the foreground on free
loopback ports for the length of one test, in front of a tiny HTTP server standing in for
the engine that answers with the Authorization header it got.

Skipped, with the reason, where nginx is not installed (``make system-deps`` installs it).
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import re
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pyinfra_vllm.core.settings import SettingsError, validate
from pyinfra_vllm.core.settings_checks_gateway import GATEWAY_DIRECTIVES
from pyinfra_vllm.operations.util.rolling import drain_command, drain_commands, undrain_command
from pyinfra_vllm.operations.util.uploads import SECRET_DIR
from pyinfra_vllm.operations.util.vllm_service import engine_key_command
from pyinfra_vllm.plans.engine_access import engine_address
from pyinfra_vllm.plans.gateway import DRAIN_FLAG, render_keys_map, render_site

NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/sbin/nginx") if Path(p).exists()), None
)
pytestmark = pytest.mark.skipif(
    NGINX is None,
    reason="nginx is not installed (make system-deps installs it): the rendered gateway "
    "is checked with the real nginx -t and real requests",
)

KEY = "sk-Live.Key+1"  # "." and "+" are regex operators: escaped, they match themselves
# The engine's own key, as the host makes it (43 characters of base64url).
ENGINE_KEY = "EngineOwnKey_0123456789-abcdefghijklmnopqrs"
LONG_KEYS = ["K" * 64, "k" * 64, "sk-" + "Ab.+/=:~_-9" * 6]  # 64+ chars, two differ in case


def free_port(family: int = socket.AF_INET) -> int:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))
        return sock.getsockname()[1]


class Gateway:
    """A rendered gateway in ``root``: nginx.conf, the site, the key file, the TLS files."""

    def __init__(self, root: Path, *, keys: list[str], engine_key: str = ENGINE_KEY,
                 vllm_host: str = "127.0.0.1", vllm_port: int = 8000, gateway_port: int = 8001,
                 upstream: str | None = None,
                 tls: tuple[Path, Path] | None = None, http_redirect_port: int | None = None,
                 node_exporter_port: int | None = None, drain_flag: Path | None = None,
                 metrics_allow: tuple[str, ...] = ("127.0.0.1/32",),
                 extra_directives: tuple[str, ...] = (), other_server_port: int | None = None,
                 http_directives: str = ""):
        self.root = root
        self.gateway_port = gateway_port
        self.http_redirect_port = http_redirect_port
        self.other_server_port = other_server_port
        # The rolling restart's drain flag (test_a_draining_gateway_...).
        self.drain_flag = drain_flag or root / "draining"
        keys_path = root / "vllm-api-keys.conf"
        engine_key_path = self._engine_key(root, engine_key)
        site = render_site(
            upstream=upstream or engine_address(vllm_host, vllm_port),
            gateway_port=gateway_port, engine_key_path=str(engine_key_path),
            metrics_allow=list(metrics_allow), body_mib=2, proxy_timeout_s=60,
            extra_directives=extra_directives,
            keys_path=str(keys_path), tls=tls is not None,
            http_redirect_port=http_redirect_port, node_exporter_port=node_exporter_port,
            drain_flag=str(self.drain_flag),
            leave_flag=str(self.drain_flag.parent / "leaving"),
            rotation_flag=str(self.drain_flag.parent / "out-of-rotation"),
            server_tokens_http="server_tokens" not in http_directives,
            **({"tls_cert_path": str(tls[0]), "tls_key_path": str(tls[1])} if tls else {}),
        )
        # The logs go where the test can write them.
        self.site = site.replace("/var/log/nginx/", f"{root}/")
        self.keys = render_keys_map(keys)
        (root / "vllm.conf").write_text(self.site)
        keys_path.write_text(self.keys)
        temp = " ".join(f"{kind}_temp_path {root}/{kind};"
                        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        # Debian's and Ubuntu's nginx.conf set these two in http {}: the gateway's TLS
        # server must override them. other_server_port: a server of another file, such as
        # Debian's default site, that the gateway's http-level lines reach too.
        other = (f"server {{ listen 127.0.0.1:{other_server_port}; location / {{ return 404; }} }}"
                 if other_server_port else "")
        self.conf = root / "nginx.conf"
        self.conf.write_text(
            f"error_log {root}/error.log;\npid {root}/nginx.pid;\nevents {{}}\n"
            f"http {{\n    {temp}\n    access_log off;\n"
            "    ssl_protocols TLSv1 TLSv1.1 TLSv1.2 TLSv1.3;\n    ssl_prefer_server_ciphers on;\n"
            f"    {http_directives}\n    include {root}/vllm.conf;\n    {other}\n}}\n"
        )

    @staticmethod
    def _engine_key(root: Path, key: str) -> Path:
        """nginx's file of the engine's key, made by the host's own command from an engine
        file that holds ``key`` (the command keeps a valid one)."""
        env, conf = root / "engine-key.env", root / "vllm-engine-key.conf"
        env.write_text(f"VLLM_API_KEY='{key}'\n")
        command = engine_key_command(str(env), str(conf)).get_raw_value()
        subprocess.run(["sh", "-c", command], check=True, timeout=30)
        return conf

    def command(self, *args: str) -> list[str]:
        assert NGINX is not None
        return [NGINX, "-c", str(self.conf), "-p", f"{self.root}/", *args]

    def test(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command("-t"), capture_output=True, text=True, timeout=30)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        proc = subprocess.Popen(self.command("-g", "daemon off;"), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", self.gateway_port), 0.2).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        out = proc.communicate()[0] if proc.poll() is not None else ""
                        pytest.fail(f"nginx did not come up: {out}")
                    time.sleep(0.05)
            yield
        finally:
            proc.terminate()
            proc.wait(timeout=10)


@contextlib.contextmanager
def engine(family: int = socket.AF_INET, received: list[str] | None = None,
           path: str | None = None) -> Iterator:
    """A stand-in engine on loopback (its port), or with AF_UNIX on the socket ``path``
    (yielded): answers every request with the path and the Authorization it got;
    ``received`` collects each request's path as it arrived."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            if received is not None:
                received.append(self.path)
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = json.dumps({"path": self.path,
                               "authorization": self.headers.get("Authorization")}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        address_family = family

        def server_bind(self) -> None:
            if family != socket.AF_UNIX:
                super().server_bind()
                return
            self.socket.bind(self.server_address)
            self.server_name, self.server_port = "localhost", 0

    address = path if family == socket.AF_UNIX else (
        "::1" if family == socket.AF_INET6 else "127.0.0.1", 0)
    server = Server(address, Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield path if family == socket.AF_UNIX else server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def request(port: int, path: str = "/v1/models", *, authorization: str | None = None,
            method: str = "POST", tls: ssl.SSLContext | None = None,
            host: str = "127.0.0.1") -> tuple[int, dict[str, str], bytes]:
    conn: http.client.HTTPConnection
    if tls is not None:
        conn = http.client.HTTPSConnection(host, port, timeout=10, context=tls)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=10)
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    conn.request(method, path, b"{}" if method == "POST" else None, headers)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), body


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A throwaway self-signed certificate for localhost, and its key (0600)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed: no certificate for the TLS tests")
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=localhost", "-addext",
         "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    key.chmod(0o600)
    return cert, key


# --- nginx -t ------------------------------------------------------------------------
def test_long_keys_and_keys_differing_in_case_pass_nginx_t(tmp_path):
    # As plain map strings, 64-character keys overflow map_hash_bucket_size, and keys that
    # differ only in case "conflict": nginx -t failed and quoted the key in both cases.
    gateway = Gateway(tmp_path, keys=LONG_KEYS)
    result = gateway.test()
    assert result.returncode == 0, result.stderr
    for key in LONG_KEYS:
        assert key.lower() not in result.stderr.lower()


def test_without_keys_with_tls_redirect_and_ipv6_engine_nginx_t_passes(tmp_path, certificate):
    for keys, extra in (
        ([], {}),
        ([KEY], {"tls": certificate, "http_redirect_port": 8080}),
        ([KEY], {"vllm_host": "::1"}),
        ([KEY], {"vllm_host": "fd00::5", "tls": certificate}),
        ([KEY], {"upstream": "unix:/run/vllm-engine/engine.sock"}),
    ):
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        root.mkdir()
        result = Gateway(root, keys=keys, **extra).test()
        assert result.returncode == 0, (extra, result.stderr)


def test_tls_key_that_is_not_the_certificates_fails_nginx_t(tmp_path, certificate):
    # The swap's nginx -t catches a certificate and key that do not belong together.
    other = tmp_path / "other-key.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-out", str(other)],
                   check=True, capture_output=True, timeout=60)
    root = tmp_path / "gw"
    root.mkdir()
    result = Gateway(root, keys=[KEY], tls=(certificate[0], other)).test()
    assert result.returncode != 0
    assert "key values mismatch" in result.stderr or "SSL_CTX_use_PrivateKey" in result.stderr


# --- requests ------------------------------------------------------------------------
def test_the_key_is_compared_exactly_and_case_sensitively(tmp_path):
    with engine() as engine_port:
        gateway = Gateway(tmp_path, keys=[KEY, *LONG_KEYS], vllm_port=engine_port,
                          gateway_port=free_port())
        with gateway.running():
            def status(authorization: str | None) -> int:
                return request(gateway.gateway_port, authorization=authorization)[0]

            assert status(f"Bearer {KEY}") == 200
            assert status(f"bearer {KEY.lower()}") == 401
            assert status(f"Bearer {KEY.lower()}") == 401
            assert status(f"Bearer {KEY.upper()}") == 401
            assert status(f"Bearer {KEY}x") == 401
            assert status(f"Bearer x{KEY}") == 401
            assert status("Bearer sk-LiveaKey+1") == 401  # "." is not "any character"
            assert status("Bearer sk-Live.Keyy1") == 401  # "+" is not "one or more"
            assert status(f"Basic {KEY}") == 401
            assert status(KEY) == 401
            assert status(None) == 401
            for key in LONG_KEYS:
                assert status(f"Bearer {key}") == 200
            # "K" * 64 and "k" * 64 are two keys; "k" * 63 + "K" is neither.
            assert status("Bearer " + "k" * 63 + "K") == 401


def test_failed_key_checks_are_rate_limited_and_good_keys_never(tmp_path):
    with engine() as engine_port:
        gateway = Gateway(tmp_path, keys=[KEY], vllm_port=engine_port,
                          gateway_port=free_port())
        with gateway.running():
            statuses = [request(gateway.gateway_port, authorization="Bearer guess")[0]
                        for _ in range(25)]
            # A burst of 20 beyond the first, then 429 (10 a minute refill far slower).
            assert statuses[:21] == [401] * 21, statuses
            assert statuses[21:] == [429] * 4, statuses
            status, headers, body = request(gateway.gateway_port, authorization="Bearer guess")
            assert status == 429 and json.loads(body)["error"]["code"] == 429
            # The same address with a good key is not limited at all.
            for _ in range(30):
                assert request(gateway.gateway_port, authorization=f"Bearer {KEY}")[0] == 200
            # Neither are requests that need no key.
            assert request(gateway.gateway_port, "/health", method="GET")[0] == 200


def test_no_version_in_server_header_or_error_pages(tmp_path):
    with engine() as engine_port:
        gateway = Gateway(tmp_path, keys=[KEY], vllm_port=engine_port,
                          gateway_port=free_port())
        with gateway.running():
            for path, authorization in (("/v1/models", None), ("/nope", None),
                                        ("/health", None)):
                _status, headers, body = request(gateway.gateway_port, path,
                                                 authorization=authorization, method="GET")
                assert headers["Server"] == "nginx", headers
                assert b"nginx/" not in body


def test_the_engine_on_its_socket_gets_its_own_key_never_the_clients(tmp_path):
    # nginx's workers (nobody, under a root master) reach the socket as the engine's
    # readiness wait leaves it: connectable, in a directory they may enter.
    where = Path(tempfile.mkdtemp(prefix="engine-"))
    where.chmod(0o755)
    try:
        with engine(socket.AF_UNIX, path=str(where / "engine.sock")) as engine_socket:
            Path(engine_socket).chmod(0o666)
            gateway = Gateway(tmp_path, keys=[KEY], upstream=f"unix:{engine_socket}",
                              gateway_port=free_port())
            with gateway.running():
                status, _headers, body = request(gateway.gateway_port,
                                                 authorization=f"Bearer {KEY}")
                assert status == 200
                assert json.loads(body)["authorization"] == f"Bearer {ENGINE_KEY}"
    finally:
        shutil.rmtree(where)


def test_engine_gets_its_own_key_on_v1_only(tmp_path):
    # The client's key is replaced by the engine's on /v1, where vLLM checks it. /health
    # and /metrics, which vLLM leaves open, get no key at all, not even the client's: a
    # listener that took the engine's address is handed none by a curl of /health.
    engine_key = ENGINE_KEY
    with engine() as engine_port:
        gateway = Gateway(tmp_path, keys=[KEY], engine_key=engine_key,
                          vllm_port=engine_port, gateway_port=free_port())
        with gateway.running():
            for path in ("/v1/models", "/v1/chat/completions"):
                status, _headers, body = request(gateway.gateway_port, path,
                                                 authorization=f"Bearer {KEY}")
                assert (status, json.loads(body)) == (
                    200, {"path": path, "authorization": f"Bearer {engine_key}"})
            assert request(gateway.gateway_port, authorization=f"Bearer {engine_key}")[0] == 401
            for path in ("/health", "/metrics"):
                for client in (None, f"Bearer {KEY}", f"Bearer {engine_key}"):
                    status, _headers, body = request(gateway.gateway_port, path,
                                                     method="GET", authorization=client)
                    assert (path, client, status, json.loads(body)) == (
                        path, client, 200, {"path": path, "authorization": None})


# Requests whose path nginx normalises (dot segments, percent-encoding, merged slashes:
# nginx docs, "location") to a public location while the raw path starts with /metrics,
# or the other way round. vLLM routes "^/metrics(?P<path>.*)$" on the path as it arrives
# (decoded, never normalised), so a raw /metrics/../health served the engine's metrics
# through "location = /health". Each: the path sent, the status, the path the engine
# gets (None: it gets no request).
AROUND_METRICS = [
    ("/metrics/../health", 200, "/health"),
    ("/metrics/%2e%2e/health", 200, "/health"),
    ("/metrics%2F..%2Fhealth", 200, "/health"),
    ("/metrics/../v1/models", 401, None),
    ("/metrics/../nope", 404, None),
    ("/v1/../metrics", 403, None),
    ("/v1/%2e%2e/metrics", 403, None),
    ("/v1/models/..%2F..%2Fmetrics", 403, None),
    ("/health/../metrics", 403, None),
    ("/%6detrics", 403, None),
    ("//metrics", 403, None),
    ("/./metrics", 403, None),
    ("/metrics", 403, None),
]


def test_no_path_reaches_the_engines_metrics_from_outside_metrics_allow(tmp_path):
    received: list[str] = []
    with engine(received=received) as engine_port:
        gateway = Gateway(tmp_path, keys=[KEY], vllm_port=engine_port,
                          gateway_port=free_port(), metrics_allow=("10.0.0.0/8",))
        with gateway.running():
            for path, want_status, want_received in AROUND_METRICS:
                received.clear()
                status = request(gateway.gateway_port, path, method="GET")[0]
                assert (path, status, received) == (
                    path, want_status, [want_received] if want_received else [])
            # With a good key the /v1/ location passes the normalised path too.
            for path in ("/v1/%2e%2e/metrics", "/v1/x/../../metrics"):
                received.clear()
                assert request(gateway.gateway_port, path, method="GET",
                               authorization=f"Bearer {KEY}")[0] == 403
                assert received == []
            received.clear()
            assert request(gateway.gateway_port, "/v1/x/%2e%2e/models?a=1", method="GET",
                           authorization=f"Bearer {KEY}")[0] == 200
            assert received == ["/v1/models?a=1"]


def test_every_location_passes_the_engine_the_normalised_path_and_the_query(tmp_path):
    received: list[str] = []
    with engine(received=received) as engine_port:
        gateway = Gateway(tmp_path, keys=[KEY], vllm_port=engine_port,
                          gateway_port=free_port())
        with gateway.running():
            for method, path, want in (
                ("GET", "/health", "/health"),
                ("GET", "/health?probe=1", "/health?probe=1"),
                ("GET", "/metrics", "/metrics"),
                ("GET", "/metrics?name[]=vllm:num_requests_running",
                 "/metrics?name[]=vllm:num_requests_running"),
                ("GET", "/v1/models", "/v1/models"),
                ("POST", "/v1/chat/completions", "/v1/chat/completions"),
                ("POST", "/v1//completions", "/v1/completions"),
                ("GET", "/v1/models/org%2Fname", "/v1/models/org/name"),
                ("GET", "/v1/models/a%20b", "/v1/models/a%20b"),
            ):
                received.clear()
                status = request(gateway.gateway_port, path, method=method,
                                 authorization=f"Bearer {KEY}")[0]
                assert (path, status, received) == (path, 200, [want])


def test_ipv6_engine_is_reached_in_brackets(tmp_path):
    try:
        socket.socket(socket.AF_INET6).close()
        free_port(socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    with engine(socket.AF_INET6) as engine_port:
        gateway = Gateway(tmp_path, keys=[KEY], vllm_host="::1", vllm_port=engine_port,
                          gateway_port=free_port())
        assert f"server [::1]:{engine_port};" in gateway.site
        with gateway.running():
            assert request(gateway.gateway_port, authorization=f"Bearer {KEY}")[0] == 200


def test_tls_serves_and_the_redirect_port_only_redirects(tmp_path, certificate):
    cert, _key = certificate
    context = ssl.create_default_context(cafile=str(cert))
    with engine() as engine_port:
        gateway = Gateway(tmp_path, keys=[KEY], vllm_port=engine_port, tls=certificate,
                          gateway_port=free_port(), http_redirect_port=free_port())
        with gateway.running():
            port = gateway.gateway_port
            assert request(port, authorization=f"Bearer {KEY}", tls=context,
                           host="localhost")[0] == 200
            assert request(port, authorization="Bearer guess", tls=context,
                           host="localhost")[0] == 401
            # TLS 1.2 and 1.3 only: the server itself answers a TLS 1.1 hello with a
            # "protocol version" alert (the client is let to offer 1.1: SECLEVEL=0).
            for version, accepted in (("-tls1_1", False), ("-tls1_2", True), ("-tls1_3", True)):
                hello = subprocess.run(
                    ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", version,
                     "-cipher", "DEFAULT:@SECLEVEL=0", "-CAfile", str(cert)],
                    input="", capture_output=True, text=True, timeout=30,
                )
                if accepted:
                    assert "Verify return code: 0 (ok)" in hello.stdout, hello.stdout
                else:
                    assert "alert protocol version" in hello.stderr, hello.stderr
            # Plain HTTP on the TLS port is an error, never served.
            assert request(port, authorization=f"Bearer {KEY}")[0] == 400
            # The redirect port answers every request with a 301 and proxies nothing.
            assert gateway.http_redirect_port is not None
            for path in ("/v1/models?x=1", "/health", "/metrics", "/"):
                status, headers, _body = request(gateway.http_redirect_port, path,
                                                 authorization=f"Bearer {KEY}",
                                                 host="localhost")
                assert status == 301
                assert headers["Location"] == f"https://localhost:{port}{path}"
                assert headers["Server"] == "nginx"


@pytest.fixture(scope="module")
def rsa_certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A throwaway self-signed RSA certificate for localhost, and its key (0600): with an
    RSA certificate a server can offer static RSA key exchange too (AES128-GCM-SHA256)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate for the TLS tests")
    where = tmp_path_factory.mktemp("rsa")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    key.chmod(0o600)
    return cert, key


def negotiated(port: int, cert: Path, *args: str) -> str:
    """The suite a TLS 1.2 hello with ``args`` (openssl s_client's) gets, "(NONE)" when
    the handshake fails."""
    hello = subprocess.run(
        ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-servername", "localhost",
         "-CAfile", str(cert), "-tls1_2", *args],
        input="", capture_output=True, text=True, timeout=30,
    )
    found = re.search(r"^New, \S+, Cipher is (\S+)$", hello.stdout, re.MULTILINE)
    assert found, hello.stdout + hello.stderr
    return found.group(1)


# TLS 1.2 suites this machine's OpenSSL offers (SECLEVEL=0 lets it offer the weak ones)
# and nginx's default (HIGH:!aNULL:!MD5) served: CBC with SHA-256 or SHA-1 MACs (Lucky 13),
# static RSA key exchange (no forward secrecy), CCM8, ARIA, Camellia; and DHE, which
# nginx offers only with ssl_dhparam.
REFUSED_TLS12 = ["ECDHE-RSA-AES128-SHA256", "ECDHE-RSA-AES256-SHA", "AES128-SHA",
                 "AES128-GCM-SHA256", "AES256-SHA256", "AES128-CCM8", "ECDHE-ARIA128-GCM-SHA256",
                 "ECDHE-RSA-CAMELLIA128-SHA256", "DHE-RSA-AES128-GCM-SHA256"]
# Mozilla's intermediate profile's suites for an RSA certificate.
ACCEPTED_TLS12 = ["ECDHE-RSA-AES128-GCM-SHA256", "ECDHE-RSA-AES256-GCM-SHA384",
                  "ECDHE-RSA-CHACHA20-POLY1305"]


def test_tls_1_2_offers_only_mozillas_intermediate_suites(tmp_path, rsa_certificate):
    cert, _key = rsa_certificate
    with engine() as engine_port:
        gateway = Gateway(tmp_path, keys=[KEY], vllm_port=engine_port, tls=rsa_certificate,
                          gateway_port=free_port())
        with gateway.running():
            port = gateway.gateway_port
            got = {suite: negotiated(port, cert, "-cipher", f"{suite}:@SECLEVEL=0")
                   for suite in REFUSED_TLS12 + ACCEPTED_TLS12}
            assert got == {**dict.fromkeys(REFUSED_TLS12, "(NONE)"),
                           **{suite: suite for suite in ACCEPTED_TLS12}}
            # The client's order wins (ssl_prefer_server_ciphers off, over Debian's "on"
            # in http {}), among the profile's suites only.
            first, second = ACCEPTED_TLS12[:2]
            assert negotiated(port, cert, "-cipher", f"{first}:{second}") == first
            assert negotiated(port, cert, "-cipher", f"{second}:{first}") == second
            # The profile's curves: X25519, prime256v1, secp384r1, not secp521r1.
            assert negotiated(port, cert, "-curves", "X25519") in ACCEPTED_TLS12
            assert negotiated(port, cert, "-curves", "secp521r1") == "(NONE)"


def test_hsts_on_every_tls_answer_and_never_over_plain_http(tmp_path, certificate):
    cert, _key = certificate
    context = ssl.create_default_context(cafile=str(cert))
    drain_dir = Path(tempfile.mkdtemp(prefix="pyinfra-vllm-drain-"))
    drain_dir.chmod(0o755)
    with engine() as engine_port, contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, drain_dir)
        gateway = Gateway(tmp_path, keys=[KEY], vllm_port=engine_port, tls=certificate,
                          gateway_port=free_port(), metrics_allow=("10.0.0.0/8",),
                          drain_flag=drain_dir / "draining")
        with gateway.running():
            def answer(path: str, authorization: str | None = None) -> tuple[int, str]:
                status, headers, _body = request(gateway.gateway_port, path, tls=context,
                                                 host="localhost", method="GET",
                                                 authorization=authorization)
                return status, headers.get("Strict-Transport-Security", "")

            hsts = "max-age=63072000"
            assert answer("/v1/models", f"Bearer {KEY}") == (200, hsts)
            assert answer("/v1/models") == (401, hsts)
            assert answer("/nope") == (404, hsts)
            assert answer("/metrics") == (403, hsts)
            assert answer("/health") == (200, hsts)
            gateway.drain_flag.touch()
            assert answer("/health") == (503, hsts)
            assert answer("/v1/models", f"Bearer {KEY}") == (503, hsts)
    (tmp_path / "plain").mkdir()
    with engine() as engine_port:
        plain = Gateway(tmp_path / "plain", keys=[KEY], vllm_port=engine_port,
                        gateway_port=free_port())
        with plain.running():
            _status, headers, _body = request(plain.gateway_port, "/health", method="GET")
            assert "Strict-Transport-Security" not in headers


def test_no_version_on_any_server_of_this_nginx(tmp_path):
    # The site's http-level server_tokens reaches a server of another file (Debian's
    # default site, a hand-made one) too.
    with engine() as engine_port:
        gateway = Gateway(tmp_path, keys=[KEY], vllm_port=engine_port,
                          gateway_port=free_port(), other_server_port=free_port())
        with gateway.running():
            assert gateway.other_server_port is not None
            for port in (gateway.gateway_port, gateway.other_server_port):
                status, headers, body = request(port, "/nope", method="GET")
                assert (status, headers["Server"]) == (404, "nginx"), (port, headers)
                assert b"nginx/" not in body


def test_server_tokens_set_in_nginx_conf_leaves_the_sites_own_out(tmp_path):
    # An http-level server_tokens in nginx.conf (its commented line uncommented): the site
    # then leaves its own out, which nginx would refuse as a duplicate.
    gateway = Gateway(tmp_path, keys=[KEY], http_directives="server_tokens off;")
    assert not gateway.site.startswith("server_tokens") and "\nserver_tokens" not in gateway.site
    assert gateway.test().returncode == 0, gateway.test().stderr
    (tmp_path / "vllm.conf").write_text("server_tokens off;\n" + gateway.site)
    result = gateway.test()
    assert result.returncode != 0
    assert '"server_tokens" directive is duplicate' in result.stderr


def test_node_metrics_reach_node_exporter_on_loopback_without_the_engines_key(tmp_path):
    # node_exporter is a stand-in on loopback: it gets /metrics, and never the
    # Authorization header nginx sends the engine.
    with engine() as engine_port, engine() as node_port:
        gateway = Gateway(tmp_path, keys=[KEY],
                          vllm_port=engine_port, gateway_port=free_port(),
                          node_exporter_port=node_port)
        assert gateway.test().returncode == 0
        with gateway.running():
            status, _headers, body = request(gateway.gateway_port, "/node-metrics",
                                             method="GET")
            assert status == 200
            assert json.loads(body) == {"path": "/metrics", "authorization": None}
            status, _headers, body = request(gateway.gateway_port, "/node-metrics",
                                             method="GET", authorization=f"Bearer {KEY}")
            assert json.loads(body) == {"path": "/metrics", "authorization": None}


# One of each directive gateway_extra_directives allows.
ALLOWED_DIRECTIVES = [
    "access_log /var/log/nginx/vllm-extra-access.log vllm_gateway;",
    "add_header X-Served-By gpu1 always;",
    "client_body_buffer_size 64k;",
    "client_body_timeout 120s;",
    "client_header_buffer_size 4k;",
    "client_header_timeout 30s;",
    "error_log /var/log/nginx/vllm-extra-error.log warn;",
    "gzip on;",
    "gzip_buffers 16 8k;",
    "gzip_comp_level 5;",
    'gzip_disable "msie6";',
    "gzip_http_version 1.1;",
    "gzip_min_length 1000;",
    "gzip_proxied any;",
    "gzip_types application/json;",
    "gzip_vary on;",
    "keepalive_requests 1000;",
    "keepalive_timeout 75s;",
    "large_client_header_buffers 4 16k;",
    "lingering_close on;",
    "lingering_time 30s;",
    "lingering_timeout 5s;",
    "log_not_found off;",
    "open_log_file_cache max=10;",
    "proxy_connect_timeout 5s;",
    "reset_timedout_connection on;",
    "send_timeout 120s;",
]


def test_every_allowed_extra_directive_passes_nginx_t_and_keeps_the_key_check(tmp_path):
    assert sorted(d.split()[0] for d in ALLOWED_DIRECTIVES) == sorted(GATEWAY_DIRECTIVES)
    settings = validate({"api_keys": ["sk-" + "a" * 40],
                         "gateway_extra_directives": ALLOWED_DIRECTIVES})
    with engine() as engine_port:
        gateway = Gateway(tmp_path, keys=[KEY], vllm_port=engine_port, gateway_port=free_port(),
                          extra_directives=tuple(settings.gateway_extra_directives))
        result = gateway.test()
        assert result.returncode == 0, result.stderr
        with gateway.running():
            status, headers, _body = request(gateway.gateway_port)
            assert (status, headers["X-Served-By"]) == (401, "gpu1")
            assert request(gateway.gateway_port, authorization=f"Bearer {KEY}")[0] == 200
            assert request(gateway.gateway_port, "/metrics/../health", method="GET")[0] == 200


@pytest.mark.parametrize("directives", [
    ["set $vllm_key_ok 1;"],
    ["satisfy any;", "allow all;"],
], ids=["set", "satisfy-any"])
def test_directives_that_open_v1_without_a_key_are_refused_by_the_settings(tmp_path, directives):
    # Rendered as they are, nginx -t passes and /v1/ is served without a key: only the
    # settings stand in their way.
    with engine() as engine_port:
        gateway = Gateway(tmp_path, keys=[KEY], vllm_port=engine_port, gateway_port=free_port(),
                          extra_directives=tuple(directives))
        assert gateway.test().returncode == 0
        with gateway.running():
            assert request(gateway.gateway_port)[0] == 200
    with pytest.raises(SettingsError, match="which is refused"):
        validate({"api_keys": ["sk-" + "a" * 40], "gateway_extra_directives": directives})


@pytest.mark.parametrize("level", ["debug", "debug_http"])
def test_a_debug_error_log_writes_the_keys_and_is_refused_by_the_settings(tmp_path, level):
    # Not only "debug": each debug_* level names what nginx writes at the debug level, and
    # debug_http writes every request header nginx reads and sends.
    assert NGINX is not None
    built = subprocess.run([NGINX, "-V"], capture_output=True, text=True, timeout=30).stderr
    if "--with-debug" not in built:
        pytest.skip("this nginx is built without --with-debug: it writes no debug lines")
    directive = f"error_log /var/log/nginx/vllm-debug.log {level};"
    with engine() as engine_port:
        gateway = Gateway(tmp_path, keys=[KEY], vllm_port=engine_port, gateway_port=free_port(),
                          extra_directives=(directive,))
        with gateway.running():
            assert request(gateway.gateway_port, authorization=f"Bearer {KEY}")[0] == 200
    log = tmp_path / "vllm-debug.log"
    assert f"Authorization: Bearer {KEY}" in log.read_text()
    assert f"Authorization: Bearer {ENGINE_KEY}" in log.read_text()
    assert log.stat().st_mode & 0o004, "nginx makes its logs readable to every user"
    with pytest.raises(SettingsError, match="logs at the debug level"):
        validate({"api_keys": ["sk-" + "a" * 40], "gateway_extra_directives": [directive]})


def test_the_workers_see_the_drain_flag_while_the_secrets_directory_is_0700(tmp_path):
    # The drain command itself (pyinfra_vllm/operations/util/rolling.py) and a secret upload's 0700
    # directory (pyinfra_vllm/operations/util/uploads.py), with /run moved into a 0755 directory of
    # this test's. Run as root, nginx's workers run as another user (nobody here,
    # www-data on a host): a flag inside the 0700 secrets' directory is invisible to them.
    root = tempfile.mkdtemp(prefix="pyinfra-vllm-root-")
    Path(root, "run").mkdir()
    for directory in (Path(root), Path(root, "run")):
        directory.chmod(0o755)
    with engine() as engine_port, contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, root)
        drain = drain_command().get_raw_value().replace(" /run/", f" {root}/run/")
        gateway = Gateway(tmp_path, keys=[KEY], vllm_port=engine_port,
                          gateway_port=free_port(), drain_flag=Path(root + DRAIN_FLAG))
        with gateway.running():
            subprocess.run(["sh", "-c", drain], check=True, timeout=30)
            secrets = Path(root + SECRET_DIR)
            secrets.mkdir(mode=0o700, exist_ok=True)
            secrets.chmod(0o700)
            (secrets / "hf_token").write_text("hf_x\n")
            assert request(gateway.gateway_port, "/health", method="GET")[0] == 503
            assert request(gateway.gateway_port, authorization=f"Bearer {KEY}")[0] == 503


def test_a_draining_gateway_answers_503_on_health_and_v1_and_serves_again(tmp_path):
    # The rolling restart's flag (pyinfra_vllm/operations/util/rolling.py): nginx tests it on
    # every request, no reload; /metrics stays up for monitoring.
    # nginx tests the flag in its workers, which run as another user when the tests run
    # as root (nobody here, www-data on a host): its directory must be searchable by
    # them, as DRAIN_DIR (0755) is; pytest's tmp_path (0700) is not.
    drain_dir = Path(tempfile.mkdtemp(prefix="pyinfra-vllm-drain-"))
    drain_dir.chmod(0o755)
    with engine() as engine_port, contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, drain_dir)
        gateway = Gateway(tmp_path, keys=[KEY], vllm_port=engine_port,
                          gateway_port=free_port(), drain_flag=drain_dir / "draining")
        with gateway.running():
            bearer = f"Bearer {KEY}"
            assert request(gateway.gateway_port, "/health", method="GET")[0] == 200
            assert request(gateway.gateway_port, authorization=bearer)[0] == 200

            gateway.drain_flag.touch()
            assert request(gateway.gateway_port, "/health", method="GET")[0] == 503
            status, _, body = request(gateway.gateway_port, authorization=bearer)
            assert status == 503
            assert json.loads(body)["error"] == {
                "message": "this server is draining for a restart; retry on another",
                "type": "service_unavailable", "code": 503}
            # Without a key too: the drain answers before the key check, and says nothing
            # of keys.
            assert request(gateway.gateway_port)[0] == 503
            assert request(gateway.gateway_port, "/metrics", method="GET")[0] == 200

            gateway.drain_flag.unlink()
            assert request(gateway.gateway_port, "/health", method="GET")[0] == 200
            status, _, body = request(gateway.gateway_port, authorization=bearer)
            assert status == 200 and json.loads(body)["path"] == "/v1/models"

            # Out of rotation (a host being tuned): load balancers see 503, /v1 serves.
            rotation = gateway.drain_flag.parent / "out-of-rotation"
            rotation.touch()
            assert request(gateway.gateway_port, "/health", method="GET")[0] == 503
            assert request(gateway.gateway_port, authorization=bearer)[0] == 200
            rotation.unlink()
            assert request(gateway.gateway_port, "/health", method="GET")[0] == 200


def test_a_leaving_gateway_fails_health_but_serves_v1_until_its_drain(tmp_path):
    # The rolling step's own commands (pyinfra_vllm/operations/util/rolling.py), /run
    # moved into a 0755 directory of this test's: the leave flag takes the host out of the
    # load balancers (/health 503) while /v1 still reaches the engine; the drain flag then
    # refuses /v1 too; the put back serves both again.
    root = tempfile.mkdtemp(prefix="pyinfra-vllm-root-")
    Path(root, "run").mkdir()
    for directory in (Path(root), Path(root, "run")):
        directory.chmod(0o755)

    def sh(command) -> None:
        raw = command.get_raw_value().replace(" /run/", f" {root}/run/")
        subprocess.run(["sh", "-c", raw], check=True, timeout=30)

    with engine() as engine_port, contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, root)
        gateway = Gateway(tmp_path, keys=[KEY], vllm_port=engine_port,
                          gateway_port=free_port(), drain_flag=Path(root + DRAIN_FLAG))
        bearer = f"Bearer {KEY}"
        leave, drain = drain_commands(0)
        with gateway.running():
            sh(leave)
            assert request(gateway.gateway_port, "/health", method="GET")[0] == 503
            status, _, body = request(gateway.gateway_port, authorization=bearer)
            assert status == 200 and json.loads(body)["path"] == "/v1/models"
            sh(drain)
            assert request(gateway.gateway_port, "/health", method="GET")[0] == 503
            assert request(gateway.gateway_port, authorization=bearer)[0] == 503
            sh(undrain_command())
            assert request(gateway.gateway_port, "/health", method="GET")[0] == 200
            status, _, body = request(gateway.gateway_port, authorization=bearer)
            assert status == 200 and json.loads(body)["path"] == "/v1/models"
