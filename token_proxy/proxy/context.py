"""What handlers share, kept on the Application under typed keys (no globals)."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from token_proxy.proxy.backend import BackendInfo
from token_proxy.proxy.sglang_client import SGLangClient
from token_proxy.settings import Settings
from token_proxy.tokenization.loader import TokenizerInfo
from token_proxy.tokenization.renderer import PromptRenderer
from token_proxy.tokenization.token_text import TokenTexts


@dataclass(slots=True)
class ProxyContext:
    settings: Settings
    client: SGLangClient
    backend: BackendInfo
    tokenizer_info: TokenizerInfo
    renderer: PromptRenderer
    token_texts: TokenTexts
    # Fire-and-forget work (upstream aborts) that must outlive a cancelled handler.
    background: set[asyncio.Task] = field(default_factory=set)
    started_at: int = field(default_factory=lambda: int(time.time()))

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    @property
    def max_model_len(self) -> int:
        return self.backend.max_model_len


SETTINGS = web.AppKey("settings", Settings)
CONTEXT = web.AppKey("context", ProxyContext)


def new_request_id(prefix: str, client_id: str | None) -> str:
    return f"{prefix}-{client_id or uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
