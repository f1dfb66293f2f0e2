"""The SGLang requests being served and the work that must outlive a cancelled handler: one small
object (what client.py's aborting_on_exit fills and empties, vLLM's /abort_requests reads)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field


@dataclass(slots=True)
class Gate:
    """Generations wait here while an admin call needs SGLang's scheduler idle from its check to its end
    (admin/memory.py: SGLang's release_memory_occupation asserts it, and dies); `passing` counts the
    generations past the gate and not yet answered (one may be on its way to SGLang, not yet in its load)."""

    opened: asyncio.Event = field(default_factory=asyncio.Event)
    passing: int = 0

    def __post_init__(self) -> None:
        self.opened.set()

    def through(self) -> Passing:
        """`async with gate.through():` a generation past the gate (waits while it is closed)."""
        return Passing(self)

    @contextlib.asynccontextmanager
    async def closed(self) -> AsyncIterator[None]:
        self.opened.clear()
        try:
            yield
        finally:
            self.opened.set()


class Passing:
    """Gate.through()'s context: a slotted class, not an asynccontextmanager, which costs every generation
    ~3 us more (a generator, its wrapper and two awaits of it)."""

    __slots__ = ("_gate",)

    def __init__(self, gate: Gate) -> None:
        self._gate = gate

    async def __aenter__(self) -> None:
        gate = self._gate
        if not gate.opened.is_set():
            await gate.opened.wait()
        gate.passing += 1

    async def __aexit__(self, *exc_info) -> None:
        self._gate.passing -= 1


@dataclass(slots=True)
class Requests:
    # The SGLang rids of each request being served, by response id (sglang/client.py's aborting_on_exit).
    rids: dict[str, list[str]] = field(default_factory=dict)
    # Fire-and-forget work (upstream aborts, flushes) that must outlive a cancelled handler.
    background: set[asyncio.Task] = field(default_factory=set)
    gate: Gate = field(default_factory=Gate)  # every generation passes it (pipeline/call.py, the pass-through)

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task
