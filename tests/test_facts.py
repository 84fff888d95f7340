"""pyinfra-testing fixtures for the suite's facts: one class per ``tests/facts/<module>.<Fact>/``.

Each JSON file pins the fact's command, its ``requires_command`` and what ``process``
returns for one recorded output (pyinfra-testing, the fixture format pyinfra 3.10's
own tests use).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pyinfra_testing.facts import make_fact_tests

BASE = Path(__file__).parent / "facts"

# ModelContent's command carries files/verify_model.py whole, so its fixtures pin the
# output and the value, not the command (tests/unit/test_verify_model.py runs it).
pytestmark = pytest.mark.filterwarnings(
    "ignore:(?s)No command set for test.*Re-hash a downloaded model against its lock"
)

for _name in sorted(d.name for d in BASE.iterdir() if d.is_dir()):
    locals()[f"TestFact_{_name.replace('.', '_')}"] = make_fact_tests("facts", _name, BASE / _name)
