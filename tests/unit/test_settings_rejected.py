"""The bad-input catalogue: every input the settings refuse, one case each.

Each case is validated alone, on top of settings that are otherwise valid, and must give
exactly one problem line. The line names the key first ("KEY = value: ...", "KEY: ..."
or a sentence starting with KEY), carries the given fragments of what is allowed and
what to do, and no secret: neither an API key nor a token nor a URL's password appears
anywhere in the message.

"{tmp}" in a value or a fragment is the test's temporary directory, where a case's
files are written first (with the mode the case gives).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pyinfra_vllm.core.settings import Settings, SettingsError, validate

# Well-formed keys (tests only): 40 characters each.
KEY = "sk-catalogue-0123456789abcdefghijklmnopq"
KEY2 = "sk-catalogue-second-456789abcdefghijklmn"
# Settings that pass on their own: the gateway with a key, or opened on purpose.
KEYED: dict[str, Any] = {"api_keys": [KEY]}
OPEN: dict[str, Any] = {"gateway_open": True}

TOKEN = "hf_CatalogueTokenValue0123"
PASSWORD = "hunter2-Pw0rd"
SHORT = "sk-short-1234"
SIGNED = "deb [signed-by=/usr/share/keyrings/nvidia.gpg] https://repo.example/ubuntu2204/x86_64 /"
CHARS = "letters, digits and _.~+/=:-"
# The shapes the router's TLS settings look for (their content is never parsed further).
ROUTER_CERT = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
ROUTER_KEY = "-----BEGIN PRIVATE KEY-----\nMIGH\n-----END PRIVATE KEY-----\n"
# Allowed extra directives (tests/unit/test_gateway_nginx.py runs one of each allowed name
# under the real nginx).
GATEWAY_EXTRA_ACCEPTED = ["add_header X-Served-By gpu1;", 'add_header X-Note "a b" always;',
                          "keepalive_timeout 75s;", "client_body_timeout 120s;",
                          "error_log /var/log/nginx/vllm-extra.log info;", "gzip off;"]


@dataclass
class Case:
    id: str
    data: dict[str, Any]
    key: str
    fragments: list[str]
    # Values that must not appear anywhere in the message.
    secrets: list[str] = field(default_factory=list)
    # name -> (content, mode); content None makes a directory.
    files: dict[str, tuple[str | bytes | None, int]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


def case(id: str, data: dict[str, Any], key: str, *fragments: str, base: dict | None = None,
         **extra: Any) -> Case:
    return Case(id, {**(OPEN if base is None else base), **data}, key, list(fragments), **extra)


NOT_LOOPBACK = ("not a loopback address", "vllm_listen_beyond_loopback=true")
NOT_IP = ("not an IP address literal", "127.0.0.1 or ::1")
SYSTEM_DIR = ("is / or a system directory", "use a directory of its own below it")
IN_SYSTEM = ("so none is taken in the system's directories (/etc, /usr, /run, /var/log ...), "
             "the homes (/home, /root) or /tmp", "use a directory of its own outside them")
SUITE_OWN = ("the suite's own directory", "use a directory of its own apart from it")
APART = ("model_dir, python_env_root and textfile_collector_dir must each be a directory of "
         "its own, none inside another", "e.g. model_dir /srv/models, python_env_root /opt/vllm")
NOT_NORMAL = ("not a normalized path", "no '.' or '..' part, no '//', no trailing '/'")
ONE_DIRECTIVE = "allowed: one simple directive per item ending in ';'"
DIRECTIVES_ALLOWED = "of these: access_log, add_header, client_body_buffer_size"
UNSIGNED = "unsigned packages run their scripts as root"
HOST_URL = "write it as http(s)://HOST[:PORT]/PATH"
BASE_URL_CREDENTIALS = "has credentials in it (user:password@ or token@ before the host)"
NAME_THEM = ("the list is there to name the few machines let in", '["10.20.0.5/32"]')

CASES = [
    # --- 1. vllm_host: an IP literal, on loopback unless opted in -----------------------
    case("host-every-ipv4-interface", {"vllm_host": "0.0.0.0"}, "vllm_host", *NOT_LOOPBACK,
         "vllm_host = '0.0.0.0'"),
    case("host-every-ipv6-interface", {"vllm_host": "::"}, "vllm_host", *NOT_LOOPBACK),
    case("host-lan-address", {"vllm_host": "10.0.0.5"}, "vllm_host", *NOT_LOOPBACK),
    case("host-nginx-injection", {"vllm_host": "127.0.0.1:1; } server { listen 80"},
         "vllm_host", *NOT_IP),
    case("host-semicolon", {"vllm_host": "127.0.0.1;"}, "vllm_host", *NOT_IP),
    case("host-brace", {"vllm_host": "127.0.0.1}"}, "vllm_host", *NOT_IP),
    case("host-newline", {"vllm_host": "127.0.0.1\ninclude /etc/passwd;"}, "vllm_host",
         *NOT_IP),
    case("host-name", {"vllm_host": "localhost"}, "vllm_host", *NOT_IP),
    case("host-brackets", {"vllm_host": "[::1]"}, "vllm_host", *NOT_IP),
    case("host-with-port", {"vllm_host": "127.0.0.1:8000"}, "vllm_host", *NOT_IP,
         "the port is vllm_port"),
    case("host-scope-id", {"vllm_host": "fe80::1%eth0"}, "vllm_host", *NOT_IP),
    case("host-not-canonical", {"vllm_host": "0:0:0:0:0:0:0:1"}, "vllm_host",
         "write the address as ::1"),
    case("host-beyond-loopback-without-key",
         {"vllm_listen_beyond_loopback": True, "vllm_host": "10.0.0.5",
          "vllm_engine_allow": ["10.0.0.7"]},
         "vllm_listen_beyond_loopback", "needs an API key", "set api_keys or api_keys_file"),
    case("host-beyond-loopback-without-allowed-machines",
         {"vllm_listen_beyond_loopback": True, "vllm_host": "10.0.0.5"},
         "vllm_engine_allow", "vllm_engine_allow is empty",
         "open to the machines of vllm_engine_allow only", "[\"10.20.0.5/32\"]", base=KEYED),
    case("engine-allow-word", {"vllm_engine_allow": ["gateway-1"]}, "vllm_engine_allow",
         "vllm_engine_allow[0] 'gateway-1' is not an IPv4 or IPv6 network"),
    case("engine-allow-everyone", {"vllm_engine_allow": ["0.0.0.0/0"]}, "vllm_engine_allow",
         "vllm_engine_allow lets in every IPv4 address (0.0.0.0/0)", *NAME_THEM),
    case("engine-allow-everyone-in-halves", {"vllm_engine_allow": ["::/1", "8000::/1"]},
         "vllm_engine_allow", "lets in every IPv6 address (::/0)", *NAME_THEM),
    case("engine-allow-unspecified", {"vllm_engine_allow": ["0.0.0.0"]}, "vllm_engine_allow",
         "vllm_engine_allow[0] '0.0.0.0' is the unspecified address", "an allow list as no "
         "machine", *NAME_THEM),

    # --- 2. api_keys and api_keys_file --------------------------------------------------
    case("key-short", {"api_keys": [SHORT]}, "api_keys",
         "api_keys[0] is shorter than 32 characters", "openssl rand -base64 36",
         base={}, secrets=[SHORT]),
    case("key-space", {"api_keys": [KEY, "sk key with a space 0123456789abcdefghij"]},
         "api_keys", f"api_keys[1] has characters other than {CHARS}", base={},
         secrets=["sk key with a space"]),
    case("key-quote", {"api_keys": ['sk"quote0123456789abcdefghijklmnopqrstu']}, "api_keys",
         f"api_keys[0] has characters other than {CHARS}", base={}, secrets=['sk"quote']),
    case("key-semicolon-brace", {"api_keys": ["sk;}0123456789abcdefghijklmnopqrstuvwx"]},
         "api_keys", f"api_keys[0] has characters other than {CHARS}", base={},
         secrets=["sk;}0123"]),
    case("key-repeated", {"api_keys": [KEY, KEY2, KEY]}, "api_keys",
         "api_keys[2] repeats api_keys[0]: keep one of them", base={}),
    case("key-repeated-but-case", {"api_keys": [KEY, KEY.upper()]}, "api_keys",
         "api_keys[1] differs only in letter case from api_keys[0]", base={},
         secrets=[KEY.upper()]),
    case("keys-not-a-list", {"api_keys": KEY}, "api_keys", "api_keys = <secret>",
         "Input should be a valid list", base={}),
    case("keys-file-missing", {"api_keys_file": "{tmp}/absent"}, "api_keys_file",
         "api_keys_file = '{tmp}/absent': cannot be read (No such file or directory)",
         "chmod 600", base={}),
    case("keys-file-world-readable", {"api_keys_file": "{tmp}/keys"}, "api_keys_file",
         "its mode 0644 lets group or others read the secret in it: chmod 600 {tmp}/keys",
         base={}, files={"keys": (KEY + "\n", 0o644)}),
    case("keys-file-group-readable", {"api_keys_file": "{tmp}/keys"}, "api_keys_file",
         "its mode 0640 lets group or others read", "chmod 600 {tmp}/keys", base={},
         files={"keys": (KEY + "\n", 0o640)}),
    case("keys-file-a-directory", {"api_keys_file": "{tmp}/keys"}, "api_keys_file",
         "is not a regular file", base={}, files={"keys": (None, 0o700)}),
    case("keys-file-only-comments", {"api_keys_file": "{tmp}/keys"}, "api_keys_file",
         "holds no key (only blank lines or # comments)", base={},
         files={"keys": ("# the keys\n\n   \n", 0o600)}),
    case("keys-file-not-text", {"api_keys_file": "{tmp}/keys"}, "api_keys_file",
         "cannot be read as text", base={}, files={"keys": (b"\xff\xfe\x00bad", 0o600)}),
    case("keys-file-short-line", {"api_keys_file": "{tmp}/keys"}, "api_keys_file",
         "line 3 is shorter than 32 characters", base={}, secrets=[SHORT],
         files={"keys": (f"# keys\n{KEY}\n{SHORT}\n", 0o600)}),
    case("keys-file-bad-characters", {"api_keys_file": "{tmp}/keys"}, "api_keys_file",
         f"line 1 has characters other than {CHARS}", base={}, secrets=["sk key"],
         files={"keys": ("sk key 0123456789abcdefghijklmnopqrstuvw # web\n", 0o600)}),
    case("keys-file-repeats-itself", {"api_keys_file": "{tmp}/keys"}, "api_keys_file",
         "line 2 repeats line 1", base={}, files={"keys": (f"{KEY}\n{KEY}\n", 0o600)}),
    case("keys-file-repeats-inline", {"api_keys": [KEY], "api_keys_file": "{tmp}/keys"},
         "api_keys_file", "line 1 repeats api_keys[0]", "keep the key in one place",
         base={}, files={"keys": (KEY.upper() + "\n", 0o600)}, secrets=[KEY.upper()]),
    case("hf-token-file-world-readable", {"hf_token_file": "{tmp}/token"}, "hf_token_file",
         "its mode 0644 lets group or others read", "chmod 600 {tmp}/token",
         files={"token": (TOKEN + "\n", 0o644)}, secrets=[TOKEN]),
    case("hf-token-file-missing", {"hf_token_file": "{tmp}/absent"}, "hf_token_file",
         "cannot be read (No such file or directory)"),
    case("hf-token-quote", {"hf_token": TOKEN + "'"}, "hf_token", "hf_token = <secret>",
         "has characters other than letters", secrets=[TOKEN]),

    # --- 3. closed by default -----------------------------------------------------------
    case("no-key-no-open", {}, "api_keys",
         "api_keys is empty: the gateway would serve /v1/ to anyone; set api_keys or "
         "api_keys_file, or gateway_open=true to serve without a key", base={}),
    case("no-key-empty-list", {"api_keys": []}, "api_keys", "api_keys is empty", base={}),
    case("open-with-keys", {"gateway_open": True, "api_keys": [KEY]}, "gateway_open",
         "an open gateway with keys is a contradiction", base={}),
    case("open-with-key-file", {"gateway_open": True, "api_keys_file": "{tmp}/keys"},
         "gateway_open", "contradiction", "remove gateway_open", base={},
         files={"keys": (KEY + "\n", 0o600)}),

    # --- 4. paths on the host, model_id, served_model_name ------------------------------
    case("model-dir-relative", {"model_dir": "srv/models"}, "model_dir",
         "not an absolute path; e.g. /srv/models"),
    case("model-dir-root", {"model_dir": "/"}, "model_dir", *SYSTEM_DIR),
    case("model-dir-etc", {"model_dir": "/etc"}, "model_dir", "is /etc, the distribution's",
         *IN_SYSTEM),
    case("model-dir-etc-nginx", {"model_dir": "/etc/nginx"}, "model_dir",
         "model_dir = '/etc/nginx': is inside /etc", *IN_SYSTEM, "e.g. /srv/models"),
    case("model-dir-var", {"model_dir": "/var"}, "model_dir", *SYSTEM_DIR),
    case("model-dir-var-log", {"model_dir": "/var/log/models"}, "model_dir",
         "is inside /var/log, the system's logs", *IN_SYSTEM),
    case("model-dir-suite-state", {"model_dir": "/var/lib/vllm"}, "model_dir",
         "is /var/lib/vllm", "the vllm account's home", *SUITE_OWN),
    case("model-dir-srv", {"model_dir": "/srv"}, "model_dir", *SYSTEM_DIR, "e.g. /srv/models"),
    case("model-dir-var-lib", {"model_dir": "/var/lib"}, "model_dir", *SYSTEM_DIR),
    case("model-dir-home", {"model_dir": "/home"}, "model_dir", "is /home, the users' homes",
         *IN_SYSTEM),
    case("model-dir-boot", {"model_dir": "/boot"}, "model_dir", "is /boot", *IN_SYSTEM),
    case("model-dir-dotdot", {"model_dir": "/srv/../etc"}, "model_dir", *NOT_NORMAL),
    case("model-dir-dot", {"model_dir": "/srv/./models"}, "model_dir", *NOT_NORMAL),
    case("model-dir-double-slash", {"model_dir": "//srv/models"}, "model_dir", *NOT_NORMAL),
    case("model-dir-inner-double-slash", {"model_dir": "/srv//models"}, "model_dir",
         *NOT_NORMAL),
    case("model-dir-trailing-slash", {"model_dir": "/srv/models/"}, "model_dir", *NOT_NORMAL),
    case("model-dir-space", {"model_dir": "/srv/my models"}, "model_dir",
         "has characters other than letters, digits and _./-"),
    case("model-dir-newline", {"model_dir": "/srv/models\nExecStartPre=/bin/sh"}, "model_dir",
         "has characters other than letters, digits and _./-"),
    case("model-dir-proc", {"model_dir": "/proc/models"}, "model_dir",
         "is on a kernel file system"),
    case("env-root-opt", {"python_env_root": "/opt"}, "python_env_root", *SYSTEM_DIR,
         "e.g. /opt/vllm"),
    case("env-root-usr", {"python_env_root": "/usr"}, "python_env_root", "is /usr", *IN_SYSTEM),
    case("env-root-tmp", {"python_env_root": "/tmp"}, "python_env_root", "is /tmp",
         "another user could put a symbolic link where root writes", *IN_SYSTEM),
    case("env-root-root", {"python_env_root": "/root"}, "python_env_root", "is /root",
         *IN_SYSTEM),
    case("env-root-home-user", {"python_env_root": "/home/ubuntu"}, "python_env_root",
         "python_env_root = '/home/ubuntu': is inside /home, the users' homes",
         "could swap a part of it for a symbolic link", *IN_SYSTEM, "e.g. /opt/vllm"),
    case("env-root-below-home", {"python_env_root": "/home/ubuntu/vllm"}, "python_env_root",
         "is inside /home", *IN_SYSTEM),
    case("env-root-below-root", {"python_env_root": "/root/vllm"}, "python_env_root",
         "is inside /root", *IN_SYSTEM),
    case("env-root-usr-local-lib", {"python_env_root": "/usr/local/lib"}, "python_env_root",
         "is inside /usr", *IN_SYSTEM),
    case("env-root-etc-nginx", {"python_env_root": "/etc/nginx"}, "python_env_root",
         "is inside /etc", *IN_SYSTEM),
    case("env-root-run", {"python_env_root": "/run/vllm"}, "python_env_root",
         "is inside /run, runtime state, emptied at every boot", *IN_SYSTEM),
    case("env-root-var-tmp", {"python_env_root": "/var/tmp/vllm"}, "python_env_root",
         "is inside /var/tmp", *IN_SYSTEM),
    case("env-root-suite-tools", {"python_env_root": "/var/lib/pyinfra-vllm"},
         "python_env_root", "is /var/lib/pyinfra-vllm", "what it set aside", *SUITE_OWN,
         "e.g. /opt/vllm"),
    case("env-root-inside-suite-state", {"python_env_root": "/var/lib/vllm/envs"},
         "python_env_root", "is inside /var/lib/vllm", *SUITE_OWN),
    case("env-root-suite-config", {"python_env_root": "/etc/vllm"}, "python_env_root",
         "is /etc/vllm, the suite's own directory (the engine's environment file)"),
    case("env-root-is-model-dir", {"python_env_root": "/srv/models"}, "python_env_root",
         "python_env_root = '/srv/models' is model_dir too", *APART,
         "move python_env_root apart"),
    case("env-root-holds-model-dir", {"python_env_root": "/data", "model_dir": "/data/models"},
         "python_env_root", "python_env_root = '/data' holds model_dir = '/data/models'",
         *APART),
    case("env-root-inside-model-dir", {"python_env_root": "/srv/models/envs"},
         "python_env_root", "python_env_root = '/srv/models/envs' is inside model_dir = "
         "'/srv/models'", *APART),
    case("model-dir-inside-env-root", {"model_dir": "/opt/vllm/models"}, "python_env_root",
         "python_env_root = '/opt/vllm' holds model_dir = '/opt/vllm/models'", *APART),
    case("env-root-relative", {"python_env_root": "opt/vllm"}, "python_env_root",
         "not an absolute path"),
    case("collector-var-lib", {"textfile_collector_dir": "/var/lib"}, "textfile_collector_dir",
         *SYSTEM_DIR),
    case("collector-run", {"textfile_collector_dir": "/run/node-exporter"},
         "textfile_collector_dir", "is inside /run", *IN_SYSTEM),
    case("collector-suite-tools", {"textfile_collector_dir": "/var/lib/pyinfra-vllm/metrics"},
         "textfile_collector_dir", "is inside /var/lib/pyinfra-vllm", *SUITE_OWN),
    case("collector-is-env-root", {"textfile_collector_dir": "/opt/vllm"},
         "textfile_collector_dir", "textfile_collector_dir = '/opt/vllm' is python_env_root "
         "too", *APART),
    case("collector-inside-model-dir", {"textfile_collector_dir": "/srv/models/metrics"},
         "textfile_collector_dir", "is inside model_dir = '/srv/models'", *APART),
    case("collector-trailing-slash",
         {"textfile_collector_dir": "/var/lib/prometheus/node-exporter/"},
         "textfile_collector_dir", *NOT_NORMAL),
    case("ca-bundle-relative", {"pip_ca_bundle": "certs/corp.pem"}, "pip_ca_bundle",
         "not an absolute path"),
    case("ca-bundle-dotdot", {"pip_ca_bundle": "/etc/ssl/../shadow"}, "pip_ca_bundle",
         *NOT_NORMAL),
    case("device-dotdot", {"model_volume_device": "/dev/../etc/passwd"}, "model_volume_device",
         "not a normalized device path"),
    case("model-id-incoming", {"model_id": "Org/.incoming"}, "model_id",
         ".incoming is a name the model downloader keeps for itself"),
    case("model-id-verified", {"model_id": ".verified.json"}, "model_id",
         ".verified.json is a name the model downloader keeps for itself"),
    case("model-id-dotdot", {"model_id": "../etc"}, "model_id",
         "not a Hugging Face model id", "not starting with '.' or '-' (no '..')"),
    case("model-id-dotdot-name", {"model_id": "Org/.."}, "model_id",
         "not a Hugging Face model id"),
    case("model-id-hidden", {"model_id": "Org/.hidden"}, "model_id",
         "not a Hugging Face model id"),
    case("model-id-dash", {"model_id": "-rf"}, "model_id", "not a Hugging Face model id"),
    case("model-id-three-parts", {"model_id": "Org/name/extra"}, "model_id",
         "not a Hugging Face model id", "org/name (or name)"),
    case("model-id-space", {"model_id": "Org/my model"}, "model_id",
         "not a Hugging Face model id"),
    case("model-id-non-ascii", {"model_id": "Org/mödel"}, "model_id",
         "not a Hugging Face model id"),
    case("served-name-space", {"served_model_name": "my model"}, "served_model_name",
         "has a space or a character other than letters, digits and ._/:-"),
    case("served-name-dash", {"served_model_name": "-x"}, "served_model_name",
         "or starts with '-'"),
    case("served-name-semicolon", {"served_model_name": "name;rm"}, "served_model_name",
         "letters, digits and ._/:-"),
    case("served-name-newline", {"served_model_name": "name\nX=1"}, "served_model_name",
         "letters, digits and ._/:-"),
    case("revision-dotdot", {"model_revision": "../main"}, "model_revision",
         "not a branch, tag or commit"),
    case("revision-dash", {"model_revision": "-x"}, "model_revision",
         "not a branch, tag or commit"),
    case("revision-space", {"model_revision": "main branch"}, "model_revision",
         "not a branch, tag or commit"),

    # --- 5. sysctl and mount options ----------------------------------------------------
    case("sysctl-key-space", {"sysctl": {"vm swappiness": 1}}, "sysctl",
         "'vm swappiness' is not a sysctl key like vm.swappiness"),
    case("sysctl-key-equals", {"sysctl": {"vm.swappiness=1": 1}}, "sysctl",
         "is not a sysctl key", "no '=', '/' or space"),
    case("sysctl-key-slashes", {"sysctl": {"net/ipv4/ip_forward": 1}}, "sysctl",
         "is not a sysctl key"),
    case("sysctl-key-undotted", {"sysctl": {"swappiness": 1}}, "sysctl", "is not a sysctl key"),
    case("sysctl-key-leading-dot", {"sysctl": {".vm.swappiness": 1}}, "sysctl",
         "is not a sysctl key"),
    case("sysctl-key-upper", {"sysctl": {"VM.swappiness": 1}}, "sysctl", "is not a sysctl key"),
    case("sysctl-key-newline", {"sysctl": {"vm.swappiness\nkernel.x": 1}}, "sysctl",
         "is not a sysctl key"),
    case("sysctl-value-semicolon", {"sysctl": {"vm.swappiness": "1; reboot"}}, "sysctl",
         "the value of vm.swappiness is not words of letters, digits and _.:/- separated by "
         "single spaces"),
    case("sysctl-value-newline", {"sysctl": {"vm.swappiness": "1\nkernel.panic = 1"}},
         "sysctl", "the value of vm.swappiness is not words"),
    case("sysctl-value-quote", {"sysctl": {"kernel.core_pattern": "'x'"}},
         "sysctl", "is not words", 'no ";", quote or newline'),
    case("sysctl-value-double-space", {"sysctl": {"net.ipv4.tcp_rmem": "4096  87380 6291456"}},
         "sysctl", "separated by single spaces", '"4096 87380 6291456"'),
    case("sysctl-value-trailing-space", {"sysctl": {"net.ipv4.tcp_rmem": "4096 87380 "}},
         "sysctl", "separated by single spaces"),
    case("mount-options-comma", {"model_volume_mount_options": ["noatime,nodev"]},
         "model_volume_mount_options", "is not one mount option each",
         'give each option as its own item, e.g. ["noatime", "nodev"]'),
    case("mount-options-space", {"model_volume_mount_options": ["noatime nodev"]},
         "model_volume_mount_options", "is not one mount option each"),
    case("mount-options-newline", {"model_volume_mount_options": ["noatime\n"]},
         "model_volume_mount_options", "is not one mount option each"),
    case("mount-options-upper", {"model_volume_mount_options": ["NOATIME"]},
         "model_volume_mount_options", "a lowercase name"),
    case("mount-options-quote", {"model_volume_mount_options": ['context="x"']},
         "model_volume_mount_options", "=value of letters, digits and _.:/-"),
    case("mount-options-nobarrier", {"model_volume_mount_options": ["nobarrier"]},
         "model_volume_mount_options", "disables write barriers"),

    # --- 6. metrics_allow ---------------------------------------------------------------
    case("metrics-bad-octet", {"metrics_allow": ["10.0.0.300/8"]}, "metrics_allow",
         "metrics_allow[0] '10.0.0.300/8' is not an IPv4 or IPv6 network",
         "allowed: an address or CIDR such as 10.20.0.0/16"),
    case("metrics-scope-id", {"metrics_allow": ["127.0.0.1/32", "fe80::1%eth0/64"]},
         "metrics_allow", "metrics_allow[1] 'fe80::1%eth0/64' has an IPv6 scope id"),
    case("metrics-word", {"metrics_allow": ["all"]}, "metrics_allow",
         "is not an IPv4 or IPv6 network"),
    case("metrics-semicolon", {"metrics_allow": ["10.0.0.0/8; allow all"]}, "metrics_allow",
         "is not an IPv4 or IPv6 network"),
    case("metrics-prefix-too-long", {"metrics_allow": ["10.0.0.0/33"]}, "metrics_allow",
         "is not an IPv4 or IPv6 network"),
    case("metrics-everyone", {"metrics_allow": ["0.0.0.0/0", "::/0"]}, "metrics_allow",
         "metrics_allow lets in every IPv4 address (0.0.0.0/0) and every IPv6 address (::/0)",
         *NAME_THEM),
    case("metrics-everyone-in-halves", {"metrics_allow": ["0.0.0.0/1", "128.0.0.0/1"]},
         "metrics_allow", "lets in every IPv4 address (0.0.0.0/0)"),
    case("metrics-unspecified-ipv6", {"metrics_allow": ["::"]}, "metrics_allow",
         "metrics_allow[0] '::' is the unspecified address"),
    case("metrics-everyone-with-prometheus-servers",
         {"metrics_allow": ["0.0.0.0/1"], "prometheus_servers": ["128.0.0.0/1"]},
         "prometheus_servers", "prometheus_servers, added to metrics_allow, lets in every "
         "IPv4 address (0.0.0.0/0)", "/metrics and /node-metrics would answer every machine",
         *NAME_THEM),

    # --- 7. nvidia_apt_repo -------------------------------------------------------------
    case("apt-bare-http-url", {"nvidia_apt_repo": "http://10.0.0.1:8787/"}, "nvidia_apt_repo",
         'a bare URL is written as "deb [trusted=yes] URL ./"', UNSIGNED,
         "nvidia_apt_repo_trusted=true"),
    case("apt-bare-https-url", {"nvidia_apt_repo": "https://repo.example/"}, "nvidia_apt_repo",
         "a bare URL", UNSIGNED, "signed-by="),
    case("apt-line-unsigned-http", {"nvidia_apt_repo": "deb http://repo.example/ ./"},
         "nvidia_apt_repo", "it names no keyring (signed-by=); its URL is not https",
         "unsigned or unverified packages run their scripts as root"),
    case("apt-line-unsigned-https", {"nvidia_apt_repo": "deb https://repo.example/ ./"},
         "nvidia_apt_repo", "it names no keyring (signed-by=)", "nvidia_apt_repo_trusted=true"),
    case("apt-line-signed-http",
         {"nvidia_apt_repo": "deb [signed-by=/usr/share/keyrings/n.gpg] http://repo.example/ ./"},
         "nvidia_apt_repo", "its URL is not https"),
    case("apt-line-trusted-yes",
         {"nvidia_apt_repo": "deb [signed-by=/k.gpg trusted=yes] https://repo.example/ ./"},
         "nvidia_apt_repo", "it turns verification off (trusted=yes)"),
    case("apt-line-allow-insecure",
         {"nvidia_apt_repo": "deb [signed-by=/k.gpg allow-insecure=yes] https://r.example/ ./"},
         "nvidia_apt_repo", "it turns verification off (allow-insecure=yes)"),
    case("apt-line-empty-signed-by",
         {"nvidia_apt_repo": "deb [signed-by=] https://repo.example/ ./"},
         "nvidia_apt_repo", "it names no keyring"),
    case("apt-line-second-line",
         {"nvidia_apt_repo": SIGNED + "\ndeb [trusted=yes] http://evil.example/ ./"},
         "nvidia_apt_repo", "has a newline or another control character: give one line"),
    case("apt-ppa", {"nvidia_apt_repo": "ppa:graphics-drivers/ppa"}, "nvidia_apt_repo",
         "not an apt source", "signed-by="),
    case("apt-line-without-suite", {"nvidia_apt_repo": "deb https://repo.example/"},
         "nvidia_apt_repo", "not an apt source"),
    case("apt-trusted-url-with-space",
         {"nvidia_apt_repo": "http://10.0.0.1:8787/ x", "nvidia_apt_repo_trusted": True},
         "nvidia_apt_repo", "has a character a URL here cannot carry"),

    # --- 8. URLs: the token's way, and credentials never shown --------------------------
    case("base-url-http-with-token", {"model_base_url": "http://10.0.0.1:8788",
                                      "hf_token": TOKEN},
         "model_base_url", "model_base_url = 'http://10.0.0.1:8788' is plain http",
         "the Hugging Face token (hf_token) would travel with every download",
         "use an https URL", secrets=[TOKEN]),
    case("base-url-http-with-token-file", {"model_base_url": "http://10.0.0.1:8788",
                                           "hf_token_file": "{tmp}/token"},
         "model_base_url", "(hf_token_file)", "use an https URL", secrets=[TOKEN],
         files={"token": (TOKEN + "\n", 0o600)}),
    case("base-url-http-with-token-variable", {"model_base_url": "http://10.0.0.1:8788"},
         "model_base_url", "(HF_TOKEN in the environment)", secrets=[TOKEN],
         env={"HF_TOKEN": TOKEN}),
    case("base-url-http-credentials-with-token",
         {"model_base_url": f"http://mirror:{PASSWORD}@10.0.0.1:8788", "hf_token": TOKEN},
         "model_base_url", "model_base_url = 'http://mirror:***@10.0.0.1:8788'",
         BASE_URL_CREDENTIALS, secrets=[TOKEN, PASSWORD]),
    # The URL is the downloader's argument on the host (ps shows it to every user there).
    case("base-url-credentials",
         {"model_base_url": f"https://mirror:{PASSWORD}@mirror.example/hf"}, "model_base_url",
         "model_base_url = 'https://mirror:***@mirror.example/hf'", BASE_URL_CREDENTIALS,
         "allowed: http(s)://HOST[:PORT]/PATH without them", "Remove them from the URL",
         "hf_token_file", "HF_TOKEN on the operator's machine",
         secrets=[PASSWORD]),
    case("base-url-token-as-user", {"model_base_url": f"https://{TOKEN}@mirror.example"},
         "model_base_url", "model_base_url = 'https://***@mirror.example'",
         BASE_URL_CREDENTIALS, secrets=[TOKEN]),
    case("base-url-at-in-password",
         {"model_base_url": f"https://mirror:x@{PASSWORD}@mirror.example/"}, "model_base_url",
         "model_base_url = 'https://mirror:***@mirror.example/'", BASE_URL_CREDENTIALS,
         secrets=[PASSWORD]),
    case("base-url-credentials-after-hash",
         {"model_base_url": f"https://mirror#{PASSWORD}@mirror.example/"}, "model_base_url",
         "model_base_url = 'https://***@mirror.example/'", BASE_URL_CREDENTIALS,
         secrets=[PASSWORD]),
    case("base-url-ftp", {"model_base_url": "ftp://mirror.example"}, "model_base_url",
         "its scheme is 'ftp'; allowed: http or https"),
    case("base-url-no-scheme", {"model_base_url": "huggingface.co"}, "model_base_url",
         "not a URL", HOST_URL),
    case("base-url-no-host", {"model_base_url": "https:///models"}, "model_base_url",
         "has no host", HOST_URL),
    case("index-url-space-with-password",
         {"pip_index_url": f"https://bob:{PASSWORD}@pypi.example/simple x"}, "pip_index_url",
         "pip_index_url = 'https://bob:***@pypi.example/simple x'",
         "has a character a URL here cannot carry", "percent-encode it", secrets=[PASSWORD]),
    case("index-url-ftp-with-password", {"pip_index_url": f"ftp://bob:{PASSWORD}@pypi.example/"},
         "pip_index_url", "'ftp://bob:***@pypi.example/'", "allowed: http or https",
         secrets=[PASSWORD]),
    case("index-url-semicolon", {"pip_index_url": "https://pypi.example/simple;reboot"},
         "pip_index_url", "has a character a URL here cannot carry"),
    case("index-url-quote", {"pip_index_url": "https://pypi.example/simple'"},
         "pip_index_url", "has a character a URL here cannot carry"),
    case("index-url-bad-port", {"pip_index_url": "https://pypi.example:port/simple"},
         "pip_index_url", "its host or port cannot be read"),
    case("proxy-newline-with-password", {"http_proxy": f"http://bob:{PASSWORD}@proxy:3128\n"},
         "http_proxy", "'http://bob:***@proxy:3128\\n'", "cannot carry", secrets=[PASSWORD]),
    case("proxy-dollar-with-token-user", {"http_proxy": f"http://{PASSWORD}@proxy:3128/$x"},
         "http_proxy", "'http://***@proxy:3128/$x'", "cannot carry", secrets=[PASSWORD]),
    case("proxy-dollar-with-at-in-password",
         {"http_proxy": f"http://bob:x@{PASSWORD}@proxy:3128/$x"}, "http_proxy",
         "'http://bob:***@proxy:3128/$x'", "cannot carry", secrets=[PASSWORD]),
    case("proxy-socks", {"http_proxy": "socks5://proxy:1080"}, "http_proxy",
         "its scheme is 'socks5'; allowed: http or https"),
    case("proxy-no-scheme", {"http_proxy": "proxy.example:3128"}, "http_proxy", "not a URL"),

    # --- 9. gateway_extra_directives ----------------------------------------------------
    case("directive-no-semicolon", {"gateway_extra_directives": ["add_header X 1"]},
         "gateway_extra_directives", "is not one nginx directive ending in ';'", ONE_DIRECTIVE),
    case("directive-two", {"gateway_extra_directives": ["add_header X 1; add_header Y 2;"]},
         "gateway_extra_directives", "holds more than one directive", ONE_DIRECTIVE),
    case("directive-newline", {"gateway_extra_directives": ["add_header X 1;\ninclude /x;"]},
         "gateway_extra_directives", "has a newline or another control character"),
    case("directive-close-brace", {"gateway_extra_directives": ["add_header X 1; }"]},
         "gateway_extra_directives", "is not one nginx directive ending in ';'"),
    case("directive-brace-in-value", {"gateway_extra_directives": ['add_header X "}";']},
         "gateway_extra_directives", "has '}'", "could close the server block"),
    case("directive-open-brace", {"gateway_extra_directives": ["location /x { return 200;"]},
         "gateway_extra_directives", "has '{'"),
    case("directive-comment", {"gateway_extra_directives": ["add_header X #1;"]},
         "gateway_extra_directives", "has '#'", "hide the rest of the line"),
    case("directive-include", {"gateway_extra_directives": ["include /etc/nginx/other.conf;"]},
         "gateway_extra_directives", "uses include, which is refused", ONE_DIRECTIVE),
    case("directive-include-upper", {"gateway_extra_directives": ["INCLUDE /x.conf;"]},
         "gateway_extra_directives", "uses INCLUDE, which is refused"),
    case("directive-listen", {"gateway_extra_directives": ["listen 80;"]},
         "gateway_extra_directives", "uses listen, which is refused"),
    case("directive-server", {"gateway_extra_directives": ["server 10.0.0.1:8000;"]},
         "gateway_extra_directives", "uses server, which is refused"),
    case("directive-location", {"gateway_extra_directives": ["location /admin;"]},
         "gateway_extra_directives", "uses location, which is refused",
         "route around the key check (location, if, return"),
    case("directive-map", {"gateway_extra_directives": ["map $a $b;"]},
         "gateway_extra_directives", "uses map, which is refused"),
    case("directive-upstream", {"gateway_extra_directives": ["upstream other;"]},
         "gateway_extra_directives", "uses upstream, which is refused"),
    case("directive-if", {"gateway_extra_directives": ["if ($x) return 200;"]},
         "gateway_extra_directives", "uses if, which is refused"),
    case("directive-ssl", {"gateway_extra_directives": ["ssl_certificate /etc/x.pem;"]},
         "gateway_extra_directives", "uses ssl_certificate, which is refused"),
    case("directive-unbalanced-quote", {"gateway_extra_directives": ['add_header X "1;']},
         "gateway_extra_directives", "has a backslash or an unbalanced quote"),
    case("directive-backslash", {"gateway_extra_directives": ["add_header X 1\\;"]},
         "gateway_extra_directives", "has a backslash or an unbalanced quote"),
    # Each of these passes nginx -t; the first three serve /v1/ without a key.
    case("directive-set-key-ok", {"gateway_extra_directives": ["set $vllm_key_ok 1;"]},
         "gateway_extra_directives", "'set $vllm_key_ok 1;' uses set, which is refused",
         "could turn the key check off", ONE_DIRECTIVE, DIRECTIVES_ALLOWED),
    case("directive-satisfy-any", {"gateway_extra_directives": ["satisfy any;", "allow all;"]},
         "gateway_extra_directives", "[0] 'satisfy any;' uses satisfy, which is refused",
         DIRECTIVES_ALLOWED),
    case("directive-auth-request-off", {"gateway_extra_directives": ["auth_request off;"]},
         "gateway_extra_directives", "uses auth_request, which is refused"),
    case("directive-allow", {"gateway_extra_directives": ["allow all;"]},
         "gateway_extra_directives", "uses allow, which is refused"),
    case("directive-deny", {"gateway_extra_directives": ["deny 10.0.0.0/8;"]},
         "gateway_extra_directives", "uses deny, which is refused"),
    case("directive-quoted-name", {"gateway_extra_directives": ['"set" $vllm_key_ok 1;']},
         "gateway_extra_directives", "uses \"set\", which is refused"),
    case("directive-proxy-pass", {"gateway_extra_directives": ["proxy_pass http://10.0.0.9;"]},
         "gateway_extra_directives", "uses proxy_pass, which is refused",
         "route around the key check"),
    case("directive-proxy-set-header",
         {"gateway_extra_directives": ['proxy_set_header Authorization "Bearer x";']},
         "gateway_extra_directives", "uses proxy_set_header, which is refused",
         "send the engine's key elsewhere"),
    case("directive-return", {"gateway_extra_directives": ["return 200;"]},
         "gateway_extra_directives", "uses return, which is refused"),
    case("directive-rewrite", {"gateway_extra_directives": ["rewrite ^/x/(.*) /v1/models;"]},
         "gateway_extra_directives", "uses rewrite, which is refused"),
    case("directive-error-page", {"gateway_extra_directives": ["error_page 401 =200 /health;"]},
         "gateway_extra_directives", "uses error_page, which is refused"),
    case("directive-root", {"gateway_extra_directives": ["root /etc;"]},
         "gateway_extra_directives", "uses root, which is refused"),
    case("directive-alias", {"gateway_extra_directives": ["alias /etc/nginx/;"]},
         "gateway_extra_directives", "uses alias, which is refused"),
    case("directive-lua", {"gateway_extra_directives": ["access_by_lua 'return';"]},
         "gateway_extra_directives", "uses access_by_lua, which is refused"),
    case("directive-js", {"gateway_extra_directives": ["js_content gate.allow;"]},
         "gateway_extra_directives", "uses js_content, which is refused"),
    case("directive-perl", {"gateway_extra_directives": ["perl Gate::handler;"]},
         "gateway_extra_directives", "uses perl, which is refused"),
    case("directive-proxy-buffering", {"gateway_extra_directives": ["proxy_buffering on;"]},
         "gateway_extra_directives", "uses proxy_buffering, which is refused"),
    case("directive-server-tokens", {"gateway_extra_directives": ["server_tokens on;"]},
         "gateway_extra_directives", "uses server_tokens, which is refused"),
    case("directive-variable",
         {"gateway_extra_directives": ["add_header X-K $vllm_upstream_authorization always;"]},
         "gateway_extra_directives", "has '$'", "sends the engine's key to every client",
         DIRECTIVES_ALLOWED),
    case("directive-variable-in-log-path",
         {"gateway_extra_directives": ["access_log /var/log/nginx/$http_authorization;"]},
         "gateway_extra_directives", "has '$'"),
    case("directive-error-log-debug",
         {"gateway_extra_directives": ["error_log /var/log/nginx/vllm-debug.log debug;"]},
         "gateway_extra_directives", "logs at the debug level", "Authorization",
         "use info or above"),
    # Each debug level writes the request headers (nginx built --with-debug): the values
    # are an allow list, by shape, never a list of refused words.
    case("directive-error-log-debug-http",
         {"gateway_extra_directives": ["error_log /var/log/nginx/vllm-debug.log debug_http;"]},
         "gateway_extra_directives", "logs at the debug level (debug_http)",
         "the engine's own key", "use info or above"),
    case("directive-error-log-debug-core-and-http",
         {"gateway_extra_directives": ["error_log /var/log/nginx/x.log debug_core debug_http;"]},
         "gateway_extra_directives", "logs at the debug level (debug_core, debug_http)"),
    case("directive-error-log-debug-quoted",
         {"gateway_extra_directives": ['error_log stderr "debug_event";']},
         "gateway_extra_directives", "logs at the debug level (debug_event)"),
    case("directive-error-log-unknown-level",
         {"gateway_extra_directives": ["error_log /var/log/nginx/x.log verbose;"]},
         "gateway_extra_directives", "gives error_log '/var/log/nginx/x.log verbose'",
         "one level of info, notice, warn, error, crit, alert, emerg"),
    case("directive-error-log-outside-var-log",
         {"gateway_extra_directives": ["error_log /tmp/x.log info;"]},
         "gateway_extra_directives", "error_log takes here: a file /var/log/nginx/NAME"),
    case("directive-access-log-default-format",
         {"gateway_extra_directives": ["access_log /var/log/nginx/x.log;"]},
         "gateway_extra_directives", "the gateway's format vllm_gateway",
         "combined, the default, writes the query string and the Referer"),
    case("directive-access-log-combined",
         {"gateway_extra_directives": ["access_log /var/log/nginx/x.log combined;"]},
         "gateway_extra_directives", "gives access_log '/var/log/nginx/x.log combined'"),
    case("directive-access-log-into-conf-d",
         {"gateway_extra_directives": [
             "access_log /var/log/nginx/../../etc/nginx/conf.d/x.conf vllm_gateway;"]},
         "gateway_extra_directives", "access_log takes here"),
    case("directive-log-format",
         {"gateway_extra_directives": ["log_format leak $http_authorization;"]},
         "gateway_extra_directives", "uses log_format, which is refused"),
    case("directive-add-header-hsts",
         {"gateway_extra_directives": ['add_header Strict-Transport-Security "max-age=60";']},
         "gateway_extra_directives", "adds Strict-Transport-Security, which the gateway's "
         "site adds itself"),
    case("directive-value-not-on-off", {"gateway_extra_directives": ["gzip maybe;"]},
         "gateway_extra_directives", "gives gzip 'maybe'; gzip takes here: on or off"),
    case("directive-value-not-a-time", {"gateway_extra_directives": ["send_timeout forever;"]},
         "gateway_extra_directives", "send_timeout takes here: a time (75s, 1m, 500ms)"),
    case("directive-proxy-read-timeout", {"gateway_extra_directives": ["proxy_read_timeout 60s;"]},
         "gateway_extra_directives", "which the gateway sets itself",
         "set gateway_proxy_timeout_s instead"),
    case("directive-body-size", {"gateway_extra_directives": ["client_max_body_size 0;"]},
         "gateway_extra_directives", "set gateway_max_body_mib instead"),
    case("bench-slo-on-a-stack-without-goodput", {"bench_slo_ttft_ms": 2000},
         "bench_slo_ttft_ms", "is set, but vLLM 0.6.3's stack has no benchmark client with goodput",
         "set vllm_version to a release whose cuda stack has it: 0.17.0, 0.22.0, 0.33.0"),
    case("bench-slo-itl", {"bench_slo_itl_ms": 50}, "bench_slo_itl_ms",
         "takes ttft, tpot and e2el targets, not itl", "set bench_slo_tpot_ms instead"),
    case("bench-slo-tpot-zero", {"bench_slo_tpot_ms": 0}, "bench_slo_tpot_ms",
         "greater than 0"),
    case("sentinel-timeout-as-long-as-interval",
         {"sentinel_interval_s": 30, "sentinel_timeout_s": 30}, "sentinel_timeout_s",
         "sentinel_timeout_s (30) must be less than sentinel_interval_s (30)",
         "lower sentinel_timeout_s or raise sentinel_interval_s"),
    case("sentinel-interval-too-short", {"sentinel_interval_s": 1}, "sentinel_interval_s",
         "greater than or equal to 5"),
    case("sentinel-no-failures", {"sentinel_failures": 0}, "sentinel_failures",
         "greater than or equal to 1"),
    case("sentinel-restart-not-a-bool", {"sentinel_restart": "sometimes"}, "sentinel_restart",
         "valid boolean"),
    case("router-tls-cert-without-its-key", {"router_tls_cert": "{tmp}/router.pem"},
         "router_tls_key", "router_tls_key is not set", "set both or neither",
         files={"router.pem": (ROUTER_CERT, 0o644)}),
    case("router-tls-key-others-may-read",
         {"router_tls_cert": "{tmp}/router.pem", "router_tls_key": "{tmp}/router.key"},
         "router_tls_key", "mode 0644 lets its group or others at the private key",
         "chmod 600 it",
         files={"router.pem": (ROUTER_CERT, 0o644), "router.key": (ROUTER_KEY, 0o644)}),
    case("router-gateway-ca-not-pem", {"router_gateway_ca": "{tmp}/ca.pem"},
         "router_gateway_ca", "holds no PEM certificate", "name the PEM file",
         files={"ca.pem": ("not a certificate\n", 0o644)}),
    case("router-gateway-ca-missing", {"router_gateway_ca": "{tmp}/nowhere.pem"},
         "router_gateway_ca", "cannot be read (No such file or directory)"),
    case("router-prefix-beyond-buffer", {"router_prefix_bytes": 20000, "router_buffer_kib": 16},
         "router_prefix_bytes", "must be less than router_buffer_kib (16) x 1024",
         "lower router_prefix_bytes or raise router_buffer_kib"),
    case("router-metrics-on-the-client-port", {"router_metrics_port": 8443},
         "router_metrics_port", "must differ from router_port", "choose another port"),
    case("gateway-address-with-a-space", {"gateway_address": "gpu-1 backup"},
         "gateway_address", "is neither an IP address nor a DNS name"),
    case("router-buffer-too-small", {"router_buffer_kib": 8}, "router_buffer_kib",
         "greater than or equal to 16"),
    case("drain-leave-negative", {"drain_leave_s": -1}, "drain_leave_s",
         "greater than or equal to 0"),
    case("drain-leave-beyond-five-minutes", {"drain_leave_s": 301}, "drain_leave_s",
         "less than or equal to 300"),
]


def _fill(value: Any, tmp: str) -> Any:
    if isinstance(value, str):
        return value.replace("{tmp}", tmp)
    if isinstance(value, list):
        return [_fill(item, tmp) for item in value]
    if isinstance(value, dict):
        return {key: _fill(item, tmp) for key, item in value.items()}
    return value


def _write(files: dict[str, tuple[str | bytes | None, int]], tmp_path: Path) -> None:
    for name, (content, mode) in files.items():
        path = tmp_path / name
        if content is None:
            path.mkdir()
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        path.chmod(mode)


def test_the_catalogue_has_one_case_per_input():
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("bad", CASES, ids=[c.id for c in CASES])
def test_rejected(bad: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    for name, value in bad.env.items():
        monkeypatch.setenv(name, value)
    _write(bad.files, tmp_path)
    with pytest.raises(SettingsError) as refused:
        validate(_fill(bad.data, str(tmp_path)), where="host gpu-1")
    message = str(refused.value)
    lines = message.splitlines()
    assert lines[0] == "invalid settings for host gpu-1:"
    problems = lines[1:-1]
    assert len(problems) == 1, message
    assert re.match(rf"  {re.escape(bad.key)}\b", problems[0]), problems[0]
    for fragment in bad.fragments:
        assert _fill(fragment, str(tmp_path)) in problems[0]
    for secret in (KEY, KEY2, *bad.secrets):
        assert secret not in message


# --- what the rules accept ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("data", "name", "expected"),
    [
        ({"vllm_host": "127.0.0.1"}, "vllm_host_url_part", "127.0.0.1"),
        ({"vllm_host": "127.0.0.53"}, "vllm_host_url_part", "127.0.0.53"),
        ({"vllm_host": "::1"}, "vllm_host_url_part", "[::1]"),
        ({"vllm_host": "10.0.0.5", "vllm_listen_beyond_loopback": True, **KEYED,
          "vllm_engine_allow": ["10.0.0.7"]}, "vllm_host_url_part", "10.0.0.5"),
        ({"vllm_host": "fd00::5", "vllm_listen_beyond_loopback": True, **KEYED,
          "vllm_engine_allow": ["fd00::7"]}, "vllm_host_url_part", "[fd00::5]"),
        ({"vllm_engine_allow": ["10.0.0.7/24", "fd00::7"]}, "vllm_engine_allow",
         ["10.0.0.0/24", "fd00::7/128"]),
        ({"metrics_allow": ["10.0.0.7/24", "::1", "fd00::/8"]}, "metrics_allow",
         ["10.0.0.0/24", "::1/128", "fd00::/8"]),
        ({"sysctl": {"net.ipv4.tcp_rmem": "4096 87380 6291456", "kernel.pid_max": 4194304,
                     "net.ipv4.conf.all.rp_filter": 1, "net.ipv4.conf.*.rp_filter": "2",
                     "kernel.perf_event_paranoid": -1, "net.ipv4.tcp_wmem": "4096\t65536 1"}},
         "sysctl", {"net.ipv4.tcp_rmem": "4096 87380 6291456", "kernel.pid_max": 4194304,
                    "net.ipv4.conf.all.rp_filter": 1, "net.ipv4.conf.*.rp_filter": "2",
                    "kernel.perf_event_paranoid": -1, "net.ipv4.tcp_wmem": "4096\t65536 1"}),
        ({"sysctl": {"net.ipv4.tcp_congestion_control": "bbr", "net.core.default_qdisc":
                     "fq"}}, "sysctl",
         {"net.ipv4.tcp_congestion_control": "bbr", "net.core.default_qdisc": "fq"}),
        ({"model_volume_mount_options": ["noatime", "nodev", "logbsize=256k", "inode64"]},
         "model_volume_mount_options", ["noatime", "nodev", "logbsize=256k", "inode64"]),
        ({"model_dir": "/srv/models", "python_env_root": "/opt/vllm"}, "model_dir",
         "/srv/models"),
        ({"model_dir": "/data/hf-models/v1.2"}, "model_dir", "/data/hf-models/v1.2"),
        ({"python_env_root": "/opt/vllm"}, "python_env_root", "/opt/vllm"),
        ({"python_env_root": "/srv/vllm"}, "python_env_root", "/srv/vllm"),
        # Beside each other, and beside the suite's directories, is apart.
        ({"model_dir": "/data/models", "python_env_root": "/data/vllm"}, "python_env_root",
         "/data/vllm"),
        ({"python_env_root": "/srv/models-envs"}, "python_env_root", "/srv/models-envs"),
        ({"python_env_root": "/var/lib/pyinfra-vllm-envs"}, "python_env_root",
         "/var/lib/pyinfra-vllm-envs"),
        ({"model_dir": "/data"}, "model_dir", "/data"),
        ({"model_dir": "/mnt/models"}, "model_dir", "/mnt/models"),
        ({"textfile_collector_dir": "/var/lib/node_exporter/textfile"},
         "textfile_collector_dir", "/var/lib/node_exporter/textfile"),
        ({"model_id": "gpt2"}, "model_id", "gpt2"),
        ({"model_id": "meta-llama/Llama-3.1-8B-Instruct"}, "model_id",
         "meta-llama/Llama-3.1-8B-Instruct"),
        ({"served_model_name": "org/qwen3.6-27b:bf16"}, "served_model_name",
         "org/qwen3.6-27b:bf16"),
        ({"model_revision": "refs/pr/1"}, "model_revision", "refs/pr/1"),
        ({"nvidia_apt_repo": SIGNED}, "nvidia_apt_repo", SIGNED),
        ({"nvidia_apt_repo": "http://10.0.0.1:8787/", "nvidia_apt_repo_trusted": True},
         "nvidia_apt_repo", "http://10.0.0.1:8787/"),
        ({"model_base_url": "http://10.0.0.1:8788"}, "model_base_url", "http://10.0.0.1:8788"),
        ({"model_base_url": "https://mirror.example/hf", "hf_token": TOKEN}, "model_base_url",
         "https://mirror.example/hf"),
        ({"pip_index_url": f"https://bob:{PASSWORD}@pypi.example/simple"}, "pip_index_url",
         f"https://bob:{PASSWORD}@pypi.example/simple"),
        ({"http_proxy": "http://proxy.example.internal:3128"}, "http_proxy",
         "http://proxy.example.internal:3128"),
        # Credentials in these reach the host in a root-only environment file: kept.
        ({"http_proxy": f"http://bob:{PASSWORD}@proxy.example:3128"}, "http_proxy",
         f"http://bob:{PASSWORD}@proxy.example:3128"),
        ({"gateway_extra_directives": GATEWAY_EXTRA_ACCEPTED}, "gateway_extra_directives",
         GATEWAY_EXTRA_ACCEPTED),
    ],
)
def test_accepted(data, name, expected, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    base = {} if "api_keys" in data else OPEN
    assert getattr(validate({**base, **data}), name) == expected


def test_keys_of_the_key_file_join_api_keys(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"# gateway keys\n\n  {KEY2}  \n# retired: none\n")
    keys.chmod(0o600)
    settings = validate({"api_keys": [KEY], "api_keys_file": str(keys)})
    assert [key.get_secret_value() for key in settings.api_keys] == [KEY, KEY2]
    assert KEY2 not in repr(settings)
    only_file = validate({"api_keys_file": str(keys)})
    assert [key.get_secret_value() for key in only_file.api_keys] == [KEY2]


def test_the_key_file_is_read_once(tmp_path, monkeypatch):
    # One read, by api_keys' rule, for every check of its keys and the keys kept.
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY2}\n")
    keys.chmod(0o600)
    opened = []
    real_open = open

    def counting_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    settings = validate({"api_keys": [KEY], "api_keys_file": str(keys)})
    assert opened.count(str(keys)) == 1
    assert [key.get_secret_value() for key in settings.api_keys] == [KEY, KEY2]


def test_every_problem_of_independent_settings_is_listed_at_once():
    with pytest.raises(SettingsError) as refused:
        validate({"vllm_host": "0.0.0.0", "model_dir": "/", "api_keys": [SHORT],
                  "metrics_allow": ["all"], "sysctl": {"vm.swappiness": "1;"}})
    named = [line.split(" = ")[0].strip() for line in str(refused.value).splitlines()[1:-1]]
    assert sorted(named) == ["api_keys", "metrics_allow", "model_dir", "sysctl", "vllm_host"]
    assert SHORT not in str(refused.value)


def test_the_rules_hold_for_settings_built_directly():
    # Settings(...) runs the same rules as validate(): no way around them in code.
    with pytest.raises(ValueError, match="api_keys is empty"):
        Settings()
    with pytest.raises(ValueError, match="not a loopback address"):
        Settings(vllm_host="0.0.0.0", gateway_open=True)


def test_keys_and_tokens_as_generators_make_them_are_accepted():
    # secrets.token_urlsafe (the sandbox's keys) and Hugging Face tokens ("hf_...") use "_".
    key = "Ab_" + "x-Y_z" * 8
    token = "hf_" + "AbCdEfGhIj" * 3 + "kLmN"
    settings = validate({"api_keys": [key], "hf_token": token})
    assert [k.get_secret_value() for k in settings.api_keys] == [key]
    assert settings.hf_token is not None and settings.hf_token.get_secret_value() == token
