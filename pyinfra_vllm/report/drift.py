"""Drift: what the deploy files planned before deploys/audit.py in the same run would
change on a host, read from pyinfra's own state.

When deploys/audit.py runs after deploys/full.py in the same ``--dry`` run
(``python -m tools.audit`` does that), ``host_plan`` reads, from pyinfra's own state,
which of the host's operations would change: ``OperationMeta.will_change``, pyinfra's
documented property for the flag it set at prepare time, the same flag its "Detected
changes" table and ``--dry --json`` plan are built from (pyinfra 3.10
``api/operation.py``; ``pyinfra_cli/prints.py`` ``build_plan_json``). The prepared state
itself (``state.ops``, ``state.op_meta``, ``host.op_hash_order``) is pyinfra's documented
API but no promise: the supported pyinfra versions are pinned
(pyinfra_vllm/core/versions.py ``PYINFRA_TESTED``) and tests/unit/test_pyinfra_contract.py
checks what this module reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyinfra.version

from pyinfra_vllm.core.versions import pyinfra_problem


def split_op_name(name: str) -> tuple[str | None, str]:
    """(stage, operation) from one pyinfra operation name.

    Each stage is a ``@deploy`` named after it, and pyinfra prefixes the operations a
    deploy adds with the names of the deploys it runs in (pyinfra 3.10
    ``api/host.py`` deploy, ``api/operation.py`` generate_operation_name), so the
    operations deploys/full.py adds are named ``"full | sysctl | Sysctl: ..."``: the
    stage is the last name before the operation's own. A path there (an older
    ``local.include`` of ``deploys/sysctl.py``) counts by its stem. Without any prefix
    the stage is read from the suite's ``"Stage: what"`` naming, e.g.
    ``"Model volume: ..."`` is ``model_volume``.
    """
    deploy, sep, operation = name.rpartition(" | ")
    if sep:
        return Path(deploy.rpartition(" | ")[2]).stem, operation
    head, sep, _ = name.partition(": ")
    return (head.strip().lower().replace(" ", "_") if sep else None), name


def _operation_words(meta: Any) -> str:
    """One operation's name as pyinfra prints it, without the stage file prefix. Names are
    shared by every host that reached the same line (``StateOperationMeta.names``)."""
    names = sorted({split_op_name(name)[1] for name in meta.names})
    words = " / ".join(names)
    if meta.args:
        words += f" ({', '.join(str(arg) for arg in meta.args)})"
    return words


def host_plan(state: Any, host: Any, refused: list[str], refusals: list[Any] | None = None,
              planned: bool = True) -> dict[str, Any]:
    """What the deploy files loaded before deploys/audit.py in this run would change on
    ``host``, read from pyinfra's prepared state.

    ``drift``: the operations that would change, in the host's order, each
    ``{"operation", "stage"}`` ([] is converged). ``conditional``: operations that
    change only when their ``_if`` holds (pyinfra's "Conditional Change" column; in this
    suite a reload or restart after another operation of the same stage changed), not
    counted as drift. ``refused``: why a stage stopped the host (pyinfra_vllm/run/context.py
    HostContext.refused); the refusing operations themselves (``refusals``: what
    ``gate.refuse`` returned, HostContext.refusals) are not drift. All three are None, with
    ``drift_note`` saying why, when no stage was planned before the audit in this run
    (``planned``), pyinfra ran with ``-y`` (no change detection), or this pyinfra is not
    one the audit was tested with.
    """
    note = pyinfra_problem(pyinfra.version.__version__)
    if note is not None:
        note = f"not checked: {note}"
    elif not state.should_check_for_changes():
        note = "not checked: pyinfra ran with -y, which skips change detection"
    elif not planned:
        note = (
            "not checked: deploys/audit.py ran alone; python -m tools.audit INVENTORY "
            "plans deploys/full.py first"
        )
    if note is not None:
        return {"drift": None, "conditional": None, "refused": None, "drift_note": note}
    drift: list[dict[str, Any]] = []
    conditional: list[dict[str, Any]] = []
    host_ops = state.ops.get(host, {})
    for op_hash in host.op_hash_order:
        op_data = host_ops.get(op_hash)
        if op_data is None:
            continue
        # With change detection on, pyinfra set the flag while preparing: will_change
        # returns it (it would run the operation again only where none was set).
        if not op_data.operation_meta.will_change:
            continue
        if any(op_data.operation_meta is refusal for refusal in refusals or ()):
            continue
        meta = state.op_meta[op_hash]
        stage = split_op_name(sorted(meta.names)[0])[0] if meta.names else None
        item = {"operation": _operation_words(meta), "stage": stage}
        (conditional if op_data.global_arguments.get("_if") else drift).append(item)
    return {"drift": drift, "conditional": conditional, "refused": list(refused),
            "drift_note": None}


def host_problems(entry: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """(operations that would change, refusal reasons) of one report entry."""
    return list(entry.get("drift") or []), list(entry.get("refused") or [])
