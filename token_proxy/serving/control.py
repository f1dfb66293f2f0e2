"""The admin owner's internal routes, on its Unix socket (only the serving processes of --workers N
reach it):

- POST /_internal/adapters: a serving process's LoRA long-poll (adapter_sync.py);
- POST /_internal/lora_sync: a serving process's request found SGLang without an adapter; re-load what is
  missing;
- GET /_internal/metrics: the one-producer block every serving process appends to its /metrics
  (metrics_block.py);
- POST /_internal/news {"process", "seen", "dropped", "wait"}: a serving process's long-poll for the served
  name and the finished sessions (owner_news.py);
- GET /_internal/fleet_versions?seen=N&wait=S: the fleet's weight-version record once it differs from `seen`
  (a long poll; fleet_mirror.py), for the data path's stale-weights check: fleet/version_feed.py's one answer, the
  same a follower proxy reads from its controller's GET /fleet/versions;
- GET /_internal/ready: whether the owner is connected to SGLang (a serving process's /health waits for it).
"""

from __future__ import annotations

from aiohttp import web

from token_proxy.admin.art import NAME_PUBLISHED
from token_proxy.api.chat.sessions import FINISH_EVERYWHERE
from token_proxy.fleet.version_feed import fleet_versions
from token_proxy.http_io import json_response, read_json
from token_proxy.lora.registry import ADAPTERS
from token_proxy.lora.sync import MAP_PUBLISHED, AdapterPublisher
from token_proxy.lora.workers import LORA
from token_proxy.route_row import ADMIN, OWNER, Route
from token_proxy.routes import INTERNAL, add_rows
from token_proxy.serving.metrics_block import render_owner_block
from token_proxy.serving.owner_news import OwnerNews
from token_proxy.state import CONTEXT

PUBLISHER = web.AppKey("adapter_publisher", AdapterPublisher)
NEWS = web.AppKey("owner_news", OwnerNews)


async def adapters_poll(request: web.Request) -> web.Response:
    body = await read_json(request)
    publisher = request.app[PUBLISHER]
    process = int(body["process"])
    publisher.report(process, int(body["seq"]), int(body["seen"]), [str(i) for i in body.get("held", [])])
    await publisher.map.wait_for_change(int(body["seen"]), float(body.get("wait", 20.0)))
    return json_response(publisher.offer(process))


async def news_poll(request: web.Request) -> web.Response:
    body = await read_json(request)
    news = request.app[NEWS]
    seen = int(body["seen"])
    news.report(int(body["process"]), seen, [str(key) for key in body.get("dropped", [])])
    await news.feed.wait_for_change(seen, float(body.get("wait", 20.0)))
    return json_response(news.offer(seen))


async def lora_sync(request: web.Request) -> web.Response:
    return json_response({"loaded": await request.app[LORA].sync_workers()})


async def owner_ready(request: web.Request) -> web.Response:
    """A serving process's /health asks: is the owner connected to SGLang (every OWNER row can be served)?"""
    reason = request.app[CONTEXT].not_ready_reason
    return json_response({"ready": reason is None, "reason": reason}, 200 if reason is None else 503)


async def owner_metrics(request: web.Request) -> web.Response:
    return web.Response(body=await render_owner_block(request.app), content_type="text/plain")


# Rows of the route table that only the owner's app has (a serving process refuses /_internal/ for clients).
CONTROL_ROUTES = (
    Route("/_internal/adapters", ("POST",), adapters_poll, ADMIN, dialect=INTERNAL, answered_by=OWNER),
    Route("/_internal/news", ("POST",), news_poll, ADMIN, dialect=INTERNAL, answered_by=OWNER),
    Route("/_internal/lora_sync", ("POST",), lora_sync, ADMIN, dialect=INTERNAL, answered_by=OWNER),
    Route("/_internal/metrics", ("GET",), owner_metrics, ADMIN, dialect=INTERNAL, answered_by=OWNER),
    Route("/_internal/fleet_versions", ("GET",), fleet_versions, ADMIN, dialect=INTERNAL, answered_by=OWNER),
    Route("/_internal/ready", ("GET",), owner_ready, ADMIN, dialect=INTERNAL, answered_by=OWNER),
)


def add_control_routes(app: web.Application) -> None:
    """Before the admin plane's routes (it ends with a catch-all); its state after them: see add_control_state."""
    add_rows(app, CONTROL_ROUTES)


def add_control_state(app: web.Application) -> None:
    """After add_routes: the publisher needs the LoRA registry the admin plane's cleanup context makes."""
    app.cleanup_ctx.append(_publisher)


async def _publisher(app: web.Application):
    publisher = app[PUBLISHER] = AdapterPublisher(app[ADAPTERS])
    app[MAP_PUBLISHED] = publisher.published  # a load or unload answers once every serving process applied it
    news = app[NEWS] = OwnerNews(app[CONTEXT])
    app[NAME_PUBLISHED] = news.renamed  # a rename or a finished session answers once every process applied it
    app[FINISH_EVERYWHERE] = news.finish_session
    yield
