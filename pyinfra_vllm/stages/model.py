"""Model: the locked files in the model volume, each verified against the lock.

The lock (``python -m tools.model_lock``, on the operator's machine) names every file
with its size and checksum at one commit. The host downloads them from model_base_url
(Hugging Face or a mirror), in parallel, resuming broken transfers, verifying each and
renaming it to its final name only then. A re-run runs nothing when every file is
verified and unchanged; the token (hf_token, hf_token_file, or HF_TOKEN on the
operator's machine) is never on a command line and never left on the host.

With model_verify "deep" (or model_repair) the stage first re-hashes every file on the
host (facts.model.ModelContent). A file whose content no longer matches the lock while
its size and mtime are unchanged, which the stat check trusts, refuses the host, named;
with model_repair it is removed and fetched again, and only it, and the vllm_service
stage restarts a running engine, which may have loaded the bad bytes.

    pyinfra inventory.py deploys/model.py
"""

from __future__ import annotations

from pyinfra import host

from facts.model import ModelFiles, silently_changed
from pyinfra_vllm.core.locks import hf_token
from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.operations import model as model_ops
from pyinfra_vllm.plans import model as model_plan
from pyinfra_vllm.plans.engine_access import Endpoint
from pyinfra_vllm.run.context import HostContext
from pyinfra_vllm.run.host_reads import Read
from pyinfra_vllm.run.stage import stage


def model_reads(settings: Settings, _place: Endpoint) -> list[Read]:
    """What the model stage reads of a converged host: the run's one read."""
    return [Read(ModelFiles, {"path": settings.model_path})]


@stage(reads=model_reads)
def model(ctx: HostContext) -> None:
    """Model: the locked files in the model volume, each verified against the lock."""
    settings = ctx.settings
    token = hf_token(settings)
    lock = ctx.required_lock()
    dest = settings.model_path
    corrupt: list[str] = []
    if settings.deep_model_check:
        content = ctx.deep_model_check(host, dest)
        if content is not None and content["error"]:
            reason = (f"model: the deep check of {dest} did not run: {content['error']}; "
                      "fix the host, or set model_verify stat")
            ctx.refuse("Model: host refused", [reason])
            return
        corrupt = silently_changed(content, host.get_fact(ModelFiles, path=dest), lock)
    if corrupt and not settings.model_repair:
        reason = model_plan.corrupt_reason(settings.model_id, dest, corrupt)
        ctx.refuse("Model: host refused", [reason])
        return
    name = f"Model: {settings.model_id}@{lock['commit'][:12]} downloaded and verified"
    if corrupt:
        name = (f"Model: {settings.model_id}@{lock['commit'][:12]}: "
                f"{len(corrupt)} corrupt file(s) fetched again and verified")
    downloaded = model_ops.downloaded(
        name=name,
        lock=lock,
        dest=dest,
        base_url=settings.model_base_url,
        token=token,
        ca_bundle=settings.pip_ca_bundle,
        proxy=settings.http_proxy,
        connections=settings.model_download_connections,
        refetch=corrupt,
    )
    if corrupt:
        ctx.model_repair = downloaded
