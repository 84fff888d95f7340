"""Every setting of the deployment: its default, its type, what is allowed, and why.

This module is the one place settings are validated: Settings, the one model, and
``validate``. pyinfra merges host data from ``--data``, the inventory,
``group_data/*.py`` and nothing else; ``load_settings`` validates that merge before any
operation is added, so a bad value stops the whole run with exit code 1 and a message
naming the key, the value and what is allowed. The fields, each with its comment, are
declared in Settings' sections: pyinfra_vllm/core/settings_engine.py, settings_host.py,
settings_gateway.py and settings_upkeep.py. The rules themselves, one function each, are
in pyinfra_vllm/core/settings_checks.py and its siblings, one module per concern;
docs/settings.md's table is rendered by pyinfra_vllm/core/settings_docs.py.

The defaults are the seed post's recipe where it is right, and the truth where it is
wrong (docs/post-review.md says where and why).
"""

from __future__ import annotations

import difflib
import ipaddress
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError, field_validator, model_validator
from pyinfra.api.exceptions import DeployError

from pyinfra_vllm.core import (
    model_files,
    settings_checks,
    settings_checks_engine,
    settings_checks_gateway,
    settings_checks_keys,
    settings_checks_networks,
    settings_checks_paths,
    settings_checks_router,
    settings_docs,
)
from pyinfra_vllm.core.secret_files import mask_credentials
from pyinfra_vllm.core.settings_checks import RULE_ERROR
from pyinfra_vllm.core.settings_engine import EngineSettings
from pyinfra_vllm.core.settings_gateway import GatewaySettings
from pyinfra_vllm.core.settings_host import HostSettings
from pyinfra_vllm.core.settings_router import RouterSettings
from pyinfra_vllm.core.settings_upkeep import UpkeepSettings
from pyinfra_vllm.core.stacks import CPU_STACKS, STACKS, StackRow, releases, stack_for

# Names of host data that belong to pyinfra's connectors or to the inventory, not to
# us: never reported as unknown settings.
FOREIGN_DATA_PREFIXES = (
    "_",
    "ssh_",
    "local_",
    "docker_",
    "dockerssh_",
    "podman_",
    "chroot_",
    "winrm_",
    "fake_",
    "terraform_",
    "vagrant_",
    "sandbox_",
)

# The stages of the whole run, in the runbook's order: the one list of them. skip_stages
# is checked against it; each is the @stage function of that name
# (pyinfra_vllm/stages/<name>.py: @stage refuses a name not here), and
# pyinfra_vllm/stages/full.py's RUNBOOK runs them in this order (refused otherwise, as it is
# imported: pyinfra_vllm/run/stage.py runbook_order).
STAGES = (
    "preflight",
    "driver",
    "mig",
    "persistence",
    "sysctl",
    "model_volume",
    "python_env",
    "model",
    "vllm_service",
    "gateway",
    "metrics",
    "sentinel",
)

# Settings whose values are never printed, not even in an error.
SECRET_KEYS = ("hf_token", "api_keys")


class Settings(RouterSettings, UpkeepSettings, GatewaySettings, HostSettings, EngineSettings):
    """The validated settings of one host."""

    # Its fields are its sections' (pyinfra_vllm/core/settings_engine.py, _host,
    # _gateway, _upkeep, _router). pydantic takes a model's fields from its last base
    # first: the engine's come first, then the host's, the gateway's, upkeep's and the
    # router's, in the order docs/settings.md lists them and validation reads them (a rule
    # may read a setting declared before its own).
    if TYPE_CHECKING:
        # What a validated Settings holds: enforce_eager's rule resolves None by
        # vllm_device (settings_checks_engine.eager_by_device), so every reader gets a bool.
        enforce_eager: bool

    # --- rules of one setting that read the stages ------------------------------------
    @field_validator("skip_stages")
    @classmethod
    def _known_stages(cls, value: list[str]) -> list[str]:
        return settings_checks.known_stages(value, STAGES)

    # --- rules across settings, in this order (the first that fails is reported) ----
    @model_validator(mode="after")
    def _gateway_tls_files(self) -> Settings:
        settings_checks_gateway.gateway_tls_files(self.gateway_tls_cert, self.gateway_tls_key,
                                                  self.gateway_http_redirect_port,
                                                  self.gateway_port)
        return self

    @model_validator(mode="after")
    def _router_files(self) -> Settings:
        problems = settings_checks_router.router_files(
            self.router_tls_cert, self.router_tls_key, self.router_gateway_ca
        ) + settings_checks_router.router_limits(
            self.router_prefix_bytes, self.router_buffer_kib, self.router_port,
            self.router_metrics_port)
        if problems:
            raise settings_checks.rule_errors(problems)
        return self

    @model_validator(mode="after")
    def _scheduler_limits(self) -> Settings:
        settings_checks_engine.scheduler_limits(self.max_num_seqs, self.max_num_batched_tokens,
                                                self.max_model_len, self.block_size,
                                                self.enable_chunked_prefill)
        return self

    @model_validator(mode="after")
    def _bench_fits(self) -> Settings:
        settings_checks_engine.bench_fits(self.bench_shape, self.max_model_len)
        return self

    @model_validator(mode="after")
    def _sentinel_timing(self) -> Settings:
        problems = settings_checks.sentinel_timing(self.sentinel_timeout_s,
                                                   self.sentinel_interval_s)
        if problems:
            raise settings_checks.rule_errors(problems)
        return self

    @model_validator(mode="after")
    def _device_has_stack(self) -> Settings:
        settings_checks_engine.device_has_stack(self.vllm_version, self.vllm_device,
                                                self.enforce_eager)
        return self

    @model_validator(mode="after")
    def _bench_goodput_on_stack(self) -> Settings:
        problems = settings_checks_engine.bench_goodput_on_stack(self.bench_slos, self.stack,
                                                                 self.vllm_version)
        if problems:
            raise settings_checks.rule_errors(problems)
        return self

    @model_validator(mode="after")
    def _deep_check_has_a_model(self) -> Settings:
        settings_checks.deep_check_has_a_model(self.deep_model_check, self.model_repair,
                                               self.skip_stages)
        return self

    @model_validator(mode="after")
    def _deep_check_has_an_environment(self) -> Settings:
        settings_checks.deep_check_has_an_environment(self.deep_env_check,
                                                      self.python_env_repair, self.skip_stages)
        return self

    @model_validator(mode="after")
    def _driver_branch_serves_stack(self) -> Settings:
        # A host without the driver stage, or without a GPU, installs no driver.
        if "driver" in self.skip_stages or self.vllm_device == "cpu":
            return self
        settings_checks_engine.driver_branch_serves_stack(self.nvidia_driver_branch,
                                                          self.stack, self.vllm_version)
        return self

    @model_validator(mode="after")
    def _dirs_apart(self) -> Settings:
        # The directories the stages take as their own, none inside another.
        problems = settings_checks_paths.dirs_apart(
            {name: getattr(self, name) for name in settings_checks_paths.OWN_DIR_SETTINGS}
        )
        if problems:
            raise settings_checks.rule_errors(problems)
        return self

    @model_validator(mode="after")
    def _exposure(self) -> Settings:
        # Rules across settings: who may reach the gateway and the engine, and where a
        # token may travel. api_keys holds api_keys_file's keys by now (api_keys' own
        # rule read them). Each problem is one sentence naming its keys; no key or token
        # is ever in it.
        problems = settings_checks_networks.exposure_problems(
            has_keys=bool(self.api_keys),
            gateway_open=self.gateway_open,
            vllm_listen_beyond_loopback=self.vllm_listen_beyond_loopback,
            engine_allow=self.vllm_engine_allow,
            token_from=settings_checks_keys.token_source(self.hf_token, self.hf_token_file),
            model_base_url=self.model_base_url,
            metrics_networks=self.metrics_networks,
        )
        if problems:
            raise settings_checks.rule_errors(problems)
        return self

    @property
    def vllm_host_url_part(self) -> str:
        """vllm_host as a URL or nginx's ``server`` line takes it: ``[::1]`` for IPv6,
        ``127.0.0.1`` as is."""
        if ipaddress.ip_address(self.vllm_host).version == 6:
            return f"[{self.vllm_host}]"
        return self.vllm_host

    @property
    def stack(self) -> StackRow:
        """The row of pyinfra_vllm/core/stacks.py for (vllm_version, vllm_device)."""
        row = stack_for(self.vllm_version, self.vllm_device)
        if row is None:  # validation refuses this pair: only an unvalidated model gets here
            raise SettingsError(f"no {self.vllm_device} stack for vLLM {self.vllm_version}")
        return row

    @property
    def deep_model_check(self) -> bool:
        """Does the model stage re-hash every file (model_verify deep, or model_repair)?"""
        return self.model_verify == "deep" or self.model_repair

    @property
    def deep_env_check(self) -> bool:
        """Does the run re-hash the environment's files against their RECORD
        (python_env_verify deep, or python_env_repair)?"""
        return self.python_env_verify == "deep" or self.python_env_repair

    @property
    def bench_shape(self) -> dict[str, int]:
        """The benchmark's shape: its four settings times bench_scale, each at least 1."""
        def scaled(value: int) -> int:
            return max(1, round(value * self.bench_scale))

        return {"input_len": scaled(self.bench_input_len),
                "output_len": scaled(self.bench_output_len),
                "concurrency": scaled(self.bench_concurrency),
                "requests": scaled(self.bench_requests)}

    @property
    def bench_slos(self) -> dict[str, float]:
        """The benchmark's latency targets that are set, in ms, by vLLM's goodput keys:
        ``{"ttft": 2000.0, "tpot": 50.0}``; empty: goodput not measured."""
        targets = {"ttft": self.bench_slo_ttft_ms, "tpot": self.bench_slo_tpot_ms}
        return {name: value for name, value in targets.items() if value is not None}

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_id

    @property
    def model_path(self) -> str:
        """The model's directory on the host: ``{model_dir}/{model_id}``."""
        return model_files.model_path(self.model_dir, self.model_id)

    @property
    def metrics_networks(self) -> list[str]:
        """Who may read the gateway's /metrics and /node-metrics: metrics_allow, then
        prometheus_servers, each network once."""
        return list(dict.fromkeys([*self.metrics_allow, *self.prometheus_servers]))

    @property
    def node_exporter_served(self) -> bool:
        """Does this host run the suite's node_exporter (so the gateway serves it)?"""
        return self.node_exporter_install and "metrics" not in self.skip_stages


class SettingsError(DeployError):
    """Settings failed validation; the message lists every problem."""


def allowed(name: str) -> str | None:
    """What a setting allows, in words: its choices or its bounds."""
    if name == "vllm_version":
        return f"allowed: {releases(STACKS)} (vllm_device cuda); {releases(CPU_STACKS)} (cpu)"
    if name == "skip_stages":
        return "allowed: any of " + ", ".join(STAGES)
    return settings_docs.field_allowed(Settings.model_fields[name])


def _error_lines(error: ValidationError, data: dict[str, Any]) -> list[str]:
    lines = []
    for item in error.errors():
        if item["type"] == RULE_ERROR:
            lines.append(f"  {item['msg']}")
            continue
        key = ".".join(str(part) for part in item["loc"]) or "(settings)"
        message = item["msg"].removeprefix("Value error, ")
        top = item["loc"][0] if item["loc"] else None
        if top in Settings.model_fields and "allowed" not in message:
            hint = allowed(str(top))
            if hint is not None:
                message = f"{message} ({hint})"
        if top in SECRET_KEYS:
            lines.append(f"  {key} = <secret>: {message}")
        elif top in data:
            # A URL's credentials (user:password@) are masked wherever they are.
            lines.append(f"  {key} = {mask_credentials(repr(data[top]))}: {message}")
        else:
            lines.append(f"  {key}: {message}")
    return lines


def unknown_key_lines(data: dict[str, Any]) -> list[str]:
    """Keys that look like misspelt settings (a close match to a real one)."""
    fields = list(Settings.model_fields)
    lines = []
    for key in data:
        if key in Settings.model_fields or key.startswith(FOREIGN_DATA_PREFIXES):
            continue
        close = difflib.get_close_matches(key, fields, n=1, cutoff=0.8)
        if close:
            lines.append(f"  {key}: unknown setting; did you mean {close[0]}?")
    return lines


def validate(data: dict[str, Any], where: str = "settings") -> Settings:
    """Validate merged host data; raise SettingsError listing every problem."""
    lines = unknown_key_lines(data)
    settings = None
    try:
        settings = Settings.model_validate(data)
    except ValidationError as error:
        lines.extend(_error_lines(error, data))
    if lines or settings is None:
        raise SettingsError(
            "\n".join(
                [
                    f"invalid settings for {where}:",
                    *lines,
                    "Fix the value in the inventory's host data, group_data/*.py or "
                    "--data KEY=VALUE; docs/settings.md lists every key with what it "
                    "allows.",
                ]
            )
        )
    return settings


def load_settings(host: Any) -> Settings:
    """The validated settings of a pyinfra host (its merged data)."""
    return validate(host.data.dict(), where=f"host {host.name}")


def reference_markdown() -> str:
    """docs/settings.md's settings table: every key, its default, what it allows, its
    meaning."""
    return settings_docs.reference_table(Settings.model_fields, allowed, SECRET_KEYS)


if __name__ == "__main__":
    print(reference_markdown())
