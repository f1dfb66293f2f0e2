"""The last line against stale weights: a reply SGLang made on weights the fleet does not serve is never
returned; it is sent again (a few tries) and counted (token_proxy_stale_replies_total).

Which versions a reply may carry (the ACCEPTED SET of one request): every weight version the fleet held
at any moment from the request's send until its reply, plus the versions an update in flight is moving
the fleet to. So a rollout kept across a keep-pause (sent on A, finished on B after the push) passes, as
does one that finished on A just before the fleet moved to B; a worker that restarted and reports
"default" (or any version the fleet left before the request was sent) does not. The fleet's record is the
admin plane's (its VersionBoard, admin/workers.py; a --workers process mirrors it, serving/fleet_mirror.py).
A reply without a weight version (SGLang before weight versions) cannot be judged and passes.

The admin plane's watcher (admin/fence.py) keeps a worker that restarted or drifted out of the fleet;
this check covers the moments before it does.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from aiohttp import web

from token_proxy.errors import BackendUnavailable

log = logging.getLogger(__name__)

RETRY_BACKOFF_S = 0.05  # doubled per try: the watcher takes the stale worker out meanwhile
RETRY_BACKOFF_MAX_S = 1.0
T = TypeVar("T")


@dataclass(slots=True)
class VersionRecord:
    """What the fleet served and when: the version now, the one before the first recorded change,
    each change (monotonic time, version; CLOCK_MONOTONIC is one clock for every process of a host),
    and the versions an update in flight is moving to (version -> accepted until; inf while it runs)."""

    current: str | None = None
    initial: str | None = None
    history: list[tuple[float, str]] = field(default_factory=list)
    incoming: dict[str, float] = field(default_factory=dict)

    def accepted(self, since: float, now: float | None = None) -> frozenset[str] | None:
        """The versions a reply to a request sent at `since` may carry; None: no fleet version known."""
        if self.current is None:
            return None
        now = time.monotonic() if now is None else now
        held = self.initial
        out = {self.current}
        for at, version in self.history:
            if at <= since:
                held = version  # the version in force when the request was sent
            else:
                out.add(version)
        if held is not None:
            out.add(held)
        out.update(v for v, until in self.incoming.items() if until >= now)
        return frozenset(out)

    def as_dict(self) -> dict:
        """JSON (a --workers mirror's copy): an update still running is accepted until None (no end yet)."""
        return {"current": self.current, "initial": self.initial, "history": [list(h) for h in self.history],
                "incoming": {v: None if math.isinf(until) else until for v, until in self.incoming.items()}}

    @classmethod
    def of(cls, data: dict) -> VersionRecord:
        return cls(data.get("current"), data.get("initial"), [(float(t), str(v)) for t, v in data.get("history", [])],
                   {str(k): math.inf if v is None else float(v) for k, v in (data.get("incoming") or {}).items()})


class FleetVersions(Protocol):
    """The fleet's version record, as this process knows it (`record` is replaced, never changed)."""

    record: VersionRecord

    async def refresh(self) -> None: ...  # learn the latest (a --workers process asks the owner)


class VersionBoard:
    """The admin owner's: the plane puts a fresh record here on every change (admin/workers.py)."""

    __slots__ = ("record",)

    def __init__(self) -> None:
        self.record = VersionRecord()

    async def refresh(self) -> None:
        return None


FLEET_VERSIONS: web.AppKey[FleetVersions] = web.AppKey("fleet_versions", object)


def reply_versions(items: Iterable[dict]) -> set[str]:
    """The weight versions SGLang reports in each item's (or stream event's) meta_info."""
    out = set()
    for item in items:
        meta = item.get("meta_info") if isinstance(item, dict) else None
        version = meta.get("weight_version") if isinstance(meta, dict) else None
        if version is not None:
            out.add(str(version))
    return out


async def stale_version(fleet: FleetVersions, versions: set[str], since: float) -> str | None:
    """A version of `versions` the fleet did not serve since `since` (asked again after a refresh), or None."""
    if not versions:
        return None
    accepted = fleet.record.accepted(since)
    if accepted is None or versions <= accepted:
        return None
    await fleet.refresh()
    accepted = fleet.record.accepted(since)
    if accepted is None:
        return None
    bad = sorted(versions - accepted)
    return bad[0] if bad else None


async def resend_stale(reply: T, since: float, send: Callable[[], Awaitable[T]],
                       versions_of: Callable[[T], set[str]], fleet: FleetVersions, tries: int,
                       on_stale: Callable[[T], Awaitable[None]], count: Callable[[], None]) -> T:
    """The slow path, for a reply (sent at `since`) whose version is not the fleet's current one: judged
    against the accepted set; a stale one is counted, handed to `on_stale` (a stream is closed there) and
    sent again, up to `tries` sends in all; the last stale one is a 503."""
    backoff = RETRY_BACKOFF_S
    for attempt in range(1, tries + 1):
        bad = await stale_version(fleet, versions_of(reply), since)
        if bad is None:
            return reply
        count()
        await on_stale(reply)
        current = fleet.record.current
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
