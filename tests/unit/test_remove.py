"""The removal's re-apply of the remaining sysctl files, run by a real shell: a refusal of
another file's key (a container's read-only kernel.pid_max) passes, one of the suite's
keys fails."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[1] / "operations/remove.sysctl_reapplied/two-keys.json"


@pytest.mark.parametrize(("refused", "status"), [
    ("kernel.pid_max", 0),
    ("vm.max_map_count", 1),
    ("vmXmax_map_count", 0),  # the dots are literal: no other key matches by accident
])
def test_only_a_refusal_of_the_suites_keys_fails(tmp_path, refused, status):
    command = json.loads(FIXTURE.read_text())["commands"][0]
    fake = tmp_path / "sysctl"
    fake.write_text(f'#!/bin/sh\necho \'sysctl: permission denied on key "{refused}"\' >&2\n'
                    "exit 1\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    proc = subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True)
    assert proc.returncode == status
    assert (refused in proc.stderr) == (status == 1)
