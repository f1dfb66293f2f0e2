"""Calls to SGLang on behalf of one client request: nothing keeps generating for nobody."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from token_proxy.errors import BackendTimeout
from token_proxy.pipeline.request_state import RequestStats
from token_proxy.sglang.discovery import ProxyContext

log = logging.getLogger(__name__)

# Why a request ends early: the client went away (cancellation, reset) or SGLang was too slow.
_ABORT_ON = (asyncio.CancelledError, ConnectionResetError, BackendTimeout)


@contextlib.asynccontextmanager
async def aborting_on_exit(ctx: ProxyContext, rids: list[str], stats: RequestStats | None = None):
    """Abort the SGLang requests `rids` if the block ends because the client left or time ran out.
    Meanwhile they are listed in `ctx.in_flight` under their response id (an admin abort finds them)."""
    request_id = response_id_of(rids)
    ctx.in_flight[request_id] = rids
    try:
        yield
    except _ABORT_ON as exc:
        log.info("aborting SGLang request %s (%s)", rids, type(exc).__name__)
        if stats is not None and not isinstance(exc, BackendTimeout):
            stats.client_disconnected = True
        abort_all_of(ctx, rids)
        raise
    finally:
        if ctx.in_flight.get(request_id) is rids:  # not a later request reusing the client's id
            del ctx.in_flight[request_id]


def response_id_of(rids: list[str]) -> str:
    """The response id the rids were made from (sglang/payload.py): one rid is the id itself;
    several (n samples, several prompts) are `<id>-<i>[-<j>]`, with items 0 and 1 differing right after
    `<id>-`, so their common prefix is `<id>-`."""
    if len(rids) == 1:
        return rids[0]
    return os.path.commonprefix(rids)[:-1]


def abort_all_of(ctx: ProxyContext, rids: list[str]) -> None:
    for rid in rids:
        ctx.spawn(ctx.client.abort(rid))
