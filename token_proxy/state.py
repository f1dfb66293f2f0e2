"""The state handlers share, in one explicit place: ProxyContext (on the Application under typed keys).

What start-up learns from SGLang (sglang/discovery.py: its BackendInfo, the tokenizer it names) is set
here once, by `set_connected`. Until then the engine-facing fields raise BackendUnavailable (a 503
naming the reason, `not_ready_reason`).

This module sits below sglang/ (discovery connects a ProxyContext), so it names the client and the
BackendInfo for type checking only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from token_proxy.errors import BackendUnavailable
from token_proxy.settings import Settings
from token_proxy.tokenization.loader import TokenizerInfo
from token_proxy.tokenization.renderer import PromptRenderer
from token_proxy.tokenization.token_text import TokenTexts

if TYPE_CHECKING:
    from token_proxy.sglang.client import SGLangClient
    from token_proxy.sglang.discovery import BackendInfo

# The outage lines are about the connection: they keep the logger of the module that connects.
log = logging.getLogger("token_proxy.sglang.discovery")


@dataclass(slots=True)
class ProxyContext:
    settings: Settings
    client: SGLangClient
    executor: Executor
    last_error: str | None = None  # why SGLang is not connected yet
    loading_tokenizer: str | None = None  # SGLang answered; this tokenizer is loading (a hub id may take long)
    # Since when SGLang has been unreachable after it was connected (None: it is there); outage_began and
    # outage_ended log the two edges, one line each.
    outage_since: float | None = None
    fatal: str | None = None  # a configuration error that ends the process (an unloadable tokenizer)
    # Fire-and-forget work (upstream aborts) that must outlive a cancelled handler.
    background: set[asyncio.Task] = field(default_factory=set)
    # The SGLang rids of each request being served, by response id (sglang/client.py's aborting_on_exit;
    # vLLM's /abort_requests).
    in_flight: dict[str, list[str]] = field(default_factory=dict)
    started_at: int = field(default_factory=lambda: int(time.time()))
    # What connecting learned (set together by set_connected; None until then).
    _backend: BackendInfo | None = field(default=None, init=False)
    _tokenizer_info: TokenizerInfo | None = field(default=None, init=False)
    _renderer: PromptRenderer | None = field(default=None, init=False)
    _token_texts: TokenTexts | None = field(default=None, init=False)
    _tool_parser: str | None = field(default=None, init=False)  # --tool-call-parser, else the template's
    _ready_hooks: list[Callable[[BackendInfo], None]] = field(default_factory=list, init=False)

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    @property
    def connected(self) -> bool:
        """SGLang is discovered and its tokenizer loaded: the data path can serve."""
        return self._backend is not None

    def when_ready(self, hook: Callable[[BackendInfo], None]) -> None:
        """Run `hook(backend)` once SGLang is known (at once if it already is)."""
        if self._backend is not None:
            hook(self._backend)
        else:
            self._ready_hooks.append(hook)

    def set_connected(self, backend: BackendInfo, tokenizer_info: TokenizerInfo, renderer: PromptRenderer,
                      token_texts: TokenTexts, tool_parser: str | None = None) -> None:
        self._tokenizer_info, self._renderer, self._token_texts = tokenizer_info, renderer, token_texts
        self._tool_parser, self._backend, self.last_error = tool_parser, backend, None
        hooks, self._ready_hooks = self._ready_hooks, []
        for hook in hooks:
            hook(backend)

    @property
    def not_ready_reason(self) -> str | None:
        """None when the data path can serve; else why not (what /health and every 503 say)."""
        if self._backend is not None:
            return None
        if self.fatal:
            return f"The proxy cannot serve: {self.fatal}"
        if self.loading_tokenizer:
            return (f"The proxy is loading the tokenizer {self.loading_tokenizer!r} (SGLang at "
                    f"{self.client.base_url} is up){_hub_hint(self.loading_tokenizer)}")
        why = f": {self.last_error}" if self.last_error else ""
        return f"The proxy is not connected to SGLang at {self.client.base_url} yet{why}"

    def outage_began(self, reason: str, clock=time.monotonic) -> None:
        """SGLang stopped answering after it was connected (the /metrics reader noticed): one warning."""
        if self._backend is None or self.outage_since is not None:
            return  # before the first connection the wait lines say it; during an outage it was said
        self.outage_since = clock()
        log.warning("lost SGLang: %s (requests get 503 until it answers again)", reason)

    def outage_ended(self, clock=time.monotonic) -> None:
        if self.outage_since is not None:
            log.info("SGLang at %s answers again (after %.0f s unreachable)", self.client.base_url,
                     clock() - self.outage_since)
            self.outage_since = None

    def _unavailable(self) -> BackendUnavailable:
        return BackendUnavailable(self.not_ready_reason)

    @property
    def backend(self) -> BackendInfo:
        if self._backend is None:
            raise self._unavailable()
        return self._backend

    @property
    def tokenizer_info(self) -> TokenizerInfo:
        if self._tokenizer_info is None:
            raise self._unavailable()
        return self._tokenizer_info

    @property
    def renderer(self) -> PromptRenderer:
        if self._renderer is None:
            raise self._unavailable()
        return self._renderer

    @property
    def token_texts(self) -> TokenTexts:
        if self._token_texts is None:
            raise self._unavailable()
        return self._token_texts

    @property
    def tool_parser(self) -> str | None:
        if self._backend is None:
            raise self._unavailable()
        return self._tool_parser

    @property
    def max_model_len(self) -> int:
        return self.backend.max_model_len


def _hub_hint(tokenizer: str) -> str:
    if os.path.isdir(tokenizer):
        return ""
    return (": a Hugging Face hub id, downloaded unless cached (HF_HOME); with no network, mount the model "
            "directory and pass --tokenizer DIR")


SETTINGS = web.AppKey("settings", Settings)
CONTEXT = web.AppKey("context", ProxyContext)
# Called with the message when connecting hits a configuration error (the CLI stops the server).
ON_FATAL = web.AppKey("on_fatal", Callable)
# register(collector): puts a prometheus collector of a module below ops/ (sessions, LoRA adapters: their own
# counters, read at scrape time) on /metrics. ops/metrics.py sets it; absent, nothing is registered.
REGISTER_COLLECTOR = web.AppKey("register_collector", Callable)
