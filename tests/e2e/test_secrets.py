"""Secrets on a real sandbox host, logged in as operators do (a sudo user): while a run
uploads the API keys, an unprivileged local user watches /tmp, the upload spool and the
process list; afterwards nothing it can read, and nothing pyinfra printed at -vvv, holds
a secret.

The control: pyinfra's own ``files.put`` under sudo, with a copy that fails, leaves its
upload readable in /tmp (pyinfra 3.10 ``connectors/ssh.py``: SFTP to /tmp as the login
user, then ``cp`` under sudo) and the watcher finds it. The suite's uploads go through
pyinfra_vllm/operations/util/uploads.py instead: test_serving.py watches its first run, installing
the host, and finds none staged in /tmp, where a local user could have created its name
first.

The Hugging Face token and a proxy's password, the same way, through a whole install:
the environment built and the model downloaded through a proxy that demands the
password, from a mirror over https that demands the token. Neither is in anything the
watcher saw, in pyinfra's or the audit's output, in the journal, nginx's logs, the
metrics textfiles or the audit's reports, nor in any file another user can read.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.mirror.server import MirrorServer
from sandbox.model_mirror import MIRROR_ROOT
from sandbox.proxy import Proxy
from tests.e2e.conftest import REPO_ROOT, booted
from tests.e2e.test_integrity import INSTALL_TIMEOUT
from tests.e2e.watch import PACED, as_nobody, start_watcher, stop_watcher

pytestmark = pytest.mark.e2e

API_KEY = "sk-" + secrets.token_hex(24)
DECOY = "decoy-" + secrets.token_hex(16)

@pytest.fixture(scope="module")
def host_sandbox():
    with booted(["seed"], own_caches=True) as sandbox:
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
        "grep -rlsF -- " + json.dumps(API_KEY) + " /tmp /run /etc /var /root "
        "/home; true",
    ).stdout
    assert readable.strip() == ""
    # Root's home is root's alone, its own package caches inside it (own_caches) too.
    assert sandbox.ssh(host, "stat -c %a /root").stdout.strip() == "700"
    # The live key file is root's alone.
    mode = sandbox.ssh(host, "stat -c '%a %U' /etc/nginx/vllm-api-keys.conf").stdout.split()
    assert mode == ["600", "root"]
    assert sandbox.ssh(host, "ls -A /run/pyinfra-vllm-upload").stdout.strip() == ""


HF_TOKEN = "hf_" + secrets.token_hex(20)
PROXY_PASSWORD = "pw-" + secrets.token_hex(16)
# Where a secret could be left on the host for root to find (the journal of every unit,
# nginx's logs, the metrics textfiles), read as root.
ROOT_READS = ("journalctl --no-pager -o cat; cat /var/log/nginx/* "
              "/var/lib/pyinfra-vllm-metrics/*.prom; true")


def mirror_certificate(tmp_path: Path, address: str) -> ssl.SSLContext:
    """A self-signed certificate for the mirror's address, as a server context; the PEM
    at tmp_path/mirror.pem, for the host to trust."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj",
                    "/CN=pyinfra-vllm sandbox mirror", "-addext", f"subjectAltName=IP:{address}",
                    "-keyout", str(tmp_path / "mirror.key"), "-out", str(tmp_path / "mirror.pem")],
                   check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "mirror.pem", tmp_path / "mirror.key")
    return context


def private_file(path: Path, text: str) -> Path:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(text + "\n")
    return path


def test_the_token_and_the_proxy_password_reach_no_other_user_and_no_log(host_sandbox,
                                                                         tmp_path):
    # A whole install as behind a corporate proxy with a password, from a mirror over
    # https that demands the Hugging Face token: the environment's build and the model's
    # download both go through the proxy, the download sends the token.
    sandbox, host = host_sandbox
    tls = mirror_certificate(tmp_path, host.gateway)
    pem = (tmp_path / "mirror.pem").read_text()
    sandbox.ssh(host, f"printf '%s' {shlex.quote(pem)} > "
                      "/usr/local/share/ca-certificates/sandbox-mirror.crt && "
                      "update-ca-certificates >/dev/null")
    token_file = private_file(tmp_path / "hf-token", HF_TOKEN)
    with MirrorServer(MIRROR_ROOT, bind=host.gateway, token=HF_TOKEN, tls=tls) as mirror, \
            Proxy((host.gateway, 0), user="sbx", password=PROXY_PASSWORD) as proxy:
        data = [f"model_base_url={mirror.url}", f"hf_token_file={token_file}",
                f"http_proxy=http://sbx:{PROXY_PASSWORD}@{host.gateway}:{proxy.port}",
                f'api_keys=["{API_KEY}"]']
        args = [arg for pair in data for arg in ("--data", pair)]
        start_watcher(sandbox, host, seconds=INSTALL_TIMEOUT, script=PACED)
        try:
            run = sandbox.pyinfra("-vv", *args, "deploys/full.py", timeout=INSTALL_TIMEOUT)
        finally:
            seen = stop_watcher(sandbox, host)
        audit = subprocess.run(
            [sys.executable, "-m", "tools.audit", str(sandbox.inventory), *sandbox.report_data(),
             *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert audit.returncode == 0, audit.stderr[-3000:]
    print("\nproxy tunnels:", dict(proxy.tunnels), "mirror GETs:",
          sum(entry.get for entry in mirror.stats.files.values()))
    # Both were used: the model's files came from the mirror with the token, through the
    # proxy, and so did the environment's packages.
    assert mirror.stats.unauthorized == 0
    assert sum(entry.get for entry in mirror.stats.files.values()) >= 4
    assert proxy.tunnels[f"{host.gateway}:{mirror.port}"] >= 1
    assert any(target.endswith(":443") for target in proxy.tunnels), dict(proxy.tunnels)
    assert proxy.refused == 0
    root_reads = sandbox.ssh(host, ROOT_READS, timeout=120).stdout
    reports = "".join(path.read_text(errors="replace")
                      for path in Path(sandbox.reports).rglob("*") if path.is_file())
    readable = as_nobody(sandbox, host, "grep -rlsF -e " + shlex.quote(HF_TOKEN) + " -e "
                         + shlex.quote(PROXY_PASSWORD) + " /tmp /run /etc /var /root /home "
                         "/opt /srv; true").stdout
    assert readable.strip() == ""
    for secret in (HF_TOKEN, PROXY_PASSWORD):
        for place, text in (("the watcher", seen), ("pyinfra's output", run.stdout + run.stderr),
                            ("the audit's output", audit.stdout + audit.stderr),
                            ("the journal, nginx's logs, the textfiles", root_reads),
                            ("reports/", reports)):
            assert secret not in text, f"a secret in {place}"
