"""Text that comes from hosts, made safe where it is shown: on a terminal and in
Markdown (the audit's reports, the benchmark's and the tuning's).

What a host reports (a GPU's name, the model id its engine serves, a refusal quoting a
file, pyinfra's output of a command, a benchmark record's words) is data, and a host
that is not trusted chooses it. On a terminal an escape sequence in it could move the
cursor, clear the screen, set the window's title, make a link (OSC 8) or rewrite a line
already printed (``\\r``, ``\\b``); in Markdown a ``|`` would add a table cell,
``[text](url)`` a link and ``<script>`` raw HTML. The JSON reports keep every string
exact: it is data, and JSON escapes control characters itself. The HTML reports escape
``printable`` text with ``html.escape``. In core, below the plans that write the
benchmark's Markdown and the run's reports alike (pyinfra_vllm/report/text.py
passes these on to the audit's).
"""

from __future__ import annotations

import re
from typing import Any

# An escape sequence as terminals read it (ECMA-48): CSI (ESC [ parameters, final byte),
# OSC (ESC ] text, ended by BEL or ESC \, or by the end of the text), or ESC and one
# more character; a lone ESC at the end as well.
_ESCAPE_SEQUENCE = re.compile(
    r"\x1b(\[[0-?]*[ -/]*[@-~]?|\][^\x07\x1b]*(\x07|\x1b\\)?|[ -~]?)"
)
# SGR: a colour or a style (ESC [ digits m), the only sequence pyinfra's own output holds.
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
# C0 controls, DEL and C1 controls (U+0080-U+009F: CSI is also U+009B).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_LINE_BREAKS = "\t\n\r\v\f"
# What Markdown reads as syntax inside a line: a table cell (|), a code span (`), a link
# or image ([ ]), raw HTML or an entity (< > &), and the backslash that escapes them.
_MARKDOWN = re.compile(r"[\\`\[\]|<>&]")
_MARKDOWN_ESCAPES = {"\\": "\\\\", "`": "\\`", "[": "\\[", "]": "\\]", "|": "\\|",
                     "<": "&lt;", ">": "&gt;", "&": "&amp;"}
# GitHub's Markdown (cmark-gfm's autolink extension) makes a link of a bare URL and of a
# www. name, and keeps them text with the ":" of "://" or the "." of "www." escaped. It
# links an e-mail address even escaped: that link's text is the address it opens.
_AUTOLINK = re.compile(r"(?P<colon>:)(?=//)|(?<![A-Za-z0-9])(?P<www>[Ww]{3})\.")


def printable(value: Any) -> str:
    """``value`` as one line a terminal only prints: escape sequences removed, tabs and
    line breaks (``\\n``, ``\\r``...) as spaces, any other control character (C0, DEL, C1)
    as ``?``."""
    text = _ESCAPE_SEQUENCE.sub("", str(value))
    return _CONTROL.sub(lambda found: " " if found.group() in _LINE_BREAKS else "?", text)


def printable_keeping_colours(line: str) -> str:
    """One line of pyinfra's output as it may reach the terminal: its colours and styles
    (SGR sequences) kept, everything else as ``printable`` makes it."""
    # The text around the colours: one piece more than there are colours.
    pieces = [printable(piece) for piece in _COLOUR.split(line)]
    colours = [*_COLOUR.findall(line), ""]
    return "".join(piece + colour for piece, colour in zip(pieces, colours, strict=True))


def markdown_text(value: Any) -> str:
    """``value`` as inline Markdown text that renders as itself: ``printable``, then
    every character Markdown reads as syntax escaped (``\\|``, ``\\[``, ``&lt;``...), so
    it stays one table cell or list item, with no link, code span or HTML of its own (no
    bare URL made a link either: ``http\\://``, ``www\\.``)."""
    text = _MARKDOWN.sub(lambda found: _MARKDOWN_ESCAPES[found.group()], printable(value))
    return _AUTOLINK.sub(_not_a_link, text)


def _not_a_link(found: re.Match[str]) -> str:
    """``\\:`` for the ":" of "://", ``www\\.`` for "www."."""
    return "\\:" if found.group("colon") else f"{found.group('www')}\\."
