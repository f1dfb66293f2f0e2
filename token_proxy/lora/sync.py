"""The LoRA map across --workers processes: the owner's registry is the truth; serving processes mirror it.

A serving process resolves `model` -> SGLang's internal adapter name on its own event loop (no hop per request)
from a mirror it keeps by long-polling the owner. Each poll reports the adapter versions the serving process's
requests hold and the map version it applied; the owner keeps, for every serving process, a lease (in its own
registry) on (a) each adapter of every map it offered that the serving process may still be using and (b) each
adapter the serving process reported in use. A replaced or removed adapter is unloaded from SGLang (the
registry's on_idle) only when its last lease ends: when no serving process can still send it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from token_proxy.long_poll import POLL_WAIT_S, PUBLISH_WAIT_S, RETRY_S, Publication
from token_proxy.lora.registry import Adapter, AdapterRegistry, Lease

log = logging.getLogger(__name__)

# On the --workers owner: AdapterPublisher.published (set by serving/control.py). Absent in one process.
MAP_PUBLISHED = web.AppKey("adapter_map_published", object)

# --- the owner's side ---------------------------------------------------------------------------

@dataclass
class _Pins:
    seq: int = -1  # the last report applied (older ones that arrive late are ignored)
    offered: dict[int, list[Lease]] = field(default_factory=dict)  # map version -> leases on its adapters
    held: dict[str, Lease] = field(default_factory=dict)  # internal name -> lease (in use there)


class AdapterPublisher:
    """The owner's view of what each serving process may send to SGLang; hands out the map."""

    def __init__(self, registry: AdapterRegistry):
        self.registry = registry
        self.map = Publication("LoRA adapter map")  # its seq is the map's version
        self._processes: dict[int, _Pins] = {}
        registry.on_change = self.map.bump

    async def published(self, timeout_s: float = PUBLISH_WAIT_S) -> bool:
        """Every live serving process applied the current map (long_poll.py), so that a load or unload answered
        now is what every process serves at once. False if one did not in time."""
        return await self.map.published(timeout_s)

    def report(self, process: int, seq: int, seen: int, held: list[str]) -> None:
        """A serving process applied map `seen` and its requests hold `held` now. New leases are taken before
        old ones end, so nothing it may use is unloaded in between."""
        pins = self._processes.setdefault(process, _Pins())
        if seq <= pins.seq:
            return
        pins.seq = seq
        self.map.applied(process, seen)
        known = {adapter.internal: adapter for adapter in self.registry.held()}
        for internal in held:
            if internal not in pins.held and internal in known:
                pins.held[internal] = self.registry.hold(known[internal])
        for internal in [i for i in pins.held if i not in held]:
            pins.held.pop(internal).release()
        for version in [v for v in pins.offered if v < seen]:
            for lease in pins.offered.pop(version):
                lease.release()

    def offer(self, process: int) -> dict:
        """The current map, for serving process `process`: its adapters stay loaded until the serving process moves past it."""
        pins = self._processes.setdefault(process, _Pins())
        adapters, version = self.registry.adapters(), self.map.seq
        if version not in pins.offered:
            pins.offered[version] = [self.registry.hold(adapter) for adapter in adapters]
        return {"version": version, "adapters": [dataclasses.asdict(a) for a in adapters]}


# --- a serving process's side ----------------------------------------------------------------------------

def apply_map(registry: AdapterRegistry, adapters: list[dict]) -> None:
    """Make the mirror serve exactly `adapters` (replaced ones stay held by their running requests)."""
    wanted = {fields["name"]: Adapter(**fields) for fields in adapters}
    for name, adapter in wanted.items():
        current = registry.get(name)
        if current is None or current.internal != adapter.internal:
            registry.switch(adapter)
    for adapter in registry.adapters():
        if adapter.name not in wanted:
            registry.remove(adapter.name)


class AdapterFollower:
    """A serving process's long-poll loop: report what is held, apply the map the owner answers with. A request
    ending the last use of a replaced adapter cuts the wait short, so the owner hears of it at once."""

    def __init__(self, session: aiohttp.ClientSession, process: int, registry: AdapterRegistry):
        self.session, self.process, self.registry = session, process, registry
        self.seen, self._seq = -1, 0
        self._wake = asyncio.Event()
        self.first_map = asyncio.Event()
        registry.on_idle = lambda adapter: self._wake.set()
        registry.on_miss = self.refresh

    def _report(self, wait_s: float = POLL_WAIT_S) -> dict:
        self._seq += 1
        held = [a.internal for a in self.registry.held() if self.registry.in_use(a)]
        return {"process": self.process, "seq": self._seq, "seen": self.seen, "held": held, "wait": wait_s}

    def _apply(self, reply: dict) -> None:
        """A map newer than the one applied (a refresh and the long-poll may answer out of order)."""
        if reply["version"] > self.seen:
            apply_map(self.registry, reply["adapters"])
            self.seen = reply["version"]
        self.first_map.set()

    async def refresh(self) -> None:
        """Ask the owner for its map now (no wait): a request named an adapter this mirror does not know
        yet, which a load through another serving process may have added a moment ago."""
        try:
            self._apply(await self._poll(self._report(wait_s=0.0)))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.debug("adapter map refresh failed: %s", exc)

    async def _poll(self, body: dict) -> dict:
        timeout = aiohttp.ClientTimeout(total=POLL_WAIT_S + 10)
        async with self.session.post("http://owner/_internal/adapters", json=body, timeout=timeout) as resp:
            resp.raise_for_status()
            return await resp.json()

    async def run(self) -> None:
        while True:
            self._wake.clear()
            poll = asyncio.ensure_future(self._poll(self._report()))
            woken = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({poll, woken}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                woken.cancel()
                if not poll.done():
                    poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(poll, return_exceptions=True)
            if poll.cancelled():
                continue  # woken: report at once
            if poll.exception() is not None:
                log.debug("adapter map poll failed: %s", poll.exception())
                await asyncio.sleep(RETRY_S)
                continue
            self._apply(poll.result())
