"""Time a command over several runs, or two commands in pairs, and print medians.

    python3 bench/timing.py -n 10 -- sh -c 'CHECK'
    python3 bench/timing.py -n 10 --vs 'bash /tmp/before.sh' -- bash /tmp/after.sh

One warm-up run first (not counted). With ``--vs`` the baseline and the command run in
turn, pair after pair, so that a machine's drift in load touches both alike; the result
is each one's median wall time and the median of the pairs' ratios (command / baseline).
Each one's CPU (user + sys, the command's process and every descendant it waited for:
what ``wait4`` reports, as ``/usr/bin/time`` does) is printed the same way.
A run that fails or passes ``--timeout`` stops the benchmark with its exit status.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def timed(argv: list[str] | str, timeout: float) -> tuple[float, float]:
    """Wall and CPU (user + sys) seconds ``argv`` took (a string: run by the shell);
    exits on its failure."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, shell=isinstance(argv, str), stdout=subprocess.DEVNULL)
    while True:  # reaped here, not by Popen, so that wait4 gives its resource usage
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() - start > timeout:
            proc.kill()
            sys.exit(f"timing: {argv!r} ran past {timeout} s")
        time.sleep(0.005)
    wall = time.perf_counter() - start
    proc.returncode = code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"timing: {argv!r} exited {code}")
    return wall, usage.ru_utime + usage.ru_stime


def spread(seconds: list[float]) -> str:
    return (f"median {statistics.median(seconds):.3f} s "
            f"({min(seconds):.3f}-{max(seconds):.3f}, {len(seconds)} runs)")


def report(name: str, runs: list[tuple[float, float]]) -> None:
    print(f"{name}: {spread([wall for wall, _cpu in runs])}")
    print(f"{name}, CPU (user + sys): {spread([cpu for _wall, cpu in runs])}")


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--runs", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--vs", help="the baseline, a shell command, run in turn with it")
    parser.add_argument("command", nargs="+", help="the command (after --)")
    options = parser.parse_args(args)
    timed(options.command, options.timeout)
    if options.vs:
        timed(options.vs, options.timeout)
    runs: list[tuple[float, float]] = []
    baseline: list[tuple[float, float]] = []
    for _ in range(options.runs):
        if options.vs:
            baseline.append(timed(options.vs, options.timeout))
        runs.append(timed(options.command, options.timeout))
    report("command", runs)
    if options.vs:
        report("baseline", baseline)
        for index, figure in ((0, "wall"), (1, "CPU")):
            ratios = [run[index] / base[index] for run, base in zip(runs, baseline, strict=True)]
            print(f"ratio command/baseline, {figure}: median {statistics.median(ratios):.3f} "
                  f"({min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
