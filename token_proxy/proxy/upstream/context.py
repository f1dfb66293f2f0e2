"""What handlers share, kept on the Application under typed keys (no globals).

The proxy starts even when SGLang is down: until the first successful discovery, the
engine-facing fields raise BackendUnavailable, which every route answers with a 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from aiohttp import web

from token_proxy.errors import BackendUnavailable
from token_proxy.proxy.upstream.client import SGLangClient
from token_proxy.proxy.upstream.discovery import BackendInfo
from token_proxy.settings import Settings
from token_proxy.tokenization.loader import TokenizerInfo
from token_proxy.tokenization.renderer import PromptRenderer
from token_proxy.tokenization.token_text import TokenTexts

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Engine:
    """What start-up learns from SGLang, and the tokenizer it names."""

    backend: BackendInfo
    tokenizer_info: TokenizerInfo
    renderer: PromptRenderer
    token_texts: TokenTexts
    tool_parser: str | None = None  # --tool-call-parser, else the one the chat template names (tools)


@dataclass(slots=True)
class ProxyContext:
    settings: Settings
    client: SGLangClient
    executor: Executor
    engine: Engine | None = None
    last_error: str | None = None  # why the engine is not there yet
    # Fire-and-forget work (upstream aborts) that must outlive a cancelled handler.
    background: set[asyncio.Task] = field(default_factory=set)
    started_at: int = field(default_factory=lambda: int(time.time()))
    _ready_hooks: list[Callable[[Engine], None]] = field(default_factory=list)

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def when_ready(self, hook: Callable[[Engine], None]) -> None:
        """Run `hook(engine)` once the engine is known (at once if it already is)."""
        if self.engine is not None:
            hook(self.engine)
        else:
            self._ready_hooks.append(hook)

    def set_engine(self, engine: Engine) -> None:
        self.engine, self.last_error = engine, None
        hooks, self._ready_hooks = self._ready_hooks, []
        for hook in hooks:
            hook(engine)

    def _ready(self) -> Engine:
        if self.engine is None:
            why = f": {self.last_error}" if self.last_error else ""
            raise BackendUnavailable(f"The proxy is not connected to SGLang at {self.client.base_url} yet{why}")
        return self.engine

    @property
    def backend(self) -> BackendInfo:
        return self._ready().backend

    @property
    def tokenizer_info(self) -> TokenizerInfo:
        return self._ready().tokenizer_info

    @property
    def renderer(self) -> PromptRenderer:
        return self._ready().renderer

    @property
    def token_texts(self) -> TokenTexts:
        return self._ready().token_texts

    @property
    def tool_parser(self) -> str | None:
        return self._ready().tool_parser

    @property
    def max_model_len(self) -> int:
        return self.backend.max_model_len


SETTINGS = web.AppKey("settings", Settings)
CONTEXT = web.AppKey("context", ProxyContext)
