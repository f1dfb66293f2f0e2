"""The prompt renderer: where a render runs (the event loop when nothing else is served, else the
executor), the render cache around it, and the Rust encoder agreeing with tokenizer.encode."""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor

import pytest

from token_proxy.errors import InvalidRequest
from token_proxy.tokenization.renderer import (
    INLINE_MAX_SIZE,
    ChatPrompt,
    PromptRenderer,
    encode_text,
    render_chat_ids,
    text_encoder,
)

TEXTS = ["", "hello", " leading space", "<|im_start|>user\nhi<|im_end|>\n", "naïve café 東京 🙂\n\n\t x",
         "a" * 5000, "<|endoftext|> after a special token"]


class CountingExecutor(ThreadPoolExecutor):
    def __init__(self):
        super().__init__(1)
        self.calls = 0

    def submit(self, fn, *args, **kwargs):
        self.calls += 1
        return super().submit(fn, *args, **kwargs)


@pytest.fixture
def executor():
    pool = CountingExecutor()
    yield pool
    pool.shutdown()


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_the_rust_encoder_matches_tokenizer_encode(hf_tokenizer, add_special_tokens):
    encode = text_encoder(hf_tokenizer)
    for text in TEXTS:
        assert encode(text, add_special_tokens) == hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)


def test_the_rust_encoder_skips_offsets_with_the_same_ids(hf_tokenizer):
    """encode_batch_fast (no character offsets) where tokenizers has it: the ids of transformers' encode,
    special tokens, odd whitespace and long texts included."""
    backend = hf_tokenizer.backend_tokenizer
    assert hasattr(backend, "encode_batch_fast")  # tokenizers >= 0.21 (the venv's): the fast way is taken
    texts = [*TEXTS, " \u2028 \x00\x01 <think>\n\n</think>" * 50, "<|im_start|><|im_end|><|endoftext|>" * 3]
    encode = text_encoder(hf_tokenizer)
    for text in texts:
        for special in (False, True):
            assert encode(text, special) == hf_tokenizer.encode(text, add_special_tokens=special)


def test_the_encoder_defers_to_transformers_when_it_would_do_otherwise(hf_tokenizer):
    tokenizer = copy.deepcopy(hf_tokenizer)
    encode = text_encoder(tokenizer)
    text = "<|im_start|>user"
    tokenizer.backend_tokenizer.encode_special_tokens = True  # what a split_special_tokens call leaves
    assert len(tokenizer.backend_tokenizer.encode(text).ids) > 2  # the backend alone would split the marker
    assert encode(text, False) == [151644, 872]  # transformers' encode: it resets the flag, as it always does
    assert tokenizer.backend_tokenizer.encode_special_tokens is False
    long_text = "one two three four five six"
    full = encode_text(tokenizer, long_text, False)
    tokenizer.backend_tokenizer.enable_truncation(3)  # a tokenizer.json with truncation: encode turns it off
    assert len(tokenizer.backend_tokenizer.encode(long_text).ids) == 3
    assert text_encoder(tokenizer)(long_text, False) == full and len(full) == 6


async def test_an_idle_proxy_renders_on_the_loop_a_busy_one_in_the_executor(hf_tokenizer, executor):
    busy = [False]
    renderer = PromptRenderer(hf_tokenizer, executor, cache_size=8, busy=lambda: busy[0])
    first = await renderer.render_chat(ChatPrompt([{"role": "user", "content": "one"}]))
    assert executor.calls == 0
    busy[0] = True
    second = await renderer.render_chat(ChatPrompt([{"role": "user", "content": "two"}]))
    assert executor.calls == 1
    assert first.ids == list(render_chat_ids(hf_tokenizer, ChatPrompt([{"role": "user", "content": "one"}])))
    assert second.ids == list(render_chat_ids(hf_tokenizer, ChatPrompt([{"role": "user", "content": "two"}])))
    assert (first.cache_hit, second.cache_hit) == (False, False)
    busy[0] = False
    huge = "x " * INLINE_MAX_SIZE  # an idle proxy still hands a big input to the executor
    assert await renderer.encode(huge, False) == hf_tokenizer.encode(huge, add_special_tokens=False)
    assert executor.calls == 2


async def test_identical_prompts_in_flight_share_one_render(hf_tokenizer, executor):
    renderer = PromptRenderer(hf_tokenizer, executor, cache_size=8, busy=lambda: True)
    prompt = ChatPrompt([{"role": "user", "content": "same"}])
    results = await asyncio.gather(*(renderer.render_chat(prompt) for _ in range(4)))
    assert executor.calls == 1
    assert [r.cache_hit for r in results] == [False, True, True, True]
    assert (renderer.misses, renderer.hits) == (1, 3)
    assert len({tuple(r.ids) for r in results}) == 1


@pytest.mark.parametrize("busy", [False, True])
async def test_a_failed_render_is_the_requests_error_and_is_not_cached(hf_tokenizer, executor, busy):
    renderer = PromptRenderer(hf_tokenizer, executor, cache_size=8, busy=lambda: busy)
    bad = ChatPrompt([{"role": "user", "content": "hi"}], chat_template="{{ raise_exception('no') }}")
    for _ in range(2):
        with pytest.raises(InvalidRequest) as caught:
            await renderer.render_chat(bad)
        assert caught.value.param == "messages"
    assert (renderer.misses, renderer.hits) == (2, 0)
    assert executor.calls == (2 if busy else 0)
