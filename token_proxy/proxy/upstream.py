"""Calls to SGLang on behalf of one client request: nothing keeps generating for nobody."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from token_proxy.errors import BackendTimeout
from token_proxy.proxy.context import ProxyContext

log = logging.getLogger(__name__)

# Why a request ends early: the client went away (cancellation, reset) or SGLang was too slow.
_ABORT_ON = (asyncio.CancelledError, ConnectionResetError, BackendTimeout)


@contextlib.asynccontextmanager
async def aborting_on_exit(ctx: ProxyContext, rid: str):
    """Abort the SGLang request `rid` if the block ends because the client left or time ran out."""
    try:
        yield
    except _ABORT_ON as exc:
        log.info("aborting SGLang request %s (%s)", rid, type(exc).__name__)
        ctx.spawn(ctx.client.abort(rid))
        raise
