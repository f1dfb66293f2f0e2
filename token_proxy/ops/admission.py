"""Overload protection: a bounded number of inference samples in flight and a bounded queue.

A request counts its samples (`n`, or `sampling_params.n`): one request with n = 64 asks SGLang for
64 sequences, so it takes 64 of --max-concurrent-requests (at most all of them: it then runs alone).
Past both bounds a request is refused at once with 503 and Retry-After, so memory stays
bounded however many clients an RL job starts; a queued request that waits too long is
refused the same way. Admin and health routes are never queued behind inference.
The body is read before a request queues (a slow body holds no slot).
"""

from __future__ import annotations

import asyncio
from collections import deque

import orjson
from aiohttp import web

from token_proxy.errors import ProxyError
from token_proxy.http_io import read_body, route_kind
from token_proxy.pipeline.request_state import stats_of
from token_proxy.route_row import INFERENCE


class Overloaded(ProxyError):
    status = 503
    type = "ServiceUnavailableError"

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict:
        return {"Retry-After": str(self.retry_after_s)}


class Admission:
    """A weighted semaphore with a FIFO queue: `active` counts samples, each waiter its weight."""

    def __init__(self, max_active: int, max_queued: int, queue_timeout_s: float):
        self.max_active = max_active
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        self._waiters: deque[tuple[asyncio.Future, int]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def weight_of(self, samples: int) -> int:
        """What a request of `samples` takes: at least 1, at most every slot (it then runs alone)."""
        return max(1, min(samples, self.max_active))

    async def acquire(self, weight: int = 1) -> None:
        """`weight`: from weight_of; release the same weight."""
        if self.active + weight <= self.max_active and not self._waiters:
            self.active += weight
            return
        if len(self._waiters) >= self.max_queued:
            raise self._refusal("and the queue is full")
        entry = (asyncio.get_running_loop().create_future(), weight)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(entry[0]), self.queue_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            self._abandon(entry)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise self._refusal(f"and the request waited {self.queue_timeout_s:g} s for a slot") from None

    def release(self, weight: int = 1) -> None:
        self.active -= weight
        self._admit()

    def _admit(self) -> None:
        """Hand freed slots to the waiters in order, so a burst cannot overtake the queue (nor a small
        request the large one at its head)."""
        while self._waiters:
            waiter, weight = self._waiters[0]
            if waiter.done():  # given up
                self._waiters.popleft()
                continue
            if self.active + weight > self.max_active:
                return
            self._waiters.popleft()
            self.active += weight
            waiter.set_result(None)

    def _abandon(self, entry: tuple[asyncio.Future, int]) -> None:
        waiter, weight = entry
        if waiter.done() and not waiter.cancelled():
            self.release(weight)  # the slots arrived as we gave up: pass them on
        else:
            waiter.cancel()
            try:
                self._waiters.remove(entry)
            except ValueError:
                pass
            self._admit()  # the head may have left: the next may fit

    def _refusal(self, why: str) -> Overloaded:
        return Overloaded(f"The proxy is at capacity ({self.active} samples in flight, {self.queued} requests "
                          f"queued) {why}; retry later", retry_after_s=1)


def samples_of(raw: bytes) -> int:
    """The samples a body asks for: its `n` (vLLM's and OpenAI's), else `sampling_params.n`
    (/inference/v1/generate, SGLang's /generate); 1 when absent or not a count (the handler refuses
    that). Only a body that names "n" is parsed here."""
    if b'"n"' not in raw:
        return 1
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return 1
    if not isinstance(body, dict):
        return 1
    params = body.get("sampling_params")
    n = body.get("n", params.get("n") if isinstance(params, dict) else None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


ADMISSION = web.AppKey("admission", Admission)


@web.middleware
async def admission_control(request: web.Request, handler):
    admission = request.app.get(ADMISSION)
    if admission is None or request.method != "POST" or route_kind(request.app, request.path) != INFERENCE:
        return await handler(request)
    weight = admission.weight_of(samples_of(await read_body(request)))
    try:
        await admission.acquire(weight)
    except Overloaded:
        stats_of(request).overloaded = True
        raise
    try:
        return await handler(request)
    finally:
        admission.release(weight)
