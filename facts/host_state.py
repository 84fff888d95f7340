"""Many facts' commands in one remote command, each output behind a marker line.

pyinfra 3 runs one remote command per fact read, one after another: a converged host's
run used to spend about thirty round trips on reads alone. ``StateSections`` runs the
commands it is given in one shell, each in a subshell (so an ``exit`` in one ends only
that one) with its exit status after it; pyinfra_vllm.run.host_reads hands each section to
its own fact's parser, with pyinfra's rules for a single fact (a failed command, or no
output, is the fact's default).
"""

from __future__ import annotations

from collections.abc import Callable

from pyinfra.api import FactBase
from typing_extensions import override

# Lines a section's own output cannot start with by chance: the nonce is the caller's.
SECTION = "##PYINFRA-VLLM-SECTION"
STATUS = "##PYINFRA-VLLM-STATUS"


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


class CommandLines(list):
    """The command lines given to StateSections, named by their count where pyinfra logs
    a fact's arguments (``-v``: "Loaded fact ..."), not printed whole."""

    def __str__(self) -> str:
        return f"<{len(self)} command lines>"


class StateSections(FactBase[list[str]]):
    """
    Returns the output of the commands given, each behind a marker line with its
    position and followed by one with its exit status; ``split_sections`` takes them
    apart (with the same nonce):

    .. code:: python

        ["##PYINFRA-VLLM-SECTION-3f9c 0", "5.15.0-119-generic", "##PYINFRA-VLLM-STATUS-3f9c 0"]

    + commands: shell command lines, run in order in one shell as the fact's user
    + nonce: a random word in the marker lines, so that no output is taken for one
    """

    @override
    def command(self, commands: list[str], nonce: str) -> str:
        parts = [
            f"echo '{SECTION}-{nonce} {index}'; ( {command}\n) 2>/dev/null; "
            f"echo \"{STATUS}-{nonce} $?\""
            for index, command in enumerate(commands)
        ]
        # One after another: most sections take a few milliseconds, and a host's whole
        # read side by side measured no faster on one sandbox host than its GPU read
        # alone side by side (facts.gpu_host), and slower on eight sharing two cores.
        # The last command is true: the whole command exits 0 whatever the sections did.
        return "; ".join([*parts, "true"])

    @override
    def process(self, output: list[str]) -> list[str]:
        return output


def split_sections(output: list[str], nonce: str) -> dict[int, tuple[int, list[str]]]:
    """Each section's exit status and output lines, by position, from StateSections'
    output with ``nonce``. A section cut off before its status line is left out: its
    fact is then read on its own."""
    section, status = f"{SECTION}-{nonce} ", f"{STATUS}-{nonce} "
    sections: dict[int, tuple[int, list[str]]] = {}
    index: int | None = None
    lines: list[str] = []
    for line in output:
        if line.startswith(section):
            index, lines = int(line[len(section):]), []
        elif line.startswith(status) and index is not None:
            sections[index] = (int(line[len(status):]), lines)
            index = None
        elif index is not None:
            lines.append(line)
    return sections
