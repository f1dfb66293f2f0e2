"""SGLang's GPU memory release and resume, guarded: the one record of what is released on the workers, kept
for vLLM's /sleep, /wake_up and /release_kv_cache_memory (vllm_rl.py) and SGLang's own forwarded
/release_memory_occupation and /resume_memory_occupation alike.

Both calls kill SGLang's scheduler when misused (SGLang 0.5.17..0.5.23, scheduler_components/weight_updater.py;
confirmed on real 0.5.17 on a GPU):
- a release asserts `is_fully_idle()`: a running request (or, before 0.5.21 or unpaused, a waiting one) kills it;
- a resume calls `offload_tags.remove(tag)`: a tag not released (a resume of nothing, or a second resume)
  raises KeyError and kills it. No tags (or []) means every tag (GPU_MEMORY_ALL_TYPES).
So the proxy refuses before sending: a release while a worker runs a request is a 409 (when the fleet is paused
through the proxy it is drained first, as /sleep does), of a tag already released a 409 (SGLang would stash the
freed weights over the kept ones); a resume of a tag not released is a 409. A release that fails on some
workers is undone on the others, so the record stays one set for the fleet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from aiohttp import web

from token_proxy.errors import BackendTimeout, InvalidRequest
from token_proxy.fleet import transaction as fleet
from token_proxy.fleet.flush import pending, read_pending
from token_proxy.fleet.plane import ADMIN, AdminPlane
from token_proxy.http_io import parse_json_object
from token_proxy.sglang.in_flight import Gate
from token_proxy.sglang.workers import raise_for_failures
from token_proxy.state import CONTEXT

log = logging.getLogger(__name__)

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES, in its order
IDLE_POLL_S = 0.05


@dataclass
class Memory:
    released: set[str] = field(default_factory=set)  # SGLang's tags released on every worker


MEMORY: web.AppKey[Memory] = web.AppKey("memory", Memory)


def checked_tags(body: dict) -> list[str]:
    """SGLang's `tags`: absent, null or [] is every tag; else known tag names, each once."""
    tags = body.get("tags")
    if tags is None or tags == []:
        return list(MEMORY_TAGS)
    if not isinstance(tags, list) or not all(isinstance(tag, str) for tag in tags):
        raise InvalidRequest(f"tags must be a list of {', '.join(MEMORY_TAGS)}, got {tags!r}", param="tags")
    unknown = [tag for tag in tags if tag not in MEMORY_TAGS]
    if unknown:
        raise InvalidRequest(f"tags must be among {', '.join(MEMORY_TAGS)}, got {unknown[0]!r}", param="tags")
    return list(dict.fromkeys(tags))


async def release(plane: AdminPlane, memory: Memory, gate: Gate, urls: list[str], tags: list[str],
                  action: str) -> None:
    """The caller holds the plane's transaction. Refused unless every worker is idle (drained first when the
    fleet is paused through the proxy) and none of `tags` is released already. From the idle check to
    SGLang's answer the proxy's gate holds new generations back, so none can reach SGLang in between."""
    again = [tag for tag in tags if tag in memory.released]
    if again:
        raise fleet.Conflict(f"{action}: {', '.join(again)} released already; resume it first (POST "
                             "/resume_memory_occupation or /wake_up): SGLang would stash the freed weights over the "
                             "ones it kept")
    async with gate.closed():
        if plane.control.paused:
            await wait_idle(plane, urls, plane.settings.admin_timeout_s, action, gate)
        else:
            busy = await busy_workers(plane, urls, gate)
            if busy:
                raise fleet.Conflict(f"{action}: requests are running on {', '.join(busy)}, and SGLang's "
                                     "release_memory_occupation asserts an idle scheduler (the server dies). Pause "
                                     "first (POST /pause?mode=wait, or /pause_generation), or use POST /sleep")
        replies = await plane.fan_out("POST", "/release_memory_occupation", {"tags": tags},
                                      plane.settings.weight_update_timeout_s, urls)
    done = [r.url for r in replies if r.ok]
    if len(done) < len(replies) and done:  # all or none: the record is one set for the fleet
        undo = await plane.fan_out("POST", "/resume_memory_occupation", {"tags": tags},
                                   plane.settings.weight_update_timeout_s, done)
        for reply in undo:
            if not reply.ok:
                log.error("%s: %s stays released on %s: %s", action, ", ".join(tags), reply.url, reply.message)
    raise_for_failures(action, replies)
    memory.released |= set(tags)


async def resume(plane: AdminPlane, memory: Memory, urls: list[str], tags: list[str], action: str) -> None:
    """Only tags released through the proxy. A resume that fails on some workers leaves the tags out of the
    record all the same: resuming them again would kill the workers that did resume."""
    missing = [tag for tag in tags if tag not in memory.released]
    if missing:
        held = ", ".join(sorted(memory.released)) or "nothing"
        raise fleet.Conflict(f"{action}: {', '.join(missing)} is not released (released now: {held}); SGLang's "
                             "resume_memory_occupation of a tag it has not released raises KeyError and its "
                             "scheduler dies")
    replies = await plane.fan_out("POST", "/resume_memory_occupation", {"tags": tags},
                                  plane.settings.weight_update_timeout_s, urls)
    memory.released -= set(tags)
    raise_for_failures(action, replies)


async def busy_workers(plane: AdminPlane, urls: list[str], gate: Gate | None = None) -> list[str]:
    """The workers running or queueing a request (/v1/loads); with `gate`, the proxy itself while a
    generation it let through has not been answered (it may not be in SGLang's load yet)."""
    busy = [r.url for r in await read_pending(plane, urls, fleet.READ_TIMEOUT_S) if pending(r) != 0]
    if gate is not None and gate.passing:
        busy.append(f"the proxy ({gate.passing} generation(s) on their way)")
    return busy


async def wait_idle(plane: AdminPlane, urls: list[str], timeout_s: float, action: str, gate: Gate | None = None) -> None:
    """Until no worker runs or queues a request (/v1/loads), or 504."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = await busy_workers(plane, urls, gate)
        if not busy:
            return
        if time.monotonic() >= deadline:
            raise BackendTimeout(f"{action}: requests still running on {', '.join(busy)} after {timeout_s:g} s")
        await asyncio.sleep(IDLE_POLL_S)


# --- SGLang's own routes, forwarded through these guards (routes.py's rows) -------------------------

async def release_memory_occupation(request: web.Request) -> web.Response:
    return await _forwarded(request, release, "release_memory_occupation")


async def resume_memory_occupation(request: web.Request) -> web.Response:
    return await _forwarded(request, resume, "resume_memory_occupation")


async def _forwarded(request: web.Request, call, action: str) -> web.Response:
    """SGLang's reply shape: FastAPI's `null` for a handler that returns None."""
    plane = request.app[ADMIN]
    raw = await request.read()
    tags = checked_tags(parse_json_object(raw) if raw.strip() else {})
    async with plane.transaction():
        if call is release:
            await release(plane, request.app[MEMORY], request.app[CONTEXT].requests.gate, await plane.worker_urls(),
                          tags, action)
        else:
            await resume(plane, request.app[MEMORY], await plane.worker_urls(), tags, action)
    return web.Response(body=b"null", content_type="application/json")


def add_memory_state(app: web.Application) -> None:
    app[MEMORY] = Memory()
