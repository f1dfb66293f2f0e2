"""A streamed /generate's time limits, on one timer, for the stream reader (sglang/relay.py): SGLang's first
output within `first_s`, no gap longer than `idle_s` while the reader waits for data, and the whole answer
within `total_s`.

The timer is re-armed only when it fires, never per read: a read costs the reader one `touch()` (or
setting `since`). The BackendTimeout is built when a limit is hit, not when the timer starts, so a stream
that ends in time runs no errors.py code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from token_proxy.errors import BackendTimeout

IDLE_MESSAGE = "SGLang stalled: no data from it within the idle limit (Timeout on reading data from socket)"


class Deadline:
    """`on_expire(error)` once, when a limit is hit (None limits are off). The reader calls `touch()` when
    data arrives or a read begins, `pause()` while it does not read (a slow client: not SGLang's gap),
    `first_done()` once the first events are in, and `cancel()` at the end."""

    __slots__ = ("_first_by", "_first_s", "_handle", "_idle_s", "_loop", "_on_expire", "_total_by", "since")

    def __init__(self, loop: asyncio.AbstractEventLoop, first_s: float | None, idle_s: float | None,
                 on_expire: Callable[[BaseException], object], total_s: float | None = None):
        self._loop = loop
        self._on_expire = on_expire
        now = loop.time()
        self._first_s = first_s
        self._first_by = now + first_s if first_s else None
        self._idle_s = idle_s or None
        self._total_by = now + total_s if total_s else None
        self.since: float | None = now  # loop.time() the idle gap is measured from; None: not reading
        self._handle: asyncio.TimerHandle | None = None
        self._arm(now)

    def touch(self) -> None:
        self.since = self._loop.time()

    def pause(self) -> None:
        self.since = None

    def first_done(self) -> None:
        self._first_by = None  # the timer, if armed for it, finds nothing to do and re-arms for the rest

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self, now: float) -> None:
        left = None
        for by in (self._first_by, self._total_by):
            if by is not None and (left is None or by - now < left):
                left = by - now
        if self._idle_s is not None:
            since = self.since
            idle_left = self._idle_s if since is None else since + self._idle_s - now
            left = idle_left if left is None else min(left, idle_left)
        self._handle = None if left is None else self._loop.call_later(max(0.0, left), self._check)

    def _check(self) -> None:
        self._handle = None
        now = self._loop.time()
        error = self._expired(now)
        if error is None:
            self._arm(now)
        else:
            self._on_expire(error)

    def _expired(self, now: float) -> BackendTimeout | None:
        if self._total_by is not None and now >= self._total_by:
            return BackendTimeout("SGLang did not finish the request in time")
        if self._first_by is not None and now >= self._first_by:
            return BackendTimeout(f"SGLang sent no output within the first-token limit of {self._first_s:g} s")
        since = self.since
        if self._idle_s is not None and since is not None and now - since >= self._idle_s:
            return BackendTimeout(IDLE_MESSAGE)
        return None
