"""The state handlers share, on the Application under typed keys, and what one request takes of it.

The data path: a handler takes `Upstream` once (`upstream_of(app)`, the request's one "connected?" check, a
503 naming the reason until SGLang is known) and passes it down: the frozen `Connected` of
sglang/discovery.py (SGLang's picture, sglang/picture.py, and the tokenizer it names), the SGLang client
(`SGLANG_CLIENT`), the requests in flight (`REQUESTS`, sglang/in_flight.py) and the settings. The connection
itself is discovery's `CONNECTION`.

The admin plane and start-up hooks read `ProxyContext` (`CONTEXT`): the same client, connection and requests.
This module sits above sglang/ and below the handlers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from dataclasses import dataclass, field

from aiohttp import web

from token_proxy.settings import Settings
from token_proxy.sglang.client import SGLangClient
from token_proxy.sglang.discovery import CONNECTION, ON_FATAL, Connected, Connection
from token_proxy.sglang.in_flight import Requests
from token_proxy.sglang.picture import BackendInfo, SGLangPicture
from token_proxy.tokenization.loader import TokenizerInfo
from token_proxy.tokenization.renderer import PromptRenderer
from token_proxy.tokenization.token_text import TokenTexts

__all__ = ["CONTEXT", "ON_FATAL", "REGISTER_COLLECTOR", "REQUESTS", "SETTINGS", "SGLANG_CLIENT", "ProxyContext",
           "Upstream", "upstream_of"]


@dataclass(slots=True)
class ProxyContext:
    settings: Settings
    client: SGLangClient
    executor: Executor
    # The SGLang rids being served and the work that outlives a cancelled handler (aborting_on_exit's).
    requests: Requests = field(default_factory=Requests)
    connection: Connection = field(init=False)
    started_at: int = field(default_factory=lambda: int(time.time()))
    # The served base model's name as a trainer renamed it (ART's /art/set_served_model_name, admin/art.py);
    # None: SGLang's or --served-model-name's. One writer, the admin owner; --workers processes mirror it.
    renamed: str | None = None

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
    @property
    def picture(self) -> SGLangPicture:
        return self.connection.get().picture

    @property
    def backend(self) -> BackendInfo:
        """The facts every SGLang server behind the backend agrees on (picture.agreed)."""
        return self.connection.get().picture.agreed

    @property
    def served_model_name(self) -> str:
        """The base model's name now: what /v1/models lists and `model` must say (aliases aside)."""
        return self.renamed or self.backend.served_model_name

    @property
    def tokenizer_info(self) -> TokenizerInfo:
        return self.connection.get().tokenizer_info

    @property
    def max_model_len(self) -> int:
        return self.backend.max_model_len


@dataclass(frozen=True, slots=True)
class Upstream:
    """What one data-path request uses of SGLang, taken once by its handler (`upstream_of`) and passed down:
    the settings, the frozen `Connected`, the client and the requests in flight (it is sglang/client.py's
    `InFlight` for aborting_on_exit). Every field is fixed for the request: no read checks anything."""

    settings: Settings
    connected: Connected
    client: SGLangClient
    requests: Requests
    renamed: str | None = None  # ProxyContext.renamed when the request began (ART's rename)

    @property
    def backend(self) -> BackendInfo:
        """The facts every SGLang server behind the backend agrees on (picture.agreed)."""
        return self.connected.picture.agreed

    @property
    def served_model_name(self) -> str:
        """The base model's name now: what `model` must say (aliases aside)."""
        return self.renamed or self.connected.picture.agreed.served_model_name

    @property
    def max_model_len(self) -> int:
        return self.connected.picture.agreed.max_model_len

    @property
    def tokenizer_info(self) -> TokenizerInfo:
        return self.connected.tokenizer_info

    @property
    def renderer(self) -> PromptRenderer:
        return self.connected.renderer

    @property
    def token_texts(self) -> TokenTexts:
        return self.connected.token_texts

    @property
    def tool_parser(self) -> str | None:
        return self.connected.tool_parser

    @property
    def in_flight(self) -> dict[str, list[str]]:
        return self.requests.rids

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        return self.requests.spawn(coro)


SETTINGS = web.AppKey("settings", Settings)
CONTEXT = web.AppKey("context", ProxyContext)
SGLANG_CLIENT = web.AppKey("sglang_client", SGLangClient)
REQUESTS = web.AppKey("requests", Requests)  # the SGLang requests being served, and work that outlives a handler


def upstream_of(app: web.Application) -> Upstream:
    """The request's `Upstream`: the one "connected?" check (BackendUnavailable, a 503 naming why not)."""
    return Upstream(app[SETTINGS], app[CONNECTION].get(), app[SGLANG_CLIENT], app[REQUESTS], app[CONTEXT].renamed)
# register(collector): puts a prometheus collector of a module below ops/ (sessions, LoRA adapters: their own
# counters, read at scrape time) on /metrics. ops/observe.py sets it; absent, nothing is registered.
REGISTER_COLLECTOR = web.AppKey("register_collector", Callable)
