"""Model: the locked files in the model volume, each verified against the lock.

The lock (``python -m tools.model_lock``, on the operator's machine) names every file
with its size and checksum at one commit. The host downloads them from model_base_url
(Hugging Face or a mirror), in parallel, resuming broken transfers, verifying each and
renaming it to its final name only then. A re-run runs nothing when every file is
verified and unchanged; the token (hf_token, hf_token_file, or HF_TOKEN on the
operator's machine) is never on a command line and never left on the host.

    pyinfra inventory.py deploys/model.py
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import deploy

from operations import model as model_ops
from pyinfra_vllm.context import context
from pyinfra_vllm.locks import hf_token


@deploy("model")
def model() -> None:
    """Model: the locked files in the model volume, each verified against the lock."""
    ctx = context(host)

    if ctx.proceed("model"):
        settings = ctx.settings
        token = hf_token(settings)
        lock = ctx.required_lock()
        model_ops.downloaded(
            name=f"Model: {settings.model_id}@{lock['commit'][:12]} downloaded and verified",
            lock=lock,
            dest=model_ops.model_path(settings.model_dir, settings.model_id),
            base_url=settings.model_base_url,
            token=token,
            ca_bundle=settings.pip_ca_bundle,
            proxy=settings.http_proxy,
        )
