"""The benchmark's record, read back from the host after its job
(pyinfra_vllm/operations/bench.py)."""

from __future__ import annotations

import json
from pathlib import Path

from pyinfra import logger
from pyinfra.api import QuoteString, StringCommand

from facts.bench import parse_record
from pyinfra_vllm.operations.util.jobs import connector_arguments
from pyinfra_vllm.plans import bench as bench_plan


def fetch_record(state, host, out_dir: str | None) -> bool:
    """The FunctionCommand after the job: the host's record read, logged and, where the
    run collects them, written to ``out_dir/<host>.json``."""
    ok, output = host.run_shell_command(
        StringCommand("cat", QuoteString(bench_plan.LATEST_PATH)), **connector_arguments(host))
    entry = parse_record("\n".join(output.stdout_lines)) if ok else None
    if entry is None:
        host.log_styled(f"bench: no record in {bench_plan.LATEST_PATH} after the job",
                        fg="red", log_func=logger.error)
        return False
    host.log_styled(f"bench: {bench_plan.record_words(entry)}",
                    fg="green" if not entry["failed"] else "yellow", log_func=logger.info)
    if out_dir:
        Path(out_dir, f"{host.name}.json").write_text(json.dumps(entry, sort_keys=True) + "\n")
    return True
