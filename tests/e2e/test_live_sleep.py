"""vLLM's sleep mode through the proxy on a live SGLang (issues #14, #20): /sleep (with a stream in flight,
and as SkyRL sends it), then /wake_up by vLLM's tags, then the same greedy output. Needs SGLang started with
--enable-memory-saver and --enable-weights-cpu-backup (level 1 keeps the weights in CPU memory); skipped
otherwise.

The same sequence was first run by hand on 2026-11-22 (SGLang 0.5.17, one H200): GPU memory 56.2 GiB ->
12.1 GiB asleep -> 54.9 GiB awake, and the same greedy ids after waking.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.conftest import CHAT


async def greedy_ids(proxy) -> list[int]:
    """Bounded: a server left asleep holds the request instead of answering."""
    response = await asyncio.wait_for(proxy.post("/v1/chat/completions", json=CHAT), 30)
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
    await wake(proxy, {"tags": ["weights"]}, {"status": "sleeping", "tags": ["weights"]})
    await wake(proxy, {"tags": ["kv_cache"]}, {"status": "awake", "tags": ["kv_cache"]})
    assert await greedy_ids(proxy) == before  # the weights came back exactly


async def wake(proxy, params, expected: dict) -> None:
    """POST /wake_up as SkyRL's RemoteInferenceClient sends it (aiohttp params: a list is repeated tags)."""
    response = await proxy.post("/wake_up", params=params)
    assert (response.status, await response.json()) == (200, expected)
    is_sleeping = await (await proxy.get("/is_sleeping")).json()
    assert is_sleeping == {"is_sleeping": expected["status"] == "sleeping"}


@pytest.mark.parametrize("wakes", [
    [({"tags": ["weights"]}, "sleeping"), ({"tags": ["kv_cache"]}, "awake")],  # SkyRL: weights, update, kv_cache
    [({"tags": ["weights", "kv_cache"]}, "awake")],  # both at once (vLLM reads repeated tags)
    [({}, "awake")],  # bare: everything
], ids=["skyrl", "both-tags", "bare"])
async def test_sleep_level_1_then_wake_by_vllms_tags_gives_the_same_greedy_ids(proxy, sglang, memory_saver, wakes):
    """SkyRL's colocated sequence through the proxy: POST /sleep?level=1 once the rollouts are done, then
    /wake_up?tags=weights (the trainer pushes into them), then /wake_up?tags=kv_cache, which also brings back
    SGLang's cuda_graph memory (vLLM does not name it): awake, and the same greedy ids as before."""
    before = await greedy_ids(proxy)
    response = await proxy.post("/sleep", params={"level": "1"})
    assert (response.status, await response.json()) == (200, {"status": "sleeping", "level": 1})
    for params, status in wakes:
        await wake(proxy, params, {"status": status, "tags": params.get("tags")})
    assert await greedy_ids(proxy) == before  # served, not held by a fleet left asleep
