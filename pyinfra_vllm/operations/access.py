"""Owner, group and mode of the suite's secrets and the engine's access paths, put back
where they were changed by hand (the table: pyinfra_vllm/plans/access.py).

``chown -h`` changes a symbolic link itself, never what it points to; ``chmod`` has no
such option (Linux has no mode on a link), so each command first checks, on the host,
that the path is still of its kind and no link, and changes nothing otherwise. The
parents of the table's paths are root's alone, so no one else can swap a path between
that check and the change; the engine's socket, whose directory is the engine's user's,
gets its mode from that user (``chmod_as``), never from root.
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation

from facts.files import PathModes
from pyinfra_vllm.operations.util.access import repair_command
from pyinfra_vllm.plans.access import KIND_WORDS, differs


@operation()
def kept(paths: dict[str, dict[str, str]]):
    """
    Keep the owner, group and mode of a set of paths, never following a link.

    + paths: ``{path: {"owner", "group", "mode", "kind", "chmod_as"}}`` (the access
      table's rows, ``pyinfra_vllm/plans/access.py`` ``wanted``): mode in octal, kind
      "file", "directory" or "socket", chmod_as the user that changes the mode

    One remote read for the set (facts.files.PathModes). A path that does not exist is
    left to the operation that makes it. One of another owner, group or mode gets
    ``chmod``/``chown -h``, narrowed first so that it is never more open than both what
    it was and what it should be. A path of another kind, or a symbolic link, is never
    changed: the operation fails, naming it (the stages refuse such a host before).
    Every path as declared: no command.
    """
    found = host.get_fact(PathModes, paths=sorted(paths))
    changed = []
    for path, wanted in sorted(paths.items()):
        have = found.get(path)
        if have is None:
            continue
        if have["kind"] != wanted["kind"]:
            yield StringCommand(
                "echo", QuoteString(f"{path} is {KIND_WORDS[have['kind']]}, not "
                                    f"{KIND_WORDS[wanted['kind']]}: not followed, not "
                                    "changed"), ">&2; exit 1")
            changed.append(path)
            continue
        if differs(wanted, have):
            yield repair_command(path, wanted, have)
            changed.append(path)
    if not changed:
        host.noop(f"{len(paths)} path(s) with their owner and mode")
