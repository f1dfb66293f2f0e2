"""vLLM's sleep mode through the proxy on a live SGLang (issue #14): /sleep with a stream in flight, then
/wake_up, then the same greedy output. Needs SGLang started with --enable-memory-saver and
--enable-weights-cpu-backup (level 1 keeps the weights in CPU memory); skipped otherwise.

The same sequence was first run by hand on 2026-11-22 (SGLang 0.5.17, one H200): GPU memory 56.2 GiB ->
12.1 GiB asleep -> 54.9 GiB awake, and the same greedy ids after waking.
"""

from __future__ import annotations

import asyncio

import pytest

CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8, "temperature": 0,
        "return_token_ids": True}


@pytest.fixture
async def memory_saver(sglang):
    _, info = await sglang.get("/server_info")
    if not (info.get("enable_memory_saver") and info.get("enable_weights_cpu_backup")):
        pytest.skip("start SGLang with --enable-memory-saver --enable-weights-cpu-backup")


async def greedy_ids(proxy) -> list[int]:
    response = await proxy.post("/v1/chat/completions", json=CHAT)
    assert response.status == 200, await response.text()
    return (await response.json())["choices"][0]["token_ids"]


async def test_sleep_with_a_stream_in_flight_then_wake_and_generate_the_same(proxy, sglang, memory_saver):
    before = await greedy_ids(proxy)
    long = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    running = asyncio.ensure_future(proxy.post("/v1/chat/completions", json=long))
    await asyncio.sleep(1.0)
    response = await proxy.post("/sleep?level=1&mode=abort")
    assert (response.status, await response.json()) == (200, {"status": "sleeping", "level": 1})
    streamed = await (await running).read()
    assert b'"finish_reason":"abort"' in streamed and streamed.endswith(b"data: [DONE]\n\n")
    assert await (await proxy.get("/is_sleeping")).json() == {"is_sleeping": True}
    refused = await proxy.post("/resume")
    assert refused.status == 409  # SGLang would run on memory it gave back
    assert (await proxy.post("/wake_up?tags=weights")).status == 200
    woken = await proxy.post("/wake_up?tags=kv_cache&tags=cuda_graph")
    assert woken.status == 200 and (await woken.json())["status"] == "awake"
    assert await (await proxy.get("/is_sleeping")).json() == {"is_sleeping": False}
    assert await greedy_ids(proxy) == before  # the weights came back exactly
