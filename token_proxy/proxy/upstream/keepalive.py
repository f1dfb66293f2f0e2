"""Pooled connections to SGLang, and the one retry a closed idle connection earns.

SGLang's uvicorn closes a keep-alive connection idle for SGLANG_TIMEOUT_KEEP_ALIVE seconds (5 by
default), and under load it acts on that timer late: a request written on the connection in that
window is dropped unread (the client sees "Server disconnected" or ECONNRESET). Two defences:

- the pool drops a connection idle for `--backend-keepalive` seconds (default 4, under SGLang's 5),
  so the proxy never writes on one SGLang is about to close;
- a request whose REUSED connection fails before any byte of the answer is sent once more on a
  fresh connection (a pool-less session): SGLang never read it. A new connection failing, or any
  failure after the status line arrived, is not retried: SGLang may have acted on the request.

aiohttp itself resends an idempotent request (GET, PUT, DELETE) once through the same pool when its
connection fails (uncounted); every /generate and admin POST has only this rule.

This is the transport's retry. `retry_if_lost` (proxy/admin/lora.py) is another rule on another
layer: SGLang answered (the adapter is gone) and the proxy re-loads it before sending again.
"""

from __future__ import annotations

import contextlib
import errno
import weakref
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar

import aiohttp

# The SGLang default the pool stays under (uvicorn's timeout_keep_alive in SGLang's launch_server).
SGLANG_KEEP_ALIVE_S = 5.0
DEFAULT_BACKEND_KEEPALIVE_S = 4.0
RETRY_REASONS = ("disconnected", "reset")  # the metric's label values, created at 0


class _Attempt:
    """Filled in by the connector while a request is being sent: did it get a pooled connection?"""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


_ATTEMPT: ContextVar[_Attempt | None] = ContextVar("sglang_attempt", default=None)


class ReuseAwareConnector(aiohttp.TCPConnector):
    """aiohttp's TCP pool that tells the request in progress (through a context variable, set in the
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


def stale_reason(exc: BaseException) -> str | None:
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


async def send(pooled: aiohttp.ClientSession, fresh: aiohttp.ClientSession | None, method: str, url: str,
               on_retry: Callable[[str], None] | None = None, **kwargs) -> aiohttp.ClientResponse:
    """`method url` through the pool, until the response's status and headers are in (read or
    release the response). Sent again, once, on a fresh connection when the pooled one was reused
    and failed before any answer (module docstring)."""
    attempt = _Attempt()
    token = _ATTEMPT.set(attempt)
    try:
        return await pooled.request(method, url, **kwargs)
    except aiohttp.ClientError as exc:
        reason = stale_reason(exc) if attempt.reused else None
        if reason is None:
            raise
    finally:
        _ATTEMPT.reset(token)
    if on_retry is not None:
        on_retry(reason)
    return await (fresh or pooled).request(method, url, **kwargs)


@contextlib.asynccontextmanager
async def sglang_sessions(keepalive_s: float) -> AsyncIterator[tuple[aiohttp.ClientSession, aiohttp.ClientSession]]:
    """(pooled, fresh): every SGLang call's pool, idle connections kept `keepalive_s` at most, and a
    session whose every request opens its own connection (the retry's)."""
    # limit=0: the data path must never queue behind aiohttp's default 100-connection pool.
    pooled = aiohttp.ClientSession(connector=ReuseAwareConnector(limit=0, keepalive_timeout=keepalive_s))
    fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))
    async with pooled, fresh:
        yield pooled, fresh
