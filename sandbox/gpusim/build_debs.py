"""Build the simulated NVIDIA driver as Debian packages named like Ubuntu's, plus an apt repo.

    python3 -m sandbox.gpusim.build_debs --out DIR [--repo DIR]

Packages (Architecture: all, they only carry Python scripts), after Ubuntu's
nvidia-graphics-drivers-535-server source package:
  nvidia-utils-535-server          /usr/bin/nvidia-smi
  nvidia-compute-utils-535-server  /usr/bin/nvidia-persistenced, its unit, the system user
  libnvidia-compute-535-server     placeholder (the real one ships libnvidia-ml.so.1; NVML is
                                   not simulated)
  nvidia-kernel-common-535-server  placeholder (real: firmware, udev rules)
  nvidia-dkms-535-server           the "kernel module": gpusimctl + gpusim-boot.service, and
                                   /usr/local/bin/dmesg (the simulated kernel log)
  nvidia-headless-535-server       meta package
Like Ubuntu's, the headless meta package does not pull in nvidia-utils: install both.

Installing changes the *installed* driver version only; the loaded module changes at the next
boot (gpusim-boot.service runs `gpusimctl boot`), as with a real driver. Only dpkg-deb is needed.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAINTAINER = "pyinfra-vllm sandbox <sandbox@localhost>"
SOURCE = "nvidia-graphics-drivers-{branch}"

# Ubuntu's unit for the -server branches (canonical/nvidia-graphics-drivers): no [Install]
# section (a udev rule starts it when the module loads), StopWhenUnneeded, and
# --no-persistence-mode, so starting it alone does NOT turn persistence mode on.
# Ubuntu's unit, plus one line: PIDFile=. When sandbox hosts shared one cgroup tree
# (before sandbox/supervise.py gave each its own), systemd could not kill a unit's control
# group ("Failed to kill control group ... Input/output error") and a stop reached only
# the main PID; without PIDFile= a forking daemon's main PID is a guess, and a lost guess
# leaves the daemon running outside its unit. The daemon writes this file, as the real
# one does.
PERSISTENCED_UNIT = """\
[Unit]
Description=NVIDIA Persistence Daemon
Wants=syslog.target
StopWhenUnneeded=true
Before=systemd-backlight@backlight:nvidia_0.service

[Service]
Type=forking
PIDFile=/run/nvidia-persistenced/nvidia-persistenced.pid
ExecStart=/usr/bin/nvidia-persistenced --user nvidia-persistenced --no-persistence-mode --verbose
ExecStopPost=/bin/rm -rf /var/run/nvidia-persistenced
"""

BOOT_UNIT = """\
[Unit]
Description=gpusim: what a reboot does to the simulated GPUs (pending MIG, module load)
DefaultDependencies=no
After=local-fs.target
Before=multi-user.target nvidia-persistenced.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/sbin/gpusimctl boot

[Install]
WantedBy=multi-user.target
"""

# postinst must work in a container without a running systemd (dpkg -i in a non-booted
# nspawn): enable by symlink, reload only when systemd is PID 1.
RELOAD = '[ -d /run/systemd/system ] && systemctl daemon-reload >/dev/null 2>&1 || true\n'

DKMS_POSTINST = """\
#!/bin/sh
set -e
if [ "$1" = configure ]; then
    mkdir -p /etc/systemd/system/multi-user.target.wants
    ln -sf /lib/systemd/system/gpusim-boot.service \\
        /etc/systemd/system/multi-user.target.wants/gpusim-boot.service
    # New driver files on disk; the running module is unchanged until the next boot.
    /usr/sbin/gpusimctl install-driver --version {upstream}
    {reload}fi
exit 0
"""

DKMS_PRERM = """\
#!/bin/sh
set -e
if [ "$1" = remove ]; then
    /usr/sbin/gpusimctl remove-driver || true
    rm -f /etc/systemd/system/multi-user.target.wants/gpusim-boot.service
fi
exit 0
"""

# As Ubuntu's nvidia-compute-utils postinst does.
COMPUTE_UTILS_POSTINST = """\
#!/bin/sh
set -e
NVPD_USER="nvidia-persistenced"
if [ "$1" = configure ]; then
    if ! id "$NVPD_USER" > /dev/null 2>&1; then
        adduser --system --no-create-home --home /nonexistent \\
            --gecos 'NVIDIA Persistence Daemon' --group "$NVPD_USER" >/dev/null 2>&1 || \\
        useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin \\
            --comment 'NVIDIA Persistence Daemon' --user-group "$NVPD_USER"
    fi
    {reload}fi
exit 0
"""

PLACEHOLDER = """\
Placeholder from the pyinfra-vllm GPU simulator (gpusim).
The real package ships {what}; the simulator does not simulate it yet.
Driver version: {upstream}
"""


def upstream_of(version: str) -> str:
    """535.129.03-0ubuntu0.22.04.1 -> 535.129.03"""
    return version.split("-")[0]


def _write(root: Path, rel: str, text: str, mode: int = 0o644) -> None:
    path = root / rel.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def _script(name: str) -> str:
    return (HERE / name).read_text()


def package_specs(branch: str, version: str) -> list[dict]:
    """Name, control fields, files and maintainer scripts of each package."""
    up = upstream_of(version)
    return [
        {"name": f"nvidia-utils-{branch}", "depends": "python3",
         "description": "NVIDIA driver support binaries (simulated nvidia-smi)",
         "files": {"/usr/bin/nvidia-smi": (_script("nvidia_smi.py"), 0o755)}},
        {"name": f"nvidia-compute-utils-{branch}",
         "depends": f"python3, adduser, libnvidia-compute-{branch} (= {version})",
         "description": "NVIDIA compute utilities (simulated nvidia-persistenced)",
         "files": {"/usr/bin/nvidia-persistenced":
                   (_script("nvidia_persistenced.py"), 0o755),
                   "/lib/systemd/system/nvidia-persistenced.service":
                   (PERSISTENCED_UNIT, 0o644)},
         "postinst": COMPUTE_UTILS_POSTINST.format(reload=RELOAD)},
        {"name": f"libnvidia-compute-{branch}", "depends": "",
         "description": "NVIDIA libcompute package (placeholder; NVML is not simulated)",
         "files": {f"/usr/share/doc/libnvidia-compute-{branch}/README.gpusim":
                   (PLACEHOLDER.format(what="libnvidia-ml.so.1 (NVML) and libcuda.so.1",
                                       upstream=up), 0o644)}},
        {"name": f"nvidia-kernel-common-{branch}", "depends": "",
         "description": "Shared files used with the kernel module (placeholder)",
         "files": {f"/usr/share/doc/nvidia-kernel-common-{branch}/README.gpusim":
                   (PLACEHOLDER.format(what="GSP firmware and udev rules", upstream=up),
                    0o644)}},
        {"name": f"nvidia-dkms-{branch}",
         "depends": f"python3, nvidia-kernel-common-{branch} (= {version})",
         "description": "NVIDIA kernel module (simulated: gpusimctl and gpusim-boot.service)",
         "files": {"/usr/sbin/gpusimctl": (_script("gpusimctl.py"), 0o755),
                   "/lib/systemd/system/gpusim-boot.service": (BOOT_UNIT, 0o644),
                   # The simulated kernel log; /usr/local/bin is ahead of /usr/bin in root's
                   # PATH and sudo's secure_path, and dpkg owns no /usr/local/bin/dmesg.
                   "/usr/local/bin/dmesg": (_script("dmesg.py"), 0o755)},
         "postinst": DKMS_POSTINST.format(upstream=up, reload=RELOAD),
         "prerm": DKMS_PRERM},
        {"name": f"nvidia-headless-{branch}",
         "depends": ", ".join(f"{p}-{branch} (= {version})" for p in (
             "nvidia-dkms", "nvidia-kernel-common", "libnvidia-compute",
             "nvidia-compute-utils")),
         "description": "NVIDIA headless metapackage (simulated)", "files": {}},
    ]


def _control(spec: dict, branch: str, version: str, size_kib: int) -> str:
    fields = [("Package", spec["name"]), ("Source", SOURCE.format(branch=branch)),
              ("Version", version), ("Architecture", "all"), ("Maintainer", MAINTAINER),
              ("Installed-Size", str(max(size_kib, 1)))]
    if spec["depends"]:
        fields.append(("Depends", spec["depends"]))
    fields += [("Section", "restricted/libs"), ("Priority", "optional"),
               ("Description", spec["description"] + "\n Built by sandbox/gpusim/build_debs.py "
                "for test hosts without a GPU.")]
    return "".join(f"{k}: {v}\n" for k, v in fields)


def _build_one(spec: dict, outdir: Path, branch: str, version: str) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "pkg"
        for target, (text, mode) in spec["files"].items():
            _write(root, target, text, mode)
        size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) // 1024
        (root / "DEBIAN").mkdir(parents=True, exist_ok=True)
        _write(root, "DEBIAN/control", _control(spec, branch, version, size))
        for script in ("postinst", "prerm"):
            if script in spec:
                _write(root, f"DEBIAN/{script}", spec[script], 0o755)
        deb = outdir / f"{spec['name']}_{version}_all.deb"
        subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root),
                        str(deb)], check=True, capture_output=True, text=True)
    return deb


def build(outdir: Path, *, branch: str = "535-server",
          version: str = "535.129.03-0ubuntu0.22.04.1") -> list[Path]:
    """Build every package into outdir; returns the .deb paths."""
    if shutil.which("dpkg-deb") is None:
        raise RuntimeError("dpkg-deb is required (Debian package dpkg)")
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    return [_build_one(spec, outdir, branch, version) for spec in package_specs(branch, version)]


# ---------------------------------------------------------------------------------- apt repo


def _digests(data: bytes) -> dict[str, str]:
    return {"MD5sum": hashlib.md5(data).hexdigest(), "SHA1": hashlib.sha1(data).hexdigest(),
            "SHA256": hashlib.sha256(data).hexdigest()}


def _stanza(deb: Path) -> str:
    """What dpkg-scanpackages writes for one .deb: its control file plus where and checksums."""
    control = subprocess.run(["dpkg-deb", "-f", str(deb)], check=True, capture_output=True,
                             text=True).stdout.rstrip("\n")
    data = deb.read_bytes()
    sums = _digests(data)
    extra = [f"Filename: ./{deb.name}", f"Size: {len(data)}", f"MD5sum: {sums['MD5sum']}",
             f"SHA1: {sums['SHA1']}", f"SHA256: {sums['SHA256']}"]
    lines = control.split("\n")
    # Keep Description (and its continuation lines) last, as dpkg-scanpackages does.
    at = next(i for i, line in enumerate(lines) if line.startswith("Description:"))
    return "\n".join(lines[:at] + extra + lines[at:]) + "\n"


def build_repo(debs: list[Path], repo_dir: Path) -> Path:
    """A flat apt repository: `deb [trusted=yes] file:REPO ./` or the same over HTTP."""
    repo_dir = Path(repo_dir)
    repo_dir.mkdir(parents=True, exist_ok=True)
    copies = []
    for deb in debs:
        target = repo_dir / Path(deb).name
        shutil.copyfile(deb, target)
        copies.append(target)
    packages = "\n".join(_stanza(d) for d in sorted(copies)).encode()
    (repo_dir / "Packages").write_bytes(packages)
    (repo_dir / "Packages.gz").write_bytes(gzip.compress(packages, mtime=0))
    index = {"Packages": packages, "Packages.gz": (repo_dir / "Packages.gz").read_bytes()}
    release = ["Origin: gpusim", "Label: gpusim", "Suite: stable", "Codename: gpusim",
               "Architectures: all amd64",
               "Date: " + time.strftime("%a, %d %b %Y %H:%M:%S UTC", time.gmtime())]
    for field in ("MD5Sum", "SHA1", "SHA256"):
        key = "MD5sum" if field == "MD5Sum" else field
        release.append(f"{field}:")
        release += [f" {_digests(data)[key]} {len(data):>8} {name}" for name, data in index.items()]
    (repo_dir / "Release").write_text("\n".join(release) + "\n")
    return repo_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for the .debs")
    parser.add_argument("--repo", type=Path, help="also write a flat apt repository here")
    parser.add_argument("--branch", default="535-server")
    parser.add_argument("--version", default="535.129.03-0ubuntu0.22.04.1")
    args = parser.parse_args(argv)
    debs = build(args.out, branch=args.branch, version=args.version)
    for deb in debs:
        print(deb)
    if args.repo:
        print(build_repo(debs, args.repo))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
