"""The SGLang requests being served and the work that must outlive a cancelled handler: one small
object (what client.py's aborting_on_exit fills and empties, vLLM's /abort_requests reads)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field


@dataclass(slots=True)
class Requests:
    # The SGLang rids of each request being served, by response id (sglang/client.py's aborting_on_exit).
    rids: dict[str, list[str]] = field(default_factory=dict)
    # Fire-and-forget work (upstream aborts, flushes) that must outlive a cancelled handler.
    background: set[asyncio.Task] = field(default_factory=set)

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task
