"""Many facts' commands in one remote command, each output behind a marker line.

pyinfra 3 runs one remote command per fact read, one after another: a converged host's
run used to spend about thirty round trips on reads alone. ``StateSections`` runs the
commands it is given in one shell, each in a subshell (so an ``exit`` in one ends only
that one) with its exit status after it; a group of them (reads that are independent
and mostly wait, as nvidia-smi's do) runs side by side. ``split_sections`` takes the
output apart again, and ``fact_value`` parses a section with its own fact, with
pyinfra's rules for a single fact (no output, or a missing binary, is the fact's
default; a parser's error is pyinfra's FactProcessError). pyinfra_vllm.run.host_reads
reads a whole run's facts this way, and facts.gpu_host.GpuHostState its GPU facts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pyinfra.api import StringCommand
from pyinfra.api import facts as pyinfra_facts
from pyinfra.api.exceptions import FactProcessError
from typing_extensions import override

from facts.base import FactBase, process_error

# Lines a section's own output cannot start with by chance: the nonce is the caller's.
SECTION = "##PYINFRA-VLLM-SECTION"
STATUS = "##PYINFRA-VLLM-STATUS"
# pyinfra's line for "this fact's binary is not installed" (pyinfra.api.facts, the guard
# it wraps a fact with ``requires_command`` in): the fact's default, as pyinfra gives it
# while a run is planned.
MISSING_COMMAND = "##PYINFRA_NOCMD##"


def side_by_side(commands: list[str], show: Callable[[int, str, str], str],
                 in_order: str) -> str:
    """One shell command line that starts ``commands`` at once, each in a subshell with
    its output and exit status in files of a private temporary directory, waits for all
    of them, then prints, in their order, ``show(index, output, status)`` (shell text
    given the two files' quoted paths). Where no temporary directory can be made it runs
    ``in_order`` instead (the same commands one after another, the same output).

    For reads that are independent and mostly wait: facts.gpu_host's six nvidia-smi
    calls took 248-303 ms one after another on a real H200 host, 133-153 ms side by side
    (bench/fleet.md)."""
    started = " ".join(
        f'{{ ( {command}\n) >"$d/{index}" 2>/dev/null; echo $? >"$d/{index}.status"; }} &'
        for index, command in enumerate(commands)
    )
    shown = "; ".join(show(index, f'"$d/{index}"', f'"$d/{index}.status"')
                      for index in range(len(commands)))
    return (f"if d=$(mktemp -d 2>/dev/null); then {started} wait; {shown}; rm -rf \"$d\"; "
            f"else {in_order}; fi")


def fact_command(fact: pyinfra_facts.FactBase, kwargs: dict[str, Any]) -> str:
    """The fact's command line, as pyinfra's get_fact runs it for these arguments, with
    its ``requires_command`` guard. Some of pyinfra's facts keep their arguments on the
    instance for ``process``: the same instance is to parse the output."""
    command = fact.command(**kwargs) if callable(fact.command) else fact.command
    line = command.get_raw_value() if isinstance(command, StringCommand) else str(command)
    requires: Any = fact.requires_command
    if callable(requires):
        requires = requires(**kwargs)
    if requires:
        needs = requires.get_raw_value() if isinstance(requires, StringCommand) else requires
        line = (f"if command -v {needs} >/dev/null 2>&1; then ( {line}\n); "
                f"else echo '{MISSING_COMMAND}'; fi")
    return line


def fact_value(fact: pyinfra_facts.FactBase, lines: list[str]) -> Any:
    """What pyinfra's get_fact makes of this output of the fact's command, when the
    command succeeded: no output, or pyinfra's missing-binary line, is the fact's
    default. Whatever its parser raises is raised as pyinfra's FactProcessError, the one
    error pyinfra's get_fact turns into "could not process fact" for that host alone."""
    if not lines or lines == [MISSING_COMMAND]:
        return fact.default()
    try:
        return fact.process(lines)
    except FactProcessError:
        raise
    except Exception as error:
        raise process_error(fact.name, error) from error


def arrange(lines: Sequence[tuple[str, str | None]]) -> tuple[list[str | list[str]], list[int]]:
    """StateSections' ``commands`` for command lines each with its group's name (None: on
    its own), and the position of each line's section. A group runs where its first line
    was; a line given twice runs once (two facts that parse one command's output, as
    DriverPackages and HeldPackages do, share its section)."""
    commands: list[str | list[str]] = []
    groups: dict[str, list[str]] = {}
    seen: set[str] = set()
    for line, group in lines:
        if line in seen:
            continue
        seen.add(line)
        if group is None:
            commands.append(line)
        elif group in groups:
            groups[group].append(line)
        else:
            groups[group] = [line]
            commands.append(groups[group])
    position: dict[str, int] = {}
    for entry in commands:
        for line in [entry] if isinstance(entry, str) else entry:
            position[line] = len(position)
    return commands, [position[line] for line, _group in lines]


class CommandLines(list):
    """The command lines given to StateSections, named by their count where pyinfra logs
    a fact's arguments (``-v``: "Loaded fact ..."), not printed whole."""

    def __str__(self) -> str:
        count = sum(1 if isinstance(entry, str) else len(entry) for entry in self)
        return f"<{count} command lines>"


def _in_order(lines: list[str], first: int, nonce: str) -> str:
    return "; ".join(
        f"echo '{SECTION}-{nonce} {first + offset}'; ( {line}\n) 2>/dev/null; "
        f"echo \"{STATUS}-{nonce} $?\""
        for offset, line in enumerate(lines)
    )


def _group(lines: list[str], first: int, nonce: str) -> str:
    in_order = _in_order(lines, first, nonce)
    if len(lines) < 2:
        return in_order

    def show(offset: int, output: str, status: str) -> str:
        return (f"echo '{SECTION}-{nonce} {first + offset}'; cat {output}; "
                f"echo \"{STATUS}-{nonce} $(cat {status})\"")

    return side_by_side(lines, show, in_order)


def sections_command(commands: Sequence[str | list[str]], nonce: str) -> str:
    """StateSections' command (see there); facts.gpu_host builds its own on it."""
    parts: list[str] = []
    first = 0
    for entry in commands:
        lines = [entry] if isinstance(entry, str) else list(entry)
        if lines:
            parts.append(_group(lines, first, nonce))
        first += len(lines)
    # One after another, but for the groups: most sections take a few milliseconds, and a
    # host's whole read side by side measured no faster on one sandbox host than its GPU
    # group alone side by side, and slower on eight sharing two cores.
    # The last command is true: the whole command exits 0 whatever the sections did.
    return "; ".join([*parts, "true"])


class StateSections(FactBase[list[str]]):
    """
    Returns the output of the commands given, each behind a marker line with its
    position and followed by one with its exit status; ``split_sections`` takes them
    apart (with the same nonce):

    .. code:: python

        ["##PYINFRA-VLLM-SECTION-3f9c 0", "5.15.0-119-generic", "##PYINFRA-VLLM-STATUS-3f9c 0"]

    + commands: shell command lines, run in order in one shell as the fact's user; an
      entry that is a list of lines is a group, whose lines run side by side
      (``side_by_side``), each its own section, numbered on in their order
    + nonce: a random word in the marker lines, so that no output is taken for one
    """

    @override
    def command(self, commands: list[str | list[str]], nonce: str) -> str:
        return sections_command(commands, nonce)

    @override
    def process(self, output: list[str]) -> list[str]:
        return output


def split_sections(output: list[str], nonce: str) -> dict[int, tuple[int, list[str]]]:
    """Each section's exit status and output lines, by position, from StateSections'
    output with ``nonce``. A section cut off before its status line, or whose status
    did not come back as a number, is left out."""
    section, status = f"{SECTION}-{nonce} ", f"{STATUS}-{nonce} "
    sections: dict[int, tuple[int, list[str]]] = {}
    index: int | None = None
    lines: list[str] = []
    for line in output:
        if line.startswith(section):
            position = line[len(section):].strip()
            index, lines = (int(position) if position.isdecimal() else None), []
        elif line.startswith(status) and index is not None:
            code = line[len(status):].strip()
            if code.isdecimal():
                sections[index] = (int(code), lines)
            index = None
        elif index is not None:
            lines.append(line)
    return sections
