"""create_app(settings): the aiohttp application and the lifetimes of what it holds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from token_proxy.api.chat.sessions import add_sessions
from token_proxy.http_io import send_response_headers
from token_proxy.ops.access_log import adopt_library_loggers
from token_proxy.ops.admission import ADMISSION, Admission, admission_control
from token_proxy.ops.auth import ACCESS, AccessPolicy, access_control
from token_proxy.ops.cors import add_cors, cors_preflight
from token_proxy.ops.drain import add_drain, drain_deadline
from token_proxy.ops.metrics import METRICS
from token_proxy.ops.middleware import openai_errors
from token_proxy.ops.observe import add_observability, observe_requests
from token_proxy.role import OWNER, ROLE, Role
from token_proxy.routes import add_routes
from token_proxy.settings import Settings
from token_proxy.sglang.client import SGLangClient
from token_proxy.sglang.discovery import CONNECTION, keep_connected
from token_proxy.sglang.pool import sglang_sessions
from token_proxy.state import CONTEXT, REQUESTS, SETTINGS, SGLANG_CLIENT, ProxyContext

ABORTS_AT_EXIT_S = 0.5  # how long the upstream aborts sent at the end may take before the process exits


def create_app(settings: Settings, role: Role | None = None,
               add_planes: Callable[[web.Application], None] | None = None) -> web.Application:
    """One process's app. `role` (token_proxy/serving/): None or single, everything here; a worker
    (--workers N > 1), the data plane with admin routes forwarded to the owner; the owner, the whole
    app behind a Unix socket that only workers reach (they checked the keys). `add_planes(app)` adds
    the routes (serving/serve.py's planes_for(role)); None: every route (routes.add_routes)."""
    if not settings.backend_url:
        raise ValueError("create_app needs settings.backend_url (the CLI starts the simulator when none is given)")
    role = role or Role()
    # observe_requests first: it sees every final status, refusals by the others included; then
    # drain_deadline, which answers what is still running when SIGTERM's --shutdown-timeout passes.
    # cors_preflight only where CORS is on (--allowed-origins): nothing runs for it otherwise.
    cors = [cors_preflight] if settings.allowed_origins else []
    app = web.Application(middlewares=[observe_requests, drain_deadline, openai_errors, *cors, access_control,
                                       admission_control], client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app[ROLE] = role
    if role.kind != OWNER:  # the owner's callers are the workers, which applied keys and limits
        app[ACCESS] = AccessPolicy(settings.api_key, settings.admin_key, settings.admin_open)
        app[ADMISSION] = Admission(settings.max_concurrent_requests, settings.max_queued_requests,
                                   settings.queue_timeout_s)
    add_drain(app, settings.shutdown_timeout_s)
    app.cleanup_ctx.append(_proxy_context)
    add_observability(app)  # after _proxy_context: the backend scrape uses its client
    add_sessions(app)  # after add_observability: its metrics go on that registry
    app.on_response_prepare.append(send_response_headers)
    add_cors(app, settings.allowed_origins, settings.allowed_methods, settings.allowed_headers,
             settings.allow_credentials)
    (add_planes or add_routes)(app)
    return app


async def _proxy_context(app: web.Application):
    settings = app[SETTINGS]
    executor = ThreadPoolExecutor(settings.tokenizer_threads, thread_name_prefix="tokenize")
    # Every SGLang call (data, admin, fan-out, router) goes through this pool (sglang/client.py).
    async with sglang_sessions(settings.backend_keepalive_s) as (pooled, fresh, replies):
        client = SGLangClient(settings.backend_url, pooled, settings.request_timeout_s,
                              settings.connect_timeout_s, settings.first_token_timeout_s,
                              settings.stream_idle_timeout_s, fresh=fresh,
                              stream_coalesce_s=settings.stream_coalesce_ms / 1000,
                              on_retry=app[METRICS].upstream_retry, api_key=settings.sglang_api_key,
                              replies=replies)
        app[CONTEXT] = ProxyContext(settings=settings, client=client, executor=executor)
        app[CONNECTION], app[SGLANG_CLIENT], app[REQUESTS] = app[CONTEXT].connection, client, app[CONTEXT].requests
        # Not awaited: the port opens at once and answers 503 (with the reason) until SGLang is known.
        connecting = asyncio.get_running_loop().create_task(keep_connected(app, adopt_library_loggers))
        yield
        connecting.cancel()
        pending = list(app[CONTEXT].background)
        if pending:  # the upstream aborts of requests cut at the drain deadline: bounded, to exit on time
            await asyncio.wait(pending, timeout=ABORTS_AT_EXIT_S)
    executor.shutdown(wait=False, cancel_futures=True)
