"""A weight-update group join that cannot complete (the first GPU fleet round: two processes took the same free
port, the trainer's master failed with EADDRINUSE and the workers sat in /init_weights_update_group for minutes
while 11,781 chats hung). fleet/joins.py's rules, on simulators whose scheduler blocks in the join as SGLang
0.5.17's does (simulator/scheduler_block.py): the join is answered 504 within --init-group-timeout, chats get a
prompt 503 with Retry-After while every worker is inside it, /weight_info `joining` and /health name it, and once
SGLang answers (torch gives up, or the rendezvous completes late) the fleet serves again, a late group destroyed.

The join is a stand-in that blocks as torch's rendezvous does (no torch here): tests/simulator/
test_simulator_join_block.py joins with torch for real."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.admin.test_fleet import url_of
from tests.support.admin_fixtures import until
from token_proxy.fleet import ADMIN, joins
from token_proxy.simulator import SIM_STATE, params
from token_proxy.simulator.weight_routes import WEIGHTS

JOIN = {"master_address": "127.0.0.1", "master_port": 29534, "rank_offset": 1, "world_size": 2}
CHAT = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4}
TORCH_TIMEOUT = "The client socket has timed out after 1800000ms while trying to connect to (127.0.0.1, 29534)."


class Rendezvous:
    """params.join_group as torch's rendezvous lives it: blocks until `end(joined)`, then joins or times out."""

    def __init__(self):
        self.ended, self.joined = threading.Event(), False

    def __call__(self, *args):
        self.ended.wait(20)
        if not self.joined:
            raise RuntimeError(TORCH_TIMEOUT)
        return object()

    def end(self, joined: bool) -> None:
        self.joined = joined
        self.ended.set()


@pytest.fixture
def rendezvous(monkeypatch):
    monkeypatch.setattr(joins, "JOIN_GRACE_S", 0.3)
    wedge = Rendezvous()
    monkeypatch.setattr(params, "join_group", wedge)
    monkeypatch.setattr(params, "leave_group", lambda group: None)
    yield wedge
    wedge.ended.set()


async def wedged_fleet(make_sim, make_proxy, count: int):
    sims = [await make_sim(health_check_timeout_s=0.5) for _ in range(count)]
    workers = tuple(url_of(s) for s in sims) if count > 1 else ()
    proxy = await make_proxy(sims[0], workers=workers, init_group_timeout_s=0.5)
    started = time.monotonic()
    reply = await proxy.post("/init_weights_update_group", json={**JOIN, "world_size": 1 + count})
    assert reply.status == 504 and time.monotonic() - started < 3
    body = await reply.json()  # one worker: the proxy's error; several: SGLang's shape, per worker
    message = body["error"]["message"] if count == 1 else body["workers"][1]["message"]
    assert "torch's rendezvous for a peer that has not come" in message
    return sims, proxy


async def test_chats_get_a_prompt_503_while_the_only_worker_is_wedged_in_a_join(make_sim, make_proxy, rendezvous):
    [sim], proxy = await wedged_fleet(make_sim, make_proxy, 1)
    started = time.monotonic()
    chat = await proxy.post("/v1/chat/completions", json=CHAT)
    assert (chat.status, chat.headers["Retry-After"]) == (503, "1")
    assert time.monotonic() - started < 1
    assert "inside /init_weights_update_group" in (await chat.json())["error"]["message"]
    info = await (await proxy.get("/weight_info")).json()
    assert [(j["url"], j["group_name"], j["caller_gave_up"]) for j in info["joining"]] == [
        (url_of(sim), "weight_update_group", True)]
    health = await proxy.get("/health")
    assert health.status == 503 and "group 'weight_update_group'" in (await health.json())["error"]["message"]

    rendezvous.end(joined=False)  # torch gives up: SGLang answers 400, its scheduler serves again
    await until(lambda: not proxy.app[ADMIN].joins.open, timeout=5)
    assert (await (await proxy.get("/weight_info")).json())["joining"] == []
    assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 200
    assert (await proxy.get("/health")).status == 200
    assert sim.app[WEIGHTS].groups == {}


async def test_a_join_that_completes_after_its_caller_gave_up_is_destroyed(make_sim, make_proxy, rendezvous):
    [sim], proxy = await wedged_fleet(make_sim, make_proxy, 1)
    rendezvous.end(joined=True)  # the rendezvous completes late: the caller was told it failed
    await until(lambda: not proxy.app[ADMIN].joins.open, timeout=5)
    assert sim.app[WEIGHTS].groups == {}  # destroyed: a new join under the same name is not refused
    assert proxy.app[ADMIN].push.live_groups == set()
    assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 200
    rendezvous.ended.clear()
    rendezvous.joined = True
    threading.Timer(0.1, rendezvous.ended.set).start()
    reply = await proxy.post("/init_weights_update_group", json=JOIN)
    assert (reply.status, proxy.app[ADMIN].push.live_groups) == (200, {"weight_update_group"})


async def test_every_worker_of_a_fleet_wedged_in_the_join_refuses_chats_until_all_answer(
        make_sim, make_proxy, rendezvous):
    sims, proxy = await wedged_fleet(make_sim, make_proxy, 2)
    assert sorted(j["url"] for j in (await (await proxy.get("/weight_info")).json())["joining"]) == sorted(
        url_of(s) for s in sims)
    assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 503
    rendezvous.end(joined=False)
    await until(lambda: not proxy.app[ADMIN].joins.open, timeout=5)
    assert not any(s.app[SIM_STATE].blocked for s in sims)
    assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 200


async def test_a_join_that_completes_in_time_delays_chats_and_refuses_none(make_sim, make_proxy, rendezvous):
    sim = await make_sim()
    proxy = await make_proxy(sim, init_group_timeout_s=5.0)
    threading.Timer(0.2, rendezvous.end, args=(True,)).start()
    join = asyncio.ensure_future(proxy.post("/init_weights_update_group", json=JOIN))
    await asyncio.sleep(0.05)
    chat = await proxy.post("/v1/chat/completions", json=CHAT)  # waits on the blocked scheduler, then served
    assert chat.status == 200
    reply = await join
    assert (reply.status, (await reply.json())["success"]) == (200, True)
    assert list(sim.app[WEIGHTS].groups) == ["weight_update_group"]
    assert (proxy.app[ADMIN].joins.open, proxy.app[ADMIN].push.live_groups) == ({}, {"weight_update_group"})
    assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 200


async def test_a_chat_sent_within_the_grace_of_a_stuck_join_waits_then_later_ones_are_refused(
        make_sim, make_proxy, rendezvous):
    sim = await make_sim()
    proxy = await make_proxy(sim, init_group_timeout_s=5.0)
    join = asyncio.ensure_future(proxy.post("/init_weights_update_group", json=JOIN))
    await until(lambda: bool(proxy.app[ADMIN].joins.open), timeout=5)
    early = asyncio.ensure_future(proxy.post("/v1/chat/completions", json=CHAT))
    await asyncio.sleep(0.5)  # past the grace (0.3 s here)
    assert (await proxy.post("/v1/chat/completions", json=CHAT)).status == 503
    assert not early.done()
    rendezvous.end(joined=False)
    assert ((await join).status, (await asyncio.wait_for(early, 10)).status) == (400, 200)
