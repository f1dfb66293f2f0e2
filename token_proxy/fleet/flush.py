"""Weight updates that cannot crash SGLang: a deferred prefix-cache flush.

SGLang 0.5.17 asserts inside the scheduler — and the whole server dies — when a weight
update's `flush_cache` (default true) finds requests pending: exactly the case while
generation is paused in `retract` or `in_place` mode with rollouts in flight (seen on a
real server). So a worker with pending requests gets `flush_cache: false`, and the flush
it is owed runs after /resume, retried until SGLang is idle for a moment (a flush while
requests run is a harmless 400). Until then, prefixes cached under the old weights may
be reused; that window is logged.

From 0.5.22 SGLang no longer dies: it updates the weights, skips the flush and answers the update
with `success: false` (FLUSH_REFUSED) and the old weight_version. The deferred flush stays right on
every version (sending flush_cache there would report a failed update although the weights changed);
a worker whose load could not be read and refused the flush anyway is settled by `settle_refusals`.

While the fleet is paused, requests reach a paused worker at any moment (they queue there), so one that had
none when its load was read may have some when the update's own flush runs: SGLang 0.5.17 dies then (issue 37,
finding 3; the fleet round's findings-2-3 phase hit it on the simulator). A paused scheduler computes nothing
until /resume, so there the flush runs first, on its own (`/flush_cache`: a harmless 400 if requests are
pending, then owed as above), and the update itself never flushes.

Loads come from GET /v1/loads?include=core (0.5.17 onward); /get_load was a shim over it, gone in 0.5.21.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from token_proxy.fleet.plane import AdminPlane
from token_proxy.sglang.workers import WorkerReply

log = logging.getLogger(__name__)

FLUSH_RETRY_S = 1.0
FLUSH_GIVE_UP_S = 600.0
LOAD_TIMEOUT_S = 10.0
LOADS_PATH = "/v1/loads?include=core"
# SGLang 0.5.22+ (scheduler_components/weight_updater.py flush_cache_after_weight_update).
FLUSH_REFUSED = "Weights were updated, but the cache was not flushed"


async def safe_flush(plane: AdminPlane, bodies: list[dict], urls: list[str]) -> list[dict]:
    """`bodies` for a weight update on `urls`, with flush_cache turned off where it would crash."""
    wants = [b.get("flush_cache", True) for b in bodies]
    if not any(wants):
        return bodies
    if plane.control.paused:
        return await _flush_first(plane, bodies, urls, wants)
    loads = await plane.fan_out("GET", LOADS_PATH, None, LOAD_TIMEOUT_S, urls)
    out = []
    for body, url, want, load in zip(bodies, urls, wants, loads):
        if want and pending(load) != 0:
            log.warning("%s has requests pending: updating weights without flushing its cache (SGLang would "
                        "crash); the flush runs after /resume", url)
            body = {**body, "flush_cache": False}
            plane.owed_flushes.add(url)
        out.append(body)
    return out


async def _flush_first(plane: AdminPlane, bodies: list[dict], urls: list[str], wants: list[bool]) -> list[dict]:
    """The fleet is paused: each worker's cache flushed now, before the update (nothing new is cached until
    /resume); one that refuses (requests pending) is owed the flush after /resume."""
    targets = [url for url, want in zip(urls, wants) if want]
    for reply in await plane.fan_out("POST", "/flush_cache", None, plane.settings.admin_timeout_s, targets):
        if reply.status != 200:
            log.warning("%s has requests pending: updating weights without flushing its cache (SGLang would "
                        "crash); the flush runs after /resume", reply.url)
            plane.owed_flushes.add(reply.url)
    return [{**body, "flush_cache": False} if want else body for body, want in zip(bodies, wants)]


def pending(reply: WorkerReply) -> int | None:
    """Running + waiting requests in a worker's /v1/loads reply (None when unreadable: assume busy)."""
    body = reply.body if reply.ok else None
    loads = body.get("loads") if isinstance(body, dict) else None
    if not isinstance(loads, list) or not all(isinstance(dp, dict) for dp in loads):
        return None
    return sum((dp.get("num_running_reqs") or 0) + (dp.get("num_waiting_reqs") or 0) for dp in loads)


async def read_pending(plane: AdminPlane, urls: list[str], timeout_s: float = LOAD_TIMEOUT_S) -> list[WorkerReply]:
    """Each worker's /v1/loads (pass each reply to `pending`); it goes through the scheduler, paused or not."""
    return await plane.fan_out("GET", LOADS_PATH, None, timeout_s, urls)


def flush_refused(reply: WorkerReply) -> bool:
    """SGLang 0.5.22+: the weights were updated but the flush refused (requests pending)."""
    return reply.status in (200, 400) and reply.error is None and reply.message.startswith(FLUSH_REFUSED)


async def settle_refusals(plane: AdminPlane, replies: list[WorkerReply], version: str | None) -> list[WorkerReply]:
    """An update whose flush SGLang refused changed the weights (0.5.22+): it succeeded, a flush is owed,
    and the version SGLang did not record is set (without aborting anything)."""
    out = []
    for reply in replies:
        if flush_refused(reply):
            log.warning("%s updated its weights but refused the flush (requests pending); the flush runs "
                        "after /resume", reply.url)
            plane.owed_flushes.add(reply.url)
            if version is not None:
                (set_version,) = await plane.fan_out("POST", "/update_weight_version",
                                                     {"new_version": version, "abort_all_requests": False},
                                                     plane.settings.admin_timeout_s, [reply.url])
                if not set_version.ok:
                    out.append(set_version)
                    continue
            body = {"success": True, "message": f"{reply.message} (the proxy flushes it after /resume)",
                    "num_paused_requests": 0}
            reply = WorkerReply(reply.url, 200, orjson.dumps(body), "application/json")
        out.append(reply)
    return out


async def flush_or_owe(plane: AdminPlane, urls: list[str]) -> list[WorkerReply]:
    """Flush every worker's prefix cache now; one that cannot (busy: SGLang's 400, or unreachable) is owed
    the flush, run once it is idle: at once while the fleet serves, else after /resume."""
    replies = await plane.fan_out("POST", "/flush_cache", None, plane.settings.admin_timeout_s, urls)
    owed = [r.url for r in replies if r.status != 200]
    plane.owed_flushes.update(owed)
    if owed and not plane.control.paused and plane.workers.spawn is not None:
        settle_owed_flushes(plane, plane.workers.spawn)
    return replies


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
