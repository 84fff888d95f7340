"""Write (refresh) the whole lock of a stack row: every package of its environment,
transitive ones included, pinned with hashes.

    python -m tools.stack_lock                          # every row
    python -m tools.stack_lock 0.6.3 --device cuda      # one row
    python -m tools.stack_lock 0.17.0 --device cpu --exclude-newer 2026-12-01T00:00:00Z

Needs uv (``pip install uv==0.13.9``, the version pyinfra_vllm/core/stacks.py installs on
hosts) and PyPI. Runs ``uv pip compile --universal --generate-hashes --only-binary :all:``
on the row's pins (its ``sdist_only`` packages excepted, its ``overrides`` applied) for
every Python from the row's lowest, and writes ``locks/stacks/<dist>-<version>.txt``
with a header naming the command, the date and the row's inputs-sha256. Commit the file:
the python_env stage installs only what it lists. ``--exclude-newer`` repeats an earlier
refresh (uv ignores files uploaded after that time).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from pyinfra_vllm.core.stack_locks import (
    INPUTS_HEADER,
    StackLock,
    disagreements,
    distribution,
    inputs_sha256,
    lock_path,
    overrides_text,
    parse_versions,
    requirements_text,
)
from pyinfra_vllm.core.stacks import CPU_STACKS, STACKS, StackRow


def uv_binary() -> str:
    try:
        from uv import find_uv_bin

        return str(find_uv_bin())
    except ImportError:
        found = shutil.which("uv")
        if not found:
            sys.exit("tools.stack_lock needs uv: pip install uv==0.13.9")
        return found


def compile_args(stack: StackRow, work: Path, exclude_newer: str) -> list[str]:
    (work / "requirements.in").write_text(requirements_text(stack))
    args = ["pip", "compile", "--universal", "--generate-hashes", "--no-header", "-q",
            "--python-version", stack.python_range[0], "--only-binary", ":all:",
            "--exclude-newer", exclude_newer, "--index-url", "https://pypi.org/simple"]
    for name in sorted(stack.sdist_only):
        args += ["--no-binary", name]
    if stack.overrides:
        (work / "overrides.txt").write_text(overrides_text(stack))
        args += ["--override", str(work / "overrides.txt")]
    return [*args, str(work / "requirements.in"), "-o", str(work / "lock.txt")]


def write_lock(stack: StackRow, exclude_newer: str) -> Path:
    device = stack.device
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        subprocess.run([uv_binary(), *compile_args(stack, work, exclude_newer)], check=True)
        body = (work / "lock.txt").read_text()
    header = (
        f"# The whole environment of vLLM {stack.vllm} ({distribution(stack)}, {device}): "
        "every package, pinned with its hashes.\n"
        f"# Written by: python -m tools.stack_lock {stack.vllm} --device {device} "
        f"--exclude-newer {exclude_newer}\n"
        f"# Python {stack.python_range[0]} and newer (environment markers where a "
        "version differs); installed with --require-hashes --no-deps.\n"
        f"{INPUTS_HEADER}{inputs_sha256(stack)}\n"
    )
    path = lock_path(stack)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + body)
    text = header + body
    problems = disagreements(stack, StackLock(path, text, "", parse_versions(text)))
    if problems:
        sys.exit(f"{path}: the resolve does not hold the row's pins: " + "; ".join(problems))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.stack_lock", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("versions", nargs="*", help="vLLM versions (default: every row)")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: both")
    parser.add_argument("--exclude-newer", default=datetime.now(timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ"), help="ignore files uploaded after this time (RFC 3339)")
    args = parser.parse_args(argv)
    rows = [row for device, table in (("cuda", STACKS), ("cpu", CPU_STACKS))
            if args.device in (None, device) for version, row in table.items()
            if not args.versions or version in args.versions]
    if not rows:
        parser.error("no stack row matches")
    for row in rows:
        print(write_lock(row, args.exclude_newer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
