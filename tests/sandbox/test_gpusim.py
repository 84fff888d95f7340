"""The GPU simulator (sandbox/gpusim): state transitions and output layouts, run as subprocesses
against a temporary state file. No containers, no root needed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

GPUSIM = Path(__file__).resolve().parents[2] / "sandbox" / "gpusim"
# The repository's copy of the recorded outputs (tests/fixtures/nvidia), so CI needs
# nothing outside the checkout.
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia"
H200 = FIXTURES / "h200-ubuntu2404-driver580"



@pytest.fixture
def env(tmp_path, monkeypatch):
    values = {"GPUSIM_STATE": str(tmp_path / "state.json"), "GPUSIM_ASSUME_ROOT": "1",
              "GPUSIM_TIME": "1796454127"}
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    spawned: list[int] = []
    yield {**os.environ, **values, "_spawned": spawned}
    for pid in spawned:  # only the processes these tests started
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def run(env: dict, program: str, *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in env.items() if not k.startswith("_")}
    return subprocess.run([sys.executable, str(GPUSIM / program), *args], env=clean,
                          capture_output=True, text=True, timeout=30)


def smi(env: dict, *args: str) -> subprocess.CompletedProcess[str]:
    return run(env, "nvidia_smi.py", *args)


def ctl(env: dict, *args: str) -> subprocess.CompletedProcess[str]:
    proc = run(env, "gpusimctl.py", *args)
    assert proc.returncode == 0, proc.stderr
    return proc


def query(env: dict, fields: str, gpu: str = "0") -> str:
    proc = smi(env, "-i", gpu, f"--query-gpu={fields}", "--format=csv,noheader")
    assert proc.returncode == 0, proc.stdout
    return proc.stdout.strip()


def attach(env: dict, gpu: int = 0) -> int:
    pid = int(ctl(env, "attach-process", "--gpu", str(gpu), "--name", "python3",
                  "--used-mib", "2048").stdout)
    env["_spawned"].append(pid)
    return pid


def state(env: dict) -> dict:
    return json.loads(Path(env["GPUSIM_STATE"]).read_text())


# ------------------------------------------------------------------------- state transitions


def test_mig_enable_with_a_client_is_only_pending(env):
    ctl(env, "init", "--scenario", "seed")
    attach(env)
    proc = smi(env, "-i", "0", "-mig", "1")
    assert proc.returncode == 0
    assert proc.stdout.startswith(
        "Warning: MIG mode is in pending enable state for GPU 00000000:17:00.0:"
        "In use by another client\n")
    assert proc.stdout.endswith("All done.\n")
    assert query(env, "mig.mode.current,mig.mode.pending") == "Disabled, Enabled"
    assert "Enabled*" in smi(env).stdout  # the table marks a pending change


def test_mig_enable_on_idle_bare_metal_a100_applies_at_once(env):
    ctl(env, "init", "--scenario", "seed")
    proc = smi(env, "-i", "0", "-mig", "1")
    assert proc.stdout == "Enabled MIG Mode for GPU 00000000:17:00.0\nAll done.\n"
    assert query(env, "mig.mode.current,mig.mode.pending") == "Enabled, Enabled"


def test_mig_enable_without_driver_reset_stays_pending(env):
    ctl(env, "init", "--scenario", "seed")
    ctl(env, "configure", "--mig-auto-reset", "off")
    proc = smi(env, "-i", "1", "-mig", "1")
    assert "pending enable state for GPU 00000000:65:00.0:Not Supported" in proc.stdout
    assert query(env, "mig.mode.current,mig.mode.pending", "1") == "Disabled, Enabled"


def test_reset_refused_while_a_process_holds_the_gpu(env):
    ctl(env, "init", "--scenario", "seed")
    attach(env)
    smi(env, "-i", "0", "-mig", "1")
    before = state(env)["gpus"]
    proc = smi(env, "-i", "0", "-r")
    assert proc.returncode == 255
    assert proc.stdout.startswith(
        "GPU 00000000:17:00.0 is currently in use by another process.\n\n"
        "1 device is currently being used by one or more other processes (e.g., Fabric Manager,")
    assert state(env)["gpus"] == before
    assert query(env, "mig.mode.current,mig.mode.pending") == "Disabled, Enabled"


def test_reset_after_detach_applies_pending_mig(env):
    ctl(env, "init", "--scenario", "seed")
    pid = attach(env)
    smi(env, "-i", "0", "-mig", "1")
    ctl(env, "detach-process", "--pid", str(pid))
    proc = smi(env, "-i", "0", "--gpu-reset")
    assert proc.returncode == 0
    assert proc.stdout == "GPU 00000000:17:00.0 was successfully reset.\nAll done.\n"
    assert query(env, "mig.mode.current,mig.mode.pending") == "Enabled, Enabled"


def test_dead_processes_are_pruned(env):
    ctl(env, "init", "--scenario", "seed")
    pid = attach(env)
    assert query(env, "memory.used") == "2052 MiB"
    os.kill(pid, signal.SIGKILL)
    for _ in range(50):
        if "No running processes found" in smi(env).stdout:
            break
        time.sleep(0.1)
    assert query(env, "memory.used") == "4 MiB"


def test_persistence_on_with_the_daemon_off_after_its_stop(env, tmp_path):
    ctl(env, "init", "--scenario", "seed")
    assert query(env, "persistence_mode") == "Disabled"
    clean = {k: v for k, v in env.items() if not k.startswith("_")}
    daemon = subprocess.Popen(
        [sys.executable, str(GPUSIM / "nvidia_persistenced.py"), "--user",
         "nvidia-persistenced", "--persistence-mode", "--verbose", "--gpusim-foreground",
         "--gpusim-pid-dir", str(tmp_path / "run")], env=clean, stderr=subprocess.PIPE)
    try:
        pidfile = tmp_path / "run" / "nvidia-persistenced.pid"
        for _ in range(100):
            if pidfile.exists():
                break
            time.sleep(0.05)
        assert pidfile.read_text().strip() == str(daemon.pid)
        assert query(env, "persistence_mode", "0,1") == "Enabled\nEnabled"
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=10)
    assert daemon.returncode == 0
    assert not pidfile.exists()
    assert query(env, "persistence_mode", "0,1") == "Disabled\nDisabled"


def test_daemon_with_no_persistence_mode_leaves_it_off(env, tmp_path):
    """Ubuntu's unit passes --no-persistence-mode: the daemon runs, persistence stays off."""
    ctl(env, "init", "--scenario", "seed")
    clean = {k: v for k, v in env.items() if not k.startswith("_")}
    daemon = subprocess.Popen(
        [sys.executable, str(GPUSIM / "nvidia_persistenced.py"), "--no-persistence-mode",
         "--gpusim-foreground", "--gpusim-pid-dir", str(tmp_path / "run")], env=clean)
    try:
        for _ in range(100):
            if (tmp_path / "run" / "nvidia-persistenced.pid").exists():
                break
            time.sleep(0.05)
        assert query(env, "persistence_mode") == "Disabled"
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=10)


def test_legacy_persistence_mode_messages(env):
    ctl(env, "init", "--scenario", "seed")
    proc = smi(env, "-i", "1", "-pm", "1")
    assert proc.stdout == "Enabled persistence mode for GPU 00000000:65:00.0.\nAll done.\n"
    assert query(env, "persistence_mode", "1") == "Enabled"
    proc = smi(env, "-pm", "0")
    assert proc.stdout == ("Disabled persistence mode for GPU 00000000:17:00.0.\n"
                           "Disabled persistence mode for GPU 00000000:65:00.0.\nAll done.\n")


def test_boot_applies_pending_mig_and_clears_persistence(env, tmp_path):
    ctl(env, "init", "--scenario", "seed")
    proc_root = tmp_path / "proc-driver"
    ctl(env, "boot", "--proc-root", str(proc_root), "--no-udev")  # continues the init state
    attach(env, 1)
    smi(env, "-i", "1", "-mig", "1")
    smi(env, "-pm", "1")
    assert query(env, "mig.mode.current,mig.mode.pending,persistence_mode", "1") == \
        "Disabled, Enabled, Enabled"
    ctl(env, "boot", "--proc-root", str(proc_root), "--no-udev")
    assert query(env, "mig.mode.current,mig.mode.pending,persistence_mode", "1") == \
        "Enabled, Enabled, Disabled"
    assert "No running processes found" in smi(env).stdout
    assert (proc_root / "nvidia" / "version").read_text() == (
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  "
        "Thu Oct 19 18:56:32 UTC 2023\n"
        "GCC version:  gcc version 11.4.0 (Ubuntu 11.4.0-1ubuntu1~22.04)\n")


ALL_QUERIES = [
    [], ["-L"], ["-q"], ["--query-gpu=index,name", "--format=csv"],
    ["--query-compute-apps=pid", "--format=csv"], ["topo", "-m"], ["topo", "-p2p", "r"],
    ["nvlink", "--status"], ["-pm", "1"], ["-i", "0", "-mig", "1"], ["-r"],
]


@pytest.mark.parametrize("args", ALL_QUERIES, ids=lambda a: " ".join(a) or "table")
def test_mismatch_fails_every_query_like_nvml(env, args):
    ctl(env, "init", "--scenario", "mismatch")
    proc = smi(env, *args)
    assert proc.returncode == 18
    assert proc.stdout == ("Failed to initialize NVML: Driver/library version mismatch\n"
                           "NVML library version: 535.129\n")


def test_mismatch_ends_with_a_reboot_and_proc_shows_the_loaded_module(env, tmp_path):
    ctl(env, "init", "--scenario", "mismatch")
    proc_root = tmp_path / "proc-driver"
    ctl(env, "boot", "--proc-root", str(proc_root), "--no-udev")  # first boot: still old
    assert "Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023" in \
        (proc_root / "nvidia" / "version").read_text()
    assert smi(env).returncode == 18
    ctl(env, "boot", "--proc-root", str(proc_root), "--no-udev")  # a reboot loads the new one
    assert smi(env).returncode == 0
    assert "535.129.03" in (proc_root / "nvidia" / "version").read_text()


def test_install_on_a_bare_host_needs_a_reboot(env, tmp_path):
    proc_root = tmp_path / "proc-driver"
    assert smi(env).returncode == 9  # nothing installed yet
    ctl(env, "install-driver", "--version", "535.129.03")  # what the postinst does
    proc = smi(env, "-L")
    assert proc.returncode == 9
    assert proc.stdout.startswith("NVIDIA-SMI has failed because it couldn't communicate")
    ctl(env, "boot", "--proc-root", str(proc_root), "--no-udev")
    assert smi(env, "-L").stdout.count("NVIDIA A100 80GB PCIe") == 2
    assert (proc_root / "nvidia" / "version").is_file()


def test_errors_and_exit_codes(env):
    ctl(env, "init", "--scenario", "seed")
    proc = smi(env, "--query-gpu=index,bogus", "--format=csv")
    assert (proc.returncode, proc.stdout) == (2, 'Field "bogus" is not a valid field to query.\n')
    proc = smi(env, "--frobnicate")
    assert proc.returncode == 2
    assert proc.stdout == ("ERROR: Option --frobnicate is not recognized. "
                           "Please run 'nvidia-smi -h' for help.\n")
    assert smi(env, "-i", "7", "-L").returncode == 6


# ------------------------------------------------------------------------------- layouts


def test_queries_units_and_compute_apps(env):
    ctl(env, "init", "--scenario", "seed")
    proc = smi(env, "--query-gpu=index,memory.total,memory.used,power.limit,compute_cap,count",
               "--format=csv")
    assert proc.stdout == ("index, memory.total [MiB], memory.used [MiB], power.limit [W], "
                           "compute_cap, count\n0, 81920 MiB, 4 MiB, 300.00 W, 8.0, 2\n"
                           "1, 81920 MiB, 4 MiB, 300.00 W, 8.0, 2\n")
    apps = "--query-compute-apps=gpu_uuid,pid,process_name,used_memory"
    assert smi(env, apps, "--format=csv").stdout == \
        "gpu_uuid, pid, process_name, used_gpu_memory [MiB]\n"
    assert smi(env, apps, "--format=csv,noheader").stdout == ""
    pid = attach(env, 1)
    uuid = query(env, "uuid", "1")
    assert smi(env, apps, "--format=csv,noheader,nounits").stdout == \
        f"{uuid}, {pid}, python3, 2048\n"


def test_seed_topology_nvlink_and_pcie_variant(env):
    ctl(env, "init", "--scenario", "seed")
    topo = smi(env, "topo", "-m").stdout.splitlines()
    assert topo[1] == "GPU0\t X \tNV12\t0-31,64-95\t0\t\tN/A"
    links = smi(env, "nvlink", "-s").stdout.splitlines()
    assert links[0].startswith("GPU 0: NVIDIA A100 80GB PCIe (UUID: GPU-")
    assert links[1:13] == [f"\t Link {n}: 25 GB/s" for n in range(12)]
    assert len(links) == 26
    ctl(env, "init", "--scenario", "pcie")
    assert smi(env, "topo", "-m").stdout.splitlines()[1].startswith("GPU0\t X \tPHB\t")
    assert smi(env, "topo", "-p2p", "r").stdout.splitlines()[1] == " GPU0\tX\tOK\t"
    assert smi(env, "nvlink", "-s").stdout == (
        "GPU 0: NVIDIA A100 80GB PCIe\n"
        "NVML: Unable to retrieve NVLink information as all links are inActive\n"
        "GPU 1: NVIDIA A100 80GB PCIe\n"
        "NVML: Unable to retrieve NVLink information as all links are inActive\n")


# A public capture of `nvidia-smi` on two A100 80GB PCIe at these bus ids, driver 535.129.03
# (github.com, a Slurm/MIG write-up; values copied, the blank separator line restored to the
# 89 spaces other R535 captures have).
R535_A100_PAIR = """\
+---------------------------------------------------------------------------------------+
| NVIDIA-SMI 535.129.03             Driver Version: 535.129.03   CUDA Version: 12.2     |
|-----------------------------------------+----------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id        Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |         Memory-Usage | GPU-Util  Compute M. |
|                                         |                      |               MIG M. |
|=========================================+======================+======================|
|   0  NVIDIA A100 80GB PCIe          Off | 00000000:17:00.0 Off |                    0 |
| N/A   46C    P0              63W / 300W |      4MiB / 81920MiB |      0%      Default |
|                                         |                      |             Disabled |
+-----------------------------------------+----------------------+----------------------+
|   1  NVIDIA A100 80GB PCIe          Off | 00000000:65:00.0 Off |                    0 |
| N/A   50C    P0              76W / 300W |      4MiB / 81920MiB |      0%      Default |
|                                         |                      |             Disabled |
+-----------------------------------------+----------------------+----------------------+
""" + " " * 89 + """
+---------------------------------------------------------------------------------------+
| Processes:                                                                            |
|  GPU   GI   CI        PID   Type   Process name                            GPU Memory |
|        ID   ID                                                             Usage      |
|=======================================================================================|
|  No running processes found                                                           |
+---------------------------------------------------------------------------------------+
"""


def test_r535_table_matches_a_real_a100_pcie_capture(env):
    ctl(env, "init", "--scenario", "pcie")
    out = smi(env).stdout
    first, rest = out.split("\n", 1)
    assert first.endswith(" 2026       ")
    assert rest == R535_A100_PAIR


def test_r535_process_row_layout(env):
    ctl(env, "init", "--scenario", "seed")
    pid = attach(env, 0)
    st = state(env)
    st["processes"][0].update(name="/usr/local/parabricks/binaries//bin/bwa", used_mib=16594)
    Path(env["GPUSIM_STATE"]).write_text(json.dumps(st))
    row = f"|    0   N/A  N/A {pid:>9}      C   .../local/parabricks/binaries//bin/bwa    16594MiB |"
    assert row in smi(env).stdout.splitlines()  # row layout of a real R535 capture


@pytest.mark.parametrize("args,fixture", [
    (["topo", "-m"], "topo-m.txt"),
    (["topo", "-p2p", "r"], "topo-p2p-r.txt"),
    (["-L"], "L.txt"),
    (["nvlink", "-s"], "nvlink-s.txt"),
    (["mig", "-lgi"], "mig-lgi.txt"),
    (["--query-gpu=index,name,uuid,pci.bus_id,memory.total,mig.mode.current,mig.mode.pending,"
      "persistence_mode,driver_version,temperature.gpu,power.limit,clocks.max.sm,"
      "ecc.mode.current", "--format=csv"], "query-gpu-csv.txt"),
    (["--query-gpu=index,name,uuid,memory.total,mig.mode.current,persistence_mode,"
      "driver_version", "--format=csv,noheader,nounits"], "query-gpu-csv-noheader-nounits.txt"),
])
def test_h200_host_byte_for_byte(env, args, fixture):
    ctl(env, "init", "--scenario", "h200")
    assert smi(env, *args).stdout == (H200 / fixture).read_text()


def test_h200_compute_capability_byte_for_byte(env):
    ctl(env, "init", "--scenario", "h200")
    capture = H200.parent / "h200-device-20261203" / "query-gpu-bus-id-compute-cap.txt"
    proc = smi(env, "--query-gpu=pci.bus_id,compute_cap", "--format=csv,noheader")
    assert proc.stdout == capture.read_text()


def test_h200_default_table_apart_from_the_timestamp(env):
    ctl(env, "init", "--scenario", "h200")
    mine = smi(env).stdout.split("\n", 1)
    real = (H200 / "smi.txt").read_text().split("\n", 1)
    assert mine[1] == real[1]
    assert len(mine[0]) == len(real[0]) and mine[0].endswith("       ")


def test_h200_q_lines_appear_in_the_capture_in_order(env):
    ctl(env, "init", "--scenario", "h200")
    real = iter((H200 / "q.txt").read_text().split("\n"))
    for line in smi(env, "-q").stdout.split("\n"):
        if line.startswith("Timestamp"):
            continue
        assert any(candidate == line for candidate in real), line


def test_r555_table_matches_the_4x_a100_sxm4_capture(env):
    ctl(env, "init", "--scenario", "seed")
    st = state(env)
    st["driver"].update(installed_version="555.42.02", module_version="555.42.02",
                        cuda_version="12.5")
    template = st["gpus"][0]
    st["gpus"] = []
    for index, (bus, temp, draw) in enumerate([("68", 25, 59), ("9E", 22, 60), ("C2", 23, 58),
                                               ("D4", 23, 58)]):
        st["gpus"].append({**template, "index": index, "name": "NVIDIA A100-SXM4-80GB",
                           "pci_bus_id": f"00000000:{bus}:00.0", "temperature_c": temp,
                           "power_draw_w": draw, "power_limit_w": 500.0,
                           "memory_base_used_mib": 1, "persistence_legacy": True})
    Path(env["GPUSIM_STATE"]).write_text(json.dumps(st))
    fixture = (FIXTURES / "smi-4xA100-sxm4-80gb-driver555-01.txt").read_text()
    assert smi(env).stdout.split("\n", 1)[1] == fixture  # the capture has no timestamp line


def test_mismatch_and_proc_formats_follow_the_fixtures(env, tmp_path):
    real = (FIXTURES / "smi-error-driver-library-version-mismatch-01.txt").read_text()
    ctl(env, "init", "--scenario", "mismatch")
    assert smi(env).stdout.splitlines()[0] == real.splitlines()[0]
    ctl(env, "init", "--scenario", "h200")
    ctl(env, "boot", "--proc-root", str(tmp_path), "--no-udev")
    assert (tmp_path / "nvidia" / "version").read_text() == \
        (H200 / "proc-driver-nvidia-version.txt").read_text()


def test_seed580_is_the_seed_pair_on_the_580_driver_in_r580_layouts(env):
    """The example fleet's hosts: two NVLink-joined A100s whose driver (580.159.04, the
    H200 capture's) carries the CUDA 13 stack; the parsers read its R580 outputs."""
    topology_facts = pytest.importorskip("facts.topology")
    ctl(env, "init", "--scenario", "seed580")
    header = smi(env).stdout.splitlines()[2]
    assert "Driver Version: 580.159.04" in header and "CUDA Version: 13.0" in header
    assert smi(env, "--query-gpu=index,name,driver_version,compute_cap",
               "--format=csv,noheader").stdout == (
        "0, NVIDIA A100 80GB PCIe, 580.159.04, 8.0\n1, NVIDIA A100 80GB PCIe, 580.159.04, 8.0\n")
    assert "|  GPU   GI   CI              PID   Type" in smi(env).stdout  # R580's process table
    topology = topology_facts.parse_topology(smi(env, "topo", "-m").stdout.splitlines())
    assert topology["links"]["GPU0"]["GPU1"] == "NV12"
    links = topology_facts.parse_nvlink_status(smi(env, "nvlink", "-s").stdout.splitlines())
    assert [len(links[gpu]) for gpu in (0, 1)] == [12, 12]


def test_parsers_read_the_simulator_output(env, tmp_path):
    """The product's nvidia-smi parsers (facts/topology.py, facts/driver.py) and the
    tensor-parallel link verdict (pyinfra_vllm/plans/topology.py) on the simulator's seed
    output."""
    topology_facts = pytest.importorskip("facts.topology")
    topology_plan = pytest.importorskip("pyinfra_vllm.plans.topology")
    driver_facts = pytest.importorskip("facts.driver")
    ctl(env, "init", "--scenario", "seed")
    topology = topology_facts.parse_topology(smi(env, "topo", "-m").stdout.splitlines())
    assert topology["links"]["GPU0"]["GPU1"] == "NV12"
    assert topology_plan.tp_link_verdict(topology, 2)["nvlink"] is True
    links = topology_facts.parse_nvlink_status(smi(env, "nvlink", "--status").stdout.splitlines())
    for gpu in (0, 1):
        assert len(links[gpu]) == 12
        assert all(link["active"] and link["speed_gbps"] == 25.0 for link in links[gpu])
    ctl(env, "init", "--scenario", "mismatch")
    ctl(env, "boot", "--proc-root", str(tmp_path), "--no-udev")
    error = driver_facts.parse_nvml_error(smi(env, "-L").stdout.splitlines())
    module = driver_facts.parse_kernel_module(
        (tmp_path / "nvidia" / "version").read_text().splitlines())
    assert module == {"version": "535.104.05", "open": False}
    assert error["nvml_library_version"] == "535.129"
    packages = {"nvidia-utils-535-server": "535.129.03-0ubuntu0.22.04.1"}
    assert "reboot required" in driver_facts.module_mismatch(module, packages, error)


# ------------------------------------------------------------------------------ packages


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="dpkg-deb missing")
def test_debs_names_versions_depends_and_files(tmp_path):
    from sandbox.gpusim.build_debs import build, build_repo

    debs = build(tmp_path / "debs")
    version = "535.129.03-0ubuntu0.22.04.1"
    names = {d.name.split("_")[0]: d for d in debs}
    assert set(names) == {f"{p}-535-server" for p in (
        "nvidia-utils", "nvidia-compute-utils", "libnvidia-compute", "nvidia-kernel-common",
        "nvidia-dkms", "nvidia-headless")}

    def field(deb, key):
        return subprocess.run(["dpkg-deb", "-f", str(deb), key], capture_output=True,
                              text=True, check=True).stdout.strip()

    def files(deb):
        listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True,
                                 check=True).stdout.splitlines()
        return {line.split()[-1].lstrip(".") for line in listing if not line.endswith("/")}

    for deb in debs:
        assert field(deb, "Version") == version
        assert field(deb, "Architecture") == "all"
    assert field(names["nvidia-utils-535-server"], "Depends") == "python3"
    assert files(names["nvidia-utils-535-server"]) == {"/usr/bin/nvidia-smi"}
    assert files(names["nvidia-compute-utils-535-server"]) == {
        "/usr/bin/nvidia-persistenced", "/lib/systemd/system/nvidia-persistenced.service"}
    assert files(names["nvidia-dkms-535-server"]) == {
        "/usr/sbin/gpusimctl", "/lib/systemd/system/gpusim-boot.service",
        "/usr/local/bin/dmesg"}
    headless = field(names["nvidia-headless-535-server"], "Depends")
    assert f"nvidia-dkms-535-server (= {version})" in headless
    assert "nvidia-utils" not in headless  # as on Ubuntu: install nvidia-utils as well

    with_scripts = subprocess.run(["dpkg-deb", "-I", str(names["nvidia-dkms-535-server"]),
                                   "postinst"], capture_output=True, text=True, check=True)
    assert "gpusimctl install-driver --version 535.129.03" in with_scripts.stdout
    assert subprocess.run(["sh", "-n"], input=with_scripts.stdout, text=True).returncode == 0

    repo = build_repo(debs, tmp_path / "repo")
    packages = (repo / "Packages").read_text()
    assert packages.count("Package: ") == 6
    assert "Filename: ./nvidia-utils-535-server_535.129.03-0ubuntu0.22.04.1_all.deb" in packages
    assert (repo / "Packages.gz").is_file() and "SHA256:" in (repo / "Release").read_text()


def test_the_plan_gives_the_580_scenarios_one_set_and_the_bare_repo_both_branches(
        tmp_path, monkeypatch):
    from sandbox import gpu

    monkeypatch.setattr(gpu, "CACHE_DIR", tmp_path)
    plan = gpu._build(lambda _: None)
    assert {deb.name.split("_")[0] for deb in plan.debs_for("seed")} == {
        f"{p}-535-server" for p in ("nvidia-utils", "nvidia-compute-utils",
                                    "libnvidia-compute", "nvidia-kernel-common",
                                    "nvidia-dkms", "nvidia-headless")}
    assert plan.debs_for("seed580") == plan.debs_for("h200")
    assert {deb.name.split("_")[1] for deb in plan.debs_for("seed580")} == {
        "580.159.04-0ubuntu0.22.04.1"}
    packages = (plan.repo_dir / "Packages").read_text()
    assert packages.count("Package: ") == 12
    assert "Package: nvidia-headless-535-server\n" in packages
    assert "Package: nvidia-headless-580-server\n" in packages
    assert gpu._build(lambda _: None) == plan  # built once per source hash


# ---------------------------------------------------------------------------- GPU health


# The health captures of the H200 host and the health/ set live in the shared fixture
# folder; the repository copy (tests/fixtures/nvidia) is preferred where it has them.
SHARED = Path("/work/shared/fixtures/nvidia")


def fixture(rel: str) -> str:
    for base in (FIXTURES, SHARED):
        if (base / rel).is_file():
            return (base / rel).read_text()
    pytest.skip(f"fixture {rel} not present")


def dmesg(env: dict, *args: str) -> subprocess.CompletedProcess[str]:
    return run({**env, "TZ": "UTC"}, "dmesg.py", *args)


def no_timestamp(text: str) -> list[str]:
    return [line for line in text.split("\n") if not line.startswith("Timestamp")]


def block(text: str, head: str) -> list[str]:
    """The lines of one -q block: `head` and the deeper-indented lines after it."""
    lines = text.split("\n")
    start = lines.index(head)
    depth = len(head) - len(head.lstrip())
    out = [head]
    for line in lines[start + 1:]:
        if not line.strip() or len(line) - len(line.lstrip()) <= depth:
            break
        out.append(line)
    return out


@pytest.mark.parametrize("display", ["ECC", "ROW_REMAPPER", "PAGE_RETIREMENT", "PERFORMANCE"])
def test_h200_health_blocks_byte_for_byte(env, display):
    real = fixture(f"h200-ubuntu2404-driver580/q-d-{display}.txt")
    ctl(env, "init", "--scenario", "h200")
    assert no_timestamp(smi(env, "-q", "-d", display).stdout) == no_timestamp(real)


def test_h200_temperature_power_keys_and_whole_q_values(env):
    real = fixture("h200-ubuntu2404-driver580/q-d-TEMPERATURE,POWER.txt")
    ctl(env, "init", "--scenario", "h200")
    mine = smi(env, "-q", "-d", "TEMPERATURE,POWER").stdout
    # Same lines and keys (this capture was taken at another temperature and power draw).
    assert [line.split(":")[0] for line in mine.split("\n")] == \
        [line.split(":")[0] for line in real.split("\n")]
    # The whole -q, where the values are those of q.txt: every health line is there.
    whole = smi(env, "-q").stdout.split("\n")
    capture = (H200 / "q.txt").read_text().split("\n")
    for head in ("    Temperature", "    GPU Power Readings", "    Remapped Rows",
                 "    ECC Errors", "    Clocks Event Reasons", "        GPU Link Info"):
        assert block("\n".join(whole), head) == block("\n".join(capture), head), head
    assert "        Replays Since Reset                            : 1" in whole


def test_h200_combined_display_and_hidden_nvlink(env):
    ctl(env, "init", "--scenario", "h200")
    both = smi(env, "-q", "-d", "ECC,ROW_REMAPPER").stdout
    ecc = fixture("h200-ubuntu2404-driver580/q-d-ECC.txt")
    rows = fixture("h200-ubuntu2404-driver580/q-d-ROW_REMAPPER.txt")
    assert no_timestamp(both) == no_timestamp(ecc)[:-2] + no_timestamp(rows)[8:]
    proc = smi(env, "nvlink", "-e")
    assert (proc.returncode, proc.stdout) == (0, fixture("h200-ubuntu2404-driver580/nvlink-e.txt"))
    assert smi(env, "nvlink", "--errorcounters", "-i", "0").stdout == ""


# The A100-SXM4-40GB 535.161.08 `-q -d ECC` capture's block (public, see README.md), and the
# A10 535.129.03 capture's Clocks Event Reasons and Remapped Rows lines (healthy values).
R535_ECC = """\
    ECC Mode
        Current                           : Enabled
        Pending                           : Enabled
    ECC Errors
        Volatile
            SRAM Correctable              : 0
            SRAM Uncorrectable Parity     : 0
            SRAM Uncorrectable SEC-DED    : 0
            DRAM Correctable              : {vc}
            DRAM Uncorrectable            : {vu}
        Aggregate
            SRAM Correctable              : 0
            SRAM Uncorrectable Parity     : 0
            SRAM Uncorrectable SEC-DED    : 0
            DRAM Correctable              : {ac}
            DRAM Uncorrectable            : {au}
            SRAM Threshold Exceeded       : No
        Aggregate Uncorrectable SRAM Sources
            SRAM L2                       : 0
            SRAM SM                       : 0
            SRAM Microcontroller          : 0
            SRAM PCIE                     : 0
            SRAM Other                    : 0"""


def ecc_block(vc=0, vu=0, ac=0, au=0) -> list[str]:
    return R535_ECC.format(vc=vc, vu=vu, ac=ac, au=au).split("\n")


def test_r535_healthy_blocks_follow_the_535_captures(env):
    ctl(env, "init", "--scenario", "seed")
    out = smi(env, "-q", "-i", "0").stdout
    lines = out.split("\n")
    at = lines.index("    ECC Mode")
    assert lines[at:at + 23] == ecc_block()
    a10 = fixture("health/q-A10-driver535-remapped-rows-pending-uncorrectable4-01.txt")
    assert block(out, "    Clocks Event Reasons") == block(a10, "    Clocks Event Reasons")
    real_rows = block(a10, "    Remapped Rows")
    mine_rows = block(out, "    Remapped Rows")
    assert [line.split(":")[0] for line in mine_rows] == [line.split(":")[0] for line in real_rows]
    assert "            Max                           : 640 bank(s)" in mine_rows
    link = block(out, "        GPU Link Info")
    assert link[2:4] == ["                Max                       : 4",
                         "                Current                   : 4"]
    assert link[-2:] == ["                Max                       : 16x",
                         "                Current                   : 16x"]
    assert block(out, "    Temperature")[1:3] == [
        "        GPU Current Temp                  : 46 C",
        "        GPU T.Limit Temp                  : N/A"]
    assert "        Power Draw                        : 63.00 W" in lines
    # Two GPUs: an empty line between their blocks.
    assert "\n\nGPU 00000000:65:00.0\n" in smi(env, "-q", "-d", "ECC").stdout


def test_fault_ecc_uncorrectable_remaps_a_row_and_logs_xid_48_and_63(env):
    ctl(env, "init", "--scenario", "seed")
    ctl(env, "fault", "0", "ecc-uncorrectable", "3")
    ecc = smi(env, "-q", "-d", "ECC", "-i", "0").stdout.split("\n")
    assert ecc[9:32] == ecc_block(vu=3, au=3)
    rows = block(smi(env, "-q", "-d", "ROW_REMAPPER", "-i", "0").stdout, "    Remapped Rows")
    assert rows[1:5] == ["        Correctable Error                 : 0",
                         "        Uncorrectable Error               : 1",
                         "        Pending                           : Yes",
                         "        Remapping Failure Occurred        : No"]
    assert "|                    3 |" in smi(env).stdout.split("\n")[8]  # Volatile Uncorr. ECC
    assert smi(env, "-q", "-d", "ECC", "-i", "1").stdout.split("\n")[9:32] == ecc_block()
    log = dmesg(env, "--time-format", "iso").stdout.splitlines()
    assert [line.split(" ", 1)[1] for line in log] == [
        "NVRM: Xid (PCI:0000:17:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable "
        "double bit error (DBE) has been detected on GPU in the framebuffer at physAddr "
        "0x12bac1c3e0 partition 2, subpartition 1.",
        "NVRM: Xid (PCI:0000:17:00): 63, pid='<unknown>', name=<unknown>, Row Remapper: New "
        "row (0x00000012bac1c3e0) marked for remapping, reset gpu to activate."]
    # A GPU reset activates the remap and clears the volatile counts; aggregate stays.
    smi(env, "-i", "0", "-r")
    rows = smi(env, "-q", "-d", "ROW_REMAPPER,ECC", "-i", "0").stdout.split("\n")
    assert rows[9:32] == ecc_block(au=3)
    assert "        Pending                           : No" in rows
    assert "        Uncorrectable Error               : 1" in rows


def test_fault_ecc_correctable_and_remap_failure(env):
    ctl(env, "init", "--scenario", "seed")
    ctl(env, "fault", "1", "ecc-correctable", "177")
    assert smi(env, "-q", "-d", "ECC", "-i", "1").stdout.split("\n")[9:32] == \
        ecc_block(vc=177, ac=177)
    assert dmesg(env).stdout == ""  # corrected errors log no Xid
    ctl(env, "fault", "1", "remap-failure")
    rows = smi(env, "-q", "-d", "ROW_REMAPPER", "-i", "1").stdout
    assert "        Remapping Failure Occurred        : Yes\n" in rows
    assert dmesg(env, "-t").stdout == (
        "NVRM: Xid (PCI:0000:65:00): 64, pid='<unknown>', name=<unknown>, Row Remapper Error: "
        "(0x00000002eebc4100) - All reserved rows for bank are remapped\n")
    ctl(env, "init", "--scenario", "h200")
    ctl(env, "fault", "0", "remap-failure")
    ecc = smi(env, "-q", "-d", "ECC").stdout
    assert "        Unrepairable Memory                            : Yes\n" in ecc


def test_fault_xid_time_formats_one_line_per_event(env):
    ctl(env, "init", "--scenario", "seed")
    ctl({**env, "GPUSIM_TIME": "1796454000"}, "boot", "--proc-root", str(Path(env["GPUSIM_STATE"])
                                                                    .parent / "proc"), "--no-udev")
    ctl({**env, "GPUSIM_TIME": "1796454123.456789"}, "fault", "0", "xid", "79")
    ctl({**env, "GPUSIM_TIME": "1796454130.5"}, "fault", "1", "xid", "94")
    ctl({**env, "GPUSIM_TIME": "1796454131"}, "fault", "1", "xid", "999")
    plain = dmesg(env).stdout.splitlines()
    assert plain[0] == ("[  123.456789] NVRM: Xid (PCI:0000:17:00): 79, pid='<unknown>', "
                        "name=<unknown>, GPU has fallen off the bus.")
    assert plain[1] == ("[  130.500000] NVRM: Xid (PCI:0000:65:00): 94, pid='<unknown>', "
                        "name=<unknown>, Contained: SM (0x1). RST: No, D-RST: No")
    assert plain[2].endswith("): 999, pid='<unknown>', name=<unknown>, Unknown Error")
    iso = dmesg(env, "--time-format=iso").stdout.splitlines()
    assert len(iso) == 3
    assert iso[0].startswith("2026-12-05T07:02:03,456789+00:00 NVRM: Xid (PCI:0000:17:00): 79, ")
    assert dmesg(env, "-T").stdout.splitlines()[1].startswith(
        "[Sat Dec  5 07:02:10 2026] NVRM: Xid (PCI:0000:65:00): 94, ")
    assert dmesg(env, "-x", "--time-format", "iso").stdout.startswith("kern  :warn  : 2026-12-05")
    # Flags it does not know are ignored; the grep the product runs finds the lines.
    assert dmesg(env, "-k", "--level", "err,warn", "-H").stdout == dmesg(env).stdout
    grep = subprocess.run(["grep", "-E", "NVRM: Xid"], input=dmesg(env, "--time-format", "iso")
                          .stdout, capture_output=True, text=True)
    assert len(grep.stdout.splitlines()) == 3
    # A reboot starts a new, empty kernel log.
    ctl(env, "boot", "--proc-root", str(Path(env["GPUSIM_STATE"]).parent / "proc"), "--no-udev")
    assert dmesg(env).stdout == ""


def test_dmesg_without_state_prints_nothing(env):
    proc = dmesg(env)
    assert (proc.returncode, proc.stdout) == (0, "")


def test_fault_nvlink_down_and_crc(env):
    ctl(env, "init", "--scenario", "seed")
    ctl(env, "fault", "0", "nvlink-down", "3")
    for gpu in ("0", "1"):  # both ends of the bridge link
        links = smi(env, "nvlink", "-s", "-i", gpu).stdout.splitlines()
        assert links[4] == "\t Link 3: <inactive>"
        assert links[3] == links[5].replace("4", "2") == "\t Link 2: 25 GB/s"
    assert smi(env, "topo", "-m").stdout.splitlines()[1] == "GPU0\t X \tNV11\t0-31,64-95\t0\t\tN/A"
    assert "74, pid='<unknown>', name=<unknown>, NVLink: fatal error detected on link 3(" in \
        dmesg(env).stdout
    ctl(env, "fault", "1", "nvlink-crc", "12")
    errors = smi(env, "nvlink", "-e", "-i", "1").stdout.split("\n")
    assert errors[:6] == [
        f"GPU 1: NVIDIA A100 80GB PCIe (UUID: {query(env, 'uuid', '1')})",
        "\t Link 0: Replay Errors: 12", "\t Link 0: Recovery Errors: 0",
        "\t Link 0: CRC Errors: 12", "", "\t Link 1: Replay Errors: 0"]
    assert len(errors) == 1 + 12 * 4 + 1  # header, 12 links of 3 lines + blank, final newline
    topology_facts = pytest.importorskip("facts.topology")
    topology = topology_facts.parse_topology(smi(env, "topo", "-m").stdout.splitlines())
    assert topology["links"]["GPU0"]["GPU1"] == "NV11"
    parsed = topology_facts.parse_nvlink_status(smi(env, "nvlink", "-s").stdout.splitlines())
    assert [link["active"] for link in parsed[0]].count(False) == 1


def test_fault_nvlink_garbled_prints_link_speeds_no_parser_reads(env):
    ctl(env, "init", "--scenario", "seed")
    healthy = smi(env, "nvlink", "-s").stdout
    ctl(env, "fault", "0", "nvlink-garbled")
    links = smi(env, "nvlink", "-s").stdout.splitlines()
    assert links[1:13] == [f"\t Link {n}: 25.25.25 GB/s" for n in range(12)]
    assert links[14:] == [f"\t Link {n}: 25 GB/s" for n in range(12)]  # GPU 1: as it was
    topology_facts = pytest.importorskip("facts.topology")
    with pytest.raises(ValueError):
        topology_facts.parse_nvlink_status(links)
    ctl(env, "fault", "0", "clear")
    assert smi(env, "nvlink", "-s").stdout == healthy
    ctl(env, "init", "--scenario", "pcie")  # no active NVLink to garble
    assert run(env, "gpusimctl.py", "fault", "0", "nvlink-garbled").returncode != 0


def test_fault_pcie_width_and_clock_reasons(env):
    ctl(env, "init", "--scenario", "seed")
    ctl(env, "fault", "1", "pcie-width", "8")
    width = block(smi(env, "-q", "-i", "1").stdout, "            Link Width")
    assert width == ["            Link Width", "                Max                       : 16x",
                     "                Current                   : 8x"]
    ctl(env, "fault", "0", "power-brake")
    perf = block(smi(env, "-q", "-d", "PERFORMANCE", "-i", "0").stdout, "    Clocks Event Reasons")
    h100 = fixture("health/q-8xH100-driver535-hw-power-brake-slowdown-active-all-gpus-01.txt")
    real = block(h100, "    Clocks Event Reasons")
    # Same as the H100 capture, apart from Idle (no process holds the simulated GPU).
    assert perf[2:] == real[2:]
    assert perf[1] == "        Idle                              : Active"
    attach(env, 0)
    assert "        Idle                              : Not Active" in \
        smi(env, "-q", "-d", "PERFORMANCE", "-i", "0").stdout.split("\n")


@pytest.mark.parametrize("fault,active", [
    ("hw-slowdown", ["HW Slowdown"]),
    ("power-brake", ["HW Slowdown", "HW Power Brake Slowdown"]),
    ("thermal-slowdown", ["HW Slowdown", "HW Thermal Slowdown"]),
    ("sw-power-cap", ["SW Power Cap"]),
])
def test_clock_fault_r580(env, fault, active):
    ctl(env, "init", "--scenario", "h200")
    ctl(env, "fault", "0", fault)
    lines = smi(env, "-q", "-d", "PERFORMANCE").stdout.split("\n")
    reasons = block("\n".join(lines), "    Clocks Event Reasons")
    on = [line.split(":")[0].strip() for line in reasons[1:] if line.endswith(": Active")]
    assert on == ["Idle"] + active


def test_fault_clear_restores_healthy_output_byte_for_byte(env):
    ctl(env, "init", "--scenario", "seed")
    views = [["-q"], ["-q", "-d", "ECC,ROW_REMAPPER,PERFORMANCE"], [], ["nvlink", "-s"],
             ["nvlink", "-e"], ["topo", "-m"]]
    healthy = [smi(env, *v).stdout for v in views]
    for words in (["0", "ecc-uncorrectable", "2"], ["1", "ecc-correctable", "5"],
                  ["0", "remap-failure"], ["1", "xid", "79"], ["0", "nvlink-down", "0"],
                  ["1", "nvlink-crc", "4"], ["0", "pcie-width", "4"], ["1", "hw-slowdown"],
                  ["0", "thermal-slowdown"]):
        ctl(env, "fault", *words)
    assert [smi(env, *v).stdout for v in views] != healthy
    ctl(env, "fault", "0", "clear")  # GPU 0 only: its faults and both ends of its link
    assert smi(env, "topo", "-m").stdout == healthy[5]
    assert "CRC Errors: 4" in smi(env, "nvlink", "-e").stdout
    ctl(env, "fault", "clear")
    assert [smi(env, *v).stdout for v in views] == healthy
    assert dmesg(env).stdout == ""
    assert all("health" not in gpu for gpu in state(env)["gpus"])


def test_state_without_health_keys_reads_healthy(env):
    """A state file written before faults existed (no health, no -q detail keys)."""
    ctl(env, "init", "--scenario", "seed")
    healthy = smi(env, "-q", "-d", "ECC,ROW_REMAPPER,PERFORMANCE").stdout
    st = state(env)
    for gpu in st["gpus"]:
        for key in ("temperature_memory_c", "pcie_gen_max", "pcie_width_max", "health"):
            gpu.pop(key, None)
    st.pop("kernel_log", None)
    Path(env["GPUSIM_STATE"]).write_text(json.dumps(st))
    assert smi(env, "-q", "-d", "ECC,ROW_REMAPPER,PERFORMANCE").stdout == healthy
    assert "                Max                       : 4" in smi(env, "-q").stdout.split("\n")
    assert dmesg(env).stdout == ""


def test_fault_usage_errors(env):
    ctl(env, "init", "--scenario", "seed")
    for words in (["0", "bogus"], ["0", "xid"], ["7", "xid", "79"], ["0", "pcie-width", "3"],
                  ["0", "hw-slowdown", "1"]):
        proc = run(env, "gpusimctl.py", "fault", *words)
        assert proc.returncode != 0, words
    ctl(env, "init", "--scenario", "pcie")
    assert run(env, "gpusimctl.py", "fault", "0", "nvlink-down", "0").returncode != 0
