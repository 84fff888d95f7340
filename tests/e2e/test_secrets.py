"""Secrets on a real sandbox host, logged in as operators do (a sudo user): while a run
uploads the API keys, an unprivileged local user watches /tmp, the upload spool and the
process list; afterwards nothing it can read, and nothing pyinfra printed at -vvv, holds
a secret.

The control: pyinfra's own ``files.put`` under sudo, with a copy that fails, leaves its
upload readable in /tmp (pyinfra 3.10 ``connectors/ssh.py``: SFTP to /tmp as the login
user, then ``cp`` under sudo) and the watcher finds it. The suite's uploads go through
operations/util/uploads.py instead: test_serving.py watches its first run, installing
the host, and finds none staged in /tmp, where a local user could have created its name
first.
"""

from __future__ import annotations

import json
import secrets

import pytest

from tests.e2e.conftest import booted
from tests.e2e.watch import as_nobody, start_watcher, stop_watcher

pytestmark = pytest.mark.e2e

API_KEY = "sk-" + secrets.token_hex(24)
DECOY = "decoy-" + secrets.token_hex(16)

@pytest.fixture(scope="module")
def host_sandbox():
    with booted(["seed"]) as sandbox:
        yield sandbox, sandbox.hosts[0]


def test_the_watcher_sees_what_pyinfra_leaves_in_tmp(host_sandbox, tmp_path):
    sandbox, host = host_sandbox
    deploy = tmp_path / "decoy.py"
    deploy.write_text(
        "from io import StringIO\n"
        "from pyinfra.operations import files\n"
        f"files.put(src=StringIO({DECOY!r}), dest='/nonexistent/dir/decoy', mode='600', "
        "create_remote_dir=False)\n"
    )
    start_watcher(sandbox, host)
    run = sandbox.pyinfra(str(deploy), timeout=120)
    seen = stop_watcher(sandbox, host)
    assert run.returncode == 1  # the copy failed: the upload stays in /tmp
    assert DECOY in seen
    leftover = as_nobody(sandbox, host, "cat /tmp/pyinfra-*").stdout
    assert DECOY in leftover
    sandbox.ssh(host, "rm -f /tmp/pyinfra-*")


def test_keys_never_readable_by_another_user_nor_printed(host_sandbox):
    sandbox, host = host_sandbox
    start_watcher(sandbox, host)
    run = sandbox.pyinfra("-vvv", "--data", f'api_keys=["{API_KEY}"]', "deploys/gateway.py")
    seen = stop_watcher(sandbox, host)
    assert run.returncode == 0, run.stderr[-3000:]
    # The key is live: nginx answers 200 with it.
    status = sandbox.ssh(
        host, "curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer "
              f"{API_KEY}' http://127.0.0.1:8001/v1/models").stdout
    assert status in ("200", "502")  # 502: no engine behind it, but past the key check
    assert API_KEY not in seen
    assert API_KEY not in run.stdout + run.stderr
    # Nothing another user can read holds it, anywhere it could have been left.
    readable = as_nobody(
        sandbox, host,
        "grep -rlsF -- " + json.dumps(API_KEY) + " /tmp /run /etc /var/log /var/lib /root "
        "/home; true",
    ).stdout
    assert readable.strip() == ""
    # The live key file is root's alone.
    mode = sandbox.ssh(host, "stat -c '%a %U' /etc/nginx/vllm-api-keys.conf").stdout.split()
    assert mode == ["600", "root"]
    assert sandbox.ssh(host, "ls -A /run/pyinfra-vllm-upload").stdout.strip() == ""
