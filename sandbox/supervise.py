"""Keep one sandbox host's systemd-nspawn running across reboots.

Started detached (own session, output to the host's console.log) by sandbox.hosts. A `reboot`
inside the container makes systemd-nspawn exit with status 133; this loop then boots the same
host again (same overlay, netns and loop device), which is what pyinfra's server.reboot needs.
Any other exit (poweroff, SIGTERM from `down`) ends the loop. The current nspawn pid is kept in
nspawn.pid so `down` can signal that process itself.

Usage: python -m sandbox.supervise HOST_DIR
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

REBOOT_STATUS = 133
# A container that reboots in a tight loop (broken image) should not spin forever.
MAX_QUICK_REBOOTS = 5
QUICK_SECONDS = 10


def _fresh_uptime(argv: list[str]) -> list[str]:
    """Run nspawn in a new time namespace whose boot clock starts at about 1 s.

    /proc/uptime in a container is the VM's uptime, so without this a reboot never looks like
    one: pyinfra's server.reboot waits for the uptime to drop and times out. unshare enters the
    namespace itself and execs nspawn (same pid), whose children (the container) see the offset.
    """
    if not Path("/proc/self/ns/time").exists():
        return argv
    host_uptime = float(Path("/proc/uptime").read_text().split()[0])
    return ["unshare", "--time", f"--boottime={-(int(host_uptime) - 1)}", *argv]


def main(host_dir: Path) -> int:
    argv = json.loads((host_dir / "nspawn.json").read_text())
    stop_flag = host_dir / "stop"
    pid_file = host_dir / "nspawn.pid"
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: object) -> None:
        # Stop was asked for: remember it and pass it on to nspawn (orderly poweroff).
        stop_flag.touch()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    quick = 0
    boots = 0
    while not stop_flag.exists():
        boots += 1
        started = time.monotonic()
        print(f"[sandbox.supervise] boot #{boots}: {' '.join(argv)}", flush=True)
        child = subprocess.Popen(_fresh_uptime(argv), stdin=subprocess.DEVNULL)
        pid_file.write_text(f"{child.pid}\n")
        if stop_flag.exists():
            # A stop that raced with this boot: the handler may have missed the new child.
            child.terminate()
        status = child.wait()
        print(f"[sandbox.supervise] systemd-nspawn exited with {status}", flush=True)
        if status != REBOOT_STATUS:
            break
        quick = quick + 1 if time.monotonic() - started < QUICK_SECONDS else 0
        if quick >= MAX_QUICK_REBOOTS:
            print("[sandbox.supervise] rebooting too fast; giving up", flush=True)
            break
    pid_file.unlink(missing_ok=True)
    (host_dir / "exited").write_text(f"{int(time.time())}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
