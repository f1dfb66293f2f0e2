"""The one retry point of every call to SGLang (`retrying`) and its one list of rules (`RULES`, in order).

Each rule is pure: the failure, what the attempt saw (`Attempt`: a reused connection? did the answer
begin?) and what the call allows (`Call`) in; a reason (or None) out. The first rule with a reason sends
the call once more, once, on a new connection.

- **a broken reply**: a /generate whose answer broke off after its status line (`ReplyBrokeOff`: the
  connection closed mid-body, the server generating it died, e.g. a worker behind sglang-router killed
  and restarted), a whole reply or a stream before its first event. Nothing of it reached the client, and
  a rollout is only worth its whole reply: it is generated again, once (through the router, on a live
  worker). Only calls that ask (`regenerates`) have this rule; a stream whose first event went out cannot
  be taken back, and ends with an error event.
- **a lost LoRA adapter**: SGLang answered that the worker does not hold the request's adapter (it
  restarted before the sync pass); the caller re-loads what is missing, then sends again. Only calls made
  with a reload (adapter requests) have this rule.
- **a stale idle connection**: SGLang's uvicorn closes a keep-alive connection idle for
  SGLANG_TIMEOUT_KEEP_ALIVE seconds (5 by default) and, under load, acts on that timer late: a request
  written in that window is dropped unread ("Server disconnected" or ECONNRESET). A REUSED pooled
  connection that failed before any byte of the answer is sent again on a new connection: SGLang never
  read it. A new connection failing, or any failure after the status line, is not retried: SGLang may
  have acted on it. (aiohttp itself resends an idempotent request once through the same pool, uncounted.)

A reply on stale weights is the pipeline's check (pipeline/fleet_versions.py): it judges a whole answer,
not a failed call, and sends again up to --stale-reply-tries times.
"""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import NamedTuple, TypeVar

import aiohttp

from token_proxy.errors import ProxyError, ReplyBrokeOff
from token_proxy.sglang.replies import is_lost_adapter
from token_proxy.vocabulary import Reloads

T = TypeVar("T")

BROKEN_REPLY = "broken_reply"
# The retries metric's label values, created at 0: the stale connection's two, and the broken reply.
RETRY_REASONS = ("disconnected", "reset", BROKEN_REPLY)
LOST_ADAPTER = "lost adapter"


class Attempt:
    """Filled in while a call is being sent (sglang/pool.py): did it get a reused connection, did the answer begin?"""

    __slots__ = ("answered", "reused")

    def __init__(self) -> None:
        self.reused = False
        self.answered = False


ATTEMPT: ContextVar[Attempt | None] = ContextVar("sglang_attempt", default=None)


class Call(NamedTuple):
    """What a call allows: `reloads`, the caller can re-load a lost adapter; `regenerates`, a whole reply
    broken off mid-body may be generated again."""

    reloads: bool = False
    regenerates: bool = False


def broken_reply(exc: BaseException, attempt: Attempt, call: Call) -> str | None:
    return BROKEN_REPLY if call.regenerates and isinstance(exc, ReplyBrokeOff) else None


def lost_adapter(exc: BaseException, attempt: Attempt, call: Call) -> str | None:
    own_answer = isinstance(exc, ProxyError) and exc.__cause__ is None and not isinstance(exc, ReplyBrokeOff)
    return LOST_ADAPTER if call.reloads and own_answer and is_lost_adapter(exc.message) else None


def stale_connection(exc: BaseException, attempt: Attempt, call: Call) -> str | None:
    if attempt.answered or not attempt.reused or isinstance(exc, ReplyBrokeOff):
        return None
    if isinstance(exc, ProxyError):
        if exc.__cause__ is None:  # SGLang's own answer
            return None
        exc = exc.__cause__
    return stale_reason(exc)


RULES = (broken_reply, lost_adapter, stale_connection)  # in order: the first reason wins


def again_because(exc: BaseException, attempt: Attempt, call: Call) -> str | None:
    """Why a call that failed with `exc` is worth sending once more (the first rule's reason), or None."""
    for rule in RULES:
        reason = rule(exc, attempt, call)
        if reason is not None:
            return reason
    return None


async def retrying(send: Callable[[bool], Awaitable[T]], *, reload: Reloads | None = None,
                   on_retry: Callable[[str], None] | None = None, regenerates: bool = False) -> T:
    """`await send(False)`; once more as `send(True)` (True: on a new connection) when a rule finds a
    reason: `reload.resync()` first for a lost adapter, `on_retry(reason)` for the others."""
    attempt = Attempt()
    token = ATTEMPT.set(attempt)
    try:
        return await send(False)
    except (ProxyError, aiohttp.ClientError) as exc:
        reason = again_because(exc, attempt, Call(reload is not None, regenerates))
        if reason is None:
            raise
    finally:
        ATTEMPT.reset(token)
    if reason == LOST_ADAPTER:
        await reload.resync()
    elif on_retry is not None:
        on_retry(reason)
    return await send(True)


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
