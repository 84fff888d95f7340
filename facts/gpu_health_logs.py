"""The kernel log and ``dcgmi diag`` as GPU health sources: the NVRM Xid events, the
kernel's notices that name a failing GPU without an Xid number, and dcgmi's tables.

Kernel log Xid lines (``NVRM: Xid (PCI:0000:91:00): 79, pid=..., name=..., text``) are
NVIDIA's documented Xid format (https://docs.nvidia.com/deploy/xid-errors/index.html).
The driver also names a GPU it cannot use without any Xid, in one line or over three::

    NVRM: GPU 0000:91:00.0: GPU has fallen off the bus.
    NVRM: GPU 0000:98:00.0: RmInitAdapter failed! (0x62:0x65:1792)
    NVRM: GPU 0000:98:00.0: rm_init_adapter failed, device minor number 0
    NVRM: The NVIDIA GPU 0000:b3:00.0
    NVRM: (PCI ID: 10de:26b5) installed in this system has
    NVRM: fallen off the bus and is not responding to commands.

(NVIDIA/open-gpu-kernel-modules#789, NVIDIA/gpu-operator#649, NVIDIA/NVSentinel#155.)
Every line is read in each form dmesg and journalctl print it: no prefix (``dmesg -t``,
grep), ``[  123.456789]``, ``-T``'s ``[Sun Feb 23 16:24:18 2025]``, any other bracketed
dmesg time, ``--time-format iso``, ``--decode``'s ``kern  :warn  :`` columns, and the
journal's and syslog's ``<time> <host> kernel:`` (short, short-precise, short-iso,
short-full, short-monotonic; a printk time after ``kernel:`` too). An Xid line behind a
prefix none of these is still read, with no time; an Xid line whose PCI address or code
cannot be read makes the log unreadable (facts/gpu_health_input.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from facts.gpu_health_input import UnreadableOutput, bounded_lines

_NVRM = "NVRM:"
_XID = "NVRM: Xid"
# dmesg --decode's facility and level columns: "kern  :warn  : ".
_DECODE_RE = re.compile(r"^[a-z]+ *:[a-z]+ *: ")
_ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:[+-]\d\d:?\d\d|Z)?"
# dmesg --time-format iso (2024-11-15T12:02:03,470068+00:00).
_ISO_RE = re.compile(rf"^{_ISO}$")
# Inside dmesg's brackets: seconds since boot (raw, delta "<...>", reltime "+0.000012"),
# -T / ctime, reltime's "Feb23 16:24".
_DMESG_TIME_RE = re.compile(
    r"^(?:\+?\d+\.\d+(?: <[ \d.]+>)?"
    r"|[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}"
    r"|[A-Z][a-z]{2} ?\d{1,2} \d\d:\d\d(?::\d\d)?)$"
)
# The journal's time before "<host> kernel:": short and short-precise (Nov 29
# 11:28:11[.123456], also syslog files), short-full (Mon 2026-12-02 02:42:57 UTC),
# short-monotonic ([  123.456789]), short-unix (1733107377.123456), short-iso.
_JOURNAL_TIME_RE = re.compile(
    r"^(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d(?:\.\d+)?"
    r"|[A-Z][a-z]{2} \d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? [A-Za-z0-9+-]{1,6}"
    r"|\[ *\d+\.\d+\]|\d+\.\d+"
    rf"|{_ISO})$"
)
_XID_RE = re.compile(r"^NVRM: Xid \(([^()]*)\): (\d+)(?:, (.*))?$")
_PCI_RE = re.compile(r"([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})")
_PID_RE = re.compile(r"^pid=('?<unknown>'?|'N/A'|N/A|\d+)(?:, |$)")
_NAME_RE = re.compile(r"^name=([^,]*)(?:, |$)")
_NOTICE_RE = re.compile(
    r"^NVRM: (The NVIDIA )?GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.[0-7])?(.*)$"
)
# "The NVIDIA GPU <pci>" goes on over the next two lines.
_NOTICE_CONTINUATION = 2
# Words of a notice -> what it says of the GPU (pyinfra_vllm/plans/gpu_health.py judges it).
NOTICE_PHRASES = (
    ("fallen off the bus", "fallen_off_bus"),
    ("rminitadapter failed", "init_failed"),
    ("rm_init_adapter failed", "init_failed"),
    ("gpu is lost", "lost"),
)


def _bracketed(text: str) -> str | None:
    """What is inside ``[...]`` when ``text`` is just that, else None."""
    if len(text) >= 2 and text[0] == "[" and text[-1] == "]" and "]" not in text[1:-1]:
        return text[1:-1].strip()
    return None


def _prefix_time(prefix: str) -> tuple[bool, str | None]:
    """Whether ``prefix`` (what precedes ``NVRM:`` on a line) is a kernel log prefix this
    parser knows, and the time it prints (None where it prints none)."""
    decoded = _DECODE_RE.match(prefix)
    if decoded is not None:
        prefix = prefix[decoded.end():].strip()
    if not prefix:
        return True, None
    head, marker, tail = prefix.partition(" kernel:")
    if marker and (not tail.strip() or _bracketed(tail.strip()) is not None):
        time = head.rpartition(" ")[0].strip()  # less the host name
        if _JOURNAL_TIME_RE.match(time) is not None:
            return True, _bracketed(time) or time
    inner = _bracketed(prefix)
    if inner is not None and _DMESG_TIME_RE.match(inner) is not None:
        return True, inner
    if _ISO_RE.match(prefix) is not None:
        return True, prefix
    return False, None


def split_log_line(line: str) -> tuple[bool, str | None, str] | None:
    """``(known, time, message)`` of a kernel log line with an NVRM message: whether its
    prefix is one this parser knows, the time as printed (None without one) and the
    message from ``NVRM:`` on; None for a line with no NVRM message."""
    text = line.strip()
    start = text.find(_NVRM)
    if start < 0:
        return None
    known, time = _prefix_time(text[:start].strip())
    return known, time, text[start:]


def is_kernel_log_line(line: str) -> bool:
    """A line as dmesg or journalctl print an NVRM message."""
    parsed = split_log_line(line)
    return parsed is not None and parsed[0]


def _xid_fields(rest: str) -> tuple[int | None, str | None, str]:
    pid: int | None = None
    process: str | None = None
    match = _PID_RE.match(rest)
    if match is not None:
        pid = int(match.group(1)) if match.group(1).isdigit() else None
        rest = rest[match.end():]
    match = _NAME_RE.match(rest)
    if match is not None:
        name = match.group(1).strip()
        process = None if name in ("<unknown>", "'<unknown>'", "N/A", "") else name
        rest = rest[match.end():]
    return pid, process, rest.strip()


def _xid_event(number: int, time: str | None, message: str) -> dict[str, Any]:
    match = _XID_RE.match(message)
    pci = _PCI_RE.search(match.group(1)) if match is not None else None
    if match is None or pci is None:
        raise UnreadableOutput(
            f"kernel log: line {number} is an Xid line whose PCI address or code cannot "
            f"be read: {message[:200]!r}"
        )
    pid, process, text = _xid_fields(match.group(3) or "")
    return {"time": time, "pci": pci.group(1).lower(), "code": int(match.group(2)),
            "pid": pid, "process": process, "text": text}


def _notices(messages: list[tuple[str | None, str]]) -> list[dict[str, Any]]:
    """The notices that name a GPU, their continuation lines joined, kept where their
    words say what NOTICE_PHRASES knows."""
    found: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for time, message in messages:
        match = _NOTICE_RE.match(message)
        if match is not None:
            current = {"time": time, "pci": match.group(2).lower(),
                       "text": match.group(3).lstrip(" :"),
                       "more": _NOTICE_CONTINUATION if match.group(1) else 0}
            found.append(current)
        elif current is not None and current["more"] > 0 and not message.startswith(_XID):
            current["text"] = f"{current['text']} {message[len(_NVRM):].strip()}".strip()
            current["more"] -= 1
        else:
            current = None
    notices = []
    for raw in found:
        lowered = raw["text"].lower()
        notice = next((name for phrase, name in NOTICE_PHRASES if phrase in lowered), None)
        if notice is not None:
            notices.append({"time": raw["time"], "pci": raw["pci"], "notice": notice,
                            "text": raw["text"]})
    return notices


def read_kernel_log(lines: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
    """The NVRM Xid events and GPU notices of kernel log lines, in log order:

    ``{"events": [{"time": str|None (as printed), "pci": "0000:91:00" (lower-case),
    "code": 79, "pid": int|None, "process": str|None, "text": "GPU has fallen off the
    bus."}], "notices": [{"time", "pci", "notice": "fallen_off_bus"|"init_failed"|
    "lost", "text"}]}``. NVSwitch SXid lines and other lines are skipped. Raises
    UnreadableOutput for a line over the bound or an Xid line it cannot read."""
    kept = bounded_lines(lines, "kernel log")
    events: list[dict[str, Any]] = []
    messages: list[tuple[str | None, str]] = []
    for number, line in enumerate(kept, 1):
        parsed = split_log_line(line)
        if parsed is None:
            continue
        _known, time, message = parsed
        if message.startswith(_XID):
            events.append(_xid_event(number, time, message))
        messages.append((time, message))
    return {"events": events, "notices": _notices(messages)}


def parse_kernel_log(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The NVRM Xid events of kernel log lines (read_kernel_log's ``events``)."""
    return read_kernel_log(lines)["events"]


# --- dcgmi diag -------------------------------------------------------------------------

_DIAG_BORDER_RE = re.compile(r"^\+[-=+]+\+$")
_DIAG_GPU_ROW_RE = re.compile(r"^GPU(\d+): (\w+)")
_DIAG_OLD_RESULT_RE = re.compile(r"^(Pass|Fail|Skip|Warn) *- *GPUs?: *(\d[\d, ]*)$")
_DIAG_GPU_NAMED_RE = re.compile(r"\bGPU (\d+)\b")
_DIAG_DIGITS_RE = re.compile(r"\d+")
DIAG_ROW_RE = re.compile(r"^\| (?:Diagnostic +\| Result|[^|]+\| (?:Pass|Fail|Skip|Warn)\b)")
_DIAG_LEVELS = ("Warning", "Error", "Info")
_RESULT_RANK = {"Skip": 0, "Pass": 1, "Warn": 2, "Fail": 3, "Error": 3}


def diag_heading(line: str) -> str | None:
    """The section a dcgmi heading row names (``|-----  Metadata  -----+---...|`` or
    ``+-----  Hardware  -----+---...+``), else None."""
    if not line or line[0] not in "|+":
        return None
    end = line.find("+", 1)
    if end < 0:
        return None
    cell = line[1:end]
    inner = cell.strip("-")
    name = inner.strip()
    if not (cell.startswith("-") and cell.endswith("-") and inner.startswith(" ")
            and inner.endswith(" ") and name):
        return None
    return name if all(ch.isalnum() or ch in " _" for ch in name) else None


def _diag_cells(line: str) -> tuple[str, str] | None:
    """(left cell, right cell) of one table row. The right cell keeps its text's own
    spaces, less one padding space each side: dcgmi cuts long text every N characters,
    mid-word, so the pieces join by plain concatenation."""
    if not line.startswith("|"):
        return None
    try:
        split = line.index("|", 1)
    except ValueError:
        return None
    right = line[split + 1:]
    # A row is "| left | " + text + "  |": one padding space before, two after.
    for closing in ("  |", " |", "|"):
        if right.endswith(closing):
            right = right[: -len(closing)]
            break
    return line[1:split].strip(), right[1:] if right.startswith(" ") else right


def _diag_result(test: dict[str, Any], value: str) -> None:
    old = _DIAG_OLD_RESULT_RE.match(value)
    if old is not None:
        for gpu in _DIAG_DIGITS_RE.findall(old.group(2)):
            test["gpus"][int(gpu)] = old.group(1)
        worst = max(test["gpus"].values(), key=lambda r: _RESULT_RANK.get(r, 0))
        test["result"] = worst
    elif test["result"] is None:
        test["result"] = value.split()[0] if value else None


def _diag_row(state: dict[str, Any], left: str, right: str) -> None:
    """One row of the table into ``state`` (tests, metadata, the current test and
    message)."""
    tests, section = state["tests"], state["section"]
    if left and section == "Metadata":
        state["metadata"][left] = right.strip()
    elif left in _DIAG_LEVELS:
        state["current"] = state["current"] or _diag_orphan(tests, section or "Diagnostic")
        state["message"] = {"level": left, "text": right.lstrip()}
        state["current"]["messages"].append(state["message"])
    elif left:
        state["current"] = tests.setdefault(left, {"section": section, "result": None,
                                                   "gpus": {}, "messages": []})
        state["message"] = None
        _diag_result(state["current"], right.strip())
    elif state["current"] is not None:
        row = _DIAG_GPU_ROW_RE.match(right.strip())
        if row is not None:
            state["current"]["gpus"][int(row.group(1))] = row.group(2)
            state["message"] = None
        elif state["message"] is None and _DIAG_OLD_RESULT_RE.match(right.strip()):
            _diag_result(state["current"], right.strip())
        elif state["message"] is not None:
            state["message"]["text"] += right


def parse_dcgmi_diag(lines: Iterable[str]) -> dict[str, Any]:
    """Parse a ``dcgmi diag`` table, old layout (``Pass - GPUs: 1, 2`` / ``Fail - GPU: 0``
    cells, wrapped ``Warning``/``Error`` rows) or DCGM 4.x (lower-case test names, one
    ``GPUn: Pass`` row per GPU). Returns ``{"tests": {name: {"section", "result",
    "gpus": {index: result}, "messages": [{"level", "text"}]}}, "metadata": {...},
    "complete": bool}``; complete is False for a table that does not end with its
    closing border (the tests after the cut are unknown, not passed). An ``Error`` row
    with no test before it becomes a test named after its section, failed ("Error")
    on the GPUs its text names. Raises UnreadableOutput for a line over the bound."""
    state: dict[str, Any] = {"tests": {}, "metadata": {}, "section": None,
                             "current": None, "message": None}
    last = ""
    for line in bounded_lines(lines, "dcgmi diag"):
        if line.strip():
            last = line.strip()
        heading = diag_heading(line)
        if heading is not None:
            state.update(section=heading, current=None, message=None)
            continue
        cells = _diag_cells(line)
        if cells is None or (cells[0], cells[1].strip()) == ("Diagnostic", "Result"):
            continue
        _diag_row(state, *cells)
    _diag_attribute_errors(state["tests"])
    return {"tests": state["tests"], "metadata": state["metadata"],
            "complete": bool(_DIAG_BORDER_RE.match(last))}


def _diag_orphan(tests: dict[str, dict[str, Any]], section: str) -> dict[str, Any]:
    return tests.setdefault(section, {"section": section, "result": "Error", "gpus": {},
                                      "messages": []})


def _diag_attribute_errors(tests: dict[str, dict[str, Any]]) -> None:
    """An ``Error`` message naming ``GPU n`` fails that GPU in its test."""
    for test in tests.values():
        for message in test["messages"]:
            message["text"] = message["text"].strip()
            if message["level"] != "Error":
                continue
            for gpu in _DIAG_GPU_NAMED_RE.findall(message["text"]):
                test["gpus"][int(gpu)] = "Error"
