"""The state handlers share, in one explicit place: ProxyContext (on the Application under typed keys).

It holds three things, each owned below it in sglang/: the SGLang client, the connection
(sglang/discovery.py's Connection: its status, and once connected one frozen value with SGLang's picture,
sglang/picture.py, and the tokenizer it names), and the requests in flight (sglang/in_flight.py). Until
SGLang is known the engine-facing fields raise BackendUnavailable (a 503 naming the reason,
`not_ready_reason`). This module sits above sglang/ and below the handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import Executor
from dataclasses import dataclass, field

from aiohttp import web

from token_proxy.errors import BackendUnavailable
from token_proxy.settings import Settings
from token_proxy.sglang.client import SGLangClient
from token_proxy.sglang.discovery import ON_FATAL, Connected, Connection
from token_proxy.sglang.in_flight import Requests
from token_proxy.sglang.picture import BackendInfo, SGLangPicture
from token_proxy.tokenization.loader import TokenizerInfo
from token_proxy.tokenization.renderer import PromptRenderer
from token_proxy.tokenization.token_text import TokenTexts

__all__ = ["CONTEXT", "ON_FATAL", "REGISTER_COLLECTOR", "SETTINGS", "Gate", "ProxyContext"]


@dataclass(slots=True)
class Gate:
    """Generations wait here while an admin call needs SGLang's scheduler idle from its check to its end
    (admin/memory.py: SGLang's release_memory_occupation asserts it, and dies); `passing` counts the
    generations past the gate and not yet answered (one may be on its way to SGLang, not yet in its load).
    Here, not in sglang/, so a plain chat runs no extra module (tests/pipeline/test_request_path.py)."""

    opened: asyncio.Event = field(default_factory=asyncio.Event)
    passing: int = 0

    def __post_init__(self) -> None:
        self.opened.set()

    @contextlib.asynccontextmanager
    async def through(self) -> AsyncIterator[None]:
        await self.opened.wait()
        self.passing += 1
        try:
            yield
        finally:
            self.passing -= 1

    @contextlib.asynccontextmanager
    async def closed(self) -> AsyncIterator[None]:
        self.opened.clear()
        try:
            yield
        finally:
            self.opened.set()


@dataclass(slots=True)
class ProxyContext:
    settings: Settings
    client: SGLangClient
    executor: Executor
    # The SGLang rids being served and the work that outlives a cancelled handler (aborting_on_exit's).
    requests: Requests = field(default_factory=Requests)
    gate: Gate = field(default_factory=Gate)  # every generation passes it (pipeline/call.py, the pass-through)
    connection: Connection = field(init=False)
    started_at: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.connection = Connection(self.client, self.settings, self.executor, busy=lambda: bool(self.requests.rids))

    # --- in flight (sglang/client.py's InFlight: client, in_flight, spawn) ---
    @property
    def in_flight(self) -> dict[str, list[str]]:
        return self.requests.rids

    @property
    def background(self) -> set[asyncio.Task]:
        return self.requests.background

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        return self.requests.spawn(coro)

    # --- the connection ---
    @property
    def connected(self) -> bool:
        """SGLang is discovered and its tokenizer loaded: the data path can serve."""
        return self.connection.connected is not None

    def when_ready(self, hook: Callable[[BackendInfo], None]) -> None:
        self.connection.when_ready(hook)

    @property
    def not_ready_reason(self) -> str | None:
        return self.connection.not_ready_reason

    @property
    def fatal(self) -> str | None:
        return self.connection.fatal

    # --- what connecting learned (one frozen value; a 503 until it is known) ---
    def _connected(self) -> Connected:
        """Read here, not through Connection.get(): a plain chat runs no code of discovery.py."""
        connected = self.connection.connected
        if connected is None:
            raise BackendUnavailable(self.connection.not_ready_reason)
        return connected

    @property
    def picture(self) -> SGLangPicture:
        return self._connected().picture

    @property
    def backend(self) -> BackendInfo:
        """The facts every SGLang server behind the backend agrees on (picture.agreed)."""
        return self._connected().picture.agreed

    @property
    def tokenizer_info(self) -> TokenizerInfo:
        return self._connected().tokenizer_info

    @property
    def renderer(self) -> PromptRenderer:
        return self._connected().renderer

    @property
    def token_texts(self) -> TokenTexts:
        return self._connected().token_texts

    @property
    def tool_parser(self) -> str | None:
        return self._connected().tool_parser

    @property
    def max_model_len(self) -> int:
        return self.backend.max_model_len


SETTINGS = web.AppKey("settings", Settings)
CONTEXT = web.AppKey("context", ProxyContext)
# register(collector): puts a prometheus collector of a module below ops/ (sessions, LoRA adapters: their own
# counters, read at scrape time) on /metrics. ops/observe.py sets it; absent, nothing is registered.
REGISTER_COLLECTOR = web.AppKey("register_collector", Callable)
