"""A weight-update group join whose peers never come, as SGLang 0.5.17 lives it (simulator/scheduler_block.py):
the join runs on the scheduler's thread, so until torch's rendezvous gives up the scheduler serves nothing:
/generate waits, /health_generate answers 503 after SGLANG_HEALTH_CHECK_TIMEOUT, a pause waits its turn, and
/model_info (the tokenizer process) still answers. Then SGLang's 400 "Failed to initialize custom process group:
<torch's error>." and the server serves again (../shared/golden/extra_run3_init_group_hang.json).

Without torch here: the join is a stand-in that blocks as torch's client rendezvous does (waits, then raises);
test_a_real_join_without_its_master_blocks_until_the_timeout joins with torch for real."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import pytest

from token_proxy.simulator import SIM_STATE, params

JOIN = {"master_address": "127.0.0.1", "master_port": 29533, "rank_offset": 1, "world_size": 2,
        "group_name": "wedged"}
TORCH_TIMEOUT = "The client socket has timed out after 1500ms while trying to connect to (127.0.0.1, 29533)."
GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


@pytest.fixture
def wedged_join(monkeypatch):
    """params.join_group blocks until `release` is set (or 10 s), then fails with torch's timeout."""
    release = threading.Event()

    def join(*args):
        release.wait(10)
        raise RuntimeError(TORCH_TIMEOUT)

    monkeypatch.setattr(params, "join_group", join)
    yield release
    release.set()


async def test_a_join_that_cannot_complete_blocks_the_scheduler_until_it_fails(make_sim, wedged_join):
    sim = await make_sim(health_check_timeout_s=0.3)
    async with aiohttp.ClientSession(str(sim.make_url(""))) as http:
        join = asyncio.ensure_future(http.post("/init_weights_update_group", json=JOIN))
        await asyncio.sleep(0.2)
        assert sim.app[SIM_STATE].blocked.startswith("init_weights_update_group 'wedged' (")
        generate = asyncio.ensure_future(http.post("/generate", json=GENERATE))
        pause = asyncio.ensure_future(http.post("/pause_generation", json={"mode": "abort"}))
        started = time.monotonic()
        health = await http.get("/health_generate")
        assert (health.status, round(time.monotonic() - started, 1) >= 0.3) == (503, True)
        assert (await http.get("/health")).status == 503
        info = await http.get("/model_info")  # the tokenizer process answers on its own
        assert info.status == 200 and (await info.json())["weight_version"] == "default"
        await asyncio.sleep(0.3)
        assert (generate.done(), pause.done(), join.done()) == (False, False, False)
        wedged_join.set()  # torch's rendezvous gives up
        reply = await join
        assert (reply.status, await reply.json()) == (
            400, {"success": False, "message": f"Failed to initialize custom process group: {TORCH_TIMEOUT}."})
        assert (await pause).status == 200  # its turn came after the join
        await http.post("/continue_generation", json={})
        done = await asyncio.wait_for(generate, 5)
        assert done.status == 200 and len((await done.json())["output_ids"]) == 4
        assert (await http.get("/health_generate")).status == 200
        assert sim.app[SIM_STATE].blocked is None


async def test_a_running_sequence_makes_no_token_while_the_scheduler_is_blocked(make_sim, wedged_join):
    sim = await make_sim(tpot_s=0.01)
    state = sim.app[SIM_STATE]
    async with aiohttp.ClientSession(str(sim.make_url(""))) as http:
        body = {**GENERATE, "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
        generate = asyncio.ensure_future(http.post("/generate", json=body))
        while not state.running or not next(iter(state.running.values())).output_ids:
            await asyncio.sleep(0.01)
        join = asyncio.ensure_future(http.post("/init_weights_update_group", json=JOIN))
        await asyncio.sleep(0.1)
        frozen = len(next(iter(state.running.values())).output_ids)
        await asyncio.sleep(0.3)
        assert len(next(iter(state.running.values())).output_ids) == frozen < 200
        wedged_join.set()
        assert (await join).status == 400
        done = await asyncio.wait_for(generate, 10)
        assert len((await done.json())["output_ids"]) == 200


async def test_a_restart_ends_the_block(make_sim, wedged_join):
    sim = await make_sim()
    async with aiohttp.ClientSession(str(sim.make_url(""))) as http:
        join = asyncio.ensure_future(http.post("/init_weights_update_group", json=JOIN))
        await asyncio.sleep(0.1)
        assert (await http.post("/sim/restart", json={"restart_s": 0.1})).status == 200
        await asyncio.sleep(0.3)
        assert sim.app[SIM_STATE].blocked is None
        assert (await asyncio.wait_for(http.post("/generate", json=GENERATE), 5)).status == 200
        wedged_join.set()
        await join


async def test_a_real_join_without_its_master_blocks_until_the_timeout(make_sim):
    pytest.importorskip("torch")
    from tests.support.admin_fixtures import free_port

    sim = await make_sim(dist_timeout_s=1.5, health_check_timeout_s=0.2)
    async with aiohttp.ClientSession(str(sim.make_url(""))) as http:
        started = time.monotonic()
        join = asyncio.ensure_future(http.post("/init_weights_update_group",
                                               json={**JOIN, "master_port": free_port()}))
        await asyncio.sleep(0.2)
        assert (await http.get("/health_generate")).status == 503
        reply = await join
        body = await reply.json()
        assert (reply.status, body["success"]) == (400, False)
        assert body["message"].startswith("Failed to initialize custom process group: ")
        assert time.monotonic() - started >= 1.4
        assert (await http.get("/health_generate")).status == 200
