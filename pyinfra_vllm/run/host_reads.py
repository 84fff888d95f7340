"""A host's state read once, in one remote command, at the start of the run.

pyinfra 3 reads a fact with one remote command each time an operation asks for it, one
after another. Over a link with 20 ms round trips, a converged host's run spent most of
its time waiting for 33 of them. Each stage declares what it reads, next to the code
that reads it (``stage(reads=...)``, kept in ``STAGE_READS``, each read made from the
settings and the engine's endpoint the run's context decided for the host), and
``state_reads`` is what every run's context reads; at the start of a run every one of
them is read in one remote command (facts.host_state.StateSections), the GPU reads side
by side as one group, each section parsed by its own fact, with pyinfra's rules for a
single fact: a parser's error fails that host with pyinfra's "could not process fact",
never the run. The host's ``get_fact`` then answers those reads from what was read until
the first command that is not a read runs on the host (an operation's command, an
upload): from then on every read goes to the host again, so an operation after a change
sees the change.

A read not listed is read on its own, as before: listing is about speed, never about
what is read. Each fact stays usable alone (``pyinfra HOST fact facts.x.Y``).
"""

from __future__ import annotations

import copy
import json
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from inspect import getcallargs
from typing import Any

from pyinfra import logger
from pyinfra.api import FactBase
from pyinfra.api.arguments import pop_global_arguments
from pyinfra.api.exceptions import FactProcessError
from pyinfra.api.facts import ShortFactBase
from pyinfra.api.host import Host
from pyinfra.api.util import get_kwargs_str, log_error_or_warning
from pyinfra.context import ContextObject, ctx_host
from pyinfra.facts.server import KernelVersion, LinuxDistribution

from facts.cpu_host import CpuHostState
from facts.gpu_host import GPU_GROUP, GpuHostState
from facts.host_state import (
    CommandLines,
    StateSections,
    arrange,
    fact_command,
    fact_value,
    split_sections,
)
from facts.python_env import VllmEnvironments
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.plans.engine_access import Endpoint


@dataclass(frozen=True)
class Read:
    """One fact with its arguments, as an operation asks ``host.get_fact`` for it."""

    fact: type[FactBase]
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Reads of one group run side by side in the one read (reads that are independent
    # and mostly wait, as nvidia-smi's do); None: on its own, in turn.
    group: str | None = None

    def key(self) -> tuple[type[FactBase], str]:
        return read_key(self.fact, (), self.kwargs)


def named_arguments(fact: type[FactBase], args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The read's arguments by name, as pyinfra's get_fact names them."""
    named = dict(kwargs)
    if args or named:
        named = getcallargs(fact().command, *args, **named)
        named.pop("self", None)
    return named


def read_key(fact: type[FactBase], args: tuple, kwargs: dict[str, Any]) -> tuple[type, str]:
    """The same key for the same read, however its arguments were passed."""
    return fact, json.dumps(named_arguments(fact, args, kwargs), sort_keys=True, default=str)


def _real_host(host: Any) -> Host:
    return ctx_host.get() if isinstance(host, ContextObject) else host


def _fail_unprocessed(host: Host, read: Read, error: FactProcessError) -> None:
    """What pyinfra's get_fact does when a fact cannot process its output
    (pyinfra.api.facts._get_fact): the error logged, and the host failed unless
    ``_ignore_errors`` holds (the operation's arguments, the deploy's, the host's data or
    the config, as pyinfra looks them up)."""
    arguments, _found = pop_global_arguments(
        host.state, host, dict(host.current_op_global_arguments or {}))
    ignore_errors = bool(arguments["_ignore_errors"])
    kwargs = get_kwargs_str(named_arguments(read.fact, (), read.kwargs))
    log_error_or_warning(host, ignore_errors, exception=error,
                         description=f"could not process fact: {read.fact.name} {kwargs}")
    if not ignore_errors:
        host.state.fail_hosts({host})


def _value(host: Host, read: Read, fact: FactBase, lines: list[str]) -> Any:
    """What pyinfra's get_fact returns for this output of a command that succeeded; for
    output the fact cannot process, its default, the host failed as pyinfra fails it."""
    try:
        return fact_value(fact, lines)
    except FactProcessError as error:
        _fail_unprocessed(host, read, error)
        return fact.default()


def read_all(host: Any, reads: Iterable[Read]) -> dict[tuple[type, str], Any]:
    """Every read's value, from one remote command. A read whose command failed, or whose
    section did not come back, is left out: it is then read on its own, and pyinfra
    handles its failure as for any fact (the host fails with "could not load fact").
    A read whose output its fact cannot process fails the host with "could not process
    fact", and its value is the fact's default, as pyinfra's get_fact gives it."""
    host = _real_host(host)
    unique: dict[tuple[type, str], Read] = {}
    for read in reads:
        if issubclass(read.fact, ShortFactBase):
            continue  # derived from another fact by pyinfra itself: nothing to run
        unique.setdefault(read.key(), read)
    if not unique:
        return {}
    # The instance that made a command line parses its output (see fact_command).
    listed = [(read, read.fact()) for read in unique.values()]
    commands, positions = arrange([(fact_command(fact, read.kwargs), read.group)
                                   for read, fact in listed])
    nonce = secrets.token_hex(8)
    output = host.get_fact(StateSections, nonce=nonce, commands=CommandLines(commands))
    sections = split_sections(output or [], nonce)
    values: dict[tuple[type, str], Any] = {}
    for (read, fact), position in zip(listed, positions, strict=True):
        status, lines = sections.get(position, (None, []))
        if status == 0:
            values[read.key()] = _value(host, read, fact, lines)
    return values


def answer_from(host: Any, values: dict[tuple[type, str], Any]) -> None:
    """Make ``host.get_fact`` answer the reads in ``values`` until the first command that
    is not a fact's runs on the host (an operation's command, an upload); from then on,
    and for every other read, the host is read as before. pyinfra runs an operation's
    reads both when it plans the run and (``-y``: only) when it executes it: the values
    hold for both as long as nothing was changed."""
    host = _real_host(host)
    read_live: Callable[..., Any] = Host.get_fact.__get__(host)
    run_live: Callable[..., Any] = Host.run_shell_command.__get__(host)
    put_live: Callable[..., Any] = Host.put_file.__get__(host)
    # "reading": inside a fact's own command; "changed": a command of any other kind ran.
    marks = {"reading": 0, "changed": False}

    def get_fact(fact: Any, *args: Any, **kwargs: Any) -> Any:
        if not marks["changed"] and not any(name.startswith("_") for name in kwargs):
            try:
                key = read_key(fact, args, kwargs)
            except TypeError:
                key = None
            if key in values:
                # A copy: an operation that edits what it read must not edit the next one's.
                return copy.deepcopy(values[key])
            logger.debug(f"{host.name}: {fact.__name__} {key and key[1]} was not read "
                         "with the host's state: reading it on its own")
        marks["reading"] += 1
        try:
            return read_live(fact, *args, **kwargs)
        finally:
            marks["reading"] -= 1

    def run_shell_command(*args: Any, **kwargs: Any) -> Any:
        if not marks["reading"]:
            marks["changed"] = True
        return run_live(*args, **kwargs)

    def put_file(*args: Any, **kwargs: Any) -> Any:
        marks["changed"] = True
        return put_live(*args, **kwargs)

    host.get_fact = get_fact
    host.run_shell_command = run_shell_command
    host.put_file = put_file


# What each stage reads on a converged host, from its settings: the run's one read.
# Reads that only a host needing work makes (a build's interpreter, apt's package lists)
# are not listed: that host pays for them with the work.

def state_reads(settings: Settings) -> list[Read]:
    """What the run's context reads for every stage, skipped or not: the OS, the vLLM
    environments (HostContext.environments) and the GPU facts side by side
    (pyinfra_vllm.run.context.collect)."""
    reads = [Read(LinuxDistribution), Read(KernelVersion),
             Read(VllmEnvironments, {"root": settings.python_env_root}),
             *(Read(fact, group=GPU_GROUP) for fact in GpuHostState.facts.values())]
    if settings.vllm_device == "cpu":
        reads.append(Read(CpuHostState))
    return reads


# What a stage reads of a converged host, from its settings and the engine's endpoint the
# run's context decided for the host (HostContext.endpoint, computed once per host and
# handed to every stage's reads, never computed again from the settings).
StageReads = Callable[[Settings, Endpoint], list[Read]]
# Each stage's, declared by the stage next to the code that reads it
# (pyinfra_vllm/run/stage.py ``stage(reads=...)``).
STAGE_READS: dict[str, StageReads] = {}


def declare(stage: str, reads: StageReads) -> None:
    """``reads``: what ``stage`` reads of a converged host, for the run's one read."""
    if STAGE_READS.setdefault(stage, reads) is not reads:
        raise ValueError(f"the reads of stage {stage} are declared twice")


def stage_reads(settings: Settings, stages: Iterable[str], place: Endpoint) -> list[Read]:
    """The context's reads (``state_reads``) and those of ``stages``, each once (a stage
    skipped by settings reads nothing). ``place``: the engine's endpoint the run's context
    decided for the host (HostContext.endpoint), handed to every stage's reads."""
    reads: dict[tuple[type, str], Read] = {read.key(): read for read in state_reads(settings)}
    for stage in stages:
        if stage in STAGE_READS and stage not in settings.skip_stages:
            for read in STAGE_READS[stage](settings, place):
                reads.setdefault(read.key(), read)
    return list(reads.values())
