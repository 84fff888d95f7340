"""Facts about the running engine, asked on the host itself: what it serves
(``/v1/models``) and a few of its own metrics (``/metrics``), and the command line and
environment its main process runs with (``/proc``).

Absent (None) where curl is missing or the engine does not answer: a stopped or
starting engine is a state the audit reports, never a failed host.
"""

from __future__ import annotations

import json
import urllib.parse
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

    + url: the engine's base URL (with ``socket``, its host is only the Host header)
    + socket: the engine's Unix socket, or None for TCP (the URL's port)
    + user: the engine's user: a listener another user owns is not asked at all, and the
      fact is ``{"models": [], "metrics": {}, "listener_uid": "65534"}``
    + key_file: the engine's own key (``VLLM_API_KEY='...'``), handed to curl on its
      standard input, never on a command line; a missing file sends no key
    """

    @override
    def requires_command(self, url: str, socket: str | None = None, user: str = "",
                         key_file: str = "") -> str:
        return "curl"

    @override
    def command(self, url: str, socket: str | None = None, user: str = "",
                key_file: str = "") -> StringCommand:
        base = QuoteString(url.rstrip("/"))
        via = ["--unix-socket", QuoteString(socket)] if socket else []
        return StringCommand(
            "key=; want=;",
            *([] if not key_file else [
                "[ -r", QuoteString(key_file), "] && key=$(sed -n",
                QuoteString("s/^VLLM_API_KEY='\\(.*\\)'$/\\1/p"), QuoteString(key_file), ");"]),
            *([] if not user else ["want=$(id -u", QuoteString(user), "2>/dev/null);",
                                   "owner=$(", listener_owner(url, socket), ");",
                                   'if [ -n "$owner" ] && [ "$owner" != "$want" ]; then',
                                   'echo "## listener $owner"; else']),
            "echo '## models';",
            'printf \'%s\' "${key:+header = \\"Authorization: Bearer $key\\"}"',
            "| curl -s -m 10 -K -", *via, StringCommand(base, "/v1/models", _separator=""),
            "; echo; echo '## metrics';",
            "curl -s -m 10", *via, StringCommand(base, "/metrics", _separator=""),
            "| grep '^vllm:';", *(["fi;"] if user else []), "true",
        )

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        for line in output:
            if line.startswith("## listener "):
                return {"models": [], "metrics": {},
                        "listener_uid": line.removeprefix("## listener ").strip()}
        return parse_engine(output)


def listener_owner(url: str, socket: str | None) -> StringCommand:
    """Shell printing the uid(s) that own the engine's listener: the socket file's owner,
    or every uid with a TCP socket listening on the URL's port (``/proc/net/tcp`` and
    ``tcp6``: state 0A, the port in hex, the uid in column 8); nothing when none."""
    if socket:
        return StringCommand("stat -c %u", QuoteString(socket), "2>/dev/null")
    port = urllib.parse.urlsplit(url).port or 80
    return StringCommand(
        "awk", QuoteString(f'$4 == "0A" && $2 ~ /:{port:04X}$/ {{ print $8 }}'),
        "/proc/net/tcp /proc/net/tcp6 2>/dev/null | sort -u | tr '\\n' ' ' | sed 's/ $//'",
    )


class EngineKey(FactBase[str | None]):
    """
    Returns the sha256 of the engine's own key, computed on the host, when its two files
    (the engine's ``VLLM_API_KEY='<43 characters>'`` and nginx's ``default "Bearer ...";``)
    hold the same valid key; None when either is missing or they differ. The key itself
    never leaves the host: printf is a builtin, so it is on no command line either.

    .. code:: python

        "3f1a...e9"
    """

    @override
    def command(self, env_path: str, nginx_path: str) -> StringCommand:
        return StringCommand(
            "a=$(sed -n", QuoteString("s/^VLLM_API_KEY='\\([A-Za-z0-9_-]\\{43\\}\\)'$/\\1/p"),
            QuoteString(env_path), "2>/dev/null);",
            "b=$(sed -n", QuoteString('s/^ *default "Bearer \\(.*\\)";$/\\1/p'),
            QuoteString(nginx_path), "2>/dev/null);",
            'if [ -n "$a" ] && [ "$a" = "$b" ]; then printf \'%s\' "$a" | sha256sum | cut -c1-64;'
            " fi; true",
        )

    @override
    def process(self, output: list[str]) -> str | None:
        digest = "".join(output).strip()
        return digest if len(digest) == 64 else None


class EngineFirewall(FactBase[str | None]):
    """
    Returns the digest the engine's nftables table carries in its comment
    (``pyinfra-vllm <16 hex digits>``, pyinfra_vllm.plans.engine_access), as loaded in the
    kernel; None when no such table is loaded or nft is not installed.

    .. code:: python

        "fd678edeec7092d7"
    """

    @override
    def command(self, nft: str, table: str, comment: str) -> StringCommand:
        return StringCommand(
            "if [ -x", QuoteString(nft), "]; then", QuoteString(nft), "list table inet",
            QuoteString(table), "2>/dev/null | sed -n",
            QuoteString(f's/^[[:space:]]*comment "{comment} \\([0-9a-f]*\\)"$/\\1/p'),
            "; fi; true",
        )

    @override
    def process(self, output: list[str]) -> str | None:
        digest = "".join(output).strip()
        return digest if len(digest) == 16 and all(c in "0123456789abcdef" for c in digest) \
            else None


# The lines of /proc/PID/status that show the process's hardening: no_new_privs, the
# seccomp mode, and its effective, permitted, bounding and ambient capability sets.
STATUS_KEYS = ("NoNewPrivs", "Seccomp", "CapEff", "CapPrm", "CapBnd", "CapAmb")


def process_snippet(keys: list[str], secret_keys: list[str]) -> StringCommand:
    """Shell that prints the process ``$pid``'s argv (``arg`` lines), the ``STATUS_KEYS``
    of its ``/proc/PID/status`` (``status`` lines, none when it cannot be read) and, of
    its initial environment, the ``keys`` (``env`` lines) and the sha256 of the
    ``secret_keys`` (``secret`` lines). A secret's value stays in the shell: printf is a
    builtin, so it is in no process's argv, and only its digest is printed."""
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
        f"sed -n -E 's/^({'|'.join(STATUS_KEYS)}):[[:space:]]*/status \\1 /p'",
        '"/proc/$pid/status" 2>/dev/null;',
        "tr '\\000' '\\n' < \"/proc/$pid/environ\" | while IFS= read -r kv; do",
        'case "${kv%%=*}" in', *cases, "esac; done",
    )


def _alternatives(names: list[str]) -> list[QuoteString]:
    return [QuoteString(name) for name in names]


def parse_process(output: list[str]) -> dict[str, Any] | None:
    """EngineProcess' lines as its value; None without a ``pid`` line."""
    found: dict[str, Any] = {"pid": None, "argv": [], "env": {}, "secret_sha256": {},
                             "status": {}}
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
        elif kind == "status":
            key, _, value = rest.partition(" ")
            if key in STATUS_KEYS and value.strip():
                found["status"][key] = value.strip()
    return found if found["pid"] is not None else None


class EngineProcess(FactBase[dict[str, Any] | None]):
    """
    Returns the command line of a unit's main process, the ``keys`` of its initial
    environment, the ``secret_keys`` only as sha256 digests computed on the host, and
    the hardening lines of its ``/proc/PID/status`` (``STATUS_KEYS``, as read; a line the
    kernel does not print is absent); None when the unit has no main process (stopped,
    or still in ExecStartPre):

    .. code:: python

        {"pid": 11486,
         "argv": ["/opt/vllm/envs/x/bin/python", "-m", "vllm.entrypoints.openai.api_server",
                  "--model", "/srv/models/m", ...],
         "env": {"CUDA_VISIBLE_DEVICES": "0,1", "HF_HUB_OFFLINE": "1", ...},
         "secret_sha256": {"VLLM_API_KEY": "9f86d081..."},
         "status": {"NoNewPrivs": "1", "Seccomp": "2", "CapEff": "0000000000000000",
                    "CapPrm": "0000000000000000", "CapBnd": "0000000000000000",
                    "CapAmb": "0000000000000000"}}

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


class EngineHealth(FactBase[int | None]):
    """
    Returns the HTTP status of the engine's ``/health``, asked on the host and given 5
    seconds; 0 when nothing answered in time (stopped, starting, or alive and hung: a
    process stopped with SIGSTOP accepts connections in the kernel and answers nothing);
    None where curl is missing.

    + url: the engine's base URL (with ``socket``, its host is only the Host header)
    + socket: the engine's Unix socket, or None for TCP

    .. code:: python

        200
    """

    @override
    def requires_command(self, url: str, socket: str | None = None) -> str:
        return "curl"

    @override
    def command(self, url: str, socket: str | None = None) -> StringCommand:
        via = ["--unix-socket", QuoteString(socket)] if socket else []
        return StringCommand(
            # A line of its own (-w's \n): the one read's sections follow it.
            "curl -s -o /dev/null -m 5 -w '%{http_code}\\n'", *via,
            StringCommand(QuoteString(url.rstrip("/")), "/health", _separator=""), "; true",
        )

    @override
    def process(self, output: list[str]) -> int | None:
        text = "".join(output).strip()
        return int(text) if text.isdigit() else 0
