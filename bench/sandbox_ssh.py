"""What one of the tests' ssh calls to a sandbox host costs: a connection of its own (key
exchange, login) against the host's shared one (sandbox/hosts.py ``ssh_argv`` given the
host's directory: OpenSSH's ControlMaster). bench/sandbox_ssh.md has the figures.

    .venv/bin/python -m sandbox up --hosts 1
    .venv/bin/python bench/sandbox_ssh.py [CALLS]      # default 20 of each, in turn

Root, from the repository root, against the sandbox's first host. Each call runs what
the tests' ``Sandbox.ssh`` runs (``sudo -n sh -c true`` as the operator), timed from
this machine; the two ways alternate, after one call of each that is not counted (the
shared connection is made by the first). Prints the median, min and max of each way and
the median of the pairs' ratios.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sandbox import hosts  # noqa: E402


def timed(argv: list[str]) -> float:
    start = time.monotonic()
    subprocess.run([*argv, "--", "sudo -n sh -c true"], check=True, capture_output=True,
                   timeout=60)
    return time.monotonic() - start


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    host = hosts.Host(**hosts.load_state()["hosts"][0])
    ways = {"own connection": hosts.ssh_argv(host.address),
            "shared connection": hosts.ssh_argv(host.address, host.dir)}
    for argv in ways.values():
        timed(argv)  # not counted: the shared connection is made here
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(calls):
        for name, argv in ways.items():
            seconds[name].append(timed(argv))
    for name, times in seconds.items():
        print(f"{name}: median {statistics.median(times):.3f} s "
              f"(min {min(times):.3f}, max {max(times):.3f}, {calls} calls)")
    ratios = [own / shared for own, shared in zip(*seconds.values(), strict=True)]
    print(f"own / shared, pair by pair: median {statistics.median(ratios):.1f}x")


if __name__ == "__main__":
    main()
