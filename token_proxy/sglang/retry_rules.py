"""The one retry point of every call to SGLang (`retrying`) and its one list of rules (`RULES`, in order).

Each rule is pure: what came back (`Outcome`: the failure, or a reply on weights the fleet does not serve;
what the attempt saw: a reused connection? did the answer begin?) and what the call allows (`Call`) in, a
reason (or None) out. The first rule with a reason sends the call again.

- **a broken reply**: a /generate whose answer broke off after its status line (`ReplyBrokeOff`: the
  connection closed mid-body, the server generating it died, e.g. a worker behind sglang-router killed
  and restarted), a whole reply or a stream before its first event. Nothing of it reached the client, and
  a rollout is only worth its whole reply: it is generated again (through the router, on a live
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
- **stale weights**: a reply SGLang made on weights the fleet does not serve is never returned (the
  request's `check`: pipeline/reply_check.py's StaleCheck); it is sent again after a backoff, up to
  `check.tries` sends in all; the last stale one is a 503.

A failure is sent again once per call (the first three rules); a stale reply up to its tries.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import NamedTuple, Protocol, TypeVar

import aiohttp

from token_proxy.errors import BackendUnavailable, ProxyError, ReplyBrokeOff
from token_proxy.sglang.replies import is_lost_adapter
from token_proxy.vocabulary import Reloads

T = TypeVar("T")

BROKEN_REPLY = "broken_reply"
# The retries metric's label values, created at 0: the stale connection's two, and the broken reply.
RETRY_REASONS = ("disconnected", "reset", BROKEN_REPLY)
LOST_ADAPTER = "lost adapter"
STALE_WEIGHTS = "stale weights"
STALE_BACKOFF_S = 0.05  # doubled per stale reply: the fleet's watcher takes the stale worker out meanwhile
STALE_BACKOFF_MAX_S = 1.0


class Attempt:
    """Filled in while a call is being sent (sglang/pool.py): did it get a reused connection, did the answer begin?"""

    __slots__ = ("answered", "reused")

    def __init__(self) -> None:
        self.reused = False
        self.answered = False


ATTEMPT: ContextVar[Attempt | None] = ContextVar("sglang_attempt", default=None)


class VersionCheck(Protocol):
    """The stale-weights check a request carries (pipeline/reply_check.py's StaleCheck over the fleet's hook)."""

    tries: int  # sends in all, the first included

    def fresh(self, versions: set[str]) -> bool: ...  # the fast path: every version is the fleet's current one

    async def stale(self, versions: set[str], since: float) -> str | None:
        """A reply (sent at `since`) carrying `versions`: None when the fleet served them meanwhile; else what
        was wrong, in a sentence (the check counts and logs it)."""


class Call(NamedTuple):
    """What a call allows: `reload`, the caller re-loads a lost adapter; `regenerates`, a whole reply broken
    off mid-body may be generated again; `check`, its replies' weight versions are judged."""

    reload: Reloads | None = None
    regenerates: bool = False
    check: VersionCheck | None = None


class Outcome(NamedTuple):
    """What an attempt came back with: a failure (`exc`), or a reply that `stale` says is on stale weights."""

    attempt: Attempt
    exc: BaseException | None = None
    stale: str | None = None


def broken_reply(outcome: Outcome, call: Call) -> str | None:
    return BROKEN_REPLY if call.regenerates and isinstance(outcome.exc, ReplyBrokeOff) else None


def lost_adapter(outcome: Outcome, call: Call) -> str | None:
    exc = outcome.exc
    own_answer = isinstance(exc, ProxyError) and exc.__cause__ is None and not isinstance(exc, ReplyBrokeOff)
    return LOST_ADAPTER if call.reload is not None and own_answer and is_lost_adapter(exc.message) else None


def stale_connection(outcome: Outcome, call: Call) -> str | None:
    exc, attempt = outcome.exc, outcome.attempt
    if exc is None or attempt.answered or not attempt.reused or isinstance(exc, ReplyBrokeOff):
        return None
    if isinstance(exc, ProxyError):
        if exc.__cause__ is None:  # SGLang's own answer
            return None
        exc = exc.__cause__
    return stale_reason(exc)


def stale_weights(outcome: Outcome, call: Call) -> str | None:
    return STALE_WEIGHTS if outcome.stale is not None else None


RULES = (broken_reply, lost_adapter, stale_connection, stale_weights)  # in order: the first reason wins


def again_because(outcome: Outcome, call: Call) -> str | None:
    """Why what came back is worth sending again (the first rule's reason), or None."""
    for rule in RULES:
        reason = rule(outcome, call)
        if reason is not None:
            return reason
    return None


PLAIN = Call()  # a call with neither reload, nor regeneration, nor check: the stale connection's rule alone


async def retrying(send: Callable[[bool], Awaitable[T]], call: Call = PLAIN, *,
                   on_retry: Callable[[str], None] | None = None,
                   versions_of: Callable[[T], set[str]] | None = None,
                   discard: Callable[[T], Awaitable[None]] | None = None) -> T:
    """`await send(False)`, and again as RULES say: `send(True)` (True: on a new connection) after a failure,
    once, with `call.reload.resync()` first for a lost adapter and `on_retry(reason)` for the others;
    `send(False)` after a reply on stale weights (`versions_of(reply)`, judged by `call.check`; the reply is
    handed to `discard` first: a stream is closed), up to `call.check.tries` sends."""
    failed, stale_sends, backoff, again = False, 0, STALE_BACKOFF_S, False
    while True:
        since = time.monotonic()
        attempt = Attempt()
        token = ATTEMPT.set(attempt)
        try:
            reply = await send(again)
        except (ProxyError, aiohttp.ClientError) as exc:
            reason = None if failed else again_because(Outcome(attempt, exc), call)
            if reason is None:
                raise
            failed = True
        else:
            check = call.check
            if check is None or versions_of is None:
                return reply
            versions = versions_of(reply)
            if not versions or check.fresh(versions):
                return reply
            stale = await check.stale(versions, since)
            if stale is None:
                return reply
            reason = again_because(Outcome(attempt, stale=stale), call)
            stale_sends += 1
            if discard is not None:
                await discard(reply)
            if stale_sends >= check.tries:
                raise BackendUnavailable(f"{stale}, {check.tries} time(s): a worker is out of step with the fleet "
                                         f"(GET /weight_info names it)")
        finally:
            ATTEMPT.reset(token)
        again = reason != STALE_WEIGHTS
        if reason == LOST_ADAPTER:
            await call.reload.resync()
        elif reason == STALE_WEIGHTS:
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, STALE_BACKOFF_MAX_S)
        elif on_retry is not None:
            on_retry(reason)


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
