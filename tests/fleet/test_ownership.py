"""One owner for the fleet's weights (issue 37 items 1-2): two would-be controllers stop fighting, a
follower forwards and mirrors, the start rule never relabels, and a chat with no healthy worker is a
prompt 503."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from tests.admin.conftest import fake_group  # noqa: F401 (the simulators' stand-in group)
from tests.admin.test_fleet import state, url_of, weights_dir
from tests.admin.test_push_failure import INIT, push
from tests.support.admin_fixtures import until
from token_proxy.fleet import ADMIN, FENCE
from token_proxy.fleet.start import start_state
from token_proxy.simulator.weight_routes import WEIGHTS

CHAT = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2, "temperature": 0}


@pytest.fixture
async def two(make_sim, make_proxy):
    sims = [await make_sim(tpot_s=0.001) for _ in range(2)]

    async def proxy(**overrides):
        overrides.setdefault("fence_interval_s", 0.05)
        overrides.setdefault("admin_timeout_s", 5.0)
        overrides.setdefault("weight_update_timeout_s", 5.0)
        return await make_proxy(sims[0], workers=tuple(url_of(s) for s in sims), **overrides)

    return proxy, sims


async def test_two_controllers_on_one_fleet_never_take_turns(two, tmp_path, caplog):
    """Finding 1: X updates to version 1; Y (started the same way) used to heal it back to "default", X back
    to 1, forever (20 version changes in 8 s). Now Y, seeing a version it never set appear a second time,
    stands down with one line naming --fleet-controller, and the workers stay on 1."""
    make, sims = two
    x, y = await make(), await make()
    await asyncio.sleep(0.2)
    response = await x.post("/update_weights", json={"weight_dir": weights_dir(tmp_path, "step_1")})
    assert response.status == 200, await response.text()
    await until(lambda: y.app[ADMIN].stood_down is not None, timeout=5)
    await asyncio.sleep(0.5)
    seen = []
    for _ in range(30):
        seen.append(tuple(state(s).weight_version for s in sims))
        await asyncio.sleep(0.05)
    assert set(seen) == {("1", "1")}  # the update stands, and nothing moves any more
    assert x.app[ADMIN].stood_down is None
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and "--fleet-controller" in
             r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("another process updates these workers' weights")
    # At most one undo each (Y healed the first foreign version it saw; X healed that back; Y saw version 1
    # again and stood down), where d6350dc went on for good (61 fenced events on each proxy in two minutes).
    assert x.app[FENCE].events["fenced"] <= 2 and y.app[FENCE].events["fenced"] <= 2
    # Y refuses to change the weights, naming the fix; its chats still answer, on the fleet's weights.
    refused = await y.post("/update_weights", json={"weight_dir": weights_dir(tmp_path, "step_2")})
    body = await refused.json()
    assert refused.status == 409 and "--fleet-controller" in body["error"]["message"]
    reply = await y.post("/v1/chat/completions", json=CHAT)
    assert reply.status == 200, await reply.text()


async def test_a_follower_forwards_to_its_controller_and_never_fences(two, tmp_path):
    make, sims = two
    controller = await make()
    controller_url = str(controller.make_url("")).rstrip("/")
    follower = await make(fleet_controller=controller_url)
    assert FENCE not in follower.app
    response = await follower.post("/update_weights", json={"weight_dir": weights_dir(tmp_path, "step_4")})
    assert (response.status, await response.json()) == (200, {"status": "ok", "weight_version": "4"})
    assert controller.app[ADMIN].weights.version == "4"  # the controller ran the transaction
    await until(lambda: follower.app[ADMIN].board.record.current == "4", timeout=5)
    reply = await follower.post("/v1/chat/completions", json=CHAT)
    assert reply.status == 200
    versions = {v["version"] for v in (await reply.json())["choices"][0]["weight_versions"]}
    assert versions == {"4"}
    # A worker reset behind both proxies' backs: the controller fences and heals it; the follower does nothing.
    state(sims[1]).weight_version = "default"
    await until(lambda: controller.app[FENCE].events["healed"] == 1, timeout=5)
    assert state(sims[1]).weight_version == "4"


def test_the_start_rule_never_relabels():
    """Finding 2: A holds vllm-2 (an NCCL push over the start-up path), B the start-up weights."""
    disagree = start_state([("a", "base", "vllm-2"), ("b", "base", "default")])
    assert (disagree.version, disagree.checkpoint) == ("vllm-2", None)  # a tie: the first worker's; no checkpoint
    assert disagree.seen == {"vllm-2", "default"} and "b ('default' from base)" in disagree.note
    majority = start_state([("a", "base", "default"), ("b", "base", "vllm-2"), ("c", "base", "default")])
    assert (majority.version, majority.checkpoint) == ("default", None)
    agree = start_state([("a", "/ckpt/7", "7"), ("b", "/ckpt/7", "7")])
    assert (agree.version, agree.checkpoint, agree.note) == ("7", "/ckpt/7", None)


async def test_a_proxy_started_over_disagreeing_workers_never_labels_the_start_weights_with_a_pushed_version(
        two, make_sim):
    """Finding 2 end to end: A got vllm-2 over NCCL (its tensors changed, its model_path is still the
    start-up one); B restarted on "default". The new proxy takes vllm-2 (the first worker's, a tie) and keeps
    B fenced and unlabelled: no checkpoint is known to hold vllm-2."""
    make, (a, b) = two
    state(a).weight_version = "vllm-2"
    a.app[WEIGHTS].values = {name: [[9.0]] for name in a.app[WEIGHTS].values}  # what the push left
    proxy = await make()
    plane = proxy.app[ADMIN]
    assert (plane.weights.version, plane.weights.loaded_path) == ("vllm-2", None)
    await until(lambda: url_of(b) in proxy.app[FENCE].fenced, timeout=5)
    await asyncio.sleep(0.5)
    assert state(b).weight_version == "default"  # never relabelled
    assert proxy.app[FENCE].fenced[url_of(b)].held


async def test_the_checkpoint_read_at_start_is_proven_before_it_labels_a_heal(two):
    """Every worker agreed at start on (the start-up path, vllm-3), but vllm-3 came over NCCL: a restarted
    worker loaded from that path does not match a healthy worker's checksum, so it is never labelled vllm-3."""
    make, (a, b) = two
    for sim in (a, b):
        state(sim).weight_version = "vllm-3"
        sim.app[WEIGHTS].values = {name: [[9.0]] for name in sim.app[WEIGHTS].values}
    proxy = await make()
    assert proxy.app[ADMIN].weights.loaded_path is not None and not proxy.app[ADMIN].weights.checkpoint_proven
    state(b).weight_version = "default"  # reset behind the proxy's back (the start-up weights)
    b.app[WEIGHTS].values = {name: [[0.0]] for name in b.app[WEIGHTS].values}
    await until(lambda: url_of(b) in proxy.app[FENCE].fenced and proxy.app[FENCE].fenced[url_of(b)].held, timeout=5)
    assert state(b).weight_version.startswith("vllm-3?unproven:")  # an honest label, never vllm-3
    assert proxy.app[ADMIN].weights.loaded_path is None  # the start pair is disproved: never used to label again


async def test_no_healthy_worker_is_a_prompt_503(two):
    make, (a, _) = two
    proxy = await make(fence_interval_s=0.05)
    proxy.app[ADMIN].weights.loaded_path = None  # NCCL weights: a fenced worker waits for the next update
    state(a).weight_version = "default2"
    proxy.app[ADMIN].weights.known_versions.add("default2")  # a drift, not another controller
    await until(lambda: url_of(a) in proxy.app[FENCE].fenced, timeout=5)
    started = time.monotonic()
    reply = await proxy.post("/v1/chat/completions", json=CHAT)
    assert (reply.status, reply.headers.get("Retry-After")) == (503, "1")
    assert time.monotonic() - started < 1.0
    assert "no healthy SGLang worker" in (await reply.json())["error"]["message"]


@pytest.mark.usefixtures("fake_group")
async def test_finding_3_no_worker_is_left_paused_by_a_controller_that_lost_the_fleet(two, tmp_path):
    """Finding 3's sequence: X pushed vllm-2 over NCCL (no checkpoint holds it); both workers are reset behind
    its back, so X fences and holds them; Y, started next, runs a disk update to 7. X used to pause both
    workers once a second for good (its hold loop: aborted rollouts, worker A producing nothing) while Y's
    /weight_info said `consistent: true, fenced: []`. Now X finds version 7, which it never set, stands down
    and lets the workers go: none stays paused, and chats through Y answer on 7."""
    make, sims = two
    x = await make()
    assert (await x.post("/init_broadcaster", json=INIT)).status == 200
    assert [status for status, _ in await push(x, "vllm-2")] == [200, 200, 200]
    assert x.app[ADMIN].weights.loaded_path is None
    for sim in sims:  # reset behind X's back, straight on SGLang
        state(sim).weight_version, state(sim).paused = "default", False
    await until(lambda: len(x.app[FENCE].fenced) == 2 and all(e.held for e in x.app[FENCE].fenced.values()), 5)
    y = await make()
    response = await y.post("/update_weights", json={"weight_dir": weights_dir(tmp_path, "step_7")})
    assert response.status == 200, await response.text()
    await until(lambda: x.app[ADMIN].stood_down is not None, timeout=5)
    await asyncio.sleep(1.5)  # X's old hold loop paused every second
    assert [(state(s).weight_version, state(s).paused) for s in sims] == [("7", False), ("7", False)]
    info = await (await y.get("/weight_info")).json()
    assert (info["consistent"], info["fenced"]) == (True, [])
    for _ in range(4):
        reply = await y.post("/v1/chat/completions", json=CHAT)
        assert reply.status == 200, await reply.text()
