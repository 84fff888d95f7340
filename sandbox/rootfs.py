"""Build (once) and cache the Debian 12 root file system every sandbox host boots from.

The rootfs is a debootstrap minbase tree plus a few baked settings (sshd, CA bundle, pip config,
apt sources). It is cached as an extracted directory outside the repo, keyed by a hash of
everything that goes into it, so an overlay mount can use it directly as lowerdir.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import time
from pathlib import Path

from sandbox.util import CACHE_DIR, SandboxError, remove_tree, run, write_file

# Bump when the bake steps below change, so old caches are not reused.
BUILD_VERSION = "4"
SUITE = "bookworm"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")

# What the hosts need to boot and be managed, plus what later deploy stages use, so the
# e2e runs do not download them again. nginx is deliberately absent: the deploy installs it.
PACKAGES = (
    "ca-certificates",
    "curl",
    "dbus",
    "gnupg",
    "iproute2",
    "iputils-ping",
    "kmod",
    "openssh-server",
    "pciutils",
    "procps",
    "python3",
    "python3-venv",
    "sudo",
    "systemd",
    "systemd-sysv",
    "util-linux",
    "xfsprogs",
)

# The login user, as on Ubuntu's cloud images: a key, passwordless sudo, no root login.
OPERATOR = "ubuntu"
OPERATOR_UID = 1000

SSHD_CONF = f"""\
# Baked by sandbox/rootfs.py: {OPERATOR} logs in with a key and uses sudo; root cannot log in.
PermitRootLogin no
PasswordAuthentication no
KbdInteractiveAuthentication no
UseDNS no
"""

PIP_CONF = """\
# Baked by sandbox/rootfs.py: pip (also inside venvs) trusts the system bundle, which includes
# the build machine's CA certificates (a TLS-intercepting proxy would otherwise break PyPI).
[global]
cert = /etc/ssl/certs/ca-certificates.crt
"""

ENVIRONMENT = """\
REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
"""


def _apt_source_uris() -> list[tuple[str, list[str]]]:
    """(URI, suites) pairs from the machine's own apt sources, one-line and deb822 formats."""
    found: list[tuple[str, list[str]]] = []
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if path.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields = dict(
                    (m.group(1).lower(), m.group(2).strip())
                    for m in re.finditer(r"^([A-Za-z-]+):\s*(.*)$", stanza, re.M)
                )
                for uri in fields.get("uris", "").split():
                    found.append((uri, fields.get("suites", "").split()))
        else:
            for line in text.splitlines():
                parts = re.sub(r"\[.*?\]", "", line).split()
                if len(parts) >= 3 and parts[0] == "deb":
                    found.append((parts[1], [parts[2]]))
    return found


def debian_mirrors() -> tuple[str, str]:
    """The (main, security) Debian mirrors named by this machine's apt sources."""
    main = security = ""
    for uri, suites in _apt_source_uris():
        if not main and SUITE in suites:
            main = uri.rstrip("/")
        if not security and f"{SUITE}-security" in suites:
            security = uri.rstrip("/")
    return (
        main or "http://deb.debian.org/debian",
        security or "http://deb.debian.org/debian-security",
    )


def _host_ca_pem() -> bytes:
    if not HOST_CA_BUNDLE.is_file():
        raise SandboxError(f"rootfs: the CA bundle {HOST_CA_BUNDLE} is missing on this machine")
    return HOST_CA_BUNDLE.read_bytes()


def cache_key() -> str:
    """Hash of everything baked into the image."""
    main, security = debian_mirrors()
    digest = hashlib.sha256()
    for part in (BUILD_VERSION, SUITE, " ".join(PACKAGES), main, security, SSHD_CONF, PIP_CONF,
                 OPERATOR):
        digest.update(part.encode() + b"\0")
    digest.update(_host_ca_pem())
    return digest.hexdigest()[:16]


def rootfs_path() -> Path:
    return CACHE_DIR / f"rootfs-{cache_key()}"


def _split_pem(bundle: bytes) -> list[bytes]:
    return re.findall(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", bundle, re.S)


def _bake(root: Path, main: str, security: str) -> None:
    """Settings every host shares; per-host ones (keys, hostname) go into its overlay."""
    write_file(root / "etc/ssh/sshd_config.d/sandbox.conf", SSHD_CONF)
    # Host keys are generated per host into its upper dir; a shared key would make every
    # host look the same to known_hosts.
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    write_file(
        root / "etc/apt/sources.list",
        f"deb {main} {SUITE} main\n"
        f"deb {main} {SUITE}-updates main\n"
        f"deb {security} {SUITE}-security main\n",
    )
    # Each certificate separately, so update-ca-certificates keeps them on any later run.
    ca_dir = root / "usr/local/share/ca-certificates/sandbox-host"
    ca_dir.mkdir(parents=True, exist_ok=True)
    for index, pem in enumerate(_split_pem(_host_ca_pem())):
        (ca_dir / f"host-{index:03d}.crt").write_bytes(pem + b"\n")
    run(
        ["chroot", str(root), "update-ca-certificates", "--fresh"],
        step="rootfs: update-ca-certificates",
    )
    run(
        ["chroot", str(root), "useradd", "--create-home", "--shell", "/bin/bash", "--uid",
         str(OPERATOR_UID), "--user-group", OPERATOR],
        step=f"rootfs: user {OPERATOR}",
    )
    write_file(root / f"etc/sudoers.d/90-{OPERATOR}", f"{OPERATOR} ALL=(ALL:ALL) NOPASSWD: ALL\n",
               0o440)
    write_file(root / "etc/pip.conf", PIP_CONF)
    write_file(root / "etc/environment", ENVIRONMENT)
    write_file(root / "etc/fstab", "# sandbox host: root is an overlay set up by the host\n")
    # Empty machine-id: each host gets its own in its upper dir.
    write_file(root / "etc/machine-id", "")
    write_file(root / "etc/pyinfra-vllm-sandbox", f"build {BUILD_VERSION}\n")
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for item in (root / sub).glob("*"):
            if item.is_file():
                item.unlink()


def _remove_tree(path: Path) -> None:
    """rm -rf a (partial) rootfs, but never into /proc or /sys that debootstrap left mounted."""
    if not path.exists():
        return
    listing = run(["findmnt", "-rn", "-o", "TARGET"], step="rootfs: findmnt", check=False)
    inside = [t for t in listing.stdout.split() if t.startswith(str(path) + "/")]
    for target in sorted(inside, key=len, reverse=True):
        run(["umount", "-l", target], step=f"rootfs: unmount {target}", check=False)
    listing = run(["findmnt", "-rn", "-o", "TARGET"], step="rootfs: findmnt", check=False)
    if any(t.startswith(str(path) + "/") for t in listing.stdout.split()):
        raise SandboxError(f"rootfs: {path} still has mounts; remove it by hand")
    problem = remove_tree(path, step="rootfs: remove")
    if problem:
        raise SandboxError(problem)


def build(*, force: bool = False, log=print) -> Path:
    """Return the cached rootfs, building it with debootstrap first if needed."""
    final = rootfs_path()
    if final.is_dir() and not force:
        return final
    if shutil.which("debootstrap") is None:
        raise SandboxError("rootfs: debootstrap is not installed (apt-get install debootstrap)")
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + ".building")
    _remove_tree(tmp)
    main, security = debian_mirrors()
    log(f"building rootfs {final} from {main} (debootstrap, about 1-2 min)")
    started = time.monotonic()
    try:
        run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(PACKAGES)}",
                SUITE,
                str(tmp),
                main,
            ],
            step="rootfs: debootstrap",
            timeout=1800,
        )
        _bake(tmp, main, security)
    except BaseException:
        _remove_tree(tmp)
        raise
    _remove_tree(final)
    tmp.rename(final)
    log(f"rootfs built in {time.monotonic() - started:.0f}s")
    return final
