"""Connecting to SGLang: discover the model, load its tokenizer, and keep trying until it works.

Start-up waits a bounded time for this; past it the proxy serves anyway (503 on the data
path, /health unhealthy) and connects by itself as soon as SGLang answers — no restart.
"""

from __future__ import annotations

import asyncio
import logging
import time

from token_proxy.errors import ProxyError
from token_proxy.proxy.upstream.context import Engine, ProxyContext
from token_proxy.proxy.upstream.discovery import discover
from token_proxy.tokenization.loader import describe_tokenizer, load_tokenizer
from token_proxy.tokenization.renderer import PromptRenderer
from token_proxy.tokenization.token_text import TokenTexts
from token_proxy.tools import choose_tool_parser

log = logging.getLogger(__name__)


async def connect_engine(ctx: ProxyContext, max_delay_s: float = 5.0) -> None:
    """Retry (with a logged, capped backoff) until SGLang is healthy and discovered."""
    start, delay = time.monotonic(), 0.2
    while True:
        try:
            if await ctx.client.healthy():
                ctx.set_engine(await _engine(ctx))
                log.info("serving %s (context %d) from %s", ctx.backend.served_model_name,
                         ctx.backend.max_model_len, ctx.client.base_url)
                return
            ctx.last_error = "its /health does not answer 200"
        except (ProxyError, RuntimeError, OSError, ValueError) as exc:
            ctx.last_error = getattr(exc, "message", None) or str(exc)
        log.info("waiting for SGLang at %s (%.0f s so far): %s", ctx.client.base_url,
                 time.monotonic() - start, ctx.last_error)
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_delay_s)


async def _engine(ctx: ProxyContext) -> Engine:
    backend = await discover(ctx.client, ctx.settings)
    tokenizer = await asyncio.get_running_loop().run_in_executor(ctx.executor, load_tokenizer,
                                                                 backend.tokenizer_path)
    return Engine(backend=backend, tokenizer_info=describe_tokenizer(tokenizer),
                  renderer=PromptRenderer(tokenizer, ctx.executor, ctx.settings.prompt_cache_size),
                  token_texts=TokenTexts(tokenizer), tool_parser=_tool_parser(ctx, tokenizer))


def _tool_parser(ctx: ProxyContext, tokenizer) -> str | None:
    """--tool-call-parser, else the parser the tokenizer's chat template names (logged either way)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one renders chats
        template = template.get("default")
    chosen = choose_tool_parser(ctx.settings.tool_call_parser, template if isinstance(template, str) else None)
    if ctx.settings.enable_auto_tool_choice and chosen is None:
        log.error("--enable-auto-tool-choice requires --tool-call-parser (the chat template names no parser): "
                  "tool_choice \"auto\" is refused until one is given")
    return chosen
