"""Facts about the running engine, asked on the host itself: what it serves
(``/v1/models``) and a few of its own metrics (``/metrics``).

Absent (None) where curl is missing or the engine does not answer: a stopped or
starting engine is a state the audit reports, never a failed host.
"""

from __future__ import annotations

import json
from typing import Any

from pyinfra.api import FactBase, QuoteString, StringCommand
from typing_extensions import override

# The engine's counters and gauges the audit shows (vLLM 0.6 named the KV gauge after
# the GPU cache; 0.17 after the KV cache).
METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)
ENV_FILE = "/etc/vllm/vllm.env"


def parse_engine(lines: list[str]) -> dict[str, Any] | None:
    """The fact's output: the served models (id, max_model_len) and METRICS, summed over
    their labels; None when the engine gave no model list."""
    section, models_text = None, []
    metrics: dict[str, float] = {}
    for line in lines:
        if line in ("## models", "## metrics"):
            section = line[3:]
        elif section == "models":
            models_text.append(line)
        elif section == "metrics" and line.startswith("vllm:"):
            series, _, value = line.rpartition(" ")
            name = series.split("{", 1)[0]
            if name not in METRICS:
                continue
            try:
                metrics[name] = metrics.get(name, 0.0) + float(value)
            except ValueError:
                continue
    try:
        answer = json.loads("\n".join(models_text))
    except ValueError:
        return None
    if not isinstance(answer, dict) or not isinstance(answer.get("data"), list):
        return None
    models = [{"id": entry.get("id"), "max_model_len": entry.get("max_model_len")}
              for entry in answer["data"] if isinstance(entry, dict)]
    return {"models": models, "metrics": metrics}


class EngineServing(FactBase[dict[str, Any] | None]):
    """
    Returns what the engine at ``url`` serves, read on the host:

    .. code:: python

        {"models": [{"id": "sandbox/tiny-qwen2", "max_model_len": 131072}],
         "metrics": {"vllm:num_requests_running": 0.0, "vllm:kv_cache_usage_perc": 0.0,
                     "vllm:prompt_tokens_total": 6176.0, ...}}

    An engine that demands a key (one that listens beyond loopback) gets the one in its
    own environment file, handed to curl on its standard input: never on a command line.
    """

    @override
    def requires_command(self, url: str) -> str:
        return "curl"

    @override
    def command(self, url: str) -> StringCommand:
        base = QuoteString(url.rstrip("/"))
        return StringCommand(
            "{ ! test -r", ENV_FILE, "|| { set -a; .", ENV_FILE, "; set +a; }; };",
            "echo '## models';",
            'printf \'%s\' "${VLLM_API_KEY:+header = \\"Authorization: Bearer $VLLM_API_KEY\\"}"',
            "| curl -s -m 10 -K - ", StringCommand(base, "/v1/models", _separator=""),
            "; echo; echo '## metrics';",
            "curl -s -m 10", StringCommand(base, "/metrics", _separator=""),
            "| grep '^vllm:' ; true",
        )

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        return parse_engine(output)
