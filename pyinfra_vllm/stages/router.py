"""Router: the fleet's front door, HAProxy from the distribution in front of every serving
host's gateway, on the hosts of the inventory's ``routers`` group (docs/router.md).

HAProxy's configuration (``/etc/haproxy/vllm-router.cfg``) is rendered from the same
inventory: each serving host's gateway a server of the pool, reached over TLS verified
against the gateways' certificates (router_gateway_ca, else their gateway_tls_cert files),
checked on its ``/health`` (out of the pool while drained, rotated out or not ready), a
failed connection or a 503 retried on another host, requests whose bodies start alike kept
on one host. Clients reach only ``/v1/`` over TLS, with a key whose sha256 is in
``/etc/haproxy/vllm-router-keys.lst`` (root, 0600: no key on the router host); each gateway
checks the key again. The configuration, the key hashes and the TLS files go live only
after ``haproxy -c`` passes (the gateway's checked swap, pyinfra_vllm/operations/gateway.py),
and HAProxy reloads only when one of them changed. The key list, the TLS key, their
directory and the staging directory keep the owner and mode of the access table
(pyinfra_vllm/plans/access.py): put back without a reload when changed by hand; a link or
another kind in their place refuses the host. Debian's unit runs it through the suite's
drop-in, hardened like the engine's; a foreign drop-in is set aside.

    pyinfra inventory.py deploys/router.py --limit routers
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyinfra import host
from pyinfra.operations import systemd
from pyinfra.operations.util import any_changed

from facts.files import PathModes
from pyinfra_vllm.core import settings_checks_router
from pyinfra_vllm.core.settings import Settings, load_settings
from pyinfra_vllm.operations import access as access_ops
from pyinfra_vllm.operations import file_set, units
from pyinfra_vllm.operations import gateway as gateway_ops
from pyinfra_vllm.operations.util.packages import debian_package
from pyinfra_vllm.plans import access
from pyinfra_vllm.plans import router as router_plan
from pyinfra_vllm.run.context import HostContext
from pyinfra_vllm.run.stage import stage

UNIT = router_plan.UNIT


def is_router(pyinfra_host: Any) -> bool:
    """Is this host of the inventory's routers group (a front door, not a serving host)?"""
    return router_plan.ROUTERS_GROUP in pyinfra_host.groups


def serving_pool(router_name: str) -> tuple[list[router_plan.Backend], list[str], list[str],
                                             dict[str, int]]:
    """The inventory's serving hosts (every host outside the routers group) as the front
    door's pool: their gateways, the names of those without TLS, the text of each one's
    gateway_tls_cert, and each one's drain_leave_s by name. Each host's settings validated
    as its own run validates them."""
    backends, plain, certs, leaves = [], [], [], {}
    for other in host.inventory:
        if is_router(other) or other.name == router_name:
            continue
        settings = load_settings(other)
        leaves[other.name] = settings.drain_leave_s
        backends.append(router_plan.backend_of(other.name, settings.gateway_address,
                                               other.data.get("ssh_hostname"),
                                               settings.gateway_port))
        if settings.gateway_tls_cert and settings.gateway_tls_key:
            certs.append(Path(settings.gateway_tls_cert).read_text())
        else:
            plain.append(other.name)
    return backends, plain, certs, leaves


# No reads declared (as bench's): the run's one read is made for the stages of STAGES, which
# every host reads, and a serving host has nothing of the router's to read.
@stage(lock_required=False, runbook=False)
def router(ctx: HostContext) -> None:
    """Router: the fleet's front door, HAProxy in front of the serving hosts' gateways."""
    if not is_router(host):
        host.noop(f"{host.name} is a serving host, not of the {router_plan.ROUTERS_GROUP} group")
        return
    settings = ctx.settings
    problems, files = front_door_files(settings, host.name)
    problems += access.wrong_kinds(access.rows(settings, access.ROUTER_STAGE, ctx.endpoint),
                                   host.get_fact(PathModes, **access.read(
                                       settings, access.ROUTER_STAGE, ctx.endpoint)))
    if problems:
        ctx.refuse("Router: host refused", problems)
        return
    keys = [secret.get_secret_value() for secret in settings.api_keys]
    debian_package("Router: haproxy installed", router_plan.SERVICE)
    gateway_ops.site(
        name="Router: HAProxy's configuration, key hashes and TLS files (haproxy -c before "
        "going live)",
        site_content=files[router_plan.CONFIG_PATH],
        keys_content=files[router_plan.KEYS_PATH],
        site_path=router_plan.CONFIG_PATH,
        keys_path=router_plan.KEYS_PATH,
        staging_dir=router_plan.STAGING_DIR,
        service=router_plan.SERVICE,
        extra_files={path: (files[path], mode) for path, mode in TLS_MODES.items()},
        secrets=keys,
        check=router_plan.CHECK_COMMAND,
    )
    # The key list, the TLS key, their directory and the staging directory as the access
    # table says (a mode changed by hand: put back, HAProxy not reloaded).
    access_ops.kept(name="Router: owner and mode of its key files and directories",
                    paths=access.wanted(settings, access.ROUTER_STAGE, ctx.endpoint))
    _unit()


# The TLS files' modes: the key a secret of the access table's.
TLS_MODES = {router_plan.TLS_CERT_PATH: "644",
             router_plan.TLS_KEY_PATH: access.mode(router_plan.TLS_KEY_PATH),
             router_plan.GATEWAY_CA_PATH: "644"}


def front_door_files(settings: Settings, router_name: str) -> tuple[list[str], dict[str, str]]:
    """Why the router host ``router_name`` cannot be set up (each a sentence), else ([],
    the front door's files as the stage writes them: ``{live path: content}``, the
    configuration, the key hashes, the TLS files and the unit's drop-in). The audit
    compares them with what is live; a key itself is in none of them."""
    backends, plain, certs, leaves = serving_pool(router_name)
    cert, key = settings.router_tls_cert, settings.router_tls_key
    problems = router_plan.pool_problems(router_name, backends, plain, tls=bool(cert and key))
    problems += settings_checks_router.leave_problems(router_name, leaves,
                                                      settings.router_check_interval_ms)
    if problems or cert is None or key is None:
        return problems, {}
    keys = [secret.get_secret_value() for secret in settings.api_keys]
    config = router_plan.render_config(
        backends=backends, router_port=settings.router_port,
        metrics_port=settings.router_metrics_port,
        metrics_allow=settings.metrics_networks, key_check=bool(keys),
        prefix_bytes=settings.router_prefix_bytes,
        buffer_kib=settings.router_buffer_kib,
        max_connections=settings.router_max_connections,
        check_interval_ms=settings.router_check_interval_ms,
        proxy_timeout_s=settings.gateway_proxy_timeout_s,
    )
    return [], {router_plan.CONFIG_PATH: config,
                router_plan.KEYS_PATH: router_plan.key_hashes(keys),
                **_tls_files(cert, key, settings.router_gateway_ca, certs),
                router_plan.DROPIN_PATH: router_plan.render_dropin()}


def _tls_files(cert: str, key: str, gateway_ca: str | None,
               gateway_certs: list[str]) -> dict[str, str]:
    """The front door's certificate and key (read here, uploaded from memory, the key never
    printed) and the trust for the gateways' certificates, to go live with the
    configuration in the same checked swap."""
    return {
        router_plan.TLS_CERT_PATH: Path(cert).read_text(),
        router_plan.TLS_KEY_PATH: Path(key).read_text(),
        router_plan.GATEWAY_CA_PATH: router_plan.gateway_trust(
            Path(gateway_ca).read_text() if gateway_ca else None, gateway_certs),
    }


def _unit() -> None:
    """Debian's haproxy unit with the suite's drop-in alone, restarted when it changed (a
    reload re-runs the command line the master started with)."""
    foreign = units.drop_ins_only(name="Router: no foreign drop-in for haproxy", unit=UNIT,
                                  own=[router_plan.DROPIN_PATH])
    dropin = file_set.present(
        name="Router: haproxy runs the front door's configuration, hardened",
        files={router_plan.DROPIN_PATH: (router_plan.render_dropin().encode(), "644")},
    )
    systemd.daemon_reload(name="Router: reload systemd units", _if=dropin.did_change)
    systemd.service(name="Router: restart haproxy with its new command line", service=UNIT,
                    running=True, restarted=True,
                    _if=any_changed(dropin, foreign))
    units.enabled_and_running(name="Router: haproxy enabled and running", unit=UNIT)
