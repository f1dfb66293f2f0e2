"""SGLang's forwarded memory calls through the proxy on a live SGLang (issue 41.1): the three sequences that
killed real SGLang 0.5.17 on an H200 when sent to it directly answer a clear 409, and SGLang is alive after each
(its /health 200, and a chat still answers). Needs SGLang started with --enable-memory-saver (and
--enable-weights-cpu-backup for the /sleep sequence); skipped otherwise. The simulator runs the same three in
tests/admin/test_memory_guards.py.

1. /resume_memory_occupation with nothing released (SGLang: KeyError 'kv_cache', scheduler dead);
2. /release_memory_occupation while a request runs (SGLang: AssertionError "should be called only when server is
   idle", scheduler dead, the running request gets nothing);
3. release, resume, then a second resume (KeyError, dead); and /sleep?level=1, a forwarded resume, /wake_up.
"""

from __future__ import annotations

import asyncio

from tests.e2e.conftest import CHAT


async def alive(proxy, sglang) -> None:
    status, _ = await sglang.get("/health")
    assert status == 200, "SGLang is dead"
    response = await asyncio.wait_for(proxy.post("/v1/chat/completions", json=CHAT), 60)
    assert response.status == 200, await response.text()


async def refused(proxy, path: str, body: dict) -> str:
    response = await asyncio.wait_for(proxy.post(path, json=body), 60)
    reply = await response.json()
    assert (response.status, reply["error"]["type"]) == (409, "ConflictError"), reply
    return reply["error"]["message"]


async def test_a_resume_of_nothing_released_is_refused(proxy, sglang, memory_saver):
    message = await refused(proxy, "/resume_memory_occupation", {})
    assert "is not released (released now: nothing)" in message
    assert "is not released" in await refused(proxy, "/resume_memory_occupation", {"tags": ["kv_cache"]})
    await alive(proxy, sglang)


async def test_a_release_while_a_request_runs_is_refused_and_the_request_finishes(proxy, sglang, memory_saver):
    long = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    running = await proxy.post("/v1/chat/completions", json=long)
    assert running.status == 200
    first = await running.content.readany()  # the request runs in SGLang now
    assert "requests are running on" in await refused(proxy, "/release_memory_occupation", {"tags": ["kv_cache"]})
    rest = await asyncio.wait_for(running.read(), 120)
    assert b'"finish_reason":"length"' in first + rest and rest.endswith(b"data: [DONE]\n\n")
    await alive(proxy, sglang)


async def test_release_resume_then_a_second_resume_is_refused(proxy, sglang, memory_saver):
    released = await proxy.post("/release_memory_occupation", json={})
    assert released.status == 200, await released.text()
    resumed = await proxy.post("/resume_memory_occupation", json={})
    assert resumed.status == 200, await resumed.text()
    assert "is not released" in await refused(proxy, "/resume_memory_occupation", {})
    await alive(proxy, sglang)


async def test_sleep_then_a_forwarded_resume_then_wake_up(proxy, sglang, memory_saver):
    response = await proxy.post("/sleep?level=1")
    assert (response.status, await response.json()) == (200, {"status": "sleeping", "level": 1})
    resumed = await proxy.post("/resume_memory_occupation", json={"tags": ["weights"]})
    assert resumed.status == 200, await resumed.text()
    assert "weights is not released" in await refused(proxy, "/resume_memory_occupation", {"tags": ["weights"]})
    woke = await proxy.post("/wake_up")
    assert (woke.status, await woke.json()) == (200, {"status": "awake", "tags": None})
    await alive(proxy, sglang)
