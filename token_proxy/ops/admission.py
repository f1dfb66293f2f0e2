"""Overload protection: a bounded number of inference requests in flight and a bounded queue.

Past both bounds a request is refused at once with 503 and Retry-After, so memory stays
bounded however many clients an RL job starts; a queued request that waits too long is
refused the same way. Admin and health routes are never queued behind inference.
"""

from __future__ import annotations

import asyncio
from collections import deque

from aiohttp import web

from token_proxy.errors import ProxyError
from token_proxy.http_io import INFERENCE, route_kind
from token_proxy.pipeline.request_state import stats_of


class Overloaded(ProxyError):
    status = 503
    type = "ServiceUnavailableError"

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict:
        return {"Retry-After": str(self.retry_after_s)}


class Admission:
    def __init__(self, max_active: int, max_queued: int, queue_timeout_s: float):
        self.max_active = max_active
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.active < self.max_active and not self._waiters:
            self.active += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise self._refusal("and the queue is full")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.queue_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            self._abandon(waiter)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise self._refusal(f"and the request waited {self.queue_timeout_s:g} s for a slot") from None

    def release(self) -> None:
        """Hand the slot straight to the next waiter, so a burst cannot overtake the queue."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1

    def _abandon(self, waiter: asyncio.Future) -> None:
        if waiter.done() and not waiter.cancelled():
            self.release()  # the slot arrived as we gave up: pass it on
        else:
            waiter.cancel()
            try:
                self._waiters.remove(waiter)
            except ValueError:
                pass

    def _refusal(self, why: str) -> Overloaded:
        return Overloaded(f"The proxy is at capacity ({self.active} requests in flight, {self.queued} queued) "
                          f"{why}; retry later", retry_after_s=1)


ADMISSION = web.AppKey("admission", Admission)


@web.middleware
async def admission_control(request: web.Request, handler):
    admission = request.app.get(ADMISSION)
    if admission is None or request.method != "POST" or route_kind(request.app, request.path) != INFERENCE:
        return await handler(request)
    try:
        await admission.acquire()
    except Overloaded:
        stats_of(request).overloaded = True
        raise
    try:
        return await handler(request)
    finally:
        admission.release()
