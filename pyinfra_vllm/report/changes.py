"""What changed since the previous audit: the report's ``changes`` field and its
Markdown section.

Pure functions over two reports as their JSON files hold them (pyinfra_vllm/report/runs.py);
the previous one may come from an older version of the suite, so every field is read
with a default and a field it lacks is not compared (never reported as a change).

``changes(previous, report)`` returns::

    {"previous": {"generated_at", "file"} | None,
     "added": [host], "removed": [host],
     "hosts": {host: [change]}}

``added``: hosts in this report only; ``removed``: hosts in the previous one only (taken
out of the inventory, or left out of this run by ``--limit``). Each change of a host in
both is ``{"field", "before", "after"}`` for a value (verdict, driver, gpus, cuda,
drift: the count of operations, None when not checked, GPU health) and ``{"field", "added",
"removed"}`` for a list (operations, refused, findings); each GPU-health counter that
moved is ``{"field": "gpu_counter", "gpu", "counter", "before", "after"}``. A host that
did not change has no key.
"""

from __future__ import annotations

from typing import Any

from pyinfra_vllm.report.text import markdown_text

# (field, label, where in an entry); the labels are what people read.
VALUES: tuple[tuple[str, str], ...] = (
    ("verdict", "verdict"),
    ("drift", "drift (operations that would change)"),
    ("driver", "driver"),
    ("cuda", "CUDA (driver)"),
    ("gpus", "GPU count"),
    ("health", "GPU health"),
)
LISTS: tuple[tuple[str, str], ...] = (
    ("operations", "operations that would change"),
    ("refused", "refused"),
    ("findings", "findings"),
)
LABELS = dict(VALUES + LISTS)
_ABSENT = object()


def _value(entry: dict[str, Any], field: str) -> Any:
    """One compared value of an entry, or _ABSENT when its report does not carry it."""
    summary = entry.get("summary") or {}
    if field == "verdict":
        return summary.get("verdict", _ABSENT)
    if field == "driver":
        return summary.get("driver_version", _ABSENT)
    if field == "cuda":
        return summary.get("cuda_version", _ABSENT)
    if field == "gpus":
        return summary.get("gpu_count", _ABSENT)
    if field == "health":
        return summary.get("health", _ABSENT)
    if field == "drift":
        if "drift" not in entry:
            return _ABSENT
        return None if entry["drift"] is None else len(entry["drift"])
    raise KeyError(field)


def _items(entry: dict[str, Any], field: str) -> list[str] | None:
    """One compared list of an entry as sentences, or None when not known."""
    if field == "operations":
        drift = entry.get("drift")
        if drift is None:
            return None
        return [f"{d.get('operation')} [{d.get('stage') or '-'}]" for d in drift]
    value = entry.get(field)
    return None if value is None else [str(item) for item in value]


def host_changes(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """The changes of one host between two of its entries ([] when none)."""
    found: list[dict[str, Any]] = []
    for field, _label in VALUES:
        old, new = _value(before, field), _value(after, field)
        if old is _ABSENT or new is _ABSENT or old == new:
            continue
        found.append({"field": field, "before": old, "after": new})
    for field, _label in LISTS:
        old_items, new_items = _items(before, field), _items(after, field)
        if old_items is None or new_items is None:
            continue
        added = [item for item in new_items if item not in old_items]
        removed = [item for item in old_items if item not in new_items]
        if added or removed:
            found.append({"field": field, "added": added, "removed": removed})
    return found + counter_changes(before.get("gpu_health"), after.get("gpu_health"))


def counter_changes(before: dict[str, Any] | None,
                    after: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each GPU-health counter that moved between two entries' ``gpu_health``, by GPU
    ({"field": "gpu_counter", "gpu", "counter", "before", "after"}); a GPU or counter
    one side lacks is not compared."""
    found: list[dict[str, Any]] = []
    if not before or not after:
        return found
    for bus in sorted(set(before) & set(after)):
        old = before[bus].get("counters") or {}
        new = after[bus].get("counters") or {}
        index = after[bus].get("index")
        gpu = f"GPU{index} {bus}" if index is not None else f"GPU {bus}"
        found += [{"field": "gpu_counter", "gpu": gpu, "counter": name,
                   "before": old[name], "after": new[name]}
                  for name in sorted(set(old) & set(new)) if old[name] != new[name]]
    return found


def changes(previous: dict[str, Any] | None, report: dict[str, Any],
            previous_file: str | None = None) -> dict[str, Any]:
    """The report's ``changes`` field: ``report`` against ``previous`` (None: no earlier
    report in the directory)."""
    if previous is None:
        return {"previous": None, "added": [], "removed": [], "hosts": {}}
    old, new = previous.get("hosts") or {}, report.get("hosts") or {}
    hosts = {}
    for name in sorted(set(old) & set(new)):
        found = host_changes(old[name], new[name])
        if found:
            hosts[name] = found
    return {
        "previous": {"generated_at": previous.get("generated_at"), "file": previous_file},
        "added": sorted(set(new) - set(old)),
        "removed": sorted(set(old) - set(new)),
        "hosts": hosts,
    }


def _shown(value: Any) -> str:
    if value is None:
        return "not checked"
    return "none" if value == "" else str(value)


def change_words(change: dict[str, Any]) -> list[str]:
    """One change in sentences: one for a value, one per item for a list."""
    if change["field"] == "gpu_counter":
        delta = change["after"] - change["before"]
        return [f"{change['gpu']} {change['counter']}: {change['before']} → "
                f"{change['after']} ({delta:+d})"]
    label = LABELS[change["field"]]
    if "before" in change:
        return [f"{label}: {_shown(change['before'])} → {_shown(change['after'])}"]
    return ([f"{label}, new: {item}" for item in change["added"]]
            + [f"{label}, gone: {item}" for item in change["removed"]])


def previous_words(found: dict[str, Any]) -> str:
    """Which report this one is compared with, in a sentence."""
    previous = found.get("previous")
    if previous is None:
        return "No earlier audit report in this directory: nothing to compare with."
    name = f" ({previous['file']})" if previous.get("file") else ""
    return f"Compared with the audit of {previous.get('generated_at') or '?'}{name}."


def markdown_changes(found: dict[str, Any] | None) -> list[str]:
    """The Markdown section "Changed since the previous audit" ([] without ``changes``)."""
    if found is None:
        return []
    lines = ["## Changed since the previous audit", "", _md(previous_words(found)), ""]
    if found.get("previous") is None:
        return lines
    lines += [f"- Host added: {_md(name)}" for name in found["added"]]
    lines += [f"- Host not in this audit (removed from the inventory, or left out by "
              f"--limit): {_md(name)}" for name in found["removed"]]
    for name, host in found["hosts"].items():
        lines += [f"- {_md(name)}: {_md(words)}" for change in host for words in change_words(change)]
    if not (found["added"] or found["removed"] or found["hosts"]):
        lines.append("Nothing changed: same hosts, verdicts, drift, driver, GPUs and findings.")
    return lines + [""]


def _md(text: Any) -> str:
    """A value read from a host or an earlier report as Markdown text that stays one list
    item, with no link, code span or HTML of its own."""
    return markdown_text(text)
