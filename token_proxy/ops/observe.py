"""The observing middleware: observe_requests, outermost, counts and times every request into the
series table (ops/metrics.py), sends a whole reply before that bookkeeping, and writes the access line;
and add_observability, which puts the series table, the SGLang scrape (ops/backend_scrape.py) and
the weight-version hooks on the app."""

from __future__ import annotations

import asyncio
import os
import time
from functools import partial

from aiohttp import web
from prometheus_client import disable_created_metrics

from token_proxy.http_io import route_kind, routes_where
from token_proxy.ops.access_log import log_request
from token_proxy.ops.backend_scrape import backend_metrics, follow_weight_updates
from token_proxy.ops.metrics import CLIENT_CLOSED, METRICS, UNMATCHED, ProxyMetrics
from token_proxy.ops.metrics_mirror import mirror_collectors
from token_proxy.pipeline.request_state import add_request_id_header, stats_of
from token_proxy.role import ROLE
from token_proxy.route_row import ADMIN, INFERENCE
from token_proxy.state import CONTEXT, REGISTER_COLLECTOR, SETTINGS

CREATED_SWITCH = "PROMETHEUS_DISABLE_CREATED_SERIES"  # prometheus-client's own, read once at its import


def endpoint_of(request: web.Request) -> str:
    """The route's canonical path (e.g. /v1/chat/completions), never the raw one."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else UNMATCHED


@web.middleware
async def observe_requests(request: web.Request, handler):
    """Outermost middleware: sees the final status (after the error middleware), counts, times,
    and writes the access line. Costs a few microseconds; nothing here waits."""
    metrics = request.app[METRICS]
    stats = stats_of(request)  # created here, so stats.started_at is the request's start
    endpoint = endpoint_of(request)
    gauge = metrics.child(metrics.in_flight, endpoint)
    gauge.inc()
    status, overloaded = 500, False
    try:
        response = await handler(request)
        status = response.status
        overloaded = stats.overloaded  # the proxy's own refusal (a 503 from SGLang's side is not)
        if isinstance(response, web.Response) and not response.prepared:
            # A whole reply leaves now, so the client does not wait for the bookkeeping below;
            # aiohttp's own prepare and write_eof then find it sent.
            try:
                await response.prepare(request)
                await response.write_eof()
            except ConnectionError:
                status = CLIENT_CLOSED
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status = CLIENT_CLOSED
        raise
    finally:
        gauge.dec()
        stats.finished_at = time.perf_counter()
        if stats.client_disconnected:
            status = CLIENT_CLOSED
        latency = stats.finished_at - stats.started_at
        metrics.observe(endpoint, status, stats, latency, overloaded)
        if endpoint in metrics.weight_update_routes:  # the version is re-read by the admin plane's hooks
            metrics.observe_weight_update(endpoint, status, latency)
        log_request(request, endpoint, status, stats, latency)


def add_observability(app: web.Application) -> None:
    """Metrics registry, X-Request-Id on every response, and the backend scrape (append after the
    proxy context: it uses its SGLang client). The middleware goes first in create_app's list."""
    settings = app[SETTINGS]
    if CREATED_SWITCH not in os.environ:  # the operator's choice, else none (ops/metrics.py says why)
        disable_created_metrics()
    multiproc = app[ROLE].multiprocess if ROLE in app else False
    metrics = app[METRICS] = ProxyMetrics(stale_after_s=settings.backend_metrics_stale_s, multiprocess=multiproc)
    app[REGISTER_COLLECTOR] = metrics.registry.register
    app.on_response_prepare.append(add_request_id_header)
    app.on_startup.append(_start_routes_at_zero)
    app.on_startup.append(_start_vllm_series)
    app.on_startup.append(follow_weight_updates)  # on_startup: after every cleanup_ctx (the admin plane's)
    if not multiproc:  # with --workers, the owner alone reads SGLang's /metrics
        app.cleanup_ctx.append(backend_metrics)
    else:
        app.cleanup_ctx.append(partial(mirror_collectors, mirror=metrics.mirror))


async def _start_routes_at_zero(app: web.Application) -> None:
    """The route table's inference and weight routes, then every fixed route of the finished router
    (admin routes included), at 0 before its first answer."""
    metrics = app[METRICS]
    served_inference = [path for path in routes_where(app, "served") if route_kind(app, path) == INFERENCE]
    metrics.routes_from_table(served_inference, routes_where(app, "weight_update"))
    paths = sorted({resource.canonical for resource in app.router.resources()
                    if isinstance(resource, web.PlainResource)})
    metrics.start_routes_at_zero(paths, [path for path in paths if route_kind(app, path) == ADMIN])


async def _start_vllm_series(app: web.Application) -> None:
    """vLLM's request-level series for the served model, at 0 once SGLang is known; the one place
    every role (single, owner, worker) starts them."""
    metrics, ctx = app[METRICS], app.get(CONTEXT)
    if ctx is not None:
        ctx.when_ready(lambda backend: metrics.start_vllm_series(backend.served_model_name, backend.max_model_len))
