"""Many facts' commands in one remote command, each output behind a marker line.

pyinfra 3 runs one remote command per fact read, one after another: a converged host's
run used to spend about thirty round trips on reads alone. ``StateSections`` runs the
commands it is given in one shell, each in a subshell (so an ``exit`` in one ends only
that one) with its exit status after it; pyinfra_vllm.host_reads hands each section to
its own fact's parser, with pyinfra's rules for a single fact (a failed command, or no
output, is the fact's default).
"""

from __future__ import annotations

from pyinfra.api import FactBase
from typing_extensions import override

# Lines a section's own output cannot start with by chance: the nonce is the caller's.
SECTION = "##PYINFRA-VLLM-SECTION"
STATUS = "##PYINFRA-VLLM-STATUS"


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
