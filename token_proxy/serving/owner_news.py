"""What the admin owner tells every --workers serving process besides the LoRA map (lora/sync.py): the served
base model's name (ART's rename: state, `ProxyContext.renamed`) and the sessions finished (SkyRL's
/finish_session: events, each dropped from every process's own session store).

Each serving process long-polls the owner (POST /_internal/news) as it does for the map. The owner answers a
rename or a finish only once every live process applied it, so the next request sees it whichever process
its connection reaches; a finish says whether any process held the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from token_proxy.lora.sync import GONE_AFTER_S, POLL_WAIT_S, PUBLISH_WAIT_S, RETRY_S
from token_proxy.sessions import SessionStore
from token_proxy.state import ProxyContext

log = logging.getLogger(__name__)

KEPT_FINISHES = 4096  # finished sessions a process that fell behind can still learn of (later ones age out)


@dataclass
class _Seen:
    seen: int = -1  # the news the process last said it applied
    reported_at: float = 0.0  # loop time of its last report


class OwnerNews:
    """The owner's side: a sequence of news, what each process applied, and the waits on it."""

    def __init__(self, ctx: ProxyContext):
        self.ctx = ctx
        self.seq = 0
        self._finished: deque[tuple[int, str]] = deque(maxlen=KEPT_FINISHES)
        self._dropped: set[str] = set()  # finished sessions a process reported it held
        self._processes: dict[int, _Seen] = {}
        self._changed = asyncio.Event()
        self._reported = asyncio.Event()

    async def renamed(self) -> bool:
        """The owner's `ctx.renamed` changed: answered once every process serves the new name."""
        self._bump()
        return await self.published()

    async def finish_session(self, key: str) -> bool:
        """Drop `key` in every serving process; True if one of them held it."""
        self._dropped.discard(key)
        self._bump()
        self._finished.append((self.seq, key))
        await self.published()
        held = key in self._dropped
        self._dropped.discard(key)
        return held

    def _bump(self) -> None:
        self.seq += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def report(self, process: int, seen: int, dropped: list[str]) -> None:
        """`process` applied the news up to `seen`; `dropped`: the finished sessions it held."""
        state = self._processes.setdefault(process, _Seen())
        state.seen, state.reported_at = max(state.seen, seen), asyncio.get_running_loop().time()
        self._dropped.update(dropped)
        self._reported.set()  # wakes every waiting `published`; the next report sets a new event
        self._reported = asyncio.Event()

    async def wait_for_change(self, seen: int, timeout_s: float) -> None:
        if seen == self.seq:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout_s)

    def offer(self, seen: int) -> dict:
        return {"seq": self.seq, "served_name": self.ctx.renamed,
                "finished": [key for seq, key in self._finished if seq > seen]}

    async def published(self, timeout_s: float = PUBLISH_WAIT_S) -> bool:
        """Wait until every live process applied the current news; False if one did not in time (a process
        silent for longer than a poll lasts is taken for gone, as lora/sync.py's publisher does)."""
        seq, loop = self.seq, asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            now = loop.time()
            behind = [p for p, state in self._processes.items()
                      if state.seen < seq and now - state.reported_at < GONE_AFTER_S]
            if not behind:
                return True
            if now >= deadline:
                log.warning("news %d (a rename or a finished session) not yet applied by --workers process(es) "
                            "%s after %.0f s", seq, behind, timeout_s)
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._reported.wait(), deadline - now)


class NewsFollower:
    """A serving process's long-poll loop: report what it applied, apply what the owner answers."""

    def __init__(self, session: aiohttp.ClientSession, process: int, ctx: ProxyContext,
                 sessions: Callable[[], SessionStore | None]):
        self.session, self.process, self.ctx, self.sessions = session, process, ctx, sessions
        self.seen = -1
        self._dropped: list[str] = []
        self.first = asyncio.Event()

    def apply(self, reply: dict) -> None:
        self.ctx.renamed = reply["served_name"]
        store = self.sessions()
        if store is not None:
            self._dropped += [key for key in reply["finished"] if store.forget(key)]
        self.seen = max(self.seen, reply["seq"])
        self.first.set()

    async def _poll(self) -> dict:
        body = {"process": self.process, "seen": self.seen, "dropped": self._dropped, "wait": POLL_WAIT_S}
        timeout = aiohttp.ClientTimeout(total=POLL_WAIT_S + 10)
        async with self.session.post("http://owner/_internal/news", json=body, timeout=timeout) as resp:
            resp.raise_for_status()
            reply = await resp.json()
        self._dropped = []  # reported
        return reply

    async def run(self) -> None:
        while True:
            try:
                reply = await self._poll()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                log.debug("owner news poll failed: %s", exc)
                await asyncio.sleep(RETRY_S)
                continue
            self.apply(reply)
