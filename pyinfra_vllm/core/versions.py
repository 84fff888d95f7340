"""The pyinfra releases the audit was tested with, compared as numbers
(facts/versions.py ``version_tuple``, shared with the facts that read versions)."""

from __future__ import annotations

from facts.versions import version_tuple

# The pyinfra releases the audit was tested with (pyproject.toml pins the same range):
# its drift reads pyinfra's prepared state (pyinfra_vllm/report/drift.py), whose layout pyinfra
# documents but does not promise to keep; tests/unit/test_pyinfra_contract.py checks it.
PYINFRA_TESTED = ((3, 10), (3, 11))  # from, up to but not including


def pyinfra_problem(version: str) -> str | None:
    """Why the audit cannot trust pyinfra ``version``, or None when it was tested."""
    low, high = PYINFRA_TESTED
    if low <= version_tuple(version)[:2] < high:
        return None
    tested = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
    return (f"pyinfra {version} is outside the versions the audit was tested with ({tested}): "
            "its drift could read a changed pyinfra wrongly; install the pinned one "
            "(pip install -r requirements.lock)")
