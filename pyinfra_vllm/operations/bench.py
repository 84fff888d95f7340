"""Bench: the acceptance benchmark as a transient job on the host, its record fetched.

vLLM's own benchmark client (files/bench_client.py, run with the engine environment's
Python) goes through the host's gateway on loopback as a systemd job of its own
(pyinfra_vllm/operations/util/jobs.py): a dropped SSH connection or a stopped run leaves it running,
and the next run with the same shape follows it instead of starting another. The job
keeps its record on the host (pyinfra_vllm/plans/bench.py); the operation then reads it
and hands it to the operator's side of the run (``OUT_ENV``).
"""

from __future__ import annotations

import json
import os

from pyinfra import host
from pyinfra.api import FunctionCommand, QuoteString, StringCommand, operation

from facts.units import UnitState
from pyinfra_vllm.operations.util import jobs
from pyinfra_vllm.operations.util.bench import fetch_record
from pyinfra_vllm.operations.util.uploads import env_file_text
from pyinfra_vllm.plans import bench as bench_plan


@operation(is_idempotent=False)
def measured(python: str, args: list[str], env: dict[str, str], shape: dict[str, int],
             stack: str, textfile: str, client: str = bench_plan.CLIENT_FILE):
    """
    Benchmark the host through its gateway with vLLM's own client, as a transient job.

    + python: the engine environment's interpreter
    + args: the client's arguments (``bench_plan.client_args``)
    + env: the client's environment (``bench_plan.client_env``): the API key among it,
      uploaded root-only for the job and removed as it starts, never on a command line
    + shape: the benchmark's shape, recorded with the result (and naming the job)
    + stack: the stack's words, recorded with the result
    + textfile: node_exporter's textfile the job writes the figures to
    + client: local path of files/bench_client.py; engine_client.py beside it, which it
      imports (the gateway's listener checked before the key is sent), goes with it

    A job of the same shape still running (a run stopped or disconnected mid-way) is
    followed, not started again. Fails when the job fails or leaves no record.
    """
    # A run with other latency targets (--goodput) is another job, not this one followed.
    unit = jobs.unit_name("bench", json.dumps(shape, sort_keys=True), stack,
                          *bench_plan.goodput_in(args))
    meter = {"kind": "steps", "path": bench_plan.RECORD_DIR}
    if jobs.running(host.get_fact(UnitState, unit=unit)):
        yield jobs.watch(unit, "bench", meter, attached=True)
    else:
        script = f"{jobs.job_dir(unit)}/bench_client.py"
        command = StringCommand(
            "install -d -m 0755", QuoteString(bench_plan.RECORD_DIR), "&&",
            "timeout", str(bench_plan.TIMEOUT_S),
            QuoteString(python), QuoteString(script),
            "--record", QuoteString(bench_plan.RECORD_DIR),
            "--textfile", QuoteString(textfile), "--stack", QuoteString(stack),
            "--shape", QuoteString(json.dumps(shape, sort_keys=True)), "--",
            *(QuoteString(arg) for arg in args),
        )
        yield from jobs.start(unit, f"pyinfra-vllm benchmark ({stack})",
                              [("vLLM's benchmark client through the gateway", command)],
                              env=env_file_text(env),
                              payload=[(client, "bench_client.py"),
                                       (os.path.join(os.path.dirname(client),
                                                     "engine_client.py"), "engine_client.py")])
        yield jobs.watch(unit, "bench", meter)
    yield FunctionCommand(fetch_record, (), {"out_dir": os.environ.get(bench_plan.OUT_ENV)})
