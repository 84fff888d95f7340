"""Compatibility gate: can the chosen vLLM stack load this model?

Pure functions over the model's ``config.json`` (a dict), a row of
``pyinfra_vllm.core.stacks.STACKS``, the model registry of the vLLM installed on the host (when
the host has one; ``None`` before the runtime stage ran) and the driver version. They
return check dicts ``{"name", "ok", "severity", "detail", "fix"}`` like
pyinfra_vllm/plans/checks.py, so preflight can refuse before anything on the host changes.

Why a gate: the seed post runs Qwen3.6-27B (``Qwen3_5ForConditionalGeneration``) on
vLLM 0.6.3, whose registry has no such class; vLLM then fails at start-up after the
whole environment and 55 GB of weights were installed.
"""

from __future__ import annotations

from typing import Any

from facts.versions import version_tuple
from pyinfra_vllm.core.stacks import FIRST_SUPPORTED, REMOVED_FROM, STACKS, StackRow, releases
from pyinfra_vllm.plans.checks import check


def architectures(config: dict[str, Any]) -> list[str]:
    """The ``architectures`` list of a config.json (empty when absent)."""
    value = config.get("architectures") or []
    return [str(a) for a in value] if isinstance(value, list) else [str(value)]


def first_supporting(arch: str) -> str | None:
    """The first vLLM release known to load ``arch``: FIRST_SUPPORTED, else the oldest
    STACKS row whose built-in table lists it."""
    if arch in FIRST_SUPPORTED:
        return FIRST_SUPPORTED[arch]
    rows = [v for v, row in STACKS.items() if arch in row.architectures]
    return min(rows, key=version_tuple) if rows else None


def removed(arch: str, version: str) -> bool:
    """Has ``arch`` left the registry by vLLM ``version`` (REMOVED_FROM)?"""
    return arch in REMOVED_FROM and version_tuple(version) >= version_tuple(REMOVED_FROM[arch])


def _model_words(config: dict[str, Any], model_id: str | None) -> str:
    name = model_id or config.get("_name_or_path") or config.get("model_type") or "the model"
    return str(name)


def check_architecture(
    config: dict[str, Any],
    stack: StackRow,
    registry: list[str] | None,
    model_id: str | None = None,
) -> dict[str, Any]:
    """Is one of the config's architectures loadable by the stack's vLLM?

    The installed registry (``ModelRegistry.get_supported_archs()`` read on the host)
    wins when known; otherwise the stack row's built-in table and FIRST_SUPPORTED decide.
    An architecture neither knows is not judged (ok None, a warning): the built-in
    table lists the Qwen family only.
    """
    version = stack.vllm
    archs = architectures(config)
    model = _model_words(config, model_id)
    if not archs:
        return check(
            "model_architecture",
            False,
            f"{model}: config.json has no 'architectures' list",
            "check that model_id names a transformers model repository",
        )
    loadable = _loadable(archs, stack, registry)
    source = "its installed registry" if registry is not None else "the built-in table"
    if loadable:
        return check(
            "model_architecture",
            True,
            f"vLLM {version} loads {loadable[0]} ({model}) per {source}",
        )
    return _not_loadable(archs[0], version, model, registry)


def _loadable(archs: list[str], stack: StackRow, registry: list[str] | None) -> list[str]:
    """The architectures of ``archs`` the stack's vLLM loads: those of its installed
    registry when known, else of the stack row's table or FIRST_SUPPORTED."""
    version = stack.vllm
    known = set(registry) if registry is not None else set(stack.architectures)
    loadable = [a for a in archs if a in known]
    if registry is None:
        # A release at or after the first that registered it loads it too.
        loadable += [
            a
            for a in archs
            if a not in loadable
            and a in FIRST_SUPPORTED
            and version_tuple(version) >= version_tuple(FIRST_SUPPORTED[a])
            and not removed(a, version)
        ]
    return loadable


def _not_loadable(arch: str, version: str, model: str,
                  registry: list[str] | None) -> dict[str, Any]:
    """The check for a model whose architecture (``arch``, its first) vLLM ``version``
    does not load: why, and what to do; not judged where neither the registry nor the
    built-in table knows it."""
    if removed(arch, version):
        return check(
            "model_architecture",
            False,
            f"vLLM {version} cannot load {arch} ({model}): its registry no longer lists "
            f"it (none from vLLM {REMOVED_FROM[arch]} on)",
            f"set vllm_version to a release before that (rows: {releases(STACKS)})",
        )
    first = first_supporting(arch)
    if first is not None and version_tuple(first) > version_tuple(version):
        return check(
            "model_architecture",
            False,
            f"vLLM {version} cannot load {arch} ({model}); it is supported from "
            f"vLLM {first}",
            f"set vllm_version to {first} or later (rows: {releases(STACKS)})",
        )
    if registry is not None:
        return check(
            "model_architecture",
            False,
            f"vLLM {version} cannot load {arch} ({model}): not in its installed registry",
            "choose a model vLLM supports or a vLLM release that registers it",
        )
    return check(
        "model_architecture",
        None,
        f"{arch} ({model}) is not in the built-in table of vLLM {version}; the installed "
        "registry decides once the runtime stage has run",
        "",
        severity="warning",
    )
