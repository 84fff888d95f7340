"""file_set.present: a secret's content never reaches a command line, and the wanted mode
is compared with stat's ``%a`` whether or not it is written with a leading zero. The
commands themselves are pinned by tests/operations/file_set.present/.
"""

from __future__ import annotations

import hashlib

import pytest
from pyinfra.api import FileUploadCommand, StringCommand
from pyinfra.context import ctx_host, ctx_state
from pyinfra_testing.util import FakeState, create_host

from pyinfra_vllm.operations import file_set

SECRET = b"HF_TOKEN=hf_unit-test-secret-3b9d1e\nVLLM_API_KEY=sk-unit-test-8f2a\n"
ENV = "/etc/vllm/vllm.env"
# A file of no row of the access table (pyinfra_vllm/plans/access.py): its owner and mode
# are file_set's to keep.
PLAIN = "/etc/vllm/extra.env"


def _run(files, found):
    state = FakeState()
    host = create_host(state, facts={"files.FileDigests": {f"paths={sorted(files)}": found}})
    with ctx_state.use(state), ctx_host.use(host):
        commands = list(file_set.present._inner(files=files))
    return commands, host


@pytest.mark.parametrize("found", [{ENV: None}, {ENV: {"sha256": "0" * 64, "mode": "644", "owner": "root:root"}}])
def test_secret_content_never_in_a_command_string(found):
    commands, _ = _run({ENV: (SECRET, "0600")}, found)
    strings = [c for c in commands if isinstance(c, StringCommand)]
    uploads = [c for c in commands if isinstance(c, FileUploadCommand)]
    assert strings and len(uploads) == 1
    for command in strings:
        for text in (command.get_raw_value(), command.get_masked_value()):
            for line in SECRET.decode().splitlines():
                assert line not in text
            assert "hf_unit-test-secret" not in text and "sk-unit-test" not in text
    assert uploads[0].src.getvalue() == SECRET
    assert uploads[0].dest == f"{ENV}.pyinfra-new"


@pytest.mark.parametrize("wanted", ["0600", "600"])
def test_mode_with_or_without_leading_zero_matches_stat(wanted):
    digest = hashlib.sha256(SECRET).hexdigest()
    commands, host = _run({ENV: (SECRET, wanted)}, {ENV: {"sha256": digest, "mode": "600", "owner": "root:root"}})
    assert commands == []
    assert host.noop_description == "1 file(s) in place"


@pytest.mark.parametrize("wanted", ["0600", "600"])
def test_mode_drift_is_chmod_only_either_way(wanted):
    digest = hashlib.sha256(SECRET).hexdigest()
    commands, _ = _run({PLAIN: (SECRET, wanted)},
                       {PLAIN: {"sha256": digest, "mode": "644", "owner": "root:root"}})
    assert [c.get_raw_value() for c in commands] == [f"chmod {wanted} {PLAIN}"]


def test_owner_drift_is_chown_only():
    digest = hashlib.sha256(SECRET).hexdigest()
    found = {PLAIN: {"sha256": digest, "mode": "600", "owner": "vllm:vllm"}}
    commands, _ = _run({PLAIN: (SECRET, "600")}, found)
    assert [c.get_raw_value() for c in commands] == [f"chown root:root {PLAIN}"]


def test_a_path_of_the_access_table_gets_its_owner_and_mode_from_operations_access_only():
    # chown and chmod here follow a link; pyinfra_vllm/operations/access.py never does, and a second
    # operation changing the same mode would be drift twice.
    digest = hashlib.sha256(SECRET).hexdigest()
    found = {ENV: {"sha256": digest, "mode": "644", "owner": "vllm:vllm"}}
    commands, host = _run({ENV: (SECRET, "600")}, found)
    assert commands == []
    assert host.noop_description == "1 file(s) in place"
