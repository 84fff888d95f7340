"""A watcher on a sandbox host, run as ``nobody`` while a pyinfra run works: what an
unprivileged local user can see of the run (tests/e2e/test_secrets.py and
tests/e2e/test_serving.py)."""

from __future__ import annotations

WATCH_SECONDS = 240

# Runs as `nobody` on the host: every readable upload in /tmp and the spool, the name of
# every upload pyinfra stages in /tmp (readable or not), and every command line, as fast
# as it can loop, until the deadline or the stop file.
WATCHER = r"""
end=$(( $(date +%s) + {seconds} ))
while [ "$(date +%s)" -lt "$end" ] && [ ! -e /run/watch-stop ]; do
    cat /tmp/pyinfra-* /run/pyinfra-vllm-upload/*/* 2>/dev/null
    ls -d /tmp/pyinfra-* 2>/dev/null | sed "s|^|tmp-name: |"
    ps -eo args 2>/dev/null
done
"""


def as_nobody(sandbox, host, script: str, *, check: bool = True):
    quoted = script.replace("'", "'\"'\"'")
    return sandbox.ssh(host, f"setpriv --reuid=nobody --regid=nogroup --clear-groups "
                             f"sh -c '{quoted}'", check=check, timeout=WATCH_SECONDS + 60)


def start_watcher(sandbox, host, seconds: float = WATCH_SECONDS,
                  script: str | None = None) -> None:
    sandbox.ssh(host, "rm -f /run/watch-stop /root/watch.log")
    quoted = (script or WATCHER).format(seconds=int(seconds)).replace("'", "'\"'\"'")
    sandbox.ssh(host, "systemd-run --unit secret-watch -p StandardOutput=file:/root/watch.log "
                      "-p User=nobody -p Group=nogroup "
                      f"sh -c '{quoted}'")


def stop_watcher(sandbox, host) -> str:
    sandbox.ssh(host, "touch /run/watch-stop; for i in $(seq 50); do "
                      "systemctl is-active -q secret-watch || break; sleep 0.1; done")
    return sandbox.ssh(host, "cat /root/watch.log").stdout


# Only the names of the uploads pyinfra stages in /tmp, every 20 ms: light enough to run
# beside a whole install.
TMP_NAMES = r"""
end=$(( $(date +%s) + {seconds} ))
while [ "$(date +%s)" -lt "$end" ] && [ ! -e /run/watch-stop ]; do
    ls -d /tmp/pyinfra-* 2>/dev/null | sed "s|^|tmp-name: |"
    sleep 0.02
done
"""


# The watcher's reads at a pace that leaves a whole install its CPUs: the same reads,
# every 50 ms.
PACED = WATCHER.replace("\ndone\n", "\n    sleep 0.05\ndone\n")
