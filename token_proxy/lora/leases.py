"""A data-path request on a LoRA adapter a worker lost (it restarted): re-load, then send once more.

The pipeline needs only this rule of LoRA's admin side (lora/workers.py loads and syncs; a worker
process asks its owner, serving/process_app.py): whatever re-loads is passed in.
"""

from __future__ import annotations

from token_proxy.sglang.replies import is_lost_adapter as is_lost_adapter_error
from token_proxy.sglang.retry_rules import Call, retrying
from token_proxy.vocabulary import Reloads

__all__ = ["is_lost_adapter_error", "retry_if_lost"]


async def retry_if_lost(lora: Reloads, send):
    """`await send()` through sglang/client.py's one retry point: if SGLang refused it because the worker
    lacks the adapter (it restarted and the sync pass has not run yet), `lora.resync()` and send once more."""
    return await retrying(lambda _again: send(), Call(reload=lora))
