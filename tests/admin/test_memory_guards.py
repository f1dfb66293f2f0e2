"""SGLang's forwarded /release_memory_occupation and /resume_memory_occupation cannot kill it (issue 41.1).

The three sequences that killed real SGLang 0.5.17 (and the simulator, whose crash model follows 0.5.17..0.5.23's
scheduler_components/weight_updater.py) answer a clear 409 through the proxy, and SGLang stays healthy; the
forwarded calls and vLLM's /sleep, /wake_up share one record of what is released (admin/memory.py). On d6350dc
each of the three gave a 500 or 502 and a dead simulator. tests/e2e/test_live_memory_guards.py runs the same
three on real SGLang (GPU)."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.weight_routes import WEIGHTS

LONG = {"messages": [{"role": "user", "content": "Count slowly."}], "max_tokens": 200, "temperature": 0,
        "ignore_eos": True}


async def sglang_healthy(sim) -> bool:
    async with aiohttp.ClientSession() as session, session.get(sim.make_url("/health")) as health:
        return health.status == 200 and not sim.app[SIM_STATE].crashed


async def answer(proxy, path: str, **kwargs) -> tuple[int, dict | None]:
    response = await proxy.post(path, **kwargs)
    raw = await response.read()
    return response.status, orjson.loads(raw) if raw else None


@pytest.fixture
async def saver(make_sim, make_proxy):
    sim = await make_sim(enable_memory_saver=True, enable_weights_cpu_backup=True, tpot_s=0.02)
    return sim, await make_proxy(sim)


async def test_a_resume_of_nothing_released_is_a_409_and_sglang_lives(saver):
    sim, proxy = saver
    status, body = await answer(proxy, "/resume_memory_occupation", json={})
    assert status == 409 and body["error"]["type"] == "ConflictError"
    assert body["error"]["message"].startswith("resume_memory_occupation: kv_cache, weights, cuda_graph is not "
                                               "released (released now: nothing)")
    status, body = await answer(proxy, "/resume_memory_occupation", json={"tags": ["kv_cache"]})
    assert status == 409
    assert await sglang_healthy(sim)
    assert (await proxy.post("/v1/chat/completions", json={**LONG, "max_tokens": 2})).status == 200


async def test_a_release_while_a_chat_runs_is_a_409_and_the_chat_finishes(saver):
    sim, proxy = saver
    chat = asyncio.create_task(proxy.post("/v1/chat/completions", json={**LONG, "max_tokens": 40}))
    while not sim.app[SIM_STATE].running:
        await asyncio.sleep(0.005)
    status, body = await answer(proxy, "/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert status == 409 and body["error"]["message"].startswith(
        "release_memory_occupation: requests are running on ")
    reply = await asyncio.wait_for(chat, 20)
    assert reply.status == 200 and (await reply.json())["usage"]["completion_tokens"] == 40
    assert sim.app[WEIGHTS].released == set()
    assert await sglang_healthy(sim)


async def test_sleep_then_a_forwarded_resume_then_wake_up_share_one_record(saver):
    """The issue's third sequence, and release, resume, resume again: the record is one for every route."""
    sim, proxy = saver
    assert (await answer(proxy, "/sleep", params={"level": "1"}))[0] == 200
    assert sim.app[WEIGHTS].released == {"kv_cache", "weights", "cuda_graph"}
    assert await answer(proxy, "/resume_memory_occupation", json={"tags": ["weights"]}) == (200, None)
    assert sim.app[WEIGHTS].released == {"kv_cache", "cuda_graph"}
    status, body = await answer(proxy, "/resume_memory_occupation", json={"tags": ["weights"]})
    assert status == 409 and "weights is not released (released now: cuda_graph, kv_cache)" in body["error"]["message"]
    assert (await (await proxy.get("/is_sleeping")).json()) == {"is_sleeping": True}
    assert await answer(proxy, "/wake_up") == (200, {"status": "awake", "tags": None})
    assert sim.app[WEIGHTS].released == set() and not sim.app[SIM_STATE].paused
    assert await sglang_healthy(sim)
    # release, resume, a second resume: the second is refused
    assert await answer(proxy, "/release_memory_occupation", json={}) == (200, None)
    status, body = await answer(proxy, "/release_memory_occupation", json={"tags": ["weights"]})
    assert status == 409 and body["error"]["message"].startswith("release_memory_occupation: weights released already")
    assert (await answer(proxy, "/resume", json={}))[0] == 409  # /resume waits for the memory, forwarded or not
    assert await answer(proxy, "/resume_memory_occupation", json={}) == (200, None)
    assert (await answer(proxy, "/resume_memory_occupation", json={}))[0] == 409
    assert await sglang_healthy(sim)


async def test_a_release_on_a_paused_fleet_drains_it_first(saver):
    sim, proxy = saver
    chat = asyncio.create_task(proxy.post("/v1/chat/completions", json={**LONG, "max_tokens": 20}))
    while not sim.app[SIM_STATE].running:
        await asyncio.sleep(0.005)
    assert (await answer(proxy, "/pause", params={"mode": "wait"}))[0] == 200  # waits for the chat
    assert await answer(proxy, "/release_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}) == (200, None)
    assert (await asyncio.wait_for(chat, 20)).status == 200
    assert sim.app[WEIGHTS].released == {"kv_cache", "cuda_graph"}
    assert await sglang_healthy(sim)


@pytest.mark.parametrize(("body", "message"), [
    ({"tags": "kv_cache"}, "tags must be a list of kv_cache, weights, cuda_graph, got 'kv_cache'"),
    ({"tags": ["kv"]}, "tags must be among kv_cache, weights, cuda_graph, got 'kv'"),
    ({"tags": [1]}, "tags must be a list of kv_cache, weights, cuda_graph, got [1]"),
])
async def test_bad_tags_are_a_400_before_sglang_sees_them(saver, body, message):
    sim, proxy = saver
    status, reply = await answer(proxy, "/release_memory_occupation", json=body)
    assert (status, reply["error"]["message"], reply["error"]["param"]) == (400, message, "tags")
    assert sim.app[WEIGHTS].released == set() and await sglang_healthy(sim)


@pytest.mark.parametrize(("version", "paused", "waiting", "dies"), [
    ("0.5.17", False, True, True), ("0.5.20", True, True, True),  # waiting requests count
    ("0.5.21", True, True, False), ("0.5.23", True, True, False),  # a paused engine's waiting queue does not
    ("0.5.23", False, True, True), ("0.5.23", True, False, True),  # unpaused, or one running: dies
])
async def test_the_simulators_idle_assert_follows_each_release(make_sim, version, paused, waiting, dies):
    """weight_updater.py: `assert self.is_fully_idle()` (0.5.17..0.5.20), `is_fully_idle(ignore_waiting=
    scheduler._engine_paused)` (0.5.21..0.5.23): read in each release's source."""
    sim = await make_sim(sglang_version=version, enable_memory_saver=True)
    state = sim.app[SIM_STATE]
    state.paused = paused
    state.running["r"] = object()  # one sequence admitted
    state.active = 0 if waiting else 1  # waiting, or past admission
    async with aiohttp.ClientSession() as session, session.post(sim.make_url("/release_memory_occupation"),
                                                                json={"tags": ["kv_cache"]}) as reply:
        assert (reply.status == 500) is dies
    assert state.crashed is dies
