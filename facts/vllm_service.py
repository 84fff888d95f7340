"""Facts about the running engine, asked on the host itself: what it serves
(``/v1/models``) and a few of its own metrics (``/metrics``), and the command line and
environment its main process runs with (``/proc``).

Absent (None) where curl is missing or the engine does not answer: a stopped or
starting engine is a state the audit reports, never a failed host.
"""

from __future__ import annotations

import json
from typing import Any

from pyinfra.api import QuoteString, StringCommand
from typing_extensions import override

from facts.base import FactBase

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


def process_snippet(keys: list[str], secret_keys: list[str]) -> StringCommand:
    """Shell that prints the process ``$pid``'s argv (``arg`` lines) and, of its initial
    environment, the ``keys`` (``env`` lines) and the sha256 of the ``secret_keys``
    (``secret`` lines). A secret's value stays in the shell: printf is a builtin, so it is
    in no process's argv, and only its digest is printed."""
    cases: list[str | StringCommand] = []
    if keys:
        cases += [StringCommand(*_alternatives(keys), _separator="|"),
                  ") printf 'env %s\\n' \"$kv\";;"]
    if secret_keys:
        cases += [StringCommand(*_alternatives(secret_keys), _separator="|"),
                  ") printf 'secret %s %s\\n' \"${kv%%=*}\" "
                  "\"$(printf '%s' \"${kv#*=}\" | sha256sum | cut -c1-64)\";;"]
    return StringCommand(
        'echo "pid $pid";',
        "tr '\\000' '\\n' < \"/proc/$pid/cmdline\" | sed 's/^/arg /';",
        "tr '\\000' '\\n' < \"/proc/$pid/environ\" | while IFS= read -r kv; do",
        'case "${kv%%=*}" in', *cases, "esac; done",
    )


def _alternatives(names: list[str]) -> list[QuoteString]:
    return [QuoteString(name) for name in names]


def parse_process(output: list[str]) -> dict[str, Any] | None:
    """EngineProcess' lines as its value; None without a ``pid`` line."""
    found: dict[str, Any] = {"pid": None, "argv": [], "env": {}, "secret_sha256": {}}
    for line in output:
        kind, _, rest = line.partition(" ")
        if kind == "pid" and rest.strip().isdigit():
            found["pid"] = int(rest)
        elif kind == "arg":
            found["argv"].append(rest)
        elif kind == "env" and "=" in rest:
            key, _, value = rest.partition("=")
            found["env"][key] = value
        elif kind == "secret":
            key, _, digest = rest.partition(" ")
            found["secret_sha256"][key] = digest.strip()
    return found if found["pid"] is not None else None


class EngineProcess(FactBase[dict[str, Any] | None]):
    """
    Returns the command line of a unit's main process and the ``keys`` of its initial
    environment, the ``secret_keys`` only as sha256 digests computed on the host; None
    when the unit has no main process (stopped, or still in ExecStartPre):

    .. code:: python

        {"pid": 11486,
         "argv": ["/opt/vllm/envs/x/bin/python", "-m", "vllm.entrypoints.openai.api_server",
                  "--model", "/srv/models/m", ...],
         "env": {"CUDA_VISIBLE_DEVICES": "0,1", "HF_HUB_OFFLINE": "1", ...},
         "secret_sha256": {"VLLM_API_KEY": "9f86d081..."}}

    The main process only (``MainPID``): vLLM's engine core and workers are its children
    and rename themselves (``VLLM::EngineCore``). ``/proc/PID/environ`` is the environment
    the process started with, the one systemd gave it. An argument holding a newline
    reads as two (the suite's units have none: systemd_quote refuses control characters).
    """

    @override
    def requires_command(self, unit: str, keys: list[str], secret_keys: list[str]) -> str:
        return "systemctl"

    @override
    def command(self, unit: str, keys: list[str], secret_keys: list[str]) -> StringCommand:
        return StringCommand(
            "pid=$(systemctl show --property=MainPID --value --", QuoteString(unit),
            "2>/dev/null);",
            'if [ -n "$pid" ] && [ "$pid" != 0 ] && [ -r "/proc/$pid/cmdline" ]; then',
            process_snippet(keys, secret_keys), "; fi; true",
        )

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        return parse_process(output)
