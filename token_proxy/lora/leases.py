"""A data-path request on a LoRA adapter a worker lost (it restarted): re-load, then send once more.

The pipeline needs only this rule of LoRA's admin side (lora/workers.py loads and syncs; a worker
process asks its owner, serving/worker_app.py): whatever re-loads is passed in.
"""

from __future__ import annotations

from typing import Protocol

from token_proxy.errors import ProxyError

# SGLang's words on /generate for an adapter a (restarted) worker does not hold.
LOST_ADAPTER = ("has never been loaded", "are not loaded")


class Reloads(Protocol):
    """What re-loads lost adapters: LoraAdmin, or a worker process's RemoteLora."""

    async def resync(self) -> None: ...


def is_lost_adapter_error(message: str) -> bool:
    """SGLang refused a request because the worker does not hold the adapter (it restarted)."""
    return any(words in message for words in LOST_ADAPTER)


async def retry_if_lost(lora: Reloads, send):
    """`await send()`; if SGLang refused it because the worker lacks the adapter (it restarted and the
    sync pass has not run yet), re-load what is missing (`lora.resync()`) and send once more."""
    try:
        return await send()
    except ProxyError as exc:
        if not is_lost_adapter_error(exc.message):
            raise
        await lora.resync()
        return await send()
