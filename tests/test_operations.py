"""pyinfra-testing fixtures for the suite's operations: one class per
``tests/operations/<module>.<operation>/``, ``<module>`` a module of
pyinfra_vllm/operations/.

Each JSON file drives one code path: the facts the operation reads (keys use the fact's
last module segment and sorted ``k=v`` arguments), the arguments it gets (the fake host
has no inventory data), and the exact commands it yields, or its noop description
(pyinfra-testing, the fixture format pyinfra 3.10's own tests use).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pyinfra_testing.operations import make_operation_tests

BASE = Path(__file__).parent / "operations"


@pytest.fixture(autouse=True)
def _repository_root(monkeypatch):
    # Fixtures name local files from the repository root (tests/fixtures/file_set/...),
    # which operations read with Path.read_bytes, not through pyinfra-testing's patches.
    monkeypatch.chdir(Path(__file__).parents[1])


# tests/conftest.py makes FakeHost.get_fact answer None and booleans as a real host does.
for _name in sorted(d.name for d in BASE.iterdir() if d.is_dir()):
    locals()[f"TestOperation_{_name.replace('.', '_')}"] = make_operation_tests(
        "pyinfra_vllm.operations", _name, BASE / _name
    )
