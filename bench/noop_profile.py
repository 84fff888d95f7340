"""Where a pyinfra run's own CPU goes: the run profiled by CPU time, not wall time.

    .venv/bin/python bench/noop_profile.py .sandbox/inventory.py deploys/full.py

Runs ``pyinfra -y ARGS...`` in this process under cProfile with ``time.process_time`` as
its clock, so time spent waiting for the hosts counts nothing. Prints the whole CPU, each
package's own share (where the instructions ran: the suite, pyinfra, paramiko and the
crypto libraries, gevent, pydantic, jinja2, Python's import machinery, the rest) and the
CPU under the run's phases (imports, settings, the one read's parse, each stage's plan).
The profiler itself adds to every figure: compare its shares, not its totals, with
bench/timing.py's medians.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from collections import defaultdict

# Where a function's own time is counted, by the first of these its file path holds.
PACKAGES = (
    ("/pyinfra_vllm/", "the suite (pyinfra_vllm)"),
    ("/facts/", "the suite (facts)"),
    ("/deploys/", "the suite (deploys)"),
    ("/pyinfra_cli/", "pyinfra (CLI)"),
    ("/pyinfra/", "pyinfra"),
    ("/paramiko/", "paramiko"),
    ("/cryptography/", "cryptography, nacl, bcrypt"),
    ("/nacl/", "cryptography, nacl, bcrypt"),
    ("/bcrypt/", "cryptography, nacl, bcrypt"),
    ("/gevent/", "gevent"),
    ("/pydantic", "pydantic"),
    ("/jinja2/", "jinja2"),
    ("<frozen importlib", "Python's import machinery"),
    ("{built-in method builtins.exec}", "module bodies run at import (exec)"),
)
# The run's phases: the CPU under the first frame of each (cumulative).
PHASES = (
    ("_find_and_load", "every import (cumulative, nested ones once)"),
    ("extract_docstrings_from_cls",
     "of which pydantic reading the settings' attribute docstrings from their source"),
    ("get_operation_order_from_stack",
     "pyinfra: each operation call's place (inspect.stack, once per operation and host)"),
    ("all_global_arguments", "pyinfra: each operation call's global arguments (type hints)"),
    ("model_validate", "settings validated (pydantic)"),
    ("read_all", "the one read: its command and its output parsed"),
)


def package_of(file: str, function: str) -> str:
    where = f"{file} {function}"
    for marker, name in PACKAGES:
        if marker in where:
            return name
    if "/lib/python3" in file and "site-packages" not in file:
        return f"the standard library: {file.rsplit('/', 1)[-1]}"
    return "the rest (click, ...)" if file != "~" else f"built-ins: {function}"


def main(args: list[str]) -> int:
    from pyinfra_cli.main import main as pyinfra_main

    sys.argv = ["pyinfra", "-y", *args]
    profile = cProfile.Profile(time.process_time)
    start = time.process_time()
    profile.enable()
    try:
        pyinfra_main()
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            print(f"pyinfra exited {exit_.code}", file=sys.stderr)
            return 1
    finally:
        profile.disable()
    total = time.process_time() - start
    stats = pstats.Stats(profile)
    own: dict[str, float] = defaultdict(float)
    phases: dict[str, float] = defaultdict(float)
    stage_plans: dict[str, float] = defaultdict(float)
    for (file, _line, function), (_cc, _nc, tottime, cumtime, callers) in stats.stats.items():
        own[package_of(file, function)] += tottime
        for name, label in PHASES:
            # The outermost frames only: a call of it from itself is not counted twice.
            if function == name and not any(caller[2] == name for caller in callers):
                phases[label] += cumtime
        if file.endswith("pyinfra_vllm/run/stage.py") and function == "run":
            stage_plans["every stage's plan (the @stage bodies, cumulative)"] += cumtime
    print(f"pyinfra's CPU under the profiler: {total:.3f} s")
    print("own CPU by package (the 12 largest):")
    for name, seconds in sorted(own.items(), key=lambda item: -item[1])[:12]:
        print(f"  {seconds:6.3f} s  {100 * seconds / total:5.1f}%  {name}")
    print("CPU under the run's phases:")
    for label, seconds in [*phases.items(), *stage_plans.items()]:
        print(f"  {seconds:6.3f} s  {100 * seconds / total:5.1f}%  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
