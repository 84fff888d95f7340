"""Where the model stage keeps its tools on a host, and what it says of model files that
no longer match their lock (operations/model.py downloads them)."""

from __future__ import annotations

# Where the downloader and the lock live on the host (root only).
TOOL_DIR = "/var/lib/pyinfra-vllm"


def corrupt_reason(model_id: str, dest: str, corrupt: list[str]) -> str:
    """Why the model stage refuses a host whose files a deep check found changed under an
    unchanged size and mtime, and the setting that repairs them."""
    return (f"model: {len(corrupt)} file(s) of {model_id} in {dest} no longer match the "
            f"lock under an unchanged size and mtime: {', '.join(corrupt)}; set "
            "model_repair=true to fetch exactly them again (the engine then restarts)")
