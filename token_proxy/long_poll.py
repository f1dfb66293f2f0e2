"""The owner's side of a long-poll, one rule for its three users: a sequence bumped on every change and a wait
for the next one (what a poll answers after), and what each --workers serving process last said it applied,
with a wait until every live one applied the latest (what an admin call answers after). Its users: the LoRA map
(lora/sync.py), the owner's news (serving/owner_news.py) and the fleet's version record (fleet/plane.py, which
a follower polls). Pure asyncio: it imports nothing of the project.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

POLL_WAIT_S = 20.0  # a poll with nothing new returns after this long (then the serving process asks again)
RETRY_S = 0.5  # a failed poll is tried again after this long
# How long an admin call waits, before it answers, for every serving process to apply the change; a serving
# process that has not polled for longer than a poll can last is taken for gone and not waited for.
PUBLISH_WAIT_S = 5.0
GONE_AFTER_S = POLL_WAIT_S + 10


@dataclass
class _Applied:
    seen: int = -1  # the change the process last said it applied
    reported_at: float = 0.0  # loop time of its last report


class Publication:
    """A sequence of changes (`seq`), what each serving process applied of it, and the waits on both."""

    def __init__(self, what: str):
        self.what = what  # names the change in the log line of a process that falls behind
        self.seq = 0
        self._changed = asyncio.Event()
        self._reported = asyncio.Event()
        self._applied: dict[int, _Applied] = {}

    def bump(self) -> None:
        self.seq += 1
        self._changed.set()  # wakes every waiting poll; the next change sets a new event
        self._changed = asyncio.Event()

    async def wait_for_change(self, seen: int, timeout_s: float) -> None:
        """Returns at once when `seen` is behind, else at the next change or after `timeout_s`."""
        if seen == self.seq:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout_s)

    def applied(self, process: int, seen: int) -> None:
        """`process` applied the changes up to `seen` (it reports so with each poll)."""
        state = self._applied.setdefault(process, _Applied())
        state.seen, state.reported_at = max(state.seen, seen), asyncio.get_running_loop().time()
        self._reported.set()  # wakes every waiting `published`; the next report sets a new event
        self._reported = asyncio.Event()

    async def published(self, timeout_s: float = PUBLISH_WAIT_S) -> bool:
        """Wait until every live serving process applied the current change, so that what is answered now is
        what every process serves at once (vLLM answers from one process). False if one did not in time."""
        seq, loop = self.seq, asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            now = loop.time()
            behind = [process for process, state in self._applied.items()
                      if state.seen < seq and now - state.reported_at < GONE_AFTER_S]
            if not behind:
                return True
            if now >= deadline:
                log.warning("%s %d not yet applied by --workers process(es) %s after %.0f s", self.what, seq,
                            behind, timeout_s)
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._reported.wait(), deadline - now)
