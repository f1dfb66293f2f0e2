"""Why a failed call to SGLang is sent once more: the two retry rules that sglang/client.py's one retry
point (`retrying`) applies. Pure: an exception and what the attempt saw in, a reason (or None) out.

- **a stale idle connection**: SGLang's uvicorn closes a keep-alive connection idle for
  SGLANG_TIMEOUT_KEEP_ALIVE seconds (5 by default) and, under load, acts on that timer late: a request
  written in that window is dropped unread ("Server disconnected" or ECONNRESET). A REUSED pooled
  connection that failed before any byte of the answer is sent again on a fresh connection: SGLang never
  read it. A new connection failing, or any failure after the status line, is not retried: SGLang may
  have acted on it. (aiohttp itself resends an idempotent request once through the same pool, uncounted.)
- **a lost LoRA adapter**: SGLang answered that the worker does not hold the request's adapter (it
  restarted before the sync pass); the caller re-loads what is missing, then sends again. Only calls made
  with a reload (adapter requests) have this rule.
- **a broken reply**: a /generate whose answer broke off after its status line (`ReplyBrokeOff`: the
  connection closed mid-body, the server generating it died, e.g. a worker behind sglang-router killed
  and restarted), a whole reply or a stream before its first event. Nothing of it reached the client, and
  a rollout is only worth its whole reply: it is generated again, once (through the router, on a live
  worker). Only calls that ask (`regenerates`) have this rule; a stream whose first event went out cannot
  be taken back, and ends with an error event.
"""

from __future__ import annotations

import errno

import aiohttp

from token_proxy.errors import ProxyError, ReplyBrokeOff
from token_proxy.sglang.replies import is_lost_adapter

BROKEN_REPLY = "broken_reply"
# The retries metric's label values, created at 0: the stale connection's two, and the broken reply.
RETRY_REASONS = ("disconnected", "reset", BROKEN_REPLY)
LOST_ADAPTER = "lost adapter"


def again_because(exc: BaseException, *, reused: bool, answered: bool, reloads: bool,
                  regenerates: bool = False) -> str | None:
    """Why a call that failed with `exc` is worth sending once more, or None. `reused`: it went out on a
    pooled connection that had carried a request before; `answered`: the status line had arrived;
    `reloads`: the caller can re-load a lost adapter; `regenerates`: a whole reply broken off mid-body may
    be generated again."""
    if isinstance(exc, ReplyBrokeOff):
        return BROKEN_REPLY if regenerates else None
    if isinstance(exc, ProxyError) and exc.__cause__ is None:  # SGLang's own answer
        return LOST_ADAPTER if reloads and is_lost_adapter(exc.message) else None
    if answered:
        return None
    cause = exc.__cause__ if isinstance(exc, ProxyError) else exc
    if not reused:
        return None
    return stale_reason(cause)


def stale_reason(exc: BaseException | None) -> str | None:
    """The retry's reason when `exc` is how a connection the server closed while idle fails before
    the answer: "disconnected" (EOF before the status line) or "reset" (RST on write or read)."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "disconnected"
    if isinstance(exc, aiohttp.ClientConnectorError):  # a connect that failed: never a reused connection
        return None
    if isinstance(exc, ConnectionResetError | BrokenPipeError):  # ClientConnectionResetError included
        return "reset"
    if isinstance(exc, aiohttp.ClientOSError) and exc.errno in (errno.ECONNRESET, errno.EPIPE):
        return "reset"
    return None
