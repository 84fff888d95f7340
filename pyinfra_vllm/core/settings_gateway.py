"""The gateway's settings: its port, its keys, who may read its metrics, its limits, its
added directives and its TLS (a section of pyinfra_vllm/core/settings.py's Settings,
where they are validated).
"""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator

from pyinfra_vllm.core import (
    settings_checks_gateway,
    settings_checks_keys,
    settings_checks_networks,
)
from pyinfra_vllm.core.settings_docs import SettingsSection


class GatewaySettings(SettingsSection):
    """The gateway: its port, keys, allow list, limits and TLS."""

    # --- gateway ---------------------------------------------------------------------
    gateway_port: int = Field(default=8001, ge=1, le=65535)
    """Port nginx listens on for clients (the seed's 8001)."""
    # api_keys_file before api_keys: api_keys' rule reads the file (once) and keeps its
    # keys, so the file is validated first; that rule runs on the default too
    # (validate_default), as the file alone may hold every key.
    api_keys_file: str | None = None
    """A file on the operator's machine with one API key per line (blank lines and lines
    starting with # ignored), read at validation time and added to api_keys; refused
    unless only its owner may read it (chmod 600).
    """
    api_keys: list[SecretStr] = Field(default_factory=list, validate_default=True)
    """API keys clients send as "Authorization: Bearer <key>"; never logged. Each at least
    32 characters (so it cannot be guessed) of letters, digits and _.~+/=:-, no two alike
    (ignoring case). After validation it holds the keys of api_keys_file too. Prefer
    api_keys_file, which keeps them out of the inventory.
    """
    gateway_open: bool = False
    """Serve /v1/ without an API key. Without keys the settings are refused unless this is
    true; with keys it must stay false.
    """
    metrics_allow: list[str] = Field(default_factory=lambda: ["127.0.0.1/32"])
    """Addresses (CIDR, IPv4 or IPv6, no scope id) allowed to read /metrics through the
    gateway; host bits are cleared (10.0.0.7/24 is 10.0.0.0/24). Never every address
    (0.0.0.0/0, ::/0, nor networks that add up to it, with prometheus_servers too) nor the
    unspecified address (0.0.0.0, ::).
    """
    gateway_proxy_timeout_s: int = Field(default=3600, ge=60, le=86400)
    """nginx proxy_read_timeout and proxy_send_timeout, in seconds. A non-streamed
    completion sends nothing until it is done, and a long generation at 128K context takes
    tens of minutes; nginx's 60 s default cuts it off with a 504 (nginx docs,
    proxy_read_timeout).
    """
    gateway_max_body_mib: int | None = Field(default=None, ge=1, le=1024)
    """nginx client_max_body_size in MiB; None derives it from max_model_len. Worst case per
    token: JSON-escaped CJK text, 2 characters per token, each escaped as \\uXXXX (6 bytes),
    is 12 bytes; 131072 tokens x 12 = 1572864 bytes (1.5 MiB), plus 64 KiB for the JSON
    envelope = 1638400 bytes, rounded up to whole MiB: 2 MiB.
    """
    gateway_extra_directives: list[str] = Field(default_factory=list)
    """Extra nginx directives added to the gateway's server block, which guards /v1/ with
    the key check. One simple directive per item, ending in ";" (e.g. "add_header
    X-Served-By gpu1;"); no block, comment or second line ({, }, #, newline), no variable
    ($). Each value of its directive's shape (pyinfra_vllm/core/settings_checks_gateway.py
    GATEWAY_DIRECTIVE_VALUES): error_log at info or above (any debug level, debug_http
    too, logs the Authorization header and the engine's key), access_log in the
    gateway's format vllm_gateway, both to /var/log/nginx/ or syslog; no add_header of a
    header the site adds itself (X-Accel-Buffering, Strict-Transport-Security). Only
    directives that set a timeout, a buffer size, logging, compression or a response header:
    access_log, add_header, client_body_buffer_size, client_body_timeout,
    client_header_buffer_size, client_header_timeout, error_log, gzip, gzip_buffers,
    gzip_comp_level, gzip_disable, gzip_http_version, gzip_min_length, gzip_proxied,
    gzip_types, gzip_vary, keepalive_requests, keepalive_timeout,
    large_client_header_buffers, lingering_close, lingering_time, lingering_timeout,
    log_not_found, open_log_file_cache, proxy_connect_timeout, reset_timedout_connection,
    send_timeout. Anything else is refused: "set $vllm_key_ok 1;" or "satisfy any;" turned
    the key check off. client_max_body_size, proxy_read_timeout and proxy_send_timeout
    come from gateway_max_body_mib and gateway_proxy_timeout_s. A directive nginx -t
    rejects leaves the old config live.
    """
    gateway_tls_cert: str | None = None
    """TLS for the gateway: a PEM certificate chain (the server's certificate first), a file
    on the operator's machine, installed as /etc/nginx/vllm-tls/cert.pem. Set with
    gateway_tls_key, or neither: nginx then speaks plain HTTP on gateway_port.
    """
    gateway_tls_key: str | None = None
    """The certificate's PEM private key, a file on the operator's machine that only its
    owner may read (chmod 600); installed as /etc/nginx/vllm-tls/key.pem (0600, root), never
    printed (--diff masks it). With both set nginx listens with TLS (1.2 and 1.3) on gateway_port.
    """
    gateway_http_redirect_port: int | None = Field(default=None, ge=1, le=65535)
    """With TLS: a plain HTTP port where every request gets a 301 to https on gateway_port
    and nothing else. A key sent there has already crossed the network in clear text:
    configure clients with the https:// URL; this only points lost ones the way.
    """

    # --- rules of one setting (settings_checks* say what each allows) -----------------
    _api_keys_file = field_validator("api_keys_file")(settings_checks_keys.api_keys_file)
    _api_keys = field_validator("api_keys")(settings_checks_keys.api_keys)
    _allow_networks = field_validator("metrics_allow")(settings_checks_networks.networks)
    _one_directive_each = field_validator("gateway_extra_directives")(
        settings_checks_gateway.one_directive_each
    )
