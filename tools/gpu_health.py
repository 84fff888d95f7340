"""Judge saved GPU health outputs, for people and for bug reports: exit 0 all GPUs ok.

    python -m tools.gpu_health [--tp 0,1] FILE...

Each FILE is one saved output: ``nvidia-smi -q`` (whole or ``-d``), ``-q -x``,
``--query-gpu`` / ``--query-remapped-rows`` / ``--query-retired-pages`` CSV,
``nvidia-smi nvlink -e`` / ``-s``, a kernel log (dmesg, journalctl -k) or a ``dcgmi
diag`` table. Its kind is detected from the text (facts/gpu_health.py detect_kind), it
is parsed, the GPUs of all files are merged (by PCI bus id; by index where a file
gives none) and judged (pyinfra_vllm/plans/gpu_health.py). Prints::

    {"gpus": {"00000000:00:06.0": {"verdict": "ok", "reasons": []}},
     "files": {"q.txt": "query_text"},
     "diag": {"tests": {...}, "complete": true}}

``reasons`` are ``"<detail>: <action>"``. An empty file (``nvlink -e`` where NVLink is
not exposed prints nothing) is listed as ``"empty"`` and judged as nothing. A failed
dcgmi test on GPU N makes that GPU failing; a failed test no GPU is blamed for (an
internal error) makes the run not ok.

Exit status: 0 every GPU ok (and no failed dcgmi test), 1 otherwise, 2 a file could not
be read or its kind is not recognised (named on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from facts.gpu_health import (
    HEALTH_QUERY_FIELDS,
    detect_kind,
    empty_record,
    merge_records,
    normalize_bus_id,
    nvlink_applicability,
    parse_dcgmi_diag,
    parse_health_csv,
    parse_kernel_log,
    parse_nvlink_errors,
    parse_query_text,
    parse_query_xml,
    parse_remapped_rows_csv,
    parse_retired_pages_csv,
    same_gpu,
)
from pyinfra_vllm.plans.gpu_health import gpu_verdict

_FAILED = ("Fail", "Error")


class Inputs:
    """What the files said, merged."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any]] = {}
        self.partial: dict[str, dict[str, Any]] = {}  # keyed by uuid / row: no bus id
        self.xids: list[dict[str, Any]] = []
        self.nvlink: dict[int, dict[str, Any]] = {}
        self.nvlink_errors: dict[int, dict[int, dict[str, int | None]]] = {}
        self.diag: list[dict[str, Any]] = []

    def add_record(self, key: str, record: dict[str, Any]) -> None:
        if normalize_bus_id(key) is None and record.get("bus_id") is None:
            index = record.get("index")
            key = self.key_for_index(index) if index is not None else key
        current = self.records.get(key)
        self.records[key] = record if current is None else merge_records(current, record)

    def key_for_index(self, index: int | None) -> str:
        for key, record in self.records.items():
            if index is not None and record.get("index") == index:
                return key
        return str(index)


def _read(path: str, inputs: Inputs) -> str:
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        return "empty"
    kind = detect_kind(text)
    if kind is None:
        raise ValueError("not a GPU health output this tool knows")
    lines = text.splitlines()
    if kind in ("query_text", "query_xml", "health_csv"):
        headerless = kind == "health_csv" and not any(c.isalpha() for c in lines[0][:6])
        parsed = (parse_query_text(lines) if kind == "query_text"
                  else parse_query_xml(text) if kind == "query_xml"
                  else parse_health_csv(lines, HEALTH_QUERY_FIELDS if headerless else None))
        for key, record in (parsed or {}).items():
            inputs.add_record(key, record)
    elif kind in ("remapped_rows_csv", "retired_pages_csv"):
        _read_partial(kind, lines, inputs)
    elif kind == "nvlink_errors":
        inputs.nvlink_errors.update(parse_nvlink_errors(lines) or {})
    elif kind == "nvlink_status":
        inputs.nvlink.update(nvlink_applicability(lines) or {})
    elif kind == "kernel_log":
        inputs.xids.extend(parse_kernel_log(lines))
    elif kind == "dcgmi_diag":
        inputs.diag.append(parse_dcgmi_diag(lines))
    return kind


def _read_partial(kind: str, lines: list[str], inputs: Inputs) -> None:
    if kind == "remapped_rows_csv":
        for key, rows in (parse_remapped_rows_csv(lines) or {}).items():
            record = empty_record()
            record["remapped_rows"] = rows
            _add_keyed(inputs, key, record)
        return
    for key, pages in (parse_retired_pages_csv(lines) or {}).items():
        if not pages["applicable"]:
            continue  # per-cause placeholder rows: page retirement does not apply
        record = empty_record()
        record["retired_pages"] = {"single_bit": pages["single_bit"],
                                   "double_bit": pages["double_bit"], "pending": None}
        _add_keyed(inputs, key, record)


def _add_keyed(inputs: Inputs, key: str, record: dict[str, Any]) -> None:
    bus_id = normalize_bus_id(key)
    if bus_id is not None:
        record["bus_id"] = bus_id
        inputs.add_record(bus_id, record)
    else:
        inputs.partial[key] = record


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


def _diag_results(inputs: Inputs) -> tuple[dict[int, list[str]], bool]:
    """GPU index -> failed dcgmi tests; and whether a test failed with no GPU blamed."""
    blamed: dict[int, list[str]] = {}
    unattributed = False
    for diag in inputs.diag:
        for name, test in diag["tests"].items():
            failed = [gpu for gpu, result in test["gpus"].items() if result in _FAILED]
            for gpu in failed:
                blamed.setdefault(gpu, []).append(name)
            if test.get("result") in _FAILED and not failed:
                unattributed = True
    return blamed, unattributed


def judge(inputs: Inputs, tp: list[int]) -> dict[str, dict[str, Any]]:
    """{key: {"verdict", "reasons": ["detail: action"]}} for every GPU the files name."""
    _attach_partial(inputs)
    blamed, _ = _diag_results(inputs)
    gpus: dict[str, dict[str, Any]] = {}
    keys = dict.fromkeys(inputs.records)
    for event in inputs.xids:
        if not any(same_gpu(key, event["pci"]) for key in keys if ":" in key):
            keys.setdefault(event["pci"])
    diag_gpus = {gpu for diag in inputs.diag for test in diag["tests"].values()
                 for gpu in test["gpus"]}
    for gpu_index in sorted(diag_gpus | set(inputs.nvlink) | set(inputs.nvlink_errors)):
        keys.setdefault(inputs.key_for_index(gpu_index))
    for key in keys:
        record = inputs.records.get(key)
        index: int | None = (record.get("index") if record
                             else int(key) if key.isdigit() else None)
        xids = [event for event in inputs.xids
                if (":" in key and same_gpu(key, event["pci"])) or key == event["pci"]]
        judged = gpu_verdict(record, xids=xids, nvlink_links=_nvlink_links(inputs, index),
                             nvlink_errors=inputs.nvlink_errors.get(index) if index is not None
                             else None, tp_member=index in tp)
        reasons = [f"{reason['detail']}: {reason['action']}" for reason in judged["reasons"]]
        verdict = judged["verdict"]
        for test in blamed.get(index, []) if index is not None else []:
            verdict = "failing"
            reasons.append(f"dcgmi diag test {test!r} failed on GPU {index}: "
                           "reset the GPU when no process uses it (nvidia-smi -r -i N), "
                           "or reboot; replace the GPU (RMA) if it fails again")
        gpus[key] = {"verdict": verdict, "reasons": reasons}
    return gpus


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.gpu_health",
        description="Judge saved nvidia-smi / kernel log / dcgmi outputs per GPU.",
    )
    parser.add_argument("files", nargs="+", metavar="FILE")
    parser.add_argument("--tp", default="", help="GPU indices of the tensor-parallel "
                        "group (comma separated): their NVLink links are judged")
    args = parser.parse_args(argv)
    try:
        tp = [int(part) for part in args.tp.split(",") if part.strip()]
    except ValueError:
        parser.error(f"--tp: not a list of GPU indices: {args.tp!r}")
    inputs, kinds, bad = Inputs(), {}, []
    for path in args.files:
        try:
            kinds[path] = _read(path, inputs)
        except (OSError, ValueError) as error:
            bad.append(f"{path}: {error}")
    if bad:
        for line in bad:
            print(f"gpu_health: {line}", file=sys.stderr)
        return 2
    gpus = judge(inputs, tp)
    report: dict[str, Any] = {"gpus": gpus, "files": kinds}
    _, unattributed = _diag_results(inputs)
    if inputs.diag:
        report["diag"] = inputs.diag[0] if len(inputs.diag) == 1 else inputs.diag
    print(json.dumps(report, indent=2, sort_keys=True, default=str))
    ok = all(gpu["verdict"] == "ok" for gpu in gpus.values()) and not unattributed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
