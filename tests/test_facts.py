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

# ModelContent's and EnvironmentContent's commands carry files/verify_model.py and
# files/verify_env.py whole, so their fixtures pin the output and the value, not the
# command (tests/unit/test_verify_model.py and test_verify_env.py run them).
pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:(?s)No command set for test.*Re-hash a downloaded model against its lock"),
    pytest.mark.filterwarnings(
        "ignore:(?s)No command set for test.*Re-hash a Python environment"),
]

for _name in sorted(d.name for d in BASE.iterdir() if d.is_dir()):
    locals()[f"TestFact_{_name.replace('.', '_')}"] = make_fact_tests("facts", _name, BASE / _name)
