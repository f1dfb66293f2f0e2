"""The connections to SGLang: aiohttp's pool for control calls, and the kept-alive pool for whole /generate replies.

Whole replies (a non-streamed /generate, the data path's one call) go out on connections of the project's own:
an asyncio protocol per connection, its answer framed by sglang/http1.py (sans-IO), one request at a time,
kept alive between requests. aiohttp's client call (request, pool, response, reader, its timer) costs ~4x the
CPU of this path per call (bench/bench_client_call.py; bench/RESULTS.md section 17). Every other call (abort, health, admin, pass-through)
stays on aiohttp's pool (`sglang_sessions`); streams open their own connection (sglang/relay.py).

Both pools drop a connection idle for `keepalive_s` (`--backend-keepalive`, default 4, under SGLang's 5:
uvicorn's SGLANG_TIMEOUT_KEEP_ALIVE), so the proxy never writes on one SGLang is about to close. The retry
point (sglang/retry_rules.py) learns from `Attempt` whether a failed call went out on a reused connection
and whether its answer began: a reused one that failed before the status line is sent again on a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp

from token_proxy.errors import BackendTimeout, BackendUnavailable, ProxyError, ReplyBrokeOff
from token_proxy.sglang.http1 import FramingError, ResponseFramer
from token_proxy.sglang.relay import Target, connect
from token_proxy.sglang.retry_rules import ATTEMPT

__all__ = ["ReplyPool", "ReuseAwareConnector", "sglang_sessions"]

DEFAULT_KEEPALIVE_S = 4.0


class _Connection(asyncio.Protocol):
    """One kept-alive connection: `send(request)` -> (status, body) of its answer, one request at a time."""

    __slots__ = ("_body", "_framer", "_timer", "_waiter", "base_url", "idle_since", "lost", "reused", "transport")

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.reused = False  # it carried a request before this one
        self.idle_since = 0.0
        self._framer: ResponseFramer | None = None  # the answer being read (None: idle)
        self._body: list[bytes] = []
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None

    async def send(self, loop: asyncio.AbstractEventLoop, request: bytes, deadline: float | None) -> tuple[int, bytes]:
        """Write `request`, wait for its whole answer. A failure closes the connection (it is not reused)."""
        self._framer = framer = ResponseFramer()
        self._waiter = waiter = loop.create_future()
        if deadline is not None:
            self._timer = loop.call_at(deadline, self._time_out)
        self.transport.write(request)
        try:
            await waiter
        except BaseException:  # failed, timed out, or the handler was cancelled (the client left): not reusable
            self.close()
            raise
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._framer = self._waiter = None
        if framer.close:
            self.close()
        body = self._body
        self._body = []
        return framer.status, body[0] if len(body) == 1 else b"".join(body)

    def close(self) -> None:
        if not self.lost:
            self.lost = True
            self.transport.close()

    # ------------------------------------------------------------ the connection's side

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        framer = self._framer
        if framer is None:  # bytes while idle: not an answer to anything
            self.close()
            return
        try:
            body = framer.feed(data)
        except FramingError as exc:
            self._fail(ReplyBrokeOff(f"SGLang closed the connection mid-response: {exc}"))
            return
        if body:
            self._body.append(body)
        if framer.done:
            self._done()

    def connection_lost(self, exc) -> None:
        self.lost = True
        framer = self._framer
        if framer is None:
            return
        if framer.ends_at_close():
            self._done()
        elif framer.status is None:  # before the answer: what a stale idle connection looks like
            cause = exc if exc is not None else aiohttp.ServerDisconnectedError()
            error = BackendUnavailable(f"SGLang at {self.base_url} is unreachable: {cause}")
            error.__cause__ = cause
            self._fail(error)
        else:
            self._fail(ReplyBrokeOff(f"SGLang closed the connection mid-response: {exc or 'connection closed'}"))

    def _done(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _time_out(self) -> None:
        self._fail(BackendTimeout("SGLang did not finish the request in time"))

    def _fail(self, error: ProxyError) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)


class ReplyPool:
    """Kept-alive connections per target (host, port, TLS), newest first; an idle one older than `keepalive_s`
    is closed, never written on. `close()` closes the idle ones (at shutdown)."""

    def __init__(self, keepalive_s: float = DEFAULT_KEEPALIVE_S) -> None:
        self.keepalive_s = keepalive_s
        self._idle: dict[Target, list[_Connection]] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    async def send(self, base_url: str, target: Target, request: bytes, *, new: bool, connect_s: float | None,
                   total_s: float | None, resolve: Callable[[str], Awaitable[str]],
                   ssl_context: ssl.SSLContext | None) -> tuple[int, bytes]:
        """`request` (whole HTTP/1.1 bytes) on an idle connection to `target`, or a new one (always when `new`):
        (status, body). The retry point's attempt learns if the connection was reused, and if the answer began."""
        loop = asyncio.get_running_loop()
        conn = None if new else self._take(target, loop.time())
        if conn is None:
            conn = _Connection(base_url)
            await connect(loop, conn, base_url, target, connect_s, resolve, ssl_context)
        attempt = ATTEMPT.get()
        if attempt is not None:
            attempt.reused = conn.reused
        status, body = await conn.send(loop, request, None if total_s is None else loop.time() + total_s)
        if attempt is not None:
            attempt.answered = True
        if self._closed:
            conn.close()
        elif not conn.lost:
            conn.reused = True
            conn.idle_since = loop.time()
            self._idle.setdefault(target, []).append(conn)
            if self._sweep is None:
                self._sweep = loop.call_later(self.keepalive_s, self._swept, loop)
        return status, body

    def close(self) -> None:
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def _take(self, target: Target, now: float) -> _Connection | None:
        idle = self._idle.get(target)
        while idle:
            conn = idle.pop()
            if not conn.lost and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        return None

    def _swept(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close what has been idle `keepalive_s`; come back when the oldest survivor's time is up."""
        self._sweep = None
        now = loop.time()
        oldest = None
        for target, conns in list(self._idle.items()):
            live = []
            for conn in conns:
                if conn.lost or now - conn.idle_since >= self.keepalive_s:
                    conn.close()
                else:
                    live.append(conn)
                    oldest = conn.idle_since if oldest is None else min(oldest, conn.idle_since)
            if live:
                self._idle[target] = live
            else:
                del self._idle[target]
        if oldest is not None:
            self._sweep = loop.call_at(oldest + self.keepalive_s, self._swept, loop)


class ReuseAwareConnector(aiohttp.TCPConnector):
    """aiohttp's TCP pool that tells the call in progress (through the retry point's context variable, set
    in the sending task) whether the connection it got has carried a request before. Cheaper than a
    TraceConfig, which costs every request a dozen awaited signals."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._used: weakref.WeakSet = weakref.WeakSet()

    async def connect(self, req, traces, timeout):
        conn = await super().connect(req, traces, timeout)
        protocol = conn.protocol
        if protocol is not None:
            attempt = ATTEMPT.get()
            if attempt is not None:
                attempt.reused = protocol in self._used
            self._used.add(protocol)
        return conn


@contextlib.asynccontextmanager
async def sglang_sessions(keepalive_s: float) -> AsyncIterator[tuple[aiohttp.ClientSession, aiohttp.ClientSession,
                                                                     ReplyPool]]:
    """(pooled, fresh, replies): aiohttp's pool for every SGLang call but whole replies, idle connections kept
    `keepalive_s` at most; a session whose every request opens its own connection (the retry's); and the
    kept-alive pool of whole /generate replies, with the same bound."""
    # limit=0: the data path must never queue behind aiohttp's default 100-connection pool.
    pooled = aiohttp.ClientSession(connector=ReuseAwareConnector(limit=0, keepalive_timeout=keepalive_s))
    fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))
    replies = ReplyPool(keepalive_s)
    try:
        async with pooled, fresh:
            yield pooled, fresh, replies
    finally:
        replies.close()
