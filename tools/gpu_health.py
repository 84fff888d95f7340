"""Judge saved GPU health outputs, for people and for bug reports: exit 0 all GPUs ok.

    python -m tools.gpu_health [--tp 0,1] FILE_OR_FOLDER...

Each FILE is one saved output: ``nvidia-smi -q`` (whole or ``-d``), ``-q -x``,
``--query-gpu`` / ``--query-remapped-rows`` / ``--query-retired-pages`` CSV,
``nvidia-smi nvlink -e`` / ``-s``, a kernel log (dmesg in any of its time formats,
journalctl -k), a ``dcgmi diag`` table, or nvidia-smi's own error. A FOLDER is every
file under it: a support bundle as it was collected. Each file's kind is detected from
the text (facts/gpu_health.py detect_kind), it is parsed, the GPUs of all files are
merged (by PCI bus id; by index where a file gives none) and judged
(pyinfra_vllm/plans/gpu_health.py). Prints::

    {"verdict": "ok", "codes": [], "reasons": [],
     "gpus": {"00000000:00:06.0": {"verdict": "ok", "codes": [], "reasons": []}},
     "files": {"q.txt": "query_text", "topo-m.txt": "unknown", "nvlink-e.txt": "empty"},
     "unreadable": {"cut.xml": "nvidia-smi -q -x: not well-formed XML ..."},
     "diag": {"tests": {...}, "complete": true}}

A GPU's verdict is ok, degraded, unknown (what was to be read of it could not be: a
device-handle error, a block with no data, a dcgmi test that failed with no GPU blamed
or a dcgmi table cut short) or failing; ``codes`` are the reasons' stable codes and
``reasons`` their ``"<detail>: <action>"``. The top ``verdict``, ``codes`` and
``reasons`` are the worst of the GPUs' with the run's own findings: nvidia-smi could not
talk to NVML (``nvml_error``), it counts more GPUs than the files name
(``gpu_missing``), a failed dcgmi test that names no GPU (``dcgmi_test_error``), no file
names a GPU at all (``no_gpu``). A file of a kind this tool does not know (an nvidia-smi
table, ``topo -m``, an inventory CSV, a README) is listed as ``"unknown"`` and skipped,
an empty one as ``"empty"`` (``nvlink -e`` where NVLink is not exposed prints nothing).
A file of a kind it knows that it cannot read (XML cut short, with a character XML does
not allow, or declaring a DTD or entity; a line over 16,384 characters; an Xid line
without its PCI address) is named under ``"unreadable"`` with why, and on stderr; so is
a file that cannot be opened (its kind ``"unreadable"``).

Exit status:

- 0: every GPU the files name is ok, and the run has no finding of its own;
- 1: a GPU is degraded, failing or unknown, or a finding of the run (above) holds;
- 2: input that could not be read: a file is unreadable (the JSON is still printed, with
  what the other files gave, unless no file could be opened at all).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from facts.gpu_health import detect_kind
from facts.gpu_health_csv import (
    health_csv_fields,
    parse_health_csv,
    parse_remapped_rows_csv,
    parse_retired_pages_csv,
)
from facts.gpu_health_input import UnreadableOutput
from facts.gpu_health_logs import parse_dcgmi_diag, read_kernel_log
from facts.gpu_health_nvlink import nvlink_applicability, parse_nvlink_errors
from facts.gpu_health_record import (
    MISSING_KEY,
    empty_record,
    merge_records,
    normalize_bus_id,
    same_gpu,
    unreadable_gpus,
)
from facts.gpu_health_smi import parse_query_text, parse_query_xml
from facts.nvidia_smi import nvml_failure
from pyinfra_vllm.plans.gpu_health import (
    READ_AGAIN,
    RESET,
    RMA,
    VERDICTS,
    gpu_verdict,
    judged,
    reason,
)

_FAILED = ("Fail", "Error")
_DCGM_AGAIN = "check DCGM and its logs, then run dcgmi diag again and save all of its output"


class Inputs:
    """What the files said, merged."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any]] = {}
        self.partial: dict[str, dict[str, Any]] = {}  # keyed by uuid / row: no bus id
        self.missing: list[dict[str, Any]] = []  # "gpu_missing": counted, not listed
        self.xids: list[dict[str, Any]] = []
        self.notices: list[dict[str, Any]] = []
        self.nvlink: dict[int, dict[str, Any]] = {}
        self.nvlink_errors: dict[int, dict[int, dict[str, int | None]]] = {}
        self.diag: list[dict[str, Any]] = []
        self.run_reasons: list[dict[str, str]] = []  # the run's own, of no one GPU

    def add_record(self, key: str, record: dict[str, Any]) -> None:
        if normalize_bus_id(key) is None and record.get("bus_id") is None:
            index = record.get("index")
            key = self.key_for_index(index) if index is not None else key
        current = self.records.get(key)
        self.records[key] = record if current is None else merge_records(current, record)

    def add_records(self, parsed: dict[str, dict[str, Any]] | None) -> None:
        for key, record in (parsed or {}).items():
            if key == MISSING_KEY:
                self.missing.append(record["unreadable"])
            else:
                self.add_record(key, record)

    def key_for_index(self, index: int | None) -> str:
        for key, record in self.records.items():
            if index is not None and record.get("index") == index:
                return key
        return str(index)


def _read_partial(kind: str, lines: list[str], inputs: Inputs) -> None:
    found: list[tuple[str, dict[str, Any]]] = []
    if kind == "remapped_rows_csv":
        for key, rows in (parse_remapped_rows_csv(lines) or {}).items():
            record = empty_record()
            record["remapped_rows"] = rows
            found.append((key, record))
    else:
        for key, pages in (parse_retired_pages_csv(lines) or {}).items():
            if not pages["applicable"]:
                continue  # per-cause placeholder rows: page retirement does not apply
            record = empty_record()
            record["retired_pages"] = {"single_bit": pages["single_bit"],
                                       "double_bit": pages["double_bit"], "pending": None}
            found.append((key, record))
    for key, record in found:
        bus_id = normalize_bus_id(key)
        if bus_id is not None:
            record["bus_id"] = bus_id
            inputs.add_record(bus_id, record)
        else:
            inputs.partial[key] = record
    inputs.add_records(unreadable_gpus(lines))


def _read_nvlink(kind: str, lines: list[str], inputs: Inputs) -> None:
    if kind == "nvlink_errors":
        inputs.nvlink_errors.update(parse_nvlink_errors(lines) or {})
    else:
        inputs.nvlink.update(nvlink_applicability(lines) or {})
    inputs.add_records(unreadable_gpus(lines))


def _read_kernel_log(lines: list[str], inputs: Inputs) -> None:
    log = read_kernel_log(lines)
    inputs.xids.extend(log["events"])
    inputs.notices.extend(log["notices"])


def _read_nvml_error(path: str, lines: list[str], inputs: Inputs) -> None:
    inputs.run_reasons.append(reason(
        "nvml_error", "unknown", f"{path}: nvidia-smi could not talk to the driver "
        f"({(nvml_failure(lines) or '')[:200]}): no GPU could be read from it",
        "fix the driver (nvidia-smi must work), then save the outputs again"))


_Reader = Callable[[str, list[str], str, Inputs], None]
_READERS: dict[str, _Reader] = {
    "query_text": lambda path, lines, text, inputs: inputs.add_records(parse_query_text(lines)),
    "query_xml": lambda path, lines, text, inputs: inputs.add_records(parse_query_xml(text)),
    "health_csv": lambda path, lines, text, inputs: inputs.add_records(
        parse_health_csv(lines, health_csv_fields(lines))),
    "device_error": lambda path, lines, text, inputs: inputs.add_records(unreadable_gpus(lines)),
    "remapped_rows_csv": lambda path, lines, text, inputs: _read_partial(
        "remapped_rows_csv", lines, inputs),
    "retired_pages_csv": lambda path, lines, text, inputs: _read_partial(
        "retired_pages_csv", lines, inputs),
    "nvlink_errors": lambda path, lines, text, inputs: _read_nvlink("nvlink_errors", lines,
                                                                    inputs),
    "nvlink_status": lambda path, lines, text, inputs: _read_nvlink("nvlink_status", lines,
                                                                    inputs),
    "kernel_log": lambda path, lines, text, inputs: _read_kernel_log(lines, inputs),
    "dcgmi_diag": lambda path, lines, text, inputs: inputs.diag.append(parse_dcgmi_diag(lines)),
    "nvml_error": lambda path, lines, text, inputs: _read_nvml_error(path, lines, inputs),
}


def _kind(text: str) -> str:
    """``text``'s kind: detect_kind's, ``"empty"`` or ``"unknown"``."""
    if not text.strip():
        return "empty"
    return detect_kind(text) or "unknown"


def _attach_partial(inputs: Inputs) -> None:
    """Rows keyed by uuid only: attached to the host's one GPU when there is one."""
    for key, record in inputs.partial.items():
        if len(inputs.records) == 1:
            only = next(iter(inputs.records))
            inputs.records[only] = merge_records(inputs.records[only], record)
        else:
            inputs.records[key] = record


def _nvlink_links(inputs: Inputs, index: int | None) -> list[dict[str, Any]] | None:
    entry = inputs.nvlink.get(index) if index is not None else None
    if entry is None or entry["status"] in ("not_applicable", "unknown"):
        return None
    return entry["links"]


def _diag_gpus(diag: dict[str, Any]) -> set[int]:
    return {gpu for test in diag["tests"].values() for gpu in test["gpus"]}


def _diag_reasons(inputs: Inputs, index: int | None) -> list[dict[str, str]]:
    """What the dcgmi runs say of GPU ``index``: a test failed on it (failing); a test
    failed blaming no GPU (an internal error), or the table was cut short (unknown)."""
    found: list[dict[str, str]] = []
    for diag in inputs.diag if index is not None else []:
        for name, test in diag["tests"].items():
            results = test["gpus"]
            if results.get(index) in _FAILED:
                found.append(reason("dcgmi_failed", "failing",
                                    f"dcgmi diag test {name!r} failed on GPU {index}",
                                    f"{RESET}; {RMA} if it fails again"))
            elif (test.get("result") in _FAILED and index in _diag_gpus(diag)
                  and not any(result in _FAILED for result in results.values())
                  and (index in results or not results)):
                found.append(reason("dcgmi_test_error", "unknown",
                                    f"dcgmi diag test {name!r} failed and blamed no GPU (an "
                                    f"internal error): its result on GPU {index} is unknown",
                                    _DCGM_AGAIN))
        if not diag["complete"] and index in _diag_gpus(diag):
            found.append(reason("dcgmi_incomplete", "unknown",
                                "the dcgmi diag table is cut short: the tests after the cut "
                                f"are unknown on GPU {index}", _DCGM_AGAIN))
    return found


def _gpu_keys(inputs: Inputs) -> list[str]:
    """Every GPU the files name: records, Xids and notices of GPUs no record holds,
    and the indices dcgmi and nvlink name."""
    keys = dict.fromkeys(inputs.records)
    for event in inputs.xids + inputs.notices:
        if not any(same_gpu(key, event["pci"]) for key in keys if ":" in key):
            keys.setdefault(event["pci"])
    diag_gpus = {gpu for diag in inputs.diag for gpu in _diag_gpus(diag)}
    for gpu_index in sorted(diag_gpus | set(inputs.nvlink) | set(inputs.nvlink_errors)):
        keys.setdefault(inputs.key_for_index(gpu_index))
    return list(keys)


def _judge_gpu(inputs: Inputs, key: str, tp: list[int]) -> dict[str, Any]:
    record = inputs.records.get(key)
    index: int | None = (record.get("index") if record
                         else int(key) if key.isdigit() else None)

    def mine(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [item for item in found
                if (":" in key and same_gpu(key, item["pci"])) or key == item["pci"]]

    verdict = gpu_verdict(record, xids=mine(inputs.xids), notices=mine(inputs.notices),
                          nvlink_links=_nvlink_links(inputs, index),
                          nvlink_errors=inputs.nvlink_errors.get(index)
                          if index is not None else None, tp_member=index in tp)
    return judged(verdict["reasons"] + _diag_reasons(inputs, index))


def _run_reasons(inputs: Inputs, gpus: dict[str, dict[str, Any]]) -> list[dict[str, str]]:
    """The run's own findings, of no one GPU."""
    found = list(inputs.run_reasons)
    named = sum(1 for key in gpus if normalize_bus_id(key) is not None)
    attached = max((int(missing["attached"]) for missing in inputs.missing), default=0)
    if attached > named:
        found.append(reason("gpu_missing", "unknown", f"nvidia-smi counts {attached} "
                            f"attached GPU(s); the files name {named} by PCI bus id",
                            READ_AGAIN))
    for diag in inputs.diag:
        if _diag_gpus(diag):
            continue
        for name, test in diag["tests"].items():
            if test.get("result") in _FAILED:
                found.append(reason("dcgmi_test_error", "unknown",
                                    f"dcgmi diag test {name!r} failed and names no GPU",
                                    _DCGM_AGAIN))
    if not gpus:
        found.append(reason("no_gpu", "unknown", "no file names a GPU: nothing was judged",
                            "save nvidia-smi -q and the kernel log of the server, then run "
                            "this again"))
    return found


def _words(verdict: dict[str, Any]) -> dict[str, Any]:
    reasons = verdict["reasons"]
    return {"verdict": verdict["verdict"], "codes": [r["code"] for r in reasons],
            "reasons": [f"{r['detail']}: {r['action']}" for r in reasons]}


def judge(inputs: Inputs, tp: list[int]) -> dict[str, Any]:
    """The report: the run's verdict, codes and reasons, and each GPU's."""
    _attach_partial(inputs)
    gpus = {key: _judge_gpu(inputs, key, tp) for key in _gpu_keys(inputs)}
    run = judged(_run_reasons(inputs, gpus))
    worst = max([VERDICTS.index(run["verdict"])]
                + [VERDICTS.index(gpu["verdict"]) for gpu in gpus.values()])
    report: dict[str, Any] = {**_words(run), "verdict": VERDICTS[worst],
                              "gpus": {key: _words(gpu) for key, gpu in gpus.items()}}
    if inputs.diag:
        report["diag"] = inputs.diag[0] if len(inputs.diag) == 1 else inputs.diag
    return report


def _paths(arguments: list[str]) -> list[str]:
    """Each FILE, and every file under each FOLDER (sorted)."""
    paths: list[str] = []
    for argument in arguments:
        folder = Path(argument)
        if folder.is_dir():
            paths += sorted(str(path) for path in folder.rglob("*") if path.is_file())
        else:
            paths.append(argument)
    return paths


def _read_all(paths: list[str], inputs: Inputs) -> tuple[dict[str, str], dict[str, str]]:
    """Each file's kind, and why each file that could not be read was not."""
    kinds: dict[str, str] = {}
    unreadable: dict[str, str] = {}
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8", errors="replace")
        except OSError as error:
            kinds[path], unreadable[path] = "unreadable", f"cannot be opened: {error}"
            continue
        kinds[path] = kind = _kind(text)
        try:
            if kind in _READERS:  # each reader parses first: where it raises, nothing is added
                _READERS[kind](path, text.splitlines(), text, inputs)
        except UnreadableOutput as error:
            unreadable[path] = str(error)
        except Exception as error:  # a parser failing on a file: that file is unreadable
            unreadable[path] = f"{kind}: the parser failed: {type(error).__name__}: {error}"
    return kinds, unreadable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.gpu_health",
        description="Judge saved nvidia-smi / kernel log / dcgmi outputs per GPU "
                    "(exit 0 every GPU ok, 1 one is not, 2 input that could not be read).",
    )
    parser.add_argument("files", nargs="+", metavar="FILE_OR_FOLDER")
    parser.add_argument("--tp", default="", help="GPU indices of the tensor-parallel "
                        "group (comma separated): their NVLink links are judged")
    args = parser.parse_args(argv)
    try:
        tp = [int(part) for part in args.tp.split(",") if part.strip()]
    except ValueError:
        parser.error(f"--tp: not a list of GPU indices: {args.tp!r}")
    inputs = Inputs()
    kinds, unreadable = _read_all(_paths(args.files), inputs)
    for path, why in unreadable.items():
        print(f"gpu_health: {path}: {why}", file=sys.stderr)
    if not kinds or all(kind == "unreadable" for kind in kinds.values()):
        print("gpu_health: no file could be read", file=sys.stderr)
        return 2
    report = judge(inputs, tp)
    report["files"] = kinds
    if unreadable:
        report["unreadable"] = unreadable
    print(json.dumps(report, indent=2, sort_keys=True, default=str))
    if unreadable:
        return 2
    return 0 if report["verdict"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
