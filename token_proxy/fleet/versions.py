"""The last line against stale weights: a reply SGLang made on weights the fleet does not serve is never
returned; it is sent again (a few tries) and counted (token_proxy_stale_replies_total). The request carries
the check (`StaleCheck`); the retry point (sglang/retry_rules.py's stale-weights rule) sends again.

Which versions a reply may carry (the ACCEPTED SET of one request): every weight version the fleet held
at any moment from the request's send until its reply, plus the versions an update in flight is moving
the fleet to. So a rollout kept across a keep-pause (sent on A, finished on B after the push) passes, as
does one that finished on A just before the fleet moved to B; a worker that restarted and reports
"default" (or any version the fleet left before the request was sent) does not. The fleet's record is the
admin plane's (its VersionBoard, plane.py; a --workers process mirrors it, serving/fleet_mirror.py); the
pipeline asks through the hook this module registers (pipeline/reply_check.py).
A reply without a weight version (SGLang before weight versions) cannot be judged and passes.

The admin plane's watcher (fence.py) keeps a worker that restarted or drifted out of the fleet;
this check covers the moments before it does.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from token_proxy.pipeline.reply_check import REPLY_CHECK

log = logging.getLogger(__name__)

@dataclass(slots=True)
class VersionRecord:
    """What the fleet served and when: the version now, the one before the first recorded change,
    each change (monotonic time, version; CLOCK_MONOTONIC is one clock for every process of a host),
    and the versions an update in flight is moving to (version -> accepted until; inf while it runs)."""

    current: str | None = None
    initial: str | None = None
    history: list[tuple[float, str]] = field(default_factory=list)
    incoming: dict[str, float] = field(default_factory=dict)
    unavailable: str | None = None  # why no worker can serve now (a prompt 503), or None
    joining: str | None = None  # why every worker is blocked in a group join now (joins.py; /health says it)

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
                "incoming": {v: None if math.isinf(until) else until for v, until in self.incoming.items()},
                "unavailable": self.unavailable, "joining": self.joining}

    @classmethod
    def of(cls, data: dict) -> VersionRecord:
        return cls(data.get("current"), data.get("initial"), [(float(t), str(v)) for t, v in data.get("history", [])],
                   {str(k): math.inf if v is None else float(v) for k, v in (data.get("incoming") or {}).items()},
                   data.get("unavailable"), data.get("joining"))


class FleetVersions(Protocol):
    """The fleet's version record, as this process knows it (`record` is replaced, never changed)."""

    record: VersionRecord

    async def refresh(self) -> None: ...  # learn the latest (a --workers process asks the owner)


class VersionBoard:
    """The admin owner's: the plane puts a fresh record here on every change (fleet/plane.py)."""

    __slots__ = ("on_stale", "record")

    def __init__(self) -> None:
        self.record = VersionRecord()
        self.on_stale: Callable[[], None] | None = None  # the fence's poke: a stale reply is news of a worker

    async def refresh(self) -> None:
        return None


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


class FleetCheck:
    """The pipeline's reply check (pipeline/reply_check.py's REPLY_CHECK) over this process's record of the
    fleet's versions: the admin plane's VersionBoard, a --workers process's mirror, or a follower's copy of
    its controller's record."""

    __slots__ = ("fleet",)

    def __init__(self, fleet: FleetVersions) -> None:
        self.fleet = fleet

    def current(self) -> str | None:
        return self.fleet.record.current

    def unavailable(self) -> str | None:
        return self.fleet.record.unavailable

    async def stale(self, versions: set[str], since: float) -> str | None:
        bad = await stale_version(self.fleet, versions, since)
        poke = getattr(self.fleet, "on_stale", None)
        if bad is not None and poke is not None:
            poke()  # the fence reads every worker now, not at its next idle read (fence.py's cadence)
        return bad


def joining(app: web.Application) -> str | None:
    """Why every worker is blocked in a weight-update group join now (the proxy's /health says it), or None."""
    check = app.get(REPLY_CHECK)
    return check.fleet.record.joining if isinstance(check, FleetCheck) else None


def register_reply_check(app: web.Application, fleet: FleetVersions) -> None:
    """At start-up, as lora/resolve.py registers MODEL_RESOLVER: the data path judges replies by `fleet`."""
    app[REPLY_CHECK] = FleetCheck(fleet)
