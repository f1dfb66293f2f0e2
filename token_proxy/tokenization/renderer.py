"""Chat-template rendering and tokenization, off the event loop, with a prompt-id cache.

GRPO sends the same prompt many times (n rollouts, often as separate requests);
rendering a template and tokenizing ~1,000 tokens costs about a millisecond,
which is what the cache saves. Identical prompts in flight share one render.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import NamedTuple

import orjson

from token_proxy.errors import InvalidRequest


class Rendered(NamedTuple):
    ids: list[int]
    cache_hit: bool
    seconds: float  # time spent rendering and tokenizing for this request (0 on a hit)


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Everything that affects how a chat is rendered into prompt ids."""

    messages: list
    tools: list | None = None
    documents: list | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False

    def cache_key(self) -> bytes:
        blob = orjson.dumps(
            [self.messages, self.tools, self.documents, self.chat_template, self.chat_template_kwargs,
             self.add_generation_prompt, self.continue_final_message, self.add_special_tokens],
            option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS,
        )
        return hashlib.blake2b(blob, digest_size=16).digest()


class PromptRenderer:
    def __init__(self, tokenizer, executor: Executor, cache_size: int):
        self.tokenizer = tokenizer
        self.executor = executor
        self._cache_size = cache_size
        self._cache: OrderedDict[bytes, asyncio.Future] = OrderedDict()
        self.hits = 0
        self.misses = 0

    async def render_chat(self, prompt: ChatPrompt) -> Rendered:
        """Prompt ids for a chat (a fresh list: callers may keep or change it)."""
        start = time.perf_counter()
        if self._cache_size <= 0:
            ids = await self._run(render_chat_ids, self.tokenizer, prompt)
            return Rendered(list(ids), False, time.perf_counter() - start)
        key = prompt.cache_key()
        future = self._cache.get(key)
        if future is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return Rendered(list(await asyncio.shield(future)), True, 0.0)
        self.misses += 1
        future = asyncio.ensure_future(self._run(render_chat_ids, self.tokenizer, prompt))
        self._remember(key, future)
        try:
            ids = await asyncio.shield(future)
        except Exception:
            self._cache.pop(key, None)
            raise
        return Rendered(list(ids), False, time.perf_counter() - start)

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self._run(encode_text, self.tokenizer, text, add_special_tokens)

    def _remember(self, key: bytes, future: asyncio.Future) -> None:
        self._cache[key] = future
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


def render_chat_text(tokenizer, prompt: ChatPrompt) -> str:
    kwargs = dict(prompt.chat_template_kwargs or {})
    try:
        return tokenizer.apply_chat_template(
            prompt.messages,
            tools=prompt.tools,
            documents=prompt.documents,
            chat_template=prompt.chat_template,
            add_generation_prompt=prompt.add_generation_prompt,
            continue_final_message=prompt.continue_final_message,
            tokenize=False,
            **kwargs,
        )
    except Exception as exc:  # template errors (raise_exception, bad roles, bad kwargs) are the request's fault
        raise InvalidRequest(f"Could not render the chat template: {exc}", param="messages") from exc


def encode_text(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def render_chat_ids(tokenizer, prompt: ChatPrompt) -> tuple[int, ...]:
    text = render_chat_text(tokenizer, prompt)
    return tuple(tokenizer.encode(text, add_special_tokens=prompt.add_special_tokens))
