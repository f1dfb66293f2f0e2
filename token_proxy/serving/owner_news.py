"""What the admin owner tells every --workers serving process besides the LoRA map (lora/sync.py): the served
base model's name (ART's rename: state, `ProxyContext.renamed`) and the sessions finished (SkyRL's
/finish_session: events, each dropped from every process's own session store).

Each serving process long-polls the owner (POST /_internal/news) as it does for the map. The owner answers a
rename or a finish only once every live process applied it, so the next request sees it whichever process
its connection reaches; a finish says whether any process held the session.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

import aiohttp

from token_proxy.long_poll import POLL_WAIT_S, RETRY_S, Publication
from token_proxy.sessions import SessionStore
from token_proxy.state import ProxyContext

log = logging.getLogger(__name__)

KEPT_FINISHES = 4096  # finished sessions a process that fell behind can still learn of (later ones age out)


class OwnerNews:
    """The owner's side: a sequence of news (long_poll.py: what each process applied, and the waits on it)."""

    def __init__(self, ctx: ProxyContext):
        self.ctx = ctx
        self.feed = Publication("news (a rename or a finished session)")
        self._finished: deque[tuple[int, str]] = deque(maxlen=KEPT_FINISHES)
        self._dropped: set[str] = set()  # finished sessions a process reported it held

    async def renamed(self) -> bool:
        """The owner's `ctx.renamed` changed: answered once every process serves the new name."""
        self.feed.bump()
        return await self.feed.published()

    async def finish_session(self, key: str) -> bool:
        """Drop `key` in every serving process; True if one of them held it."""
        self._dropped.discard(key)
        self.feed.bump()
        self._finished.append((self.feed.seq, key))
        await self.feed.published()
        held = key in self._dropped
        self._dropped.discard(key)
        return held

    def report(self, process: int, seen: int, dropped: list[str]) -> None:
        """`process` applied the news up to `seen`; `dropped`: the finished sessions it held."""
        self._dropped.update(dropped)
        self.feed.applied(process, seen)

    def offer(self, seen: int) -> dict:
        return {"seq": self.feed.seq, "served_name": self.ctx.renamed,
                "finished": [key for seq, key in self._finished if seq > seen]}


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
