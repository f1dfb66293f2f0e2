"""Which `token_proxy` modules run while one request is served (issue 21's measuring test).

Recording is armed by a context variable in the task that serves the request; what that task starts (tasks,
timers, the callbacks of a connection it opens) copies its context, so it counts too, while the simulator's
tasks, earlier requests' timers and background loops on the same event loop do not. A function counts when
it starts: a coroutine resumed after an await is the same call (every await resumes the whole chain of
middleware frames above the handler, which must not count as running them). Python 3.12+ reports starts
directly (sys.monitoring's PY_START); before, sys.setprofile's 'call' on a frame that has not run yet.
"""

from __future__ import annotations

import dis
import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from aiohttp import web

ARMED: ContextVar[ModuleTrace | None] = ContextVar("module_trace_armed", default=None)
_RESUMABLE = 0x20 | 0x80 | 0x100 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ITERABLE_COROUTINE | CO_ASYNC_GENERATOR


@functools.cache
def _first_resume(code) -> int:
    return next((i.offset for i in dis.get_instructions(code) if i.opname == "RESUME"), 0)


def _starts(frame) -> bool:
    """A 'call' event for a new call, not a generator or coroutine resumed where it stopped."""
    code = frame.f_code
    return not code.co_flags & _RESUMABLE or frame.f_lasti <= _first_resume(code)


class ModuleTrace:
    """One recording window: `with trace.recording(): ...`; code counts where `arm` ran (and in what
    that task starts). `modules()`: paths relative to `root`, without those under `exclude`."""

    def __init__(self, root: Path, exclude: tuple[str, ...] = ()):
        self.root = root.resolve()
        self.exclude = exclude
        self.active = False
        self._files: set[str] = set()

    def arm(self):
        return ARMED.set(self)

    @contextmanager
    def recording(self) -> Iterator[ModuleTrace]:
        self.active = True
        try:
            if sys.version_info >= (3, 12):
                with self._monitoring():
                    yield self
            else:
                with self._profiling():
                    yield self
        finally:
            self.active = False

    def modules(self) -> set[str]:
        found = set()
        for name in self._files:
            path = Path(name).resolve()
            if self.root in path.parents:
                relative = path.relative_to(self.root).as_posix()
                if not relative.startswith(self.exclude):
                    found.add(relative)
        return found

    @contextmanager
    def _profiling(self) -> Iterator[None]:
        files = self._files

        def profile(frame, event, arg):
            if event == "call" and ARMED.get() is self and _starts(frame):
                files.add(frame.f_code.co_filename)

        previous = sys.getprofile()
        sys.setprofile(profile)
        try:
            yield
        finally:
            sys.setprofile(previous)

    @contextmanager
    def _monitoring(self) -> Iterator[None]:
        monitoring = sys.monitoring
        tool = monitoring.PROFILER_ID
        files = self._files

        def started(code, offset):
            if ARMED.get() is self:
                files.add(code.co_filename)

        monitoring.use_tool_id(tool, "module_trace")
        try:
            monitoring.register_callback(tool, monitoring.events.PY_START, started)
            monitoring.set_events(tool, monitoring.events.PY_START)
            yield
        finally:
            monitoring.set_events(tool, 0)
            monitoring.register_callback(tool, monitoring.events.PY_START, None)
            monitoring.free_tool_id(tool)


class Probe:
    """Two middlewares that arm the current trace: `outermost` (first in the app's list: the whole app,
    the response's send after the middleware chain included) or `innermost` (last: the route's handler
    alone, handler -> SGLang -> response). `where` picks which one arms; None: neither."""

    def __init__(self):
        self.trace: ModuleTrace | None = None
        self.where: str | None = None

    def install(self, app: web.Application) -> None:
        app.middlewares.insert(0, self.outermost)
        app.middlewares.append(self.innermost)

    @web.middleware
    async def outermost(self, request: web.Request, handler):
        if self.where == "app" and self.trace is not None and self.trace.active:
            self.trace.arm()  # left armed: aiohttp sends a returned response after the chain
        return await handler(request)

    @web.middleware
    async def innermost(self, request: web.Request, handler):
        if self.where != "handler" or self.trace is None or not self.trace.active:
            return await handler(request)
        token = self.trace.arm()
        try:
            return await handler(request)
        finally:
            ARMED.reset(token)
