"""Chat-template rendering and tokenization, with a prompt-id cache.

GRPO sends the same prompt many times (n rollouts, often as separate requests);
rendering a template and tokenizing ~1,000 tokens costs about a millisecond,
which is what the cache saves. Identical prompts in flight share one render.

Where a render runs: in the tokenizer executor while other requests are being served (the Rust
encoder releases the GIL, so the event loop serves them meanwhile), on the event loop when nothing
else is (a thread hop then only adds its wake-up and hand-offs: measured +0.3 ms per miss at
concurrency 1 on a busy 2-core host). Text is encoded by the Rust tokenizer directly where that is
the same as `tokenizer.encode` (transformers' wrapper costs ~13 % of an 800-token encode), and ASCII text
by the tiktoken twin that fast_bpe.py proves equal at start-up (about a quarter of the CPU).
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import NamedTuple

import orjson

from token_proxy.errors import InvalidRequest
from token_proxy.tokenization.fast_bpe import FastBpe

# Inputs up to this size (~8k tokens) may be rendered on the event loop: a bigger one would hold
# probes (/health, /metrics) for milliseconds, and its thread hop is small beside its encode.
INLINE_MAX_SIZE = 32 * 1024
# The longest text the tiktoken twin is given: its regex engine (fancy-regex) gives up on a whitespace run of
# ~1,000,000 characters before a letter (`\s+(?!\S)` backtracks past its limit); tokenizers encodes longer ones.
TWIN_MAX_CHARS = 256 * 1024
# What a cache entry holds beside its ids: the 16-byte key (a bytes object) and the LRU's node.
KEY_AND_NODE_BYTES = 49 + 104


def entry_bytes(ids: tuple[int, ...]) -> int:
    """The bytes one cached prompt is counted as: its tuple of shared ints (8 bytes an id), key and node."""
    return sys.getsizeof(ids) + KEY_AND_NODE_BYTES


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

    def key_blob(self) -> bytes:
        """Everything the render depends on, serialised (its length is about the prompt's)."""
        return orjson.dumps(
            [self.messages, self.tools, self.documents, self.chat_template, self.chat_template_kwargs,
             self.add_generation_prompt, self.continue_final_message, self.add_special_tokens],
            option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS,
        )


class PromptRenderer:
    """Chat prompts rendered into ids, with an LRU cache bounded by entries (`cache_size`) and bytes
    (`cache_bytes`; 0 for either: no cache). A cached prompt is its key (a 16-byte digest of everything
    the render depends on, never the prompt itself) and its ids as a tuple of the vocabulary's shared int
    objects (`_ints`, built once: ~6 MB for 150k tokens): 8 bytes an id where the encoder's own ints
    cost ~36, and a hit still only copies pointers (an array of uint32 would hold 4 bytes an id but
    make every hit build its ints again: bench/bench_prompt_cache.py). A render with more ids than
    `max_prompt_ids` is not kept: the context check refuses it (a truncate_prompt_tokens request may
    still take it, re-rendered each time)."""

    def __init__(self, tokenizer, executor: Executor, cache_size: int, busy: Callable[[], bool] = lambda: True,
                 cache_bytes: int = 256 << 20, max_prompt_ids: int | None = None, fast_bpe: FastBpe | None = None):
        """`busy()`: other requests are being served now (a render then goes to the executor). `fast_bpe`:
        the tokenizer's proven tiktoken twin (fast_bpe.load_fast_bpe), for ASCII text."""
        self.tokenizer = tokenizer
        self.executor = executor
        self._encode = text_encoder(tokenizer, fast_bpe)
        self._busy = busy
        self._in_executor = 0
        self._cache_size = cache_size if cache_bytes > 0 else 0
        self._cache_bytes = cache_bytes
        self._max_prompt_ids = max_prompt_ids
        self._cache: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._ints: tuple[int, ...] = ()  # int i at index i, for every id of the vocabulary (built on first use)
        self._pending: dict[bytes, asyncio.Future] = {}  # renders in flight, shared by identical prompts
        self.cached_bytes = 0
        self.hits = 0
        self.misses = 0

    async def render_chat(self, prompt: ChatPrompt) -> Rendered:
        """Prompt ids for a chat (a fresh list: callers may keep or change it)."""
        start = time.perf_counter()
        blob = prompt.key_blob()
        if self._cache_size <= 0:
            ids = await self._start(len(blob), self._render_ids, prompt)
            return Rendered(ids, False, time.perf_counter() - start)
        key, size = hashlib.blake2b(blob, digest_size=16).digest(), len(blob)
        del blob  # a big prompt's serialised copy is not kept while it renders
        cached = self._cache.get(key)
        if cached is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return Rendered(list(cached), True, 0.0)
        future = self._pending.get(key)
        if future is not None:
            self.hits += 1
            return Rendered(list(await asyncio.shield(future)), True, 0.0)
        self.misses += 1
        future = self._start(size, self._render_ids, prompt)
        if future.done():  # rendered on the loop
            self._settle(key, future)
        else:
            self._pending[key] = future
            future.add_done_callback(lambda done: self._settle(key, done))
        ids = await asyncio.shield(future)
        return Rendered(list(ids), False, time.perf_counter() - start)

    @property
    def encoder(self) -> Callable[[str, bool], list[int]]:
        """The synchronous encode this renderer uses (for a caller already in the tokenizer thread)."""
        return self._encode

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self._start(len(text), self._encode, text, add_special_tokens)

    def _render_ids(self, prompt: ChatPrompt) -> list[int]:
        return self._encode(render_chat_text(self.tokenizer, prompt), prompt.add_special_tokens)

    def _settle(self, key: bytes, future: asyncio.Future) -> None:
        """A render ended: its ids kept unless it failed, the context check would refuse them, or
        they alone exceed the byte bound; then the least recently used entries go past either bound."""
        if self._pending.get(key) is future:
            del self._pending[key]
        if future.cancelled() or future.exception() is not None:
            return
        ids = future.result()
        if self._max_prompt_ids is not None and len(ids) > self._max_prompt_ids:
            return
        if 8 * len(ids) > self._cache_bytes or key in self._cache:
            return
        stored = self._shared(ids)
        if stored is None:
            return
        self._cache[key] = stored
        self.cached_bytes += entry_bytes(stored)
        while len(self._cache) > self._cache_size or self.cached_bytes > self._cache_bytes:
            _, dropped = self._cache.popitem(last=False)
            self.cached_bytes -= entry_bytes(dropped)

    def _shared(self, ids: list[int]) -> tuple[int, ...] | None:
        """The ids as the vocabulary's shared int objects (None: an id past the vocabulary, not kept)."""
        if not self._ints:
            self._ints = tuple(range(len(self.tokenizer)))
        ints = self._ints
        try:
            return tuple([ints[i] for i in ids])
        except (IndexError, TypeError):
            return None

    def _start(self, size: int, fn, *args) -> asyncio.Future:
        """fn(*args) on the event loop when nothing else is being served and the input is small
        (`size`, in bytes or characters), else in the executor."""
        loop = asyncio.get_running_loop()
        if size <= INLINE_MAX_SIZE and self._in_executor == 0 and not self._busy():
            future = loop.create_future()
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001 -- the awaiting request raises it, as from the executor
                future.set_exception(exc)
            return future
        self._in_executor += 1
        future = loop.run_in_executor(self.executor, fn, *args)
        future.add_done_callback(self._executor_done)
        return future

    def _executor_done(self, _future: asyncio.Future) -> None:
        self._in_executor -= 1


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


def text_encoder(tokenizer, fast_bpe: FastBpe | None = None) -> Callable[[str, bool], list[int]]:
    """`encode_text` for this tokenizer: through its Rust backend's `encode_batch` (which releases the
    GIL) when transformers' own `encode` would make exactly that call (a TokenizersBackend whose
    class overrides neither `encode` nor `_encode_plus`, no truncation or padding configured), else
    `tokenizer.encode`. Checked per call: transformers may switch `encode_special_tokens`.
    Where the backend would encode, ASCII text goes to `fast_bpe` (proven to give the backend's ids on
    ASCII text) unless special tokens are split as text, or asked for and the post-processor adds some."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its own encode
        return lambda text, add_special_tokens: encode_text(tokenizer, text, add_special_tokens)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cls = type(tokenizer)
    if (backend is None or not isinstance(tokenizer, TokenizersBackend)
            or cls.encode is not PreTrainedTokenizerBase.encode or cls._encode_plus is not TokenizersBackend._encode_plus
            or backend.truncation is not None or backend.padding is not None):
        return lambda text, add_special_tokens: encode_text(tokenizer, text, add_special_tokens)
    split_special = bool(tokenizer.split_special_tokens)
    # tokenizers >= 0.21: the same ids without the character offsets nobody here reads (about a fifth
    # less CPU on an 1,100-token chat prompt); it releases the GIL as encode_batch does.
    encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
    fast = fast_bpe.encode if fast_bpe is not None and not split_special else None
    fast_with_specials = fast if fast_bpe is not None and fast_bpe.adds_nothing else None

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        if backend.encode_special_tokens != split_special:
            return encode_text(tokenizer, text, add_special_tokens)
        twin = fast_with_specials if add_special_tokens else fast
        if twin is not None and len(text) <= TWIN_MAX_CHARS and text.isascii():
            try:
                return twin(text)
            except ValueError:  # tiktoken's regex gave up (a backtracking limit): tokenizers encodes it
                pass
        return encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    return encode


def render_chat_ids(tokenizer, prompt: ChatPrompt) -> tuple[int, ...]:
    text = render_chat_text(tokenizer, prompt)
    return tuple(tokenizer.encode(text, add_special_tokens=prompt.add_special_tokens))
