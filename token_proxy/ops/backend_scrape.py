"""What the proxy reads from SGLang for its metrics: the /metrics scrape loop behind the vllm: view
(the backend's page, or behind an sglang-router each worker's), and the weight version SGLang serves,
re-read when the admin plane reports a weight update (its after_weights hooks) and when SGLang answers
again after an outage.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from token_proxy.errors import BackendTimeout, BackendUnavailable, ProxyError
from token_proxy.fleet.plane import ADMIN
from token_proxy.ops.metrics import METRICS, ProxyMetrics
from token_proxy.state import CONTEXT, SETTINGS

log = logging.getLogger(__name__)


async def backend_metrics(app: web.Application):
    """cleanup_ctx, after the proxy context: reads SGLang's /metrics on an interval for the vllm:
    view, and seeds the weight version from start-up discovery."""
    settings, metrics, ctx = app[SETTINGS], app[METRICS], app[CONTEXT]

    def seed(backend) -> None:  # once SGLang is known (start-up may come before it)
        metrics.backend.model_name = backend.served_model_name
        if backend.max_total_num_tokens:
            metrics.backend.set_cache_config(backend.max_total_num_tokens, backend.page_size)
        if backend.weight_version:
            metrics.set_weight_version(str(backend.weight_version))

    ctx.when_ready(seed)
    interval = settings.backend_metrics_interval_s
    task = None
    if interval > 0:
        timeout = min(5.0, max(interval, settings.backend_metrics_stale_s / 2))
        task = asyncio.get_running_loop().create_task(_scrape_forever(ctx, metrics, interval, timeout))
    yield
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _scrape_forever(ctx, metrics: ProxyMetrics, interval: float, timeout: float) -> None:
    """Reads SGLang's /metrics for the vllm: view: the backend's, or behind an sglang-router (which serves
    none) each worker's, added up (_read_pages). When SGLang answers again after failing (it may have
    restarted, with other weights), the weight version is read again at once. Whether SGLang answers at
    all is the proxy's outage signal (the connection's outage_began / outage_ended log it): a 404 is an
    answer. A page SGLang refuses is named once, after discovery (before it, a router's 404 says nothing)."""
    conn = ctx.connection
    backend, was_up, warned = metrics.backend, True, False
    while True:
        try:
            backend.update_many(await _read_pages(ctx, timeout))
            conn.outage_ended()
            warned = False
        except (BackendUnavailable, BackendTimeout) as exc:  # no answer: SGLang is gone, or not there yet
            backend.failed()
            conn.outage_began(exc.message)
        except ProxyError as exc:
            backend.failed()
            conn.outage_ended()
            if not warned and conn.connected is not None:
                warned = True
                hint = (" (start SGLang with --enable-metrics)" if "HTTP 404" in exc.message
                        and "HTML page" not in exc.message else "; the vllm: view goes stale")
                log.warning("cannot read SGLang's /metrics: %s%s", exc.message, hint)
        except Exception:  # a bad page must not end the loop
            backend.failed()
            log.exception("unreadable /metrics page from SGLang")
        if backend.up and not was_up:
            log.info("reading SGLang's /metrics again")
            await refresh_weight_version(version_client(ctx), metrics)
        was_up = backend.up
        await asyncio.sleep(interval)


async def _read_pages(ctx, timeout: float) -> list[str]:
    """The backend's /metrics page, or behind a router every worker's (the router's port serves none).
    All workers unreachable is an outage; one worker failing is a ProxyError naming it."""
    connected = ctx.connection.connected
    if connected is None or not connected.picture.behind_router:
        return [await ctx.client.metrics_text(timeout)]
    urls = connected.picture.worker_urls
    pages = await asyncio.gather(*(ctx.client.at(url).metrics_text(timeout) for url in urls),
                                 return_exceptions=True)
    failed = [(url, page) for url, page in zip(urls, pages) if isinstance(page, BaseException)]
    for _url, exc in failed:
        if not isinstance(exc, ProxyError):
            raise exc
    if failed and len(failed) == len(urls) and all(isinstance(e, (BackendUnavailable, BackendTimeout))
                                                   for _, e in failed):
        raise failed[0][1]
    if failed:
        url, exc = failed[0]
        raise ProxyError(f"worker {url}: {exc.message}")
    return pages


def version_client(ctx):
    """Where the weight version is read: the backend, or behind a router its first worker (a router
    serves no /model_info)."""
    connected = ctx.connection.connected
    if connected is None or not connected.picture.behind_router:
        return ctx.client
    return ctx.client.at(connected.picture.worker_urls[0])


async def refresh_weight_version(client, metrics: ProxyMetrics) -> None:
    """Ask SGLang which weights it now serves (a weight update may not say)."""
    try:
        info = await client.get_json("/model_info", timeout_s=10.0)
    except ProxyError:
        return
    version = info.get("weight_version") if isinstance(info, dict) else None
    if version:
        metrics.set_weight_version(str(version))


async def follow_weight_updates(app: web.Application) -> None:
    """on_startup, after the admin plane exists: every weight update or version change it records
    re-reads the version SGLang serves (the token_proxy_weight_version gauges). A --workers process
    has no admin plane: the owner's does this, and its block carries the gauges."""
    plane, ctx, metrics = app.get(ADMIN), app.get(CONTEXT), app[METRICS]
    if plane is None or ctx is None:
        return
    plane.after_weights.append(lambda: ctx.spawn(refresh_weight_version(version_client(ctx), metrics)))
