"""Pure helpers of the gateway: body-size arithmetic, the key map, the rendered site."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from pyinfra.api import OperationValueError

from pyinfra_vllm.core.settings import Settings, SettingsError, validate
from pyinfra_vllm.operations.util.gateway import disable_script, swap_script
from pyinfra_vllm.plans.engine_access import KEY_NGINX_PATH, SOCKET_PATH, engine_address
from pyinfra_vllm.plans.gateway import (
    SITE_PATH,
    body_limit_mib,
    foreign_paths,
    http_server_tokens,
    key_regex,
    metrics_networks,
    redactions,
    render_keys_map,
    render_site,
)


def site(**overrides) -> str:
    args = dict(
        upstream="127.0.0.1:8000",
        gateway_port=8001,
        metrics_allow=["127.0.0.1/32", "10.0.0.7/24"],
        body_mib=2,
        proxy_timeout_s=3600,
    )
    args.update(overrides)
    return render_site(**args)


def test_body_limit_for_128k_tokens_is_2_mib():
    # 131072 tokens x 12 bytes (2 CJK chars per token, 6 bytes per \uXXXX) + 64 KiB.
    assert 131072 * 12 + 65536 == 1638400
    assert body_limit_mib(131072) == 2
    assert body_limit_mib(32768) == 1
    # Just over a MiB boundary rounds up, never down.
    assert body_limit_mib(174763) == 3


def test_keys_map_lists_each_key_as_an_exact_case_sensitive_regex_with_default_deny():
    text = render_keys_map(["sk-a", "sk-b.c_d+e"])
    block = text[text.index("map $http_authorization") :]
    block = block[: block.index("}")]
    assert "default 0;" in block
    # "~": a case-sensitive PCRE (a plain string entry compares case-insensitively and is
    # hashed: a long key failed nginx -t); anchored at both ends; "." and "+" escaped.
    assert '"~^Bearer sk-a\\z" 1;' in block
    assert '"~^Bearer sk-b\\.c_d\\+e\\z" 1;' in block
    assert '"Bearer sk-a" 1;' not in block
    assert "default 1;" not in block


def test_key_regex_escapes_every_operator_of_the_key_alphabet():
    # The alphabet is A-Za-z0-9_.~+/=:- ; PCRE reads only "." and "+" of it as operators.
    assert key_regex("aZ09_.~+/=:-") == r"^Bearer aZ09_\.~\+/=:-\z"
    pattern = key_regex("sk.a+b")
    python = pattern.replace(r"\z", r"\Z")  # Python's spelling of PCRE's \z
    assert re.match(python, "Bearer sk.a+b")
    for wrong in ("Bearer skXa+b", "Bearer sk.aab", "Bearer sk.a+b\n", "bearer sk.a+b",
                  "Bearer SK.A+B", "Bearer sk.a+bx", "xBearer sk.a+b"):
        assert not re.match(python, wrong), wrong


def test_repeated_key_is_refused_by_position_only():
    # By the settings, before any host is touched: the key map renders the validated
    # settings' keys as they are, with no second check.
    one, two = "sk-one-" + "1" * 32, "sk-two-" + "2" * 32
    with pytest.raises(SettingsError) as raised:
        validate({"api_keys": [one, two, one]})
    assert "  api_keys = <secret>: api_keys[2] repeats api_keys[0]" in str(raised.value)
    assert one not in str(raised.value)
    # Keys that differ only in case are two keys to nginx: two case-sensitive entries.
    text = render_keys_map(["sk-one", "SK-ONE"])
    assert '"~^Bearer sk-one\\z" 1;' in text and '"~^Bearer SK-ONE\\z" 1;' in text


def test_no_keys_turns_the_check_off():
    text = render_keys_map([])
    assert re.search(r"^\s*default 1;", text, re.M)
    assert "~^Bearer" not in text


def test_the_engine_gets_its_own_key_from_the_hosts_file_never_a_clients():
    # The client keys' map sets no upstream Authorization: the site includes the file
    # made on the host, which does.
    assert "vllm_upstream_authorization" not in render_keys_map(["sk-a", "sk-b"])
    text = site()
    assert f"include {KEY_NGINX_PATH};" in text
    assert "proxy_set_header Authorization $vllm_upstream_authorization;" in text


@pytest.mark.parametrize("bad", ['sk"x', "sk x", "sk;x", "sk{x", "", "sk\\x"])
def test_key_with_nginx_syntax_is_refused_without_printing_it(bad):
    # By the settings, before any host is touched (the key map trusts them).
    with pytest.raises(SettingsError) as raised:
        validate({"api_keys": ["sk-ok-" + "0" * 32, bad]})
    assert "api_keys[1] has characters other than letters, digits and _.~+/=:-" in str(
        raised.value)
    if bad:
        assert bad not in str(raised.value)


def test_site_streams_over_http11_keepalive():
    text = site()
    for line in (
        "proxy_buffering off;",
        "proxy_cache off;",
        "proxy_http_version 1.1;",
        'proxy_set_header Connection "";',
        "add_header X-Accel-Buffering no always;",
        "keepalive 32;",
        "server 127.0.0.1:8000;",
        "listen 8001;",
        "client_max_body_size 2m;",
        "proxy_read_timeout 3600s;",
        "proxy_send_timeout 3600s;",
        "include /etc/nginx/vllm-api-keys.conf;",
    ):
        assert line in text, line


def test_metrics_allow_list_then_deny_all():
    text = site()
    block = text[text.index("location = /metrics") :]
    block = block[: block.index("}")]
    assert [line.strip() for line in block.splitlines()[1:] if line.strip()] == [
        "allow 127.0.0.1/32;",
        "allow 10.0.0.0/24;",
        "deny all;",
        "proxy_pass http://vllm_engine/metrics;",
    ]


def test_every_proxy_pass_names_a_uri_so_the_engine_gets_the_normalised_path():
    # Without a URI nginx passes the path as the client wrote it ("/metrics/../health"
    # chose location = /health and vLLM served it its metrics); test_gateway_nginx.py
    # sends those paths to the real nginx.
    text = site(node_exporter_port=9100)
    passes = {}
    for block in text.split("\n    location ")[1:]:
        name = block.split("{")[0].removeprefix("= ").strip()
        passes[name] = re.findall(r"^\s*proxy_pass (\S+);", block, re.M)
    assert passes == {
        "/v1/": ["http://vllm_engine/v1/"],
        "/_vllm_key_check": [],
        "@vllm_unauthorized": [],
        "@vllm_too_many_failures": [],
        "/health": ["http://vllm_engine/health"],
        "/metrics": ["http://vllm_engine/metrics"],
        "/node-metrics": ["http://127.0.0.1:9100/metrics"],
        "/": [],
    }
    assert len(re.findall(r"^\s*proxy_pass ", text, re.M)) == 4


def test_v1_needs_the_key_health_does_not():
    text = site()
    v1 = text[text.index("location /v1/") :]
    v1 = v1[: v1.index("}")]
    assert "auth_request /_vllm_key_check;" in v1
    assert "error_page 401 = @vllm_unauthorized;" in v1
    check = text[text.index("location = /_vllm_key_check") :]
    assert "internal;" in check and "if ($vllm_key_ok = 0)" in check and "return 401" in check
    health = text[text.index("location = /health") : text.index("location = /metrics")]
    assert "vllm_key_ok" not in health and "auth_request" not in health
    assert "return 404" in text[text.index("location / {") :]


def test_failed_key_checks_are_counted_per_address_and_limited_on_v1_only():
    text = site()
    http_level = text[: text.index("server {")]
    assert re.search(r"map \$vllm_key_ok \$vllm_key_failed_client \{\s*0 \$binary_remote_addr;"
                     r'\s*default "";\s*\}', http_level)
    assert ("limit_req_zone $vllm_key_failed_client zone=vllm_key_failures:10m rate=10r/m;"
            in http_level)
    v1 = text[text.index("location /v1/") :]
    v1 = v1[: v1.index("}")]
    # limit_req (preaccess phase) before the key check (access phase) answers 401.
    assert "limit_req zone=vllm_key_failures burst=20 nodelay;" in v1
    assert "limit_req_status 429;" in v1
    assert v1.index("limit_req ") < v1.index("auth_request")
    assert text.count("limit_req zone=") == 1
    # A rewrite-phase "return 401" here would end the request before limit_req saw it.
    # The one return is the drain's 503 (a rolling restart), under its flag only.
    returns = [line.strip() for line in v1.splitlines() if line.strip().startswith("return")]
    assert len(returns) == 1 and returns[0].startswith("return 503 ")
    assert "if (-f /run/pyinfra-vllm-drain/draining) {" in v1


def test_server_tokens_off_for_every_server_of_nginx_and_in_each_of_the_sites():
    for text in (site(), site(tls=True, http_redirect_port=8080)):
        # At http level (the file is included inside http {}), before any block: every
        # server of this nginx, Debian's default site and hand-made ones too.
        top = text[: text.index("\ninclude ")]
        assert "\nserver_tokens off;\n" in top
        assert text.count("server {") + 1 == text.count("server_tokens off;")
    # Another file sets it at http level: the site's own would be a duplicate.
    text = site(server_tokens_http=False)
    assert text.count("server_tokens off;") == text.count("server {") == 1


def test_http_server_tokens_of_other_files():
    def tokens(*entries: tuple[str, str]) -> dict:
        return {"files": [], "server_tokens": [
            {"path": path, "line": 21, "value": value} for path, value in entries]}

    assert http_server_tokens(None) == (True, [])
    assert http_server_tokens(tokens((SITE_PATH, "off"))) == (True, [])
    assert http_server_tokens(tokens(("/etc/nginx/nginx.conf", "off"))) == (False, [])
    write, refusals = http_server_tokens(tokens(("/etc/nginx/nginx.conf", "on"),
                                                (SITE_PATH, "off")))
    assert write is False
    assert refusals == [
        "gateway: /etc/nginx/nginx.conf line 21 sets server_tokens 'on' for every server of "
        "this nginx, which then shows its version in the Server header and on error pages; "
        "set it to off there or remove the line (the gateway's site sets it off for every "
        "server)"]


# Mozilla's intermediate profile (ssl-config.mozilla.org, guidelines 5.7), less its DHE
# suites (nginx offers them only with ssl_dhparam).
INTERMEDIATE_TLS12 = ("ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-RSA-AES128-GCM-SHA256:"
                      "ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-RSA-AES256-GCM-SHA384:"
                      "ECDHE-ECDSA-CHACHA20-POLY1305:ECDHE-RSA-CHACHA20-POLY1305")


def test_tls_follows_mozillas_intermediate_profile():
    server = site(tls=True)
    for line in (f"ssl_ciphers {INTERMEDIATE_TLS12};",
                 "ssl_ecdh_curve X25519:prime256v1:secp384r1;",
                 "ssl_prefer_server_ciphers off;", "ssl_protocols TLSv1.2 TLSv1.3;"):
        assert f"\n    {line}\n" in server, line
    # Forward secrecy and AEAD only: no CBC, no SHA-1, no static RSA key exchange.
    for suite in INTERMEDIATE_TLS12.split(":"):
        assert re.fullmatch(r"ECDHE-(ECDSA|RSA)-(AES(128|256)-GCM-SHA(256|384)"
                            r"|CHACHA20-POLY1305)", suite), suite
    assert "ssl_ciphers" not in site()


def test_hsts_with_tls_only_and_no_location_drops_the_servers_headers():
    hsts = 'add_header Strict-Transport-Security "max-age=63072000" always;'
    assert site(tls=True, http_redirect_port=8080).count(hsts) == 1
    assert hsts not in site()
    # nginx passes a level's add_header lines only into a location that sets none of its
    # own: one add_header in a location would drop HSTS and X-Accel-Buffering there.
    lines = site(tls=True, node_exporter_port=9100).splitlines()
    starts = [index for index, line in enumerate(lines) if line.startswith("    location ")]
    assert len(starts) == 8
    for start in starts:
        block = lines[start : lines.index("    }", start)]
        assert not [line for line in block if "add_header" in line], block


def test_the_engine_gets_the_key_files_authorization_on_v1_only_never_the_clients():
    text = site()
    # The server's default: no Authorization passed on, the client's stops here.
    assert '    proxy_set_header Authorization "";\n' in text.split("    location ", 1)[0]
    # The engine's key in location /v1/ alone, where vLLM checks it (not /health nor
    # /metrics: whoever holds the engine's address gets no key from them).
    v1 = text.split("    location /v1/ {\n", 1)[1].split("\n    }\n", 1)[0]
    assert "        proxy_set_header Authorization $vllm_upstream_authorization;\n" in v1
    assert text.count("Authorization $vllm_upstream_authorization;") == 1


@pytest.mark.parametrize(("host", "server"), [
    ("127.0.0.1", "127.0.0.1:8000"),
    ("::1", "[::1]:8000"),
    ("fd00::5", "[fd00::5]:8000"),
    ("0.0.0.0", "127.0.0.1:8000"),
    ("::", "[::1]:8000"),
    ("engine.internal", "engine.internal:8000"),
])
def test_upstream_server_brackets_ipv6_and_reaches_a_wildcard_on_loopback(host, server):
    assert engine_address(host, 8000) == server
    assert f"    server {server};" in site(upstream=engine_address(host, 8000))


def test_upstream_server_can_be_the_engines_socket():
    assert f"    server unix:{SOCKET_PATH};" in site(upstream=f"unix:{SOCKET_PATH}")


def test_plain_http_by_default_is_todays_server():
    text = site()
    assert "listen 8001;" in text
    assert "ssl" not in text.replace("proxy_buffering", "")
    assert text.count("server {") == 1


def test_tls_listens_ssl_with_modern_protocols_and_the_installed_files():
    text = site(tls=True)
    server = text[text.index("server {") :]
    for line in ("listen 8001 ssl;", "ssl_certificate /etc/nginx/vllm-tls/cert.pem;",
                 "ssl_certificate_key /etc/nginx/vllm-tls/key.pem;",
                 "ssl_protocols TLSv1.2 TLSv1.3;", "ssl_session_tickets off;"):
        assert f"    {line}\n" in server, line
    assert "listen 8001;" not in text
    assert text.count("server {") == 1  # no redirect port, no second server


def test_redirect_port_serves_a_301_and_nothing_else():
    text = site(tls=True, http_redirect_port=8080)
    assert text.count("server {") == 2
    redirect = text[text.index("server {") :]
    redirect = redirect[: redirect.index("\n}\n")]
    body = [line.strip() for line in redirect.splitlines()[1:] if line.strip()
            and not line.strip().startswith("#")]
    assert body == [
        "listen 8080;",
        "server_name _;",
        "server_tokens off;",
        "access_log /var/log/nginx/vllm-access.log vllm_gateway;",
        "error_log /var/log/nginx/vllm-error.log;",
        "return 301 https://$host:8001$request_uri;",
    ]
    assert "proxy_pass" not in redirect and "location" not in redirect


def test_redirect_port_needs_tls_and_its_own_port():
    with pytest.raises(OperationValueError, match="needs tls"):
        site(http_redirect_port=8080)
    with pytest.raises(OperationValueError, match="differ"):
        site(tls=True, http_redirect_port=8001)


def test_access_log_has_times_and_no_authorization():
    text = site()
    fmt = text[text.index("log_format") : text.index("upstream vllm_engine")]
    assert "$request_time" in fmt and "$upstream_response_time" in fmt
    assert "authorization" not in fmt.lower()
    assert "$request " not in fmt and "$request_uri" not in fmt  # no query strings


def test_bad_cidr_is_refused():
    with pytest.raises(OperationValueError, match="not a CIDR"):
        metrics_networks(["10.0.0.300/8"])


def test_extra_directives_go_inside_the_server_block():
    text = site(extra_directives=["add_header X-Served-By gpu1;"])
    assert text.rstrip().endswith("add_header X-Served-By gpu1;\n}")


def test_settings_defaults_and_directive_check():
    defaults = Settings(gateway_open=True)
    assert defaults.gateway_proxy_timeout_s == 3600
    assert defaults.gateway_max_body_mib is None
    with pytest.raises(Exception, match="ending in ';'"):
        validate({"gateway_extra_directives": ["no semicolon"], "gateway_open": True})


def test_swap_script_tests_before_reload_and_rolls_back():
    script = swap_script([("site.conf", "/etc/nginx/conf.d/vllm.conf", "644")], "/st", "nginx")
    assert script.index("mv -f /st/site.conf /etc/nginx/conf.d/vllm.conf") < script.index(
        "nginx -t"
    ) < script.index("systemctl reload-or-restart nginx")
    rollback = script[script.index("else if") :]
    assert "mv -f /st/site.conf.bak /etc/nginx/conf.d/vllm.conf" in rollback
    assert "exit 1" in rollback


def test_redactions_hold_each_secret_as_written_and_as_a_regex():
    assert redactions(["sk-a.b+c", "sk-plain", ""]) == [
        "sk-a.b+c", r"sk-a\.b\+c", "sk-plain",
    ]


def test_swap_script_without_filters_prints_nginx_t_as_before():
    script = swap_script([("site.conf", "/etc/nginx/conf.d/vllm.conf", "644")], "/st", "nginx")
    assert 'the previous files are back: $out" >&2; exit 1; fi' in script
    assert "grep" not in script


SECRET = "sk-Secret.Key+42"

# A stand-in nginx whose test fails with every kind of line that could carry a key: a
# string map entry quoted in lower case, a regex entry as written, a line of the key file.
FAKE_NGINX = f"""#!/bin/sh
echo 'nginx: [emerg] conflicting parameter "bearer {SECRET.lower()}" in @KEYS@:7' >&2
echo 'nginx: [emerg] pcre2_compile() failed in "^Bearer {SECRET.replace('.', chr(92) + '.').replace('+', chr(92) + '+')}"' >&2
echo 'nginx: [emerg] unexpected "}}" in @KEYS@:9' >&2
echo 'nginx: [emerg] unknown directive "bogus_directive" in /x/site.conf:3' >&2
echo 'nginx: configuration file /etc/nginx/nginx.conf test failed' >&2
exit 1
"""


def run_swap(tmp_path: Path, secrets: list[str]) -> subprocess.CompletedProcess[str]:
    """swap_script for real in sh, with stand-ins for nginx, chown and systemctl."""
    bin_dir, staging, live = tmp_path / "bin", tmp_path / "st", tmp_path / "x"
    for path in (bin_dir, staging, live):
        path.mkdir()
    for name, text in (("nginx", FAKE_NGINX), ("chown", "#!/bin/sh\n"),
                       ("systemctl", "#!/bin/sh\necho reloaded\n")):
        (bin_dir / name).write_text(text.replace("@KEYS@", str(live / "keys.conf")))
        (bin_dir / name).chmod(0o755)
    (live / "keys.conf").write_text("old keys\n")
    (staging / "api-keys.conf").write_text(f'"~^Bearer {SECRET}" 1;\n')
    redact = None
    if secrets:
        redact = "redact.txt"
        (staging / redact).write_text("".join(f"{s}\n" for s in redactions(secrets)))
    script = swap_script([("api-keys.conf", str(live / "keys.conf"), "600")], str(staging),
                         "nginx", hide=[str(live / "keys.conf")], redact=redact)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env,
                          timeout=30)


def test_failed_nginx_t_output_never_shows_a_key_nor_the_key_files_lines(tmp_path):
    result = run_swap(tmp_path, [SECRET, "sk-other"])
    assert result.returncode == 1
    assert (tmp_path / "x" / "keys.conf").read_text() == "old keys\n"  # rolled back
    err = result.stderr
    assert SECRET.lower() not in err.lower()
    assert r"sk-Secret\.Key\+42" not in err
    assert "keys.conf" not in err
    assert "nginx -t rejected the new configuration; the previous files are back:" in err
    assert 'unknown directive "bogus_directive" in' in err and "test failed" in err
    assert "(3 line(s) of its output not shown: they name the API key file or hold a key)" in err
    assert not (tmp_path / "st" / "redact.txt").exists()


def test_without_keys_only_the_key_files_lines_are_hidden(tmp_path):
    result = run_swap(tmp_path, [])
    assert result.returncode == 1
    # No key to look for: the two lines naming the key file go, the rest is shown.
    assert "keys.conf" not in result.stderr
    assert "pcre2_compile() failed" in result.stderr
    assert "(2 line(s) of its output not shown" in result.stderr


def run_disable(tmp_path: Path, nginx_passes: bool) -> tuple[subprocess.CompletedProcess[str],
                                                              Path, Path, Path]:
    """disable_script for real in sh on Debian's default site (a symlink) and a hand-made
    file, with a third path that is not there; stand-ins for nginx and systemctl.
    Returns the run, the link, the file and the directory they are kept in."""
    etc, kept, bin_dir = tmp_path / "etc" / "nginx", tmp_path / "kept", tmp_path / "bin"
    for path in (etc / "sites-available", etc / "sites-enabled", etc / "conf.d", bin_dir):
        path.mkdir(parents=True, exist_ok=True)
    (etc / "sites-available" / "default").write_text("server { listen 80 default_server; }\n")
    link, hand = etc / "sites-enabled" / "default", etc / "conf.d" / "api.conf"
    if not link.is_symlink():
        link.symlink_to(etc / "sites-available" / "default")
    hand.write_text("server { listen 8001; }\n")
    nginx = "#!/bin/sh\nexit 0\n" if nginx_passes else (
        "#!/bin/sh\necho 'nginx: [emerg] host not found in upstream' >&2\nexit 1\n")
    for name, text in (("nginx", nginx), ("systemctl", "#!/bin/sh\necho reloaded\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = disable_script([str(link), str(hand), str(etc / "conf.d" / "gone.conf")],
                            str(kept), "nginx")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return (subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env,
                           timeout=30), link, hand, kept)


def test_foreign_files_are_moved_aside_a_symlink_as_a_symlink_never_deleted(tmp_path):
    result, link, hand, kept = run_disable(tmp_path, nginx_passes=True)
    assert (result.returncode, result.stdout) == (0, "reloaded\n"), result.stderr
    assert not link.is_symlink() and not hand.exists()
    kept_link = Path(f"{kept}{link}")
    assert kept_link.is_symlink()
    assert os.readlink(kept_link) == str(link.parent.parent / "sites-available" / "default")
    assert Path(f"{kept}{hand}").read_text() == "server { listen 8001; }\n"
    assert not Path(f"{kept}{hand.parent}/gone.conf").exists()
    # The package's file stays where it was; a second set-aside keeps the first one.
    assert (link.parent.parent / "sites-available" / "default").is_file()
    result, *_ = run_disable(tmp_path, nginx_passes=True)
    assert result.returncode == 0, result.stderr
    assert Path(f"{kept}{link}.~1~").is_symlink() and kept_link.is_symlink()


def test_nginx_installed_by_the_run_has_debians_default_site_set_aside():
    # No read of the run could see the site nginx's package makes as it installs.
    found = [{"path": "/etc/nginx/conf.d/api.conf"}]
    assert foreign_paths(found, nginx_installed=True) == ["/etc/nginx/conf.d/api.conf"]
    assert foreign_paths([], nginx_installed=True) == []
    assert foreign_paths([], nginx_installed=False) == ["/etc/nginx/sites-enabled/default"]


def test_foreign_files_come_back_when_nginx_t_fails_without_them(tmp_path):
    result, link, hand, kept = run_disable(tmp_path, nginx_passes=False)
    assert result.returncode == 1
    assert "nginx -t failed without the foreign files; they are back:" in result.stderr
    assert "host not found in upstream" in result.stderr and "reloaded" not in result.stdout
    assert link.is_symlink() and os.readlink(link).endswith("/sites-available/default")
    assert hand.read_text() == "server { listen 8001; }\n"
    assert not Path(f"{kept}{link}").is_symlink() and not Path(f"{kept}{hand}").exists()
    assert not (hand.parent / "gone.conf").exists()


# --- TLS settings ------------------------------------------------------------------
CERT_PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
KEY_PEM = "-----BEGIN PRIVATE KEY-----\nMIGH\n-----END PRIVATE KEY-----\n"


@pytest.fixture
def tls_files(tmp_path) -> dict[str, str]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text(CERT_PEM)
    key.write_text(KEY_PEM)
    key.chmod(0o600)
    # With a key: a gateway without one is refused before TLS is looked at.
    return {"gateway_tls_cert": str(cert), "gateway_tls_key": str(key),
            "api_keys": ["sk-tls-test-" + "0123456789" * 3]}


def refusal(data: dict) -> str:
    with pytest.raises(Exception) as refused:
        validate(data)
    return str(refused.value)


def test_tls_settings_default_off_and_accept_a_pair(tls_files):
    fields = Settings.model_fields
    assert fields["gateway_tls_cert"].default is None and fields["gateway_tls_key"].default is None
    assert fields["gateway_http_redirect_port"].default is None
    settings = validate({**tls_files, "gateway_http_redirect_port": 8080})
    assert settings.gateway_tls_key == tls_files["gateway_tls_key"]


def test_tls_cert_and_key_go_together(tls_files):
    for only in ("gateway_tls_cert", "gateway_tls_key"):
        assert "set both or neither" in refusal({only: tls_files[only]})


def test_tls_key_readable_by_group_or_others_is_refused(tls_files):
    key = Path(tls_files["gateway_tls_key"])
    for mode in (0o640, 0o604, 0o660):
        key.chmod(mode)
        message = refusal(tls_files)
        assert f"gateway_tls_key {key}: mode {mode:04o} lets its group or others" in message
        assert "chmod 600" in message
        assert "MIGH" not in message  # never the key's content
    key.chmod(0o400)
    validate(tls_files)


def test_tls_files_must_exist_and_be_pem(tls_files, tmp_path):
    missing = {**tls_files, "gateway_tls_cert": str(tmp_path / "nope.pem")}
    assert "nope.pem: cannot be read (No such file or directory)" in refusal(missing)
    Path(tls_files["gateway_tls_cert"]).write_text("not a certificate\n")
    assert "holds no PEM certificate" in refusal(tls_files)
    Path(tls_files["gateway_tls_cert"]).write_text(CERT_PEM)
    Path(tls_files["gateway_tls_key"]).write_text(CERT_PEM)
    assert "holds no PEM private key" in refusal(tls_files)


def test_http_redirect_port_needs_tls_and_another_port(tls_files):
    assert "needs gateway_tls_cert and gateway_tls_key" in refusal(
        {"gateway_http_redirect_port": 8080}
    )
    assert "must differ from gateway_port" in refusal(
        {**tls_files, "gateway_http_redirect_port": 8001}
    )
