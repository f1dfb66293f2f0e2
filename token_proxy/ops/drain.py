"""SIGTERM's drain deadline (--shutdown-timeout): what a request still in flight gets when it passes.

aiohttp stops accepting, then waits for the handlers; past the deadline it cancels them and closes
their connections, so a stream ended with no error event or [DONE] and a whole reply met a closed
connection. Here, at the deadline each handler still running is cancelled (its SGLang request is
aborted on the way out, as for a client that leaves) and answers in a way a client can act on:

- a reply not started yet: 503 with Retry-After and OpenAI's error body;
- an SSE stream already open: an error event, then `data: [DONE]`.

The same holds for SGLang's own data routes reached through the pass-through (native /generate, whole and
streamed; /health_generate, /ping): admin/forward.py notes the reply it relays (PASSED_THROUGH), whose
stream it writes whole events only, so the error event follows the last whole event. Admin routes (a
weight update, a forwarded admin call) are not cut: stopping one midway would leave the workers apart.

aiohttp's own shutdown timeout is this one plus SERVER_GRACE_S, a backstop only: the handlers end at
the deadline, so the process exits within about the timeout.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
from aiohttp import web

from token_proxy.errors import BackendUnavailable
from token_proxy.http_io import DONE, PASSED_THROUGH, SSE_RESPONSE, route_of, sse_frames
from token_proxy.pipeline.request_state import stats_of
from token_proxy.route_row import ADMIN

log = logging.getLogger(__name__)

LOCAL = "local"  # a route this process's own handler answers (routes.py's LOCAL)
SERVER_GRACE_S = 0.5  # aiohttp's shutdown timeout past ours: time to write the errors


class Drain:
    """The handlers in flight, and the timer that cuts them once SIGTERM's deadline passes."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.running: set[asyncio.Task] = set()
        self.cut: set[asyncio.Task] = set()  # cancelled by the deadline (not by a client that left)
        self._timer: asyncio.TimerHandle | None = None

    def begin(self) -> None:
        """SIGTERM: the deadline starts now."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.timeout_s, self.cut_all)

    def cut_all(self) -> None:
        if self.running:
            log.warning("--shutdown-timeout (%g s) passed: %d requests in flight get a 503 (or an error "
                        "event in their stream)", self.timeout_s, len(self.running))
        for task in self.running:
            self.cut.add(task)
            task.cancel()

    def error(self) -> BackendUnavailable:
        return BackendUnavailable(f"The proxy is shutting down and the request did not finish within "
                                  f"--shutdown-timeout ({self.timeout_s:g} s); send it again (its generation "
                                  "was aborted)")


DRAIN = web.AppKey("drain", Drain)


def add_drain(app: web.Application, timeout_s: float) -> None:
    app[DRAIN] = Drain(timeout_s)
    app.on_shutdown.append(_begin)


async def _begin(app: web.Application) -> None:
    app[DRAIN].begin()


@web.middleware
async def drain_deadline(request: web.Request, handler):
    drain = request.app.get(DRAIN)
    route = route_of(request.app, request.path)
    if drain is None or not _drained(route):
        # The admin plane's calls (forwarded, or passed through to an admin route): never cut midway.
        return await handler(request)
    task = asyncio.current_task()
    drain.running.add(task)
    try:
        return await handler(request)
    except asyncio.CancelledError:
        # Ours alone (a client that left cancels it too: then nobody is there to answer).
        if task not in drain.cut or task.cancelling() != 1:
            raise
        task.uncancel()
        return await _answer(request, drain.error())
    finally:
        drain.running.discard(task)
        drain.cut.discard(task)


def _drained(route) -> bool:
    """This process's own handlers, and SGLang's data routes through the pass-through (no handler of ours)."""
    return route is not None and (route.answered_by == LOCAL or (route.handler is None and route.kind != ADMIN))


async def _answer(request: web.Request, error: BackendUnavailable) -> web.StreamResponse:
    """The data plane's handlers answer whole (prepared after they return) or open an SSE stream; the
    pass-through relays SGLang's reply, and once that began only an SSE stream can still say why it ends."""
    passed = request.get(PASSED_THROUGH)
    if passed is not None and passed.prepared:
        if passed.content_type == "text/event-stream":
            await passed.write(sse_frames([error.body()]) + DONE)
        await passed.write_eof()
        return passed
    stream = request.get(SSE_RESPONSE)
    if stream is None:
        return web.Response(status=error.status, body=orjson.dumps(error.body()), content_type="application/json",
                            headers=error.headers())
    stats_of(request).stream_error_status = error.status
    await stream.write(sse_frames([error.body()]) + DONE)
    await stream.write_eof()
    return stream
