"""SGLang's keep-alive close, as its uvicorn does it, and the request that meets it.

uvicorn closes a keep-alive connection idle for SGLANG_TIMEOUT_KEEP_ALIVE seconds (5 by default),
from a timer on the event loop. Under load the timer runs late, and uvloop runs due timers before it
reads the sockets: a request that arrived after the timer was due, but before it ran, is closed
unread (the client sees ECONNRESET or "Server disconnected"). Here: an idle connection is closed
after `keep_alive_s` plus a random lateness up to `keep_alive_late_s`, and a request that arrives
on a connection idle for `keep_alive_s` or more (inside that lateness) is dropped with the socket.

aiohttp's own keep-alive (the runner's `keepalive_timeout`, 75 s by default) is left longer than
this one: it would close on time, without the window.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, field

from aiohttp import web


@dataclass(slots=True)
class _Connection:
    busy: int = 0  # requests being handled on it
    idle_since: float | None = None  # loop time its last answer ended (None: busy, or never answered)
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class IdleConnections:
    """The simulator's open connections, by transport (an entry lives until its close timer runs)."""

    keep_alive_s: float
    late_s: float
    rng: random.Random = field(default_factory=random.Random)
    dropped: int = 0  # requests that met a close (what a client loses without a retry)
    closed: int = 0  # idle connections closed by the timer
    _open: dict = field(default_factory=dict)

    def arrived(self, transport) -> bool:
        """A request came in on `transport`: False when it is lost to a late close (closed here)."""
        conn = self._open.get(transport)
        if conn is None:
            conn = self._open[transport] = _Connection()
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        loop = asyncio.get_running_loop()
        if conn.idle_since is not None and loop.time() - conn.idle_since >= self.keep_alive_s:
            del self._open[transport]
            self.dropped += 1
            transport.abort()  # unread: the kernel answers the client's bytes with a reset
            return False
        conn.busy += 1
        conn.idle_since = None
        return True

    def answered(self, transport) -> None:
        conn = self._open.get(transport)
        if conn is None:
            return
        conn.busy -= 1
        if conn.busy:
            return
        loop = asyncio.get_running_loop()
        conn.idle_since = loop.time()
        late = self.rng.uniform(0.0, self.late_s) if self.late_s > 0 else 0.0
        conn.timer = loop.call_later(self.keep_alive_s + late, self._close_idle, transport)

    def _close_idle(self, transport) -> None:
        # Armed only when the connection went idle, cancelled by the next request (arrived): never busy here.
        if self._open.pop(transport, None) is None:
            return
        if not transport.is_closing():
            self.closed += 1
            transport.close()


KEEP_ALIVE = web.AppKey("keep_alive", IdleConnections)


@web.middleware
async def keep_alive_close(request: web.Request, handler) -> web.StreamResponse:
    """Outermost: count the request on its connection, drop it if it met a late close."""
    idle = request.app[KEEP_ALIVE]
    transport = request.transport
    if transport is None or idle.keep_alive_s <= 0:
        return await handler(request)
    if not idle.arrived(transport):
        raise asyncio.CancelledError  # aiohttp ends the handler quietly; the socket is gone
    try:
        response = await handler(request)
        if not response.prepared and not transport.is_closing():  # sent now: idle from when it has left
            with contextlib.suppress(ConnectionError):  # the client left meanwhile
                await response.prepare(request)
                await response.write_eof()
        return response
    finally:
        idle.answered(transport)
