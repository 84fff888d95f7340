"""Gateway: nginx in front of the engine, with API keys, streaming and a safe reload.

nginx from the distribution; the site (``/etc/nginx/conf.d/vllm.conf``), the key map
(``/etc/nginx/vllm-api-keys.conf``, 0600) and, with TLS, the certificate and its key
(``/etc/nginx/vllm-tls/``, the key 0600) go live only after ``nginx -t`` passes, and nginx
is reloaded only when one of them changed (pyinfra_vllm/operations/gateway.py). The keys are never
printed: no command line or log line carries them, ``--diff`` masks them, and a failed
``nginx -t`` is shown without the lines that would. Failed key checks are rate-limited per address.
``/metrics`` (the engine's) and ``/node-metrics`` (node_exporter's, on loopback, when the
metrics stage runs it) answer only metrics_allow and prometheus_servers; the central
Prometheus's scrape jobs come from ``python -m tools.scrape_config`` (docs/monitoring.md).

Another server block on the gateway's ports (a hand-made site) would take requests meant
for the gateway, and Debian's ``sites-enabled/default`` serves its welcome page, with
nginx's version, on port 80 of every address: found in ``nginx -T`` (the default site on
any port, and where nginx is installed by this run, where no read could see it yet), its
file is set aside (moved, a symlink as a symlink, under
/var/lib/pyinfra-vllm/nginx-disabled/), tested by ``nginx -t`` before nginx reloads. A
file that cannot be set aside whole (nginx.conf itself, or one that also serves other
ports) refuses the host, naming the file; so does a ``server_tokens`` other than off set
for every server by another file. The key map, the engine's key for nginx, the TLS key and
the staging directory keep the owner and mode of the access table
(pyinfra_vllm/plans/access.py): put back without a reload when changed by hand; a link or
another kind in their place refuses the host.

    pyinfra inventory.py deploys/gateway.py
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import click
from pyinfra import host
from pyinfra.facts.deb import DebPackage
from pyinfra.facts.files import Sha1File

from facts.files import PathModes
from facts.nginx import NginxServers
from facts.units import UnitActivation
from facts.vllm_service import EngineKey
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.operations import access as access_ops
from pyinfra_vllm.operations import gateway as gateway_ops
from pyinfra_vllm.operations import units
from pyinfra_vllm.operations import vllm_service as vllm_service_ops
from pyinfra_vllm.operations.util.packages import debian_package
from pyinfra_vllm.plans import access, engine_access
from pyinfra_vllm.plans import gateway as gateway_plan
from pyinfra_vllm.run.context import HostContext
from pyinfra_vllm.run.host_reads import Read
from pyinfra_vllm.run.stage import stage

logger = logging.getLogger("pyinfra")


def gateway_reads(settings: Settings, place: engine_access.Endpoint) -> list[Read]:
    """What the gateway stage reads of a converged host: the run's one read (the access
    table's rows at the engine's endpoint ``place``, HostContext.endpoint)."""
    live = [gateway_plan.SITE_PATH, gateway_plan.KEYS_PATH]
    if settings.gateway_tls_cert and settings.gateway_tls_key:
        live += [gateway_plan.TLS_CERT_PATH, gateway_plan.TLS_KEY_PATH]
    return [
        Read(DebPackage, {"package": "nginx"}),
        Read(NginxServers),
        Read(EngineKey, engine_access.KEY_READ),
        *(Read(Sha1File, {"path": path}) for path in live),
        Read(PathModes, access.read(settings, "gateway", place)),
        Read(UnitActivation, {"unit": "nginx.service"}),
    ]


@stage(reads=gateway_reads)
def gateway(ctx: HostContext) -> None:
    """Gateway: nginx in front of the engine, with API keys, streaming and a safe reload."""
    settings = ctx.settings
    keys = [key.get_secret_value() for key in settings.api_keys]
    if not keys:
        logger.warning(
            "%s%s",
            host.print_prefix,
            click.style(
                "warning: api_keys is empty: the gateway's API key check is OFF, "
                f"anyone who reaches port {settings.gateway_port} can use /v1/",
                fg="yellow",
            ),
        )

    wrong = access.wrong_kinds(access.rows(settings, "gateway", ctx.endpoint),
                               host.get_fact(PathModes, **access.read(settings, "gateway",
                                                                      ctx.endpoint)))
    if wrong:
        ctx.refuse("Gateway: host refused", wrong)
        return
    debian_package("Gateway: nginx installed", "nginx")

    found = host.get_fact(NginxServers)
    if not _foreign_set_aside(ctx, found):
        return
    tls_files = _tls_files(settings, warn_clear=bool(keys))
    # The site sends the engine its own key from a file made on the host: there before
    # nginx -t reads the site.
    vllm_service_ops.engine_key(name="Gateway: the engine's own key, for nginx to send it")
    gateway_ops.site(
        name="Gateway: nginx site and API keys (nginx -t before going live)",
        site_content=gateway_plan.render_site(
            upstream=ctx.endpoint.nginx_server,
            gateway_port=settings.gateway_port,
            metrics_allow=settings.metrics_networks,
            node_exporter_port=(settings.node_exporter_port
                                if settings.node_exporter_served else None),
            body_mib=settings.gateway_max_body_mib
            or gateway_plan.body_limit_mib(settings.max_model_len),
            proxy_timeout_s=settings.gateway_proxy_timeout_s,
            extra_directives=settings.gateway_extra_directives,
            tls=bool(tls_files),
            http_redirect_port=settings.gateway_http_redirect_port,
            server_tokens_http=gateway_plan.http_server_tokens(found)[0],
        ),
        keys_content=gateway_plan.render_keys_map(keys),
        extra_files=tls_files,
        secrets=keys,
    )

    # The key map, the engine's key for nginx, the TLS key and the staging directory as
    # the access table says (a mode changed by hand: put back, nginx not reloaded).
    access_ops.kept(name="Gateway: owner and mode of its key files and staging directory",
                    paths=access.wanted(settings, "gateway", ctx.endpoint))
    units.enabled_and_running(name="Gateway: nginx enabled and running", unit="nginx.service")


def _foreign_set_aside(ctx: HostContext, found: dict[str, Any] | None) -> bool:
    """Servers of other files on the gateway's ports and Debian's default site (``found``,
    facts.nginx.NginxServers) set aside; False, the host refused, where one cannot be set
    aside whole or another file shows nginx's version on every server."""
    settings = ctx.settings
    ports = [settings.gateway_port] + (
        [settings.gateway_http_redirect_port] if settings.gateway_http_redirect_port else [])
    foreign = gateway_plan.foreign_servers(found, ports)
    unsafe = [
        f"gateway: {gateway_plan.foreign_words(entry)} takes port(s) "
        f"{', '.join(map(str, ports))} from the gateway and cannot be set aside whole: "
        f"{entry['unsafe']}; remove or move that server block by hand, or change "
        "gateway_port"
        for entry in foreign if entry["unsafe"]
    ] + gateway_plan.http_server_tokens(found)[1]
    if unsafe:
        ctx.refuse("Gateway: host refused", unsafe)
        return False
    gateway_ops.foreign_disabled(
        name="Gateway: no other nginx server on the gateway's port (nginx -t before "
        "reload)",
        paths=gateway_plan.foreign_paths(
            foreign, nginx_installed=bool(host.get_fact(DebPackage, package="nginx"))),
    )
    return True


def _tls_files(settings: Settings, warn_clear: bool) -> dict[str, tuple[str, str]]:
    """The certificate and its key, to go live with the site in the same checked swap
    (settings checked both exist, and that the key is its owner's alone): read here,
    uploaded from memory; the key is never printed. None set: a warning where clients
    send keys (``warn_clear``) in clear text."""
    if settings.gateway_tls_cert and settings.gateway_tls_key:
        return {
            gateway_plan.TLS_CERT_PATH: (Path(settings.gateway_tls_cert).read_text(), "644"),
            gateway_plan.TLS_KEY_PATH: (Path(settings.gateway_tls_key).read_text(),
                                        access.mode(gateway_plan.TLS_KEY_PATH)),
        }
    if warn_clear:
        logger.warning(
            "%s%s",
            host.print_prefix,
            click.style(
                "warning: gateway_tls_cert/gateway_tls_key not set: clients send their API "
                f"keys to port {settings.gateway_port} in clear text",
                fg="yellow",
            ),
        )
    return {}
