"""A chat completion through a sandbox host's gateway, or through the front door, as a
client would send it.

    python -m sandbox chat [--host gpu-sbx-1 | --router] [MESSAGE]

The API key is read from the file the inventory names (api_keys_file); it is sent, never
printed. With ``up --tls`` the gateway's self-signed certificate is the only one trusted.
Prints the command a user would type for the same request (the key read from the file
by the shell, so it is neither shown nor on the command line), then the answer.
"""

from __future__ import annotations

import json
import os
import shlex
import ssl
import time
import urllib.request
from pathlib import Path

from sandbox.util import SandboxError

GATEWAY_PORT = 8001
ROUTER_PORT = 8443  # router_port's default (pyinfra_vllm/core/settings_router.py)


def _key(path: str) -> str:
    lines = [line.strip() for line in Path(path).read_text().splitlines()]
    keys = [line for line in lines if line and not line.startswith("#")]
    if not keys:
        raise SandboxError(f"{path} holds no key")
    return keys[0]


def _shown(path: str) -> str:
    """``path`` as the user would type it from the repository root."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def endpoint(host: dict) -> tuple[str, str | None, str]:
    """(the host's URL for clients, the certificate to trust or None, what answers there):
    a front door's HAProxy (a host of `up --routers`), else the host's gateway."""
    data = host["data"]
    if host.get("router"):
        port = data.get("router_port", ROUTER_PORT)
        return f"https://{host['address']}:{port}", data["router_tls_cert"], "the front door"
    tls = data.get("gateway_tls_cert")
    scheme = "https" if tls else "http"
    return (f"{scheme}://{host['address']}:{data.get('gateway_port', GATEWAY_PORT)}", tls,
            "nginx")


def request(host: dict, message: str, max_tokens: int = 16) -> tuple[str, dict, float]:
    """(the curl command a user would type, the answer, seconds) for one chat completion."""
    data = host["data"]
    url, tls, _ = endpoint(host)
    url += "/v1/chat/completions"
    model = data.get("served_model_name") or data["model_id"]
    body = {"model": model, "messages": [{"role": "user", "content": message}],
            "max_tokens": max_tokens, "temperature": 0}
    key_file = data["api_keys_file"]
    shown_key, shown_cert = _shown(key_file), _shown(tls) if tls else None
    header = f"printf 'header = \"Authorization: Bearer %s\"' \"$(grep -v '^#' {shown_key})\""
    command = " ".join([
        "curl", "-sS", *(["--cacert", shlex.quote(shown_cert)] if shown_cert else []),
        "-K", f"<({header})",
        "-H", "'Content-Type: application/json'", "-d", shlex.quote(json.dumps(body)),
        url,
    ])
    context = ssl.create_default_context(cafile=tls) if tls else None
    sent = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {_key(key_file)}"})
    start = time.monotonic()
    with urllib.request.urlopen(sent, timeout=120, context=context) as answer:
        reply = json.loads(answer.read())
    return command, reply, time.monotonic() - start


def main(host: dict, message: str) -> None:
    command, reply, seconds = request(host, message)
    choice = reply["choices"][0]
    print(f"$ {command}")
    print(f"{host['name']} answered in {seconds:.2f}s through {endpoint(host)[2]} "
          f"({reply['model']}, "
          f"{reply['usage']['completion_tokens']} tokens, finish_reason "
          f"{choice['finish_reason']}): {choice['message']['content']!r}")
