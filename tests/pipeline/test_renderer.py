"""The prompt renderer: where a render runs (the event loop when nothing else is served, else the
executor), the render cache around it, and the Rust encoder agreeing with tokenizer.encode."""

from __future__ import annotations

import asyncio
import copy
import gc
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from token_proxy.cli import parse_settings
from token_proxy.errors import InvalidRequest
from token_proxy.settings import Settings
from token_proxy.state import upstream_of
from token_proxy.tokenization import ChatPrompt, PromptRenderer
from token_proxy.tokenization.renderer import (
    INLINE_MAX_SIZE,
    encode_text,
    entry_bytes,
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


def _chat(text: str) -> ChatPrompt:
    return ChatPrompt([{"role": "user", "content": text}])


async def test_the_cache_is_bounded_in_bytes_and_shares_the_vocabularys_ints(hf_tokenizer, executor):
    prompts = [_chat(f"prompt {i}: " + "word " * 200) for i in range(3)]
    ids = [list(render_chat_ids(hf_tokenizer, p)) for p in prompts]
    sizes = [entry_bytes(tuple(i)) for i in ids]
    assert sizes[0] == 8 * 213 + 40 + 153 and len(ids[0]) == 213  # 8 bytes an id, the key and the LRU node
    renderer = PromptRenderer(hf_tokenizer, executor, cache_size=100, busy=lambda: False,
                              cache_bytes=sizes[0] + sizes[1] + 10)  # room for two of the three
    for prompt in prompts:
        await renderer.render_chat(prompt)
    assert renderer.cached_bytes == sizes[1] + sizes[2]  # the least recently used went
    assert [list(v) for v in renderer._cache.values()] == ids[1:]
    # Each cached id is the one shared int object of the vocabulary, not one of its own (~28 bytes).
    assert len(renderer._ints) == len(hf_tokenizer) == 151665
    assert all(i is renderer._ints[i] for v in renderer._cache.values() for i in v)
    hit = await renderer.render_chat(prompts[2])
    assert (hit.cache_hit, hit.ids, type(hit.ids)) == (True, ids[2], list)
    hit.ids.append(0)  # the caller's own list
    assert (await renderer.render_chat(prompts[2])).ids == ids[2]
    assert (await renderer.render_chat(prompts[0])).cache_hit is False
    assert (renderer.misses, renderer.hits) == (4, 2)


async def test_a_prompt_the_context_check_refuses_is_not_kept(hf_tokenizer, executor):
    renderer = PromptRenderer(hf_tokenizer, executor, cache_size=100, busy=lambda: True, max_prompt_ids=50)
    long, short = _chat("word " * 100), _chat("word " * 10)
    for _ in range(2):
        assert len((await renderer.render_chat(long)).ids) == 109
    assert (renderer.misses, renderer.hits, renderer.cached_bytes) == (2, 0, 0)
    # Identical prompts in flight still share one render, kept or not.
    results = await asyncio.gather(*(renderer.render_chat(long) for _ in range(3)))
    assert [r.cache_hit for r in results] == [False, True, True] and renderer.cached_bytes == 0
    assert (await renderer.render_chat(short)).cache_hit is False
    assert (await renderer.render_chat(short)).cache_hit is True
    assert renderer.cached_bytes == entry_bytes(render_chat_ids(hf_tokenizer, short))
    assert renderer._pending == {}


@pytest.mark.parametrize(("size", "cache_bytes"), [(0, 1 << 20), (8, 0)])
async def test_either_bound_at_0_turns_the_cache_off(hf_tokenizer, executor, size, cache_bytes):
    renderer = PromptRenderer(hf_tokenizer, executor, cache_size=size, busy=lambda: False, cache_bytes=cache_bytes)
    for _ in range(2):
        assert (await renderer.render_chat(_chat("hi"))).cache_hit is False
    assert (renderer.cached_bytes, len(renderer._cache)) == (0, 0)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm (Linux)")
async def test_a_stream_of_big_refused_prompts_leaves_memory_flat(make_proxy, sim):
    """Issue 32: each refused 2 MB prompt (~350k ids) stayed in the cache as a tuple of its own ints (~14 MB);
    25 of them grew RSS by ~350 MB. Now nothing is kept for them, and accepted prompts stay under the bound."""
    client = await make_proxy(sim, context_length=4096, prompt_cache_bytes=64 << 10)
    renderer = upstream_of(client.app).renderer

    async def refused(i: int) -> None:
        body = {"model": "sim/qwen2-tiny", "max_tokens": 1,
                "messages": [{"role": "user", "content": f"{i} " + "hello " * 350_000}]}
        reply = await client.post("/v1/chat/completions", json=body)
        error = (await reply.json())["error"]
        assert (reply.status, error["param"]) == (400, "input_tokens"), error
        assert "maximum context length is 4096 tokens" in error["message"]

    for i in range(-4, 0):  # warm: the allocators' high-water mark for one big request (~60 MiB, then flat)
        await refused(i)
    gc.collect()
    before = _rss_bytes()
    for i in range(25):
        await refused(i)
        assert renderer.cached_bytes == 0
    gc.collect()
    grown = _rss_bytes() - before
    assert grown < 50 << 20, f"RSS grew {grown / 2**20:.0f} MiB over 25 refused prompts"
    assert renderer.misses == 29 and len(renderer._cache) == 0
    for i in range(30):  # accepted prompts (~1,000 ids each): kept up to the 64 KiB bound
        reply = await client.post("/v1/chat/completions", json={
            "model": "sim/qwen2-tiny", "max_tokens": 1, "messages": [{"role": "user", "content": f"{i} " + "hi " * 1000}]})
        assert reply.status == 200, await reply.text()
        assert 0 < renderer.cached_bytes <= 64 << 10
    assert len(renderer._cache) == 7  # the last 7 (8 bytes an id: ~8.2 KiB each)


def test_the_byte_bound_is_a_flag_with_an_env_fallback(capsys):
    assert Settings().prompt_cache_bytes == 256 << 20
    assert parse_settings(["--prompt-cache-bytes", "1048576"], environ={}).prompt_cache_bytes == 1 << 20
    settings = parse_settings([], environ={"TOKEN_PROXY_PROMPT_CACHE_BYTES": "0", "TOKEN_PROXY_PROMPT_CACHE_SIZE": "9"})
    assert (settings.prompt_cache_bytes, settings.prompt_cache_size) == (0, 9)
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(["--prompt-cache-bytes", "-1"], environ={})
    assert exit_info.value.code == 2
    assert "--prompt-cache-size and --prompt-cache-bytes must be >= 0" in capsys.readouterr().err
