"""files/gpu_guard.py: every verdict, through the script's own command line.

The script runs as a subprocess with ``--snapshot FILE`` (its test/replay input), so the
exact line, the stream it goes to and the exit code are what systemd would see. The NVML
reading layer runs against a fake ``pynvml`` module put first on PYTHONPATH.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUARD = ROOT / "files" / "gpu_guard.py"

BUS = {0: "00000000:4F:00.0", 1: "00000000:52:00.0"}


def link(n: int, peer: int | None, active: bool = True) -> dict:
    return {
        "link": n,
        "active": active,
        "remote_bus_id": BUS[peer] if peer is not None and active else None,
        "remote_type": "gpu" if peer is not None and active else None,
    }


def gpu(index: int, **fields) -> dict:
    entry = {
        "index": index,
        "name": "NVIDIA A100 80GB PCIe",
        "bus_id": BUS[index],
        "mig_current": 0,
        "processes": [],
        "nvlinks": [link(n, 1 - index) for n in range(12)],
    }
    entry.update(fields)
    return entry


GOOD = {"nvml_error": None, "driver_version": "535.129.03", "gpus": [gpu(0), gpu(1)]}


def run(tmp_path: Path, snapshot: dict | None, *args: str, env: dict | None = None):
    argv = [sys.executable, str(GUARD), *args]
    if snapshot is not None:
        path = tmp_path / "snapshot.json"
        path.write_text(json.dumps(snapshot))
        argv += ["--snapshot", str(path)]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)


def guard(tmp_path: Path, snapshot: dict, *extra: str):
    return run(tmp_path, snapshot, "--expect-gpus", "2", "--devices", "0,1", *extra)


def assert_fails(result, line: str) -> None:
    assert (result.returncode, result.stdout, result.stderr) == (1, "", line + "\n")


def test_ok_with_nvlink(tmp_path):
    result = guard(tmp_path, GOOD, "--require-nvlink")
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == (
        "gpu-guard: ok: 2 GPU(s) [0,1] NVIDIA A100 80GB PCIe, MIG off, no compute process, "
        "NVLink GPU0-GPU1 12 link(s), driver 535.129.03\n"
    )


def test_ok_without_nvlink_check_says_nothing_about_links(tmp_path):
    snapshot = copy.deepcopy(GOOD)
    for entry in snapshot["gpus"]:
        entry["nvlinks"] = None
    result = guard(tmp_path, snapshot)
    assert result.returncode == 0
    assert result.stdout == (
        "gpu-guard: ok: 2 GPU(s) [0,1] NVIDIA A100 80GB PCIe, MIG off, no compute process, "
        "driver 535.129.03\n"
    )


def test_nvml_missing(tmp_path):
    snapshot = {"nvml_error": "NVML Shared Library Not Found", "gpus": []}
    assert_fails(guard(tmp_path, snapshot, "--require-nvlink"),
                 "gpu-guard: NVML unavailable: NVML Shared Library Not Found")


def test_driver_library_mismatch(tmp_path):
    snapshot = {"nvml_error": "RM has detected an NVML/RM version mismatch.", "gpus": []}
    assert_fails(guard(tmp_path, snapshot),
                 "gpu-guard: NVML unavailable: RM has detected an NVML/RM version mismatch.")


def test_too_few_gpus_and_absent_index(tmp_path):
    snapshot = {**GOOD, "gpus": [gpu(0)]}
    assert_fails(
        guard(tmp_path, snapshot),
        "gpu-guard: expected at least 2 GPU(s), NVML sees 1; "
        "GPU 1 not found (NVML indexes: 0)",
    )


def test_device_index_absent(tmp_path):
    result = run(tmp_path, GOOD, "--expect-gpus", "2", "--devices", "0,3")
    assert_fails(result, "gpu-guard: GPU 3 not found (NVML indexes: 0, 1)")


def test_mig_on(tmp_path):
    snapshot = {**GOOD, "gpus": [gpu(0), gpu(1, mig_current=1)]}
    assert_fails(
        guard(tmp_path, snapshot),
        "gpu-guard: GPU 1 has MIG mode enabled (vLLM needs whole GPUs; "
        "the deploy's mig stage turns it off)",
    )


def test_mig_unsupported_is_not_a_problem(tmp_path):
    snapshot = {**GOOD, "gpus": [gpu(0, mig_current=None), gpu(1, mig_current=None)]}
    assert guard(tmp_path, snapshot).returncode == 0


def test_foreign_process(tmp_path):
    holders = [
        {"pid": 812, "name": "python3", "used_mib": 40960},
        {"pid": 913, "name": None, "used_mib": None},
    ]
    snapshot = {**GOOD, "gpus": [gpu(0, processes=holders), gpu(1)]}
    assert_fails(
        guard(tmp_path, snapshot),
        "gpu-guard: GPU 0 is in use by pid 812 (python3, 40960 MiB), pid 913 (name unknown)",
    )


def test_process_on_a_gpu_not_used_is_ignored(tmp_path):
    snapshot = {**GOOD, "gpus": [gpu(0), gpu(1, processes=[{"pid": 5, "name": "x"}])]}
    result = run(tmp_path, snapshot, "--expect-gpus", "1", "--devices", "0")
    assert result.returncode == 0
    assert result.stdout.startswith("gpu-guard: ok: 1 GPU(s) [0] ")


def test_no_nvlink_between_the_pair(tmp_path):
    inactive = [link(n, None, active=False) for n in range(12)]
    snapshot = {**GOOD, "gpus": [gpu(0, nvlinks=inactive), gpu(1, nvlinks=None)]}
    assert_fails(
        guard(tmp_path, snapshot, "--require-nvlink"),
        "gpu-guard: no active NVLink between GPU 0 and GPU 1 (NVLink not supported on GPU 1)",
    )
    # The same GPUs pass when NVLink is not required (allow_pcie_tensor_parallel).
    assert guard(tmp_path, snapshot).returncode == 0


def test_nvlink_to_a_third_gpu_does_not_join_the_pair(tmp_path):
    elsewhere = [{"link": 0, "active": True, "remote_bus_id": "00000000:99:00.0",
                  "remote_type": "gpu"}]
    snapshot = {**GOOD, "gpus": [gpu(0, nvlinks=elsewhere), gpu(1, nvlinks=[])]}
    assert_fails(guard(tmp_path, snapshot, "--require-nvlink"),
                 "gpu-guard: no active NVLink between GPU 0 and GPU 1")


def test_nvlink_seen_from_one_end_in_another_bus_id_spelling(tmp_path):
    # sysfs spelling, lower case, 4-digit domain; and only GPU 1 reports the link.
    one_end = [{"link": 3, "active": True, "remote_bus_id": "0000:4f:00.0", "remote_type": None}]
    snapshot = {**GOOD, "gpus": [gpu(0, nvlinks=[]), gpu(1, nvlinks=one_end)]}
    result = guard(tmp_path, snapshot, "--require-nvlink")
    assert result.returncode == 0
    assert "NVLink GPU0-GPU1 1 link(s)" in result.stdout


def test_nvswitch_joins_the_pair(tmp_path):
    switch = [{"link": n, "active": True, "remote_bus_id": "00000000:C1:00.0",
               "remote_type": "switch"} for n in range(18)]
    snapshot = {**GOOD, "gpus": [gpu(0, nvlinks=switch), gpu(1, nvlinks=switch)]}
    result = guard(tmp_path, snapshot, "--require-nvlink")
    assert result.returncode == 0
    assert "NVLink GPU0-GPU1 18 link(s)" in result.stdout


def test_every_problem_on_one_line(tmp_path):
    snapshot = {**GOOD, "gpus": [
        gpu(0, mig_current=1, processes=[{"pid": 7, "name": "vllm", "used_mib": 1}], nvlinks=[]),
        gpu(1, nvlinks=[]),
    ]}
    assert_fails(
        guard(tmp_path, snapshot, "--require-nvlink"),
        "gpu-guard: GPU 0 has MIG mode enabled (vLLM needs whole GPUs; the deploy's mig stage "
        "turns it off); GPU 0 is in use by pid 7 (vllm, 1 MiB); "
        "no active NVLink between GPU 0 and GPU 1",
    )


def test_json_prints_the_snapshot_and_keeps_the_exit_code(tmp_path):
    result = guard(tmp_path, GOOD, "--json")
    assert (result.returncode, result.stderr) == (0, "")
    assert json.loads(result.stdout) == {"ok": True, "problems": [], "snapshot": GOOD}
    # A saved --json output is a valid --snapshot input (replay).
    bad = {**GOOD, "gpus": [gpu(0), gpu(1, mig_current=1)]}
    saved = json.loads(guard(tmp_path, bad, "--json").stdout)
    assert saved["ok"] is False
    assert guard(tmp_path, saved).returncode == 1


@pytest.mark.parametrize(
    ("args", "line"),
    [
        ((), "gpu-guard: bad arguments: the following arguments are required: --expect-gpus"),
        (("--expect-gpus", "2", "--devices", "0,1,2"),
         "gpu-guard: bad arguments: --devices lists 3 GPU(s) but --expect-gpus is 2"),
        (("--expect-gpus", "2", "--devices", "0,0"),
         "gpu-guard: bad arguments: --devices '0,0' must list distinct indexes >= 0"),
        (("--expect-gpus", "2", "--devices", "a,b"),
         "gpu-guard: bad arguments: --devices 'a,b' is not a comma-separated list of indexes"),
        (("--expect-gpus", "0"), "gpu-guard: bad arguments: --expect-gpus 0 must be >= 1"),
    ],
)
def test_bad_arguments_exit_2_on_one_line(tmp_path, args, line):
    result = run(tmp_path, None, *args)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", line + "\n")


def test_unreadable_snapshot_is_a_bad_argument(tmp_path):
    missing = tmp_path / "nope.json"
    result = run(tmp_path, None, "--expect-gpus", "1", "--snapshot", str(missing))
    assert result.returncode == 2
    assert result.stderr.startswith(f"gpu-guard: bad arguments: cannot read snapshot {missing}:")
    assert result.stderr.count("\n") == 1


def test_without_pynvml_in_this_venv(tmp_path):
    # The repository's venv has no nvidia-ml-py: the reason names the interpreter.
    probe = subprocess.run([sys.executable, "-c", "import pynvml"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("pynvml is importable here; the fake-pynvml tests cover NVML errors")
    result = run(tmp_path, None, "--expect-gpus", "2", "--devices", "0,1", "--require-nvlink")
    assert_fails(
        result,
        f"gpu-guard: NVML unavailable: pynvml is not installed in {sys.executable}'s environment",
    )


# --- the NVML reading layer, against a fake pynvml --------------------------------------
FAKE_PYNVML = textwrap.dedent(
    '''
    """A stand-in for nvidia-ml-py: two NVLink-joined A100s, driven by FAKE_NVML."""
    import os
    from types import SimpleNamespace

    MODE = os.environ.get("FAKE_NVML", "good")
    NVML_NVLINK_MAX_LINKS = 18
    NVML_VALUE_NOT_AVAILABLE = 2**64 - 1


    class NVMLError(Exception):
        pass


    class NVMLError_LibraryNotFound(NVMLError):
        def __str__(self):
            return "NVML Shared Library Not Found"


    class NVMLError_LibRmVersionMismatch(NVMLError):
        def __str__(self):
            return "RM has detected an NVML/RM version mismatch."


    class NVMLError_NotSupported(NVMLError):
        def __str__(self):
            return "Not Supported"


    class NVMLError_NoPermission(NVMLError):
        def __str__(self):
            return "Insufficient Permissions"


    class NVMLError_InvalidArgument(NVMLError):
        def __str__(self):
            return "Invalid Argument"


    class NVMLError_NotFound(NVMLError):
        def __str__(self):
            return "Not Found"


    BUS = [b"00000000:4F:00.0", b"00000000:52:00.0"]


    def nvmlInit():
        if MODE == "missing":
            raise NVMLError_LibraryNotFound()
        if MODE == "mismatch":
            raise NVMLError_LibRmVersionMismatch()


    def nvmlShutdown():
        pass


    def nvmlSystemGetDriverVersion():
        return "535.129.03"


    def nvmlDeviceGetCount():
        return 2


    def nvmlDeviceGetHandleByIndex(index):
        return index


    def nvmlDeviceGetName(handle):
        return b"NVIDIA A100 80GB PCIe"  # older nvidia-ml-py returns bytes


    def nvmlDeviceGetPciInfo(handle):
        return SimpleNamespace(busId=BUS[handle])


    def nvmlDeviceGetMigMode(handle):
        if MODE == "old-gpu":
            raise NVMLError_NotSupported()
        return [1 if MODE == "busy" and handle == 1 else 0, 0]


    def nvmlDeviceGetComputeRunningProcesses(handle):
        if MODE == "busy" and handle == 0:
            return [SimpleNamespace(pid=812, usedGpuMemory=1024 * 1024 * 1024),
                    SimpleNamespace(pid=913, usedGpuMemory=NVML_VALUE_NOT_AVAILABLE)]
        return []


    def nvmlSystemGetProcessName(pid):
        if pid == 913:
            raise NVMLError_NotFound()
        return "python3"


    def nvmlDeviceGetNvLinkState(handle, link):
        if MODE == "old-gpu":
            raise NVMLError_NotSupported()
        if link >= 12:
            raise NVMLError_InvalidArgument()
        return 0 if MODE == "busy" else 1


    def nvmlDeviceGetNvLinkRemotePciInfo(handle, link):
        return SimpleNamespace(busId=BUS[1 - handle])


    def nvmlDeviceGetNvLinkRemoteDeviceType(handle, link):
        return 0
    '''
)


@pytest.fixture()
def fake_nvml(tmp_path):
    lib = tmp_path / "fake"
    lib.mkdir()
    (lib / "pynvml.py").write_text(FAKE_PYNVML)

    def env(mode: str) -> dict:
        return {**os.environ, "PYTHONPATH": str(lib), "FAKE_NVML": mode}

    return env


def test_nvml_reading_good_host(tmp_path, fake_nvml):
    result = run(tmp_path, None, "--expect-gpus", "2", "--devices", "0,1", "--require-nvlink",
                 "--json", env=fake_nvml("good"))
    assert result.returncode == 0, result.stderr
    snapshot = json.loads(result.stdout)["snapshot"]
    assert snapshot["driver_version"] == "535.129.03"
    first = snapshot["gpus"][0]
    assert (first["name"], first["bus_id"], first["mig_current"]) == (
        "NVIDIA A100 80GB PCIe", "00000000:4F:00.0", 0)
    assert len(first["nvlinks"]) == 12
    assert first["nvlinks"][0] == {"link": 0, "active": True,
                                   "remote_bus_id": "00000000:52:00.0", "remote_type": "gpu"}
    plain = run(tmp_path, None, "--expect-gpus", "2", "--require-nvlink", env=fake_nvml("good"))
    assert plain.stdout.startswith("gpu-guard: ok: 2 GPU(s) [0,1] NVIDIA A100 80GB PCIe, ")


@pytest.mark.parametrize(
    ("mode", "line"),
    [
        ("missing", "gpu-guard: NVML unavailable: NVML Shared Library Not Found"),
        ("mismatch", "gpu-guard: NVML unavailable: RM has detected an NVML/RM version mismatch."),
        ("busy", "gpu-guard: GPU 1 has MIG mode enabled (vLLM needs whole GPUs; the deploy's "
                 "mig stage turns it off); GPU 0 is in use by pid 812 (python3, 1024 MiB), "
                 "pid 913 (name unknown); no active NVLink between GPU 0 and GPU 1"),
        ("old-gpu", "gpu-guard: no active NVLink between GPU 0 and GPU 1 "
                    "(NVLink not supported on GPU 0, 1)"),
    ],
)
def test_nvml_reading_failures(tmp_path, fake_nvml, mode, line):
    result = run(tmp_path, None, "--expect-gpus", "2", "--devices", "0,1", "--require-nvlink",
                 env=fake_nvml(mode))
    assert_fails(result, line)
