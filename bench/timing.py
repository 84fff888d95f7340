"""Time a command over several runs, or two commands in pairs, and print medians.

    python3 bench/timing.py -n 10 -- sh -c 'CHECK'
    python3 bench/timing.py -n 10 --vs 'bash /tmp/before.sh' -- bash /tmp/after.sh

One warm-up run first (not counted). With ``--vs`` the baseline and the command run in
turn, pair after pair, so that a machine's drift in load touches both alike; the result
is each one's median wall time and the median of the pairs' ratios (command / baseline).
A run that fails or passes ``--timeout`` stops the benchmark with its exit status.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def timed(argv: list[str] | str, timeout: float) -> float:
    """Seconds ``argv`` took (a string: run by the shell); exits on its failure."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(argv, shell=isinstance(argv, str), timeout=timeout,
                              stdout=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        sys.exit(f"timing: {argv!r} ran past {timeout} s")
    if proc.returncode != 0:
        sys.exit(f"timing: {argv!r} exited {proc.returncode}")
    return time.perf_counter() - start


def spread(seconds: list[float]) -> str:
    return (f"median {statistics.median(seconds):.3f} s "
            f"({min(seconds):.3f}-{max(seconds):.3f}, {len(seconds)} runs)")


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
    runs: list[float] = []
    baseline: list[float] = []
    for _ in range(options.runs):
        if options.vs:
            baseline.append(timed(options.vs, options.timeout))
        runs.append(timed(options.command, options.timeout))
    print(f"command: {spread(runs)}")
    if options.vs:
        ratios = [run / base for run, base in zip(runs, baseline, strict=True)]
        print(f"baseline: {spread(baseline)}")
        print(f"ratio command/baseline: median {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
