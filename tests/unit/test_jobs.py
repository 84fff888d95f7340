"""Long jobs as transient units (pyinfra_vllm/operations/util/jobs.py): the progress lines, the
polling loop against a sequence of unit states, the watch's output parsing, and the job script run
for real by /bin/sh in a temporary directory (systemd's part, ExecStopPost's variables, given by
hand as systemd.exec(5) names them)."""

from __future__ import annotations

import subprocess

import pytest
from pyinfra.api import StringCommand

from pyinfra_vllm.operations.util import jobs

SIZES = {"config.json": 1_000, "model-1.safetensors": 30_000_000_000,
         "model-2.safetensors": 25_600_000_000}
RUNNING = {"active": "active", "sub": "running", "result": "success", "status": 0}
STOP_POST = {"active": "deactivating", "sub": "stop-post", "result": "success", "status": 0}


def find_lines(**files: int) -> list[str]:
    return [f"{size} {path}" for path, size in files.items()]


# --- progress -------------------------------------------------------------------------
def test_human_units():
    assert jobs.human_bytes(12_400_000_000) == "12.4 GB"
    assert jobs.human_bytes(410_000_000) == "410.0 MB"
    assert jobs.human_bytes(999) == "999 B"
    assert jobs.human_seconds(105) == "1m45s"
    assert jobs.human_seconds(7380) == "2h03m"
    assert jobs.human_seconds(40.4) == "40s"


def test_bytes_on_disk_counts_final_files_then_partial_ones_capped_at_the_lock_size():
    lines = [
        "1000 config.json",
        "30000000000 model-1.safetensors",
        # a partial download of the second shard, in files/fetch_model.py's .incoming
        "4000000000 .incoming/model-2.safetensors.part",
        # not files of the lock: the verification record, another revision's shard
        "512 .verified.json",
        "9999999 old-model.safetensors",
    ]
    assert jobs.bytes_on_disk(lines, SIZES) == 34_000_001_000
    # a final file larger than the lock says counts as the lock's size
    assert jobs.bytes_on_disk(["5000 config.json"], {"config.json": 1_000}) == 1_000
    assert jobs.bytes_on_disk([], SIZES) == 0


def test_the_model_line_gives_bytes_of_total_then_rate_and_eta():
    meter = jobs.Meter({"kind": "bytes", "path": "/srv/m", "sizes": SIZES})
    first = meter.line(find_lines(**{".incoming/model-1.safetensors.part": 6_250_000_000}),
                       now=100.0)
    assert first == "6.2 GB of 55.6 GB"
    # 6.15 GB more in 15 s: 410 MB/s; 43.2 GB left: 105 s
    second = meter.line(find_lines(**{".incoming/model-1.safetensors.part": 12_400_001_000}),
                        now=115.0)
    assert second == "12.4 GB of 55.6 GB, 410.0 MB/s, ETA 1m45s"
    stalled = meter.line(find_lines(**{".incoming/model-1.safetensors.part": 12_400_001_000}),
                         now=130.0)
    assert stalled == "12.4 GB of 55.6 GB, no new bytes in 15s"


def test_the_model_line_says_verifying_when_every_byte_is_there():
    meter = jobs.Meter({"kind": "bytes", "path": "/srv/m", "sizes": {"a": 10}})
    meter.line(["10 a"], now=1.0)
    assert meter.line(["10 a"], now=6.0) == "10 B of 10 B, verifying"


def test_the_environment_line_gives_the_step_and_the_size():
    meter = jobs.Meter({"kind": "steps", "path": "/opt/vllm/envs/e"})
    assert meter.line(["step 3/5 installing the stack lock", "size 3200000000"], now=1.0) \
        == "3/5 installing the stack lock, 3.2 GB in /opt/vllm/envs/e"
    assert meter.line(["size "], now=2.0) == "starting"


# --- the polling loop -----------------------------------------------------------------
class FakeUnit:
    """A job seen through the watch: readings in order; the clock advances by each
    sleep, as a real poll would."""

    def __init__(self, readings: list[jobs.Reading]) -> None:
        self.readings = list(readings)
        self.now = 0.0
        self.sleeps: list[float] = []
        self.reports: list[str] = []

    def read(self) -> jobs.Reading:
        return self.readings.pop(0)

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def follow(self, meter: jobs.Meter) -> tuple[bool, str]:
        return jobs.follow(self.read, self.reports.append, meter, sleep=self.sleep,
                           clock=lambda: self.now, poll_s=5.0, report_s=15.0)


def part(size: int) -> list[str]:
    return [f"{size} .incoming/a.part"]


def test_follow_reports_every_report_s_and_succeeds_on_a_success_result():
    readings = [jobs.Reading(RUNNING, part(size), None)
                for size in (0, 100, 200, 300, 400, 500, 600)]
    readings += [jobs.Reading(STOP_POST, ["1000 a"], None),
                 jobs.Reading(None, ["1000 a"], "success exited 0")]
    unit = FakeUnit(readings)
    ok = unit.follow(jobs.Meter({"kind": "bytes", "path": "/m", "sizes": {"a": 1000}}))
    assert ok == (True, "finished")
    # polled at 0, 5, ..., 40 s; a line at 0, 15 and 30 s; the rate over each 15 s
    assert unit.sleeps == [5.0] * 8
    assert unit.reports == ["0 B of 1.0 kB",
                            "300 B of 1.0 kB, 20 B/s, ETA 35s",
                            "600 B of 1.0 kB, 20 B/s, ETA 20s"]


def test_follow_fails_with_the_result_of_a_failed_job():
    unit = FakeUnit([jobs.Reading(RUNNING, [], None),
                     jobs.Reading(None, [], "exit-code exited 3")])
    assert unit.follow(jobs.Meter({"kind": "steps", "path": "/e"})) == (
        False, "failed (exit-code: exited 3)")
    assert unit.reports == ["starting"]


def test_follow_of_a_job_already_over_reports_nothing():
    # attached just as it ended: the result is there, the unit collected
    unit = FakeUnit([jobs.Reading(None, [], "success exited 0")])
    assert unit.follow(jobs.Meter({"kind": "steps", "path": "/e"})) == (True, "finished")
    assert unit.reports == [] and unit.sleeps == []


def test_follow_of_a_unit_gone_without_a_result_fails():
    unit = FakeUnit([jobs.Reading(RUNNING, [], None), jobs.Reading(None, [], None)])
    ok, words = unit.follow(jobs.Meter({"kind": "steps", "path": "/e"}))
    assert not ok
    assert words == "ended without a result (stopped before it recorded one?)"


def test_follow_of_a_failed_unit_not_yet_collected_uses_the_unit():
    failed = {"active": "failed", "sub": "failed", "result": "signal", "status": 9}
    unit = FakeUnit([jobs.Reading(failed, [], None)])
    assert unit.follow(jobs.Meter({"kind": "steps", "path": "/e"})) == (
        False, "failed (signal: status 9)")


# --- the watch's command and output ---------------------------------------------------
def test_poll_command_reads_state_progress_and_result_in_one_round_trip():
    unit = "pyinfra-vllm-env-0123456789ab"
    command = jobs.poll_command(unit, {"kind": "steps", "path": "/opt/vllm/envs/e"})
    assert command.get_raw_value() == (
        # at most 25 x 0.2 s waiting for the unit to end, on the host: no poll interval
        # lost after a job ends
        f"n=0; while [ $n -lt 25 ] && case $(systemctl show --property=ActiveState --value "
        f"-- {unit} 2>/dev/null) in active|activating|deactivating|reloading) true;; "
        "*) false;; esac; do sleep 0.2; n=$((n+1)); done; "
        "systemctl show --property=LoadState,ActiveState,SubState,Result,ExecMainStatus "
        f"-- {unit} 2>/dev/null; echo '@@pyinfra-vllm progress'; sed 's/^/step /' "
        f"/run/pyinfra-vllm/jobs/{unit}/progress 2>/dev/null; printf 'size '; du -sb "
        "/opt/vllm/envs/e 2>/dev/null | cut -f1; echo ; echo '@@pyinfra-vllm result'; cat "
        f"/run/pyinfra-vllm/jobs/{unit}/result 2>/dev/null; true")


def test_poll_command_without_a_wait_reads_at_once():
    command = jobs.poll_command("u", {"kind": "steps", "path": "/e"}, wait_s=0)
    assert command.get_raw_value().startswith("n=0; while [ $n -lt 0 ] && ")


def test_split_reading():
    reading = jobs.split_reading([
        "LoadState=loaded", "ActiveState=active", "SubState=running", "Result=success",
        "ExecMainStatus=0", "@@pyinfra-vllm progress", "1000 config.json",
        "@@pyinfra-vllm result",
    ])
    assert reading == jobs.Reading(RUNNING, ["1000 config.json"], None)
    ended = jobs.split_reading([
        "LoadState=not-found", "ActiveState=inactive", "SubState=dead", "Result=success",
        "ExecMainStatus=0", "@@pyinfra-vllm progress", "@@pyinfra-vllm result",
        "exit-code exited 1",
    ])
    assert ended == jobs.Reading(None, [], "exit-code exited 1")


def test_unit_names_are_stable_and_carry_no_argument():
    name = jobs.unit_name("model", "/srv/models/Qwen/Qwen3.6-27B", "5f1e" * 10)
    assert name == jobs.unit_name("model", "/srv/models/Qwen/Qwen3.6-27B", "5f1e" * 10)
    assert name != jobs.unit_name("model", "/srv/models/Qwen/Qwen3.6-27B", "0" * 40)
    assert name.startswith("pyinfra-vllm-model-") and len(name) == len("pyinfra-vllm-model-") + 12
    assert "Qwen" not in name


@pytest.mark.parametrize("active, expected", [
    ("active", True), ("activating", True), ("deactivating", True), ("failed", False),
    ("inactive", False)])
def test_running(active, expected):
    assert jobs.running({"active": active}) is expected


def test_running_of_an_unknown_unit():
    assert jobs.running(None) is False


# --- the job script, run by /bin/sh -------------------------------------------------------
def test_the_job_script_reads_and_removes_its_env_file_runs_steps_and_records_results(
        tmp_path, monkeypatch):
    monkeypatch.setattr(jobs, "JOB_ROOT", str(tmp_path))
    unit = "pyinfra-vllm-env-0123456789ab"
    base = tmp_path / unit
    base.mkdir()
    out = tmp_path / "out"
    script = jobs.job_script(unit, "a test job", [
        ("writing", StringCommand("echo", "$SECRET_VALUE", ">", str(out))),
        ("failing", StringCommand("true && false")),
        ("never", StringCommand("touch", str(tmp_path / "never"))),
    ])
    (base / "run.sh").write_bytes(script)
    (base / "env").write_text("SECRET_VALUE='s3cret value'\n")
    run = subprocess.run(["/bin/sh", str(base / "run.sh")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, check=False)
    # the failing step's status ends the job; the step after it never runs
    assert run.returncode == 1
    assert run.stdout == "== 1/3 writing\n== 2/3 failing\n"
    assert out.read_text() == "s3cret value\n"
    assert not (base / "env").exists()
    assert not (tmp_path / "never").exists()
    assert (base / "progress").read_text() == "2/3 failing\n"
    # The job recorded its own result as it exited; ExecStopPost (with the variables
    # systemd gives it, here other ones) leaves that record as it is.
    assert (base / "result").read_text() == "exit-code exited 1\n"
    subprocess.run(["/bin/sh", str(base / "run.sh"), "finished"], check=True,
                   env={"PATH": "/usr/bin:/bin", "SERVICE_RESULT": "success",
                        "EXIT_CODE": "exited", "EXIT_STATUS": "0"})
    assert (base / "result").read_text() == "exit-code exited 1\n"
    assert jobs.outcome(jobs.Reading(None, [], "exit-code exited 1"))[0] is False


def test_a_job_that_succeeds_records_success_itself(tmp_path, monkeypatch):
    monkeypatch.setattr(jobs, "JOB_ROOT", str(tmp_path))
    unit = "pyinfra-vllm-env-0123456789ab"
    (tmp_path / unit).mkdir()
    (tmp_path / unit / "run.sh").write_bytes(
        jobs.job_script(unit, "t", [("ok", StringCommand("true"))]))
    run = subprocess.run(["/bin/sh", str(tmp_path / unit / "run.sh")], check=False,
                         capture_output=True, env={"PATH": "/usr/bin:/bin"})
    assert run.returncode == 0
    assert (tmp_path / unit / "result").read_text() == "success exited 0\n"
    assert jobs.outcome(jobs.Reading(None, [], "success exited 0")) == (True, "finished")


def test_the_job_script_finished_removes_an_env_file_never_read(tmp_path, monkeypatch):
    # stopped before its first line ran: ExecStopPost still takes the secrets away
    monkeypatch.setattr(jobs, "JOB_ROOT", str(tmp_path))
    unit = "pyinfra-vllm-model-0123456789ab"
    (tmp_path / unit).mkdir()
    (tmp_path / unit / "run.sh").write_bytes(jobs.job_script(unit, "t", []))
    (tmp_path / unit / "env").write_text("HF_TOKEN=x\n")
    subprocess.run(["/bin/sh", str(tmp_path / unit / "run.sh"), "finished"], check=True,
                   env={"PATH": "/usr/bin:/bin", "SERVICE_RESULT": "signal",
                        "EXIT_CODE": "killed", "EXIT_STATUS": "TERM"})
    assert not (tmp_path / unit / "env").exists()
    assert (tmp_path / unit / "result").read_text() == "signal killed TERM\n"
