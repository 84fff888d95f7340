"""Pure helpers of the gateway: body-size arithmetic, the key map, the rendered site."""

from __future__ import annotations

import re

import pytest
from pyinfra.api import OperationValueError

from operations.gateway import (
    body_limit_mib,
    metrics_networks,
    render_keys_map,
    render_site,
    swap_script,
)
from pyinfra_vllm.settings import Settings, validate


def site(**overrides) -> str:
    args = dict(
        vllm_host="127.0.0.1",
        vllm_port=8000,
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


def test_keys_map_lists_each_key_with_default_deny():
    text = render_keys_map(["sk-a", "sk-b.c_d"])
    assert "default 0;" in text
    assert '"Bearer sk-a" 1;' in text and '"Bearer sk-b.c_d" 1;' in text
    assert "default 1;" not in text


def test_no_keys_turns_the_check_off():
    text = render_keys_map([])
    assert re.search(r"^\s*default 1;", text, re.M)
    assert "Bearer" not in text


@pytest.mark.parametrize("bad", ['sk"x', "sk x", "sk;x", "sk{x", "", "sk\\x"])
def test_key_with_nginx_syntax_is_refused_without_printing_it(bad):
    with pytest.raises(OperationValueError) as raised:
        render_keys_map(["sk-ok", bad])
    assert "api_keys[1]" in str(raised.value)
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
        "proxy_pass http://vllm_engine;",
    ]


def test_v1_needs_the_key_health_does_not():
    text = site()
    v1 = text[text.index("location /v1/") : text.index("location = /health")]
    assert "if ($vllm_key_ok = 0)" in v1 and "return 401" in v1
    health = text[text.index("location = /health") : text.index("location = /metrics")]
    assert "vllm_key_ok" not in health
    assert "return 404" in text[text.index("location / {") :]


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
