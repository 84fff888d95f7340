"""The rules of addresses and allow lists, and of who may reach the gateway and the
engine: vllm_host, metrics_address, the networks of vllm_engine_allow, metrics_allow and
prometheus_servers, and what the keys must cover (the rules' conventions:
settings_checks.py).
"""

from __future__ import annotations

import ipaddress
import re

from pydantic import ValidationInfo

from pyinfra_vllm.core.secret_files import mask_credentials

# A DNS host name (RFC 1123 labels): what a Prometheus target's host part may be.
HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")
# What to write instead of every address, in the allow lists' messages.
_NAME_THEM = ("the list is there to name the few machines let in: name their networks, "
              "e.g. [\"10.20.0.5/32\"] or [\"10.20.0.0/24\"]")


def engine_address(value: str, info: ValidationInfo) -> str:
    """vllm_host; reads vllm_listen_beyond_loopback, declared before it."""
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        address = None
    if address is None or "%" in value:
        raise ValueError(
            "not an IP address literal: the engine listens on an address such as "
            "127.0.0.1 or ::1 (no host name, brackets, scope id or port; the port is "
            "vllm_port)"
        )
    if str(address) != value:
        raise ValueError(f"write the address as {address}")
    if not address.is_loopback and not info.data.get("vllm_listen_beyond_loopback"):
        raise ValueError(
            "not a loopback address: the engine would be reachable from the network "
            "around the gateway and its key check (0.0.0.0 and :: are every "
            "interface); keep 127.0.0.1 or ::1, or set vllm_listen_beyond_loopback=true "
            "and an API key, which the engine then requires"
        )
    return value


def networks(value: list[str], info: ValidationInfo) -> list[str]:
    """Networks for nginx's allow (and the engine's firewall), host bits cleared; never
    every address, nor the unspecified address."""
    cleared = []
    name = info.field_name
    for index, entry in enumerate(value):
        if "%" in entry:
            raise ValueError(f"{name}[{index}] {entry!r} has an IPv6 scope id "
                             "(%): nginx's allow takes a network without one")
        try:
            network = ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise ValueError(
                f"{name}[{index}] {entry!r} is not an IPv4 or IPv6 network; "
                "allowed: an address or CIDR such as 10.20.0.0/16, 127.0.0.1 or ::1/128"
            ) from None
        if network.prefixlen == network.max_prefixlen and network.network_address.is_unspecified:
            raise ValueError(
                f"{name}[{index}] {entry!r} is the unspecified address: a listening "
                f"socket reads it as every address, an allow list as no machine; {_NAME_THEM}"
            )
        cleared.append(str(network))
    covered = whole_address_spaces(cleared)
    if covered:
        raise ValueError(f"{name} lets in {covered}; {_NAME_THEM}")
    return cleared


def whole_address_spaces(cleared: list[str]) -> str | None:
    """Which whole address space networks (host bits cleared) cover, alone ("0.0.0.0/0")
    or together ("0.0.0.0/1" and "128.0.0.0/1"), in words: "every IPv4 address
    (0.0.0.0/0)"; None when they leave machines out, as an allow list must."""
    networks = [ipaddress.ip_network(entry) for entry in cleared]
    v4 = [net for net in networks if isinstance(net, ipaddress.IPv4Network)]
    v6 = [net for net in networks if isinstance(net, ipaddress.IPv6Network)]
    found = []
    if list(ipaddress.collapse_addresses(v4)) == [ipaddress.IPv4Network("0.0.0.0/0")]:
        found.append("every IPv4 address (0.0.0.0/0)")
    if list(ipaddress.collapse_addresses(v6)) == [ipaddress.IPv6Network("::/0")]:
        found.append("every IPv6 address (::/0)")
    return " and ".join(found) or None


def reachable_address(value: str | None) -> str | None:
    if value is None:
        return value
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if not HOST_NAME.fullmatch(value):
            raise ValueError(
                "not a host name or IP address literal: letters, digits, '-' and '.' "
                "(e.g. gpu-a100-01.example.internal) or an address such as 10.20.0.7 "
                "or fd00::7; no scheme, port, path or brackets (the port is "
                "gateway_port)"
            ) from None
    if "%" in value:
        raise ValueError("has an IPv6 scope id (%), which means nothing to another host")
    return value


def exposure_problems(*, has_keys: bool, gateway_open: bool,
                      vllm_listen_beyond_loopback: bool, engine_allow: list[str],
                      token_from: str | None, model_base_url: str,
                      metrics_networks: list[str]) -> list[tuple[str, str]]:
    """Who may reach the gateway and the engine, and where a token may travel: each
    problem as (key, sentence naming its keys); no key or token is ever in it."""
    problems = []
    if not has_keys and not gateway_open:
        problems.append((
            "api_keys",
            "api_keys is empty: the gateway would serve /v1/ to anyone; set api_keys or "
            "api_keys_file, or gateway_open=true to serve without a key",
        ))
    if has_keys and gateway_open:
        problems.append((
            "gateway_open",
            "gateway_open = True, yet api_keys or api_keys_file set keys: an open "
            "gateway with keys is a contradiction; remove gateway_open (the keys are "
            "then required) or the keys",
        ))
    if vllm_listen_beyond_loopback and not has_keys:
        problems.append((
            "vllm_listen_beyond_loopback",
            "vllm_listen_beyond_loopback = True needs an API key: an engine reachable "
            "beyond loopback is for a gateway that checks client keys; set api_keys or "
            "api_keys_file, or remove "
            "vllm_listen_beyond_loopback and keep vllm_host on 127.0.0.1",
        ))
    if vllm_listen_beyond_loopback and not engine_allow:
        problems.append((
            "vllm_engine_allow",
            "vllm_engine_allow is empty, yet vllm_listen_beyond_loopback = True: the "
            "engine's port is open to the machines of vllm_engine_allow only (its key "
            "guards /v1 alone); name the networks of the machines that reach it, e.g. "
            "[\"10.20.0.5/32\"], or remove vllm_listen_beyond_loopback",
        ))
    covered = whole_address_spaces(metrics_networks)
    if covered:
        problems.append((
            "prometheus_servers",
            f"prometheus_servers, added to metrics_allow, lets in {covered}: the gateway's "
            f"/metrics and /node-metrics would answer every machine; {_NAME_THEM}",
        ))
    if token_from is not None and not model_base_url.startswith("https://"):
        problems.append((
            "model_base_url",
            f"model_base_url = {mask_credentials(model_base_url)!r} is plain http, "
            f"and the Hugging Face token ({token_from}) would travel with every download: "
            "use an https URL, or no token (hf_token, hf_token_file, HF_TOKEN) for a "
            "mirror that needs none",
        ))
    return problems
