"""Serving one process: the app for its role (single, owner or serving process) on a listening socket, on uvloop
where it is installed. The CLI runs it for one process; a --workers N serving process (process.py) runs it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable

from token_proxy.role import OWNER, SERVING, Role
from token_proxy.settings import Settings

log = logging.getLogger("token_proxy")  # the CLI's start and stop lines


def planes_for(role: Role | None) -> Callable | None:
    """What create_app adds for a role: a serving process, the data plane with admin routes forwarded to the owner;
    the owner, the control routes (before the admin plane's catch-all pass-through), every route, and the
    control state; None (the app's own add_routes) for a single process."""
    kind = role.kind if role is not None else None
    if kind == SERVING:
        return add_serving_planes
    if kind == OWNER:
        return add_owner_planes
    return None


def add_serving_planes(app) -> None:
    from token_proxy.routes import add_routes
    from token_proxy.serving.process_app import add_serving_plane

    add_routes(app, add_admin=add_serving_plane)


def add_owner_planes(app) -> None:
    from token_proxy.routes import add_routes
    from token_proxy.serving.control import add_control_routes, add_control_state

    add_control_routes(app)  # before the admin plane's catch-all pass-through
    add_routes(app)
    add_control_state(app)


def serve(settings: Settings, sock: socket.socket, role=None, listen_when_ready: bool = False) -> None:
    """Serve on `sock` until SIGTERM. A socket that is bound but not listening starts listening when the
    site starts: at once (answering 503 until SGLang is connected), or with `listen_when_ready` only
    once SGLang is known and the tokenizer loaded (a restarted --workers process whose siblings serve)."""
    from aiohttp import web

    from token_proxy.app import create_app
    from token_proxy.ops.drain import SERVER_GRACE_S
    from token_proxy.serving.tls import scheme, server_ssl_context
    from token_proxy.state import CONTEXT, ON_FATAL

    # Every stream event allocates a few short-lived dicts; the default gen-0 threshold (700) would run
    # the collector thousands of times a second under load. Long-lived objects are frozen out of it.
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    fatal: list[str] = []
    app = create_app(settings, role, planes_for(role))

    def stop(message: str) -> None:  # a configuration error found while connecting: stop serving
        fatal.append(message)
        os.kill(os.getpid(), signal.SIGTERM)  # run_app's handler: a graceful stop

    app[ON_FATAL] = stop
    port = sock.getsockname()[1]
    process = f" (serving process {role.index})" if role is not None and role.index is not None else ""

    async def say_shutting_down(app: web.Application) -> None:  # SIGTERM / SIGINT: before the drain
        ctx = app.get(CONTEXT)
        log.info("token-proxy shutting down%s: not accepting; %d requests in flight get up to %g s "
                 "(--shutdown-timeout)", process, len(ctx.in_flight) if ctx else 0, settings.shutdown_timeout_s)

    app.on_shutdown.append(say_shutting_down)
    if listen_when_ready:
        app.on_startup.append(until_ready)  # after the cleanup contexts (CONTEXT): run_app listens after it
        log.info("token-proxy%s: listening on %s://%s:%d/v1 once SGLang at %s is connected", process,
                 scheme(settings), settings.host, port, settings.backend_url)
    else:
        log.info("token-proxy listening on %s://%s:%d/v1%s -> %s (answering 503 until SGLang is connected)",
                 scheme(settings), settings.host, port, process, settings.backend_url)
    # aiohttp's own timeout is a backstop: at --shutdown-timeout each request still running answers an
    # error (ops/drain.py) and ends.
    web.run_app(app, sock=sock, handler_cancellation=True, shutdown_timeout=settings.shutdown_timeout_s + SERVER_GRACE_S,
                access_log=None, print=None, loop=new_event_loop(), ssl_context=server_ssl_context(settings))
    if fatal:  # already logged, in one line, where it was found
        logging.shutdown()
        raise SystemExit(2)


async def until_ready(app) -> None:
    """An on_startup hook: returns once the data path can serve. A fatal configuration error meanwhile
    sends SIGTERM (ON_FATAL), which ends the wait and the process."""
    from token_proxy.state import CONTEXT

    ready = asyncio.Event()
    app[CONTEXT].when_ready(lambda _backend: ready.set())
    await ready.wait()


def exit_at_once(status: int) -> None:
    """The end of a process that has stopped serving and cleaned up: logs flushed, then out without the
    interpreter's teardown, which frees the tokenizer and the libraries for about a second (it would push
    the exit that far past --shutdown-timeout)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (a Linux dependency, as in vLLM and SGLang): a stream's read ->
    write per token costs ~10 % less CPU on it (bench/RESULTS.md, section 5); else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
