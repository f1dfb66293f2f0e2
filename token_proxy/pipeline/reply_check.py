"""The pipeline's reply check, a hook a feature registers at start-up (fleet/versions.py does, as
lora/resolve.py sets run.py's MODEL_RESOLVER): a reply SGLang made on weights the fleet does not serve is
never returned; it is sent again (a few tries) and counted (token_proxy_stale_replies_total). Which
versions a reply may carry is the hook's to say; the pipeline only asks it and sends again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol, TypeVar

from aiohttp import web

from token_proxy.errors import BackendUnavailable

log = logging.getLogger(__name__)

RETRY_BACKOFF_S = 0.05  # doubled per try: the watcher takes the stale worker out meanwhile
RETRY_BACKOFF_MAX_S = 1.0
T = TypeVar("T")


class ReplyCheck(Protocol):
    """What the pipeline asks about a reply's weight versions."""

    def current(self) -> str | None: ...  # the fleet's version now (the fast path: a reply carrying it passes)

    async def stale(self, versions: set[str], since: float) -> str | None: ...  # one the fleet did not serve

    def unavailable(self) -> str | None: ...  # why no worker can serve now: a prompt 503, never a wait


def refuse_if_unavailable(check: ReplyCheck | None) -> None:
    """Before a request is sent: with no healthy worker (every one fenced, or the fleet held after a failed
    update) a 503 with Retry-After at once, instead of a wait on a paused worker until the client's timeout."""
    reason = check.unavailable() if check is not None else None
    if reason is not None:
        raise BackendUnavailable(f"no healthy SGLang worker: {reason}")


REPLY_CHECK: web.AppKey[ReplyCheck] = web.AppKey("reply_check", object)


def reply_versions(items: Iterable[dict]) -> set[str]:
    """The weight versions SGLang reports in each item's (or stream event's) meta_info."""
    out = set()
    for item in items:
        meta = item.get("meta_info") if isinstance(item, dict) else None
        version = meta.get("weight_version") if isinstance(meta, dict) else None
        if version is not None:
            out.add(str(version))
    return out


async def resend_stale(reply: T, since: float, send: Callable[[], Awaitable[T]],
                       versions_of: Callable[[T], set[str]], fleet: ReplyCheck, tries: int,
                       on_stale: Callable[[T], Awaitable[None]], count: Callable[[], None]) -> T:
    """The slow path, for a reply (sent at `since`) whose version is not the fleet's current one: judged
    against the accepted set; a stale one is counted, handed to `on_stale` (a stream is closed there) and
    sent again, up to `tries` sends in all; the last stale one is a 503."""
    backoff = RETRY_BACKOFF_S
    for attempt in range(1, tries + 1):
        bad = await fleet.stale(versions_of(reply), since)
        if bad is None:
            return reply
        count()
        await on_stale(reply)
        current = fleet.current()
        log.warning("a reply came from weight version %r, not the fleet's %r: sent again (%d of %d)", bad,
                    current, attempt, tries)
        if attempt == tries:
            raise BackendUnavailable(
                f"SGLang answered from weight version {bad!r} while the fleet serves {current!r}, "
                f"{tries} time(s): a worker is out of step with the fleet (GET /weight_info names it)")
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, RETRY_BACKOFF_MAX_S)
        since = time.monotonic()
        reply = await send()
    return reply
