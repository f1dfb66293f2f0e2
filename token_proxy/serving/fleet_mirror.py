"""A --workers data-plane process's copy of the fleet's weight-version record (the last line against
stale weights, pipeline/reply_check.py, reads it): long-polled from the admin owner, and asked for
at once when a reply's version is not in it (a change the poll has not brought yet)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from token_proxy.fleet import version_feed
from token_proxy.fleet.versions import VersionRecord

log = logging.getLogger(__name__)

POLL_WAIT_S = 20.0
RETRY_S = 0.5
PATH = "http://owner/_internal/fleet_versions"


class FleetMirror:
    def __init__(self, session: aiohttp.ClientSession):
        self.session = session
        self.seq = -1
        self.record = VersionRecord()
        self.first = asyncio.Event()

    async def refresh(self) -> None:
        try:
            await self._fetch(-1, 0.0)
        except Exception as exc:  # noqa: BLE001 (the record held stays until the next poll brings one)
            log.warning("cannot read the fleet's weight versions from the admin process: %s", exc)

    async def run(self) -> None:
        while True:
            try:
                await self._fetch(self.seq, POLL_WAIT_S)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                await asyncio.sleep(RETRY_S)
            except Exception:  # the mirror outlives any one bad answer
                log.exception("cannot read the fleet's weight versions from the admin process")
                await asyncio.sleep(RETRY_S)

    async def _fetch(self, seen: int, wait_s: float) -> None:
        timeout = aiohttp.ClientTimeout(total=wait_s + 10.0)
        async with self.session.get(PATH, params=version_feed.query(seen, wait_s), timeout=timeout) as resp:
            if resp.status != 200:
                raise aiohttp.ClientError(f"HTTP {resp.status}")
            seq, record = version_feed.read(await resp.json(), same_clock=True)  # the owner's host clock
        if seq >= self.seq:
            self.seq, self.record = seq, record
        self.first.set()
