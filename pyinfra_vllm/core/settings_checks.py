"""The rules of the settings: what each value may be, and what settings must agree.

pyinfra_vllm/core/settings.py declares the settings; its validators call these plain
functions. A rule of one setting takes the value (and, where it reads another setting
or its own name, pydantic's ``ValidationInfo``), returns the value as kept, and raises
ValueError with a message naming what is allowed; pydantic reports it under the key. A
rule across settings takes the values it compares.

The rules are grouped by the settings they guard, a module each beside this one:
settings_checks_engine.py (the stack, the model, the engine's scheduler),
settings_checks_paths.py (the directories the deploy takes as its own, the model
volume), settings_checks_networks.py (addresses, allow lists, who may reach the gateway
and the engine), settings_checks_gateway.py (the gateway's added directives, its TLS
files), settings_checks_keys.py (API keys, the Hugging Face token) and
settings_checks_sources.py (where packages and the model come from). This module: the
stages (skip_stages, and what a skipped stage leaves unchecked), the kernel parameters,
the sentinel's timing, and the error of a rule across settings.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

# sysctl keys as sysctl.d(5) writes them: net.ipv4.tcp_rmem, kernel.pid_max,
# net.ipv4.conf.all.rp_filter; "*" is systemd-sysctl's glob (net.ipv4.conf.*.rp_filter).
SYSCTL_KEY = re.compile(r"[a-z0-9_]+(\.[a-z0-9_*-]+)+")
# Integers separated by single spaces or tabs: 1, -1, "4096 87380 6291456".
# Words of letters, digits and _.:/- (bbr, fq_codel, 4096) separated by single spaces or
# tabs: what sysctl.d values are, and nothing a sysctl.d line or a shell reads otherwise.
SYSCTL_VALUE = re.compile(r"[A-Za-z0-9_.:/-]+([ \t][A-Za-z0-9_.:/-]+)*")

# The error type of a rule across settings: its message is a whole sentence that names
# its keys (and values, where not secret), printed as it is.
RULE_ERROR = "settings_rule"


def known_stages(value: list[str], stages: Collection[str]) -> list[str]:
    unknown = [stage for stage in value if stage not in stages]
    if unknown:
        raise ValueError(f"unknown stage {unknown}; allowed: {', '.join(stages)}")
    return value


def sysctl_keys(value: dict[str, int | str]) -> dict[str, int | str]:
    for key, setting in value.items():
        if not SYSCTL_KEY.fullmatch(key):
            raise ValueError(
                f"{key!r} is not a sysctl key like vm.swappiness or "
                "net.ipv4.conf.all.rp_filter: lowercase dotted names of letters, digits "
                "and _- ('*' as a glob), no '=', '/' or space"
            )
        if isinstance(setting, str) and not SYSCTL_VALUE.fullmatch(setting):
            raise ValueError(
                f"the value of {key} is not words of letters, digits and _.:/- separated "
                'by single spaces (e.g. 1, bbr or "4096 87380 6291456"); no ";", quote '
                "or newline"
            )
    return value


def deep_check_has_a_model(deep_model_check: bool, model_repair: bool,
                           skip_stages: list[str]) -> None:
    # The deep check runs in the model stage: with the stage skipped it would silently
    # check nothing, and an audit asked for it would report a host as sound.
    if deep_model_check and "model" in skip_stages:
        asked = "model_repair true" if model_repair else "model_verify deep"
        raise ValueError(
            f"{asked} re-hashes the model in the model stage, which skip_stages skips: "
            "remove model from skip_stages, or leave model_verify stat and model_repair "
            "false"
        )


def deep_check_has_an_environment(deep_env_check: bool, python_env_repair: bool,
                                  skip_stages: list[str]) -> None:
    # The environment's deep check refuses or repairs in the python_env stage: with the
    # stage skipped, a host whose files changed would pass an audit asked for it.
    if deep_env_check and "python_env" in skip_stages:
        asked = "python_env_repair true" if python_env_repair else "python_env_verify deep"
        raise ValueError(
            f"{asked} re-hashes the environment in the python_env stage, which skip_stages "
            "skips: remove python_env from skip_stages, or leave python_env_verify stat "
            "and python_env_repair false"
        )


def sentinel_timing(timeout_s: int, interval_s: int) -> list[tuple[str, str]]:
    # A completion still waited for when the next is due would overlap it: the sentinel
    # probes once per interval, and a timeout as long would count one slow answer late.
    if timeout_s >= interval_s:
        return [("sentinel_timeout_s",
                 f"sentinel_timeout_s ({timeout_s}) must be less than sentinel_interval_s "
                 f"({interval_s}): the sentinel sends one completion per interval; lower "
                 "sentinel_timeout_s or raise sentinel_interval_s")]
    return []


def rule_errors(problems: list[tuple[str, str]]) -> ValidationError:
    """Problems of rules across settings as one ValidationError, each under its key with
    its sentence as the message (RULE_ERROR)."""
    return ValidationError.from_exception_data(
        "Settings",
        [
            InitErrorDetails(
                type=PydanticCustomError(RULE_ERROR, "{sentence}", {"sentence": text}),
                loc=(key,),
                input=key,
            )
            for key, text in problems
        ],
    )
