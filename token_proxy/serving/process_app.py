"""A data-plane serving process's admin side (`--workers N`; a proxy process, not an SGLang worker): every admin-plane route (the route table's OWNER rows) is forwarded to the owner over
its Unix socket (the same routes as one process serves, so labels, 404s and 405s match), the LoRA map
is mirrored (adapter_sync.py), so are the fleet's weight-version record (fleet_mirror.py), the served name and
the finished sessions (owner_news.py), and /metrics appends the owner's block (metrics_block.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
from aiohttp import web

from token_proxy.api.chat.sessions import SESSIONS
from token_proxy.errors import BackendUnavailable, NotFound
from token_proxy.fleet.versions import register_reply_check
from token_proxy.http_io import PASSED_THROUGH
from token_proxy.lora.registry import ADAPTERS, AdapterRegistry
from token_proxy.lora.resolve import register_resolver
from token_proxy.lora.sync import AdapterFollower
from token_proxy.lora.workers import LORA
from token_proxy.ops.access_log import PROCESS_INDEX
from token_proxy.ops.exposition import EXTRA_METRICS
from token_proxy.role import ROLE
from token_proxy.route_row import OWNER
from token_proxy.routes import OWNER_NOT_READY, ROUTES, add_rows
from token_proxy.serving.fleet_mirror import FleetMirror
from token_proxy.serving.metrics_block import CONTROL_SESSION, fetch_owner_block
from token_proxy.serving.owner_news import NewsFollower
from token_proxy.state import CONTEXT

log = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp sets itself.
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "transfer-encoding", "upgrade", "host", "content-length"})
CONNECT_TIMEOUT_S = 5.0
OWNER_READY_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


async def forward_to_owner(request: web.Request) -> web.StreamResponse:
    """The request as it came (method, path, query, headers, body) to the owner; its reply streamed back.
    Keys were checked here (the owner trusts its socket). No deadline: the owner's admin calls carry
    their own (a weight update may take minutes); a client that leaves cancels the call there too."""
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
    body = await request.read()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
    try:
        upstream = await request.app[CONTROL_SESSION].request(
            request.method, "http://owner" + str(request.rel_url), headers=headers, data=body or None,
            timeout=timeout, allow_redirects=False)
    except aiohttp.ClientError as exc:
        raise BackendUnavailable(f"the proxy's admin process does not answer ({exc}); it may be stopping") from None
    async with upstream:
        # ops/drain.py ends it at SIGTERM's deadline (an error event in a stream) once it has begun
        response = request[PASSED_THROUGH] = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for key, value in upstream.headers.items():
            if key.lower() not in _HOP:
                response.headers.add(key, value)
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


async def internal_only(request: web.Request) -> web.StreamResponse:
    """The owner's /_internal/ routes are for serving processes, never forwarded for a client."""
    raise NotFound(f"{request.path} is not a route of this server")


class RemoteLora:
    """What the data path needs of LoraAdmin (`Reloads`, for the client's retry point): ask the owner to re-load lost adapters."""

    def __init__(self, session: aiohttp.ClientSession):
        self.session = session

    async def sync_workers(self) -> int:
        async with self.session.post("http://owner/_internal/lora_sync") as resp:
            return (await resp.json()).get("loaded", 0) if resp.status == 200 else 0


class OwnerReadiness:
    """routes.OWNER_NOT_READY for a data-plane process: asks the owner until it has once said ready (it
    connects once; a later loss of SGLang shows in this process's own check of SGLang)."""

    def __init__(self, session: aiohttp.ClientSession):
        self.session = session
        self.ready = False

    async def __call__(self) -> str | None:
        if self.ready:
            return None
        try:
            async with self.session.get("http://owner/_internal/ready", timeout=OWNER_READY_TIMEOUT) as resp:
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            return f"the proxy's admin process does not answer yet ({exc or type(exc).__name__})"
        self.ready = resp.status == 200
        return None if self.ready else f"the proxy's admin process is not ready: {body.get('reason')}"


def add_serving_plane(app: web.Application) -> None:
    """In place of routes.add_admin_plane: the route table's OWNER rows, each forwarded, then the catch-all."""
    add_rows(app, [route for route in ROUTES if route.answered_by == OWNER], handler=forward_to_owner)
    app.router.add_route("*", "/_internal/{tail:.*}", internal_only)
    app.router.add_route("*", "/{tail:.*}", forward_to_owner)
    app.cleanup_ctx.append(_serving_state)


async def _serving_state(app: web.Application):
    role = app[ROLE]
    app[PROCESS_INDEX] = role.index
    connector = aiohttp.UnixConnector(path=role.control_socket, limit=0)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        app[CONTROL_SESSION] = session
        app[OWNER_NOT_READY] = OwnerReadiness(session)
        app[EXTRA_METRICS] = fetch_owner_block
        registry = app[ADAPTERS] = AdapterRegistry()
        reloads = app[LORA] = RemoteLora(session)
        register_resolver(app, registry, reloads)
        follower = AdapterFollower(session, role.index, registry)

        def learn(backend) -> None:
            registry.base_names = {backend.served_model_name}

        app[CONTEXT].when_ready(learn)
        mirror = FleetMirror(session)  # the fleet's versions (the stale-reply check)
        register_reply_check(app, mirror)
        news = NewsFollower(session, role.index, app[CONTEXT], lambda: app.get(SESSIONS))  # name, finished sessions
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(follower.run()), loop.create_task(mirror.run()), loop.create_task(news.run())]
        with contextlib.suppress(asyncio.TimeoutError):  # the owner is up before serving processes start
            await asyncio.wait_for(asyncio.gather(follower.first_map.wait(), mirror.first.wait(), news.first.wait()),
                                   5.0)
        yield
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
