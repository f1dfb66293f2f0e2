"""The pool of connections to SGLang, and the one retry point of every call the proxy makes to it.

SGLang's uvicorn closes a keep-alive connection idle for SGLANG_TIMEOUT_KEEP_ALIVE seconds (5 by
default), and under load it acts on that timer late: a request written on the connection in that
window is dropped unread (the client sees "Server disconnected" or ECONNRESET). The pool drops a
connection idle for `--backend-keepalive` seconds (default 4, under SGLang's 5), so the proxy never
writes on one SGLang is about to close.

`retrying` sends a call once more, once, for one of two reasons (`again_because`):

- **a stale idle connection**: the REUSED pooled connection failed before any byte of the answer
  (SGLang never read the request); sent again on a fresh connection. A new connection failing, or any
  failure after the status line arrived, is not retried: SGLang may have acted on the request. aiohttp
  itself resends an idempotent request (GET, PUT, DELETE) once through the same pool (uncounted);
- **a lost LoRA adapter**: SGLang answered that the worker does not hold the request's adapter (it
  restarted before the sync pass); the caller's `reload` re-loads what is missing, then the call is
  sent again. Only calls made with a `reload` (adapter requests) have this rule.
"""

from __future__ import annotations

import contextlib
import errno
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from typing import Protocol, TypeVar

import aiohttp

from token_proxy.errors import ProxyError
from token_proxy.sglang.replies import is_lost_adapter

RETRY_REASONS = ("disconnected", "reset")  # the stale-connection metric's label values, created at 0
LOST_ADAPTER = "lost adapter"
T = TypeVar("T")


class Reloads(Protocol):
    """What re-loads lost adapters: LoraAdmin, or a worker process's RemoteLora."""

    async def resync(self) -> None: ...


class Attempt:
    """Filled in while a call is being sent: did it get a pooled connection, did the answer begin?"""

    __slots__ = ("answered", "reused")

    def __init__(self) -> None:
        self.reused = False
        self.answered = False


_ATTEMPT: ContextVar[Attempt | None] = ContextVar("sglang_attempt", default=None)


async def retrying(send: Callable[[bool], Awaitable[T]], *, reload: Reloads | None = None,
                   on_retry: Callable[[str], None] | None = None) -> T:
    """`await send(False)`; once more as `send(True)` (True: on a fresh connection) when `again_because`
    finds a reason: `reload.resync()` first for a lost adapter, `on_retry(reason)` for a stale connection."""
    attempt = Attempt()
    token = _ATTEMPT.set(attempt)
    try:
        return await send(False)
    except (ProxyError, aiohttp.ClientError) as exc:
        reason = again_because(exc, attempt, reload)
        if reason is None:
            raise
    finally:
        _ATTEMPT.reset(token)
    if reason == LOST_ADAPTER:
        await reload.resync()
    elif on_retry is not None:
        on_retry(reason)
    return await send(True)


def again_because(exc: BaseException, attempt: Attempt, reload: Reloads | None) -> str | None:
    """Why a failed call is worth sending once more (the module docstring's two rules), or None."""
    if isinstance(exc, ProxyError) and exc.__cause__ is None:  # SGLang's own answer
        return LOST_ADAPTER if reload is not None and is_lost_adapter(exc.message) else None
    if not attempt.reused or attempt.answered:
        return None
    return stale_reason(exc.__cause__ if isinstance(exc, ProxyError) else exc)


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


async def request(session: aiohttp.ClientSession, method: str, url: str, **kwargs) -> aiohttp.ClientResponse:
    """One HTTP request, until its status and headers are in (the attempt notes that the answer began)."""
    resp = await session.request(method, url, **kwargs)
    attempt = _ATTEMPT.get()
    if attempt is not None:
        attempt.answered = True
    return resp


async def send(pooled: aiohttp.ClientSession, fresh: aiohttp.ClientSession | None, method: str, url: str,
               on_retry: Callable[[str], None] | None = None, **kwargs) -> aiohttp.ClientResponse:
    """`method url` through the pool, until the response's status and headers are in (read or release
    the response); sent once more on a fresh connection when the pooled one was stale."""
    return await retrying(lambda again: request(fresh if again and fresh else pooled, method, url, **kwargs),
                          on_retry=on_retry)


class ReuseAwareConnector(aiohttp.TCPConnector):
    """aiohttp's TCP pool that tells the call in progress (through a context variable, set in the
    sending task) whether the connection it got has carried a request before. Cheaper than a
    TraceConfig, which costs every request a dozen awaited signals."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._used: weakref.WeakSet = weakref.WeakSet()

    async def connect(self, req, traces, timeout):
        conn = await super().connect(req, traces, timeout)
        protocol = conn.protocol
        if protocol is not None:
            attempt = _ATTEMPT.get()
            if attempt is not None:
                attempt.reused = protocol in self._used
            self._used.add(protocol)
        return conn


@contextlib.asynccontextmanager
async def sglang_sessions(keepalive_s: float) -> AsyncIterator[tuple[aiohttp.ClientSession, aiohttp.ClientSession]]:
    """(pooled, fresh): every SGLang call's pool, idle connections kept `keepalive_s` at most, and a
    session whose every request opens its own connection (the retry's)."""
    # limit=0: the data path must never queue behind aiohttp's default 100-connection pool.
    pooled = aiohttp.ClientSession(connector=ReuseAwareConnector(limit=0, keepalive_timeout=keepalive_s))
    fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))
    async with pooled, fresh:
        yield pooled, fresh
