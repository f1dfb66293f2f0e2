"""Weight updates that cannot crash SGLang: a deferred prefix-cache flush.

SGLang 0.5.17 asserts inside the scheduler — and the whole server dies — when a weight
update's `flush_cache` (default true) finds requests pending: exactly the case while
generation is paused in `retract` or `in_place` mode with rollouts in flight (seen on a
real server). So a worker with pending requests gets `flush_cache: false`, and the flush
it is owed runs after /resume, retried until SGLang is idle for a moment (a flush while
requests run is a harmless 400). Until then, prefixes cached under the old weights may
be reused; that window is logged.
"""

from __future__ import annotations

import asyncio
import logging
import time

from token_proxy.proxy.admin.workers import AdminPlane

log = logging.getLogger(__name__)

FLUSH_RETRY_S = 1.0
FLUSH_GIVE_UP_S = 600.0
LOAD_TIMEOUT_S = 10.0


async def safe_flush(plane: AdminPlane, bodies: list[dict], urls: list[str]) -> list[dict]:
    """`bodies` for a weight update on `urls`, with flush_cache turned off where it would crash."""
    wants = [b.get("flush_cache", True) for b in bodies]
    if not any(wants):
        return bodies
    loads = await plane.fan_out("GET", "/get_load", None, LOAD_TIMEOUT_S, urls)
    out = []
    for body, url, want, load in zip(bodies, urls, wants, loads):
        if want and _pending(load) != 0:
            log.warning("%s has requests pending: updating weights without flushing its cache (SGLang would "
                        "crash); the flush runs after /resume", url)
            body = {**body, "flush_cache": False}
            plane.owed_flushes.add(url)
        out.append(body)
    return out


def _pending(reply) -> int | None:
    """Running + waiting requests on a worker (None when its load cannot be read: assume busy)."""
    if not reply.ok or not isinstance(reply.body, list):
        return None
    return sum((dp.get("num_reqs") or 0) + (dp.get("num_waiting_reqs") or 0) for dp in reply.body)


def settle_owed_flushes(plane: AdminPlane, spawn) -> None:
    """After /resume: flush every worker that skipped its flush, as soon as it is idle."""
    for url in list(plane.owed_flushes):
        spawn(_flush_when_idle(plane, url))


async def _flush_when_idle(plane: AdminPlane, url: str) -> None:
    deadline = time.monotonic() + FLUSH_GIVE_UP_S
    while url in plane.owed_flushes and time.monotonic() < deadline:
        (reply,) = await plane.fan_out("POST", "/flush_cache", None, LOAD_TIMEOUT_S, [url])
        if reply.status == 200:
            plane.owed_flushes.discard(url)
            log.info("%s: prefix cache flushed after the weight update", url)
            return
        await asyncio.sleep(FLUSH_RETRY_S)
    if url in plane.owed_flushes:
        log.warning("%s: could not flush the prefix cache within %.0f s of the weight update (never idle)",
                    url, FLUSH_GIVE_UP_S)
