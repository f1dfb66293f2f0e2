"""The second layout of issue 37 item 4: one proxy per inference node, each the controller of its own node's
SGLang workers (disjoint fleets), and the trainer's own multi-server client fanning the admin calls out to
every proxy, as prime-rl's orchestrator does (tests/support/prime_rl_admin.py follows its
src/prime_rl/utils/client.py). Three proxies, two simulated workers each (k = 2). Disk updates here; the NCCL
group spanning the three proxies is tests/fleet/test_per_node_nccl.py (needs torch)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from tests.admin.test_fleet import inject, state, url_of, weights_dir
from tests.support.admin_fixtures import proxy_url, until
from tests.support.prime_rl_admin import AdminCallFailed, PrimeRLAdmin
from token_proxy.broadcast import BroadcastError, SGLangBroadcaster
from token_proxy.fleet import ADMIN
from token_proxy.simulator import params
from token_proxy.simulator.weight_routes import WEIGHTS

NODES, PER_NODE = 3, 2
CHAT = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 3, "temperature": 0}


@pytest.fixture
async def nodes(make_sim, make_proxy):
    """NODES proxies; proxy i fronts its own PER_NODE simulators (the node's SGLang servers) and nothing else."""
    sims = [[await make_sim(tpot_s=0.001) for _ in range(PER_NODE)] for _ in range(NODES)]
    proxies = [await make_proxy(node[0], workers=tuple(url_of(s) for s in node), fence_interval_s=0.05,
                                admin_timeout_s=5.0, weight_update_timeout_s=5.0) for node in sims]
    async with aiohttp.ClientSession() as session:
        # prime-rl is configured with each server's OpenAI base URL; its admin clients strip the /v1
        yield proxies, sims, PrimeRLAdmin(session, [proxy_url(p) + "/v1" for p in proxies], backoff_s=0.01)


async def chat_versions(proxy) -> tuple[int, list[str]]:
    response = await proxy.post("/v1/chat/completions", json=CHAT)
    body = await response.json()
    if response.status != 200:
        return response.status, []
    return 200, sorted({span["version"] for span in body["choices"][0]["weight_versions"]})


@pytest.fixture
def step_dir(tmp_path):
    """prime-rl's step directory (a safetensors file the simulators accept)."""
    return lambda step: Path(weights_dir(tmp_path, f"step_{step}"))


async def test_each_node_serves_the_new_version_after_one_fanned_out_step(nodes, step_dir):
    proxies, sims, trainer = nodes
    await trainer.update_weights(step_dir(1))
    for proxy, node in zip(proxies, sims):
        info = await (await proxy.get("/weight_info")).json()
        assert (info["weight_version"], info["consistent"], info["fenced"]) == ("1", True, [])
        assert [state(s).weight_version for s in node] == ["1", "1"]
        assert not any(state(s).paused for s in node)  # the finally's /resume reached every node
        assert await chat_versions(proxy) == (200, ["1"])
        assert proxy.app[ADMIN].stood_down is None  # disjoint fleets: no proxy sees another's update


async def test_a_failed_update_on_one_node_holds_that_node_and_reaches_the_trainer(nodes, step_dir):
    """Node 1's first worker takes the update and then refuses the rollback, its second refuses the update:
    that proxy holds its workers paused (held_paused) and answers 400, then 409 to the finally's /resume.
    prime-rl's gather raises that (the trainer sees the failure, naming the node); the other two nodes
    are on the new version and serving. Node 1 answers chats with a prompt 503 until an update succeeds."""
    proxies, sims, trainer = nodes
    await trainer.update_weights(step_dir(1))
    inject(sims[1][0], {"kind": "pass"}, {"kind": "fail", "message": "Failed to load: out of memory."})
    inject(sims[1][1], {"kind": "fail", "message": "Failed to get weights iterator: disk full."})
    with pytest.raises(AdminCallFailed) as failed:
        await trainer.update_weights(step_dir(2))
    held = proxy_url(proxies[1])
    # The finally's /resume, refused by the held node, is what propagates (Python: an exception raised in a
    # finally replaces the one in flight); the update's own 400 is its context.
    assert (failed.value.url, failed.value.status) == (held + "/resume", 409)
    assert "held paused" in failed.value.body or "failed weight update" in failed.value.body
    update = failed.value.__context__
    assert isinstance(update, AdminCallFailed)
    assert (update.url, update.status) == (held + "/update_weights", 400) and '"held_paused"' in update.body
    for i in (0, 2):  # the healthy nodes: updated, and resumed by the same gather
        await until(lambda i=i: not any(state(s).paused for s in sims[i]), timeout=5)
        assert [state(s).weight_version for s in sims[i]] == ["2", "2"]
        assert await chat_versions(proxies[i]) == (200, ["2"])
    info = await (await proxies[1].get("/weight_info")).json()
    assert info["consistent"] is False and info["weight_version"] is None and info["held"]
    assert [state(s).weight_version for s in sims[1]] == ["2", "1"] and all(state(s).paused for s in sims[1])
    # a prompt refusal, not a wait on its paused workers (before set_hold, the record kept no hold: it hung)
    refused = await asyncio.wait_for(proxies[1].post("/v1/chat/completions", json=CHAT), 5)
    assert refused.status == 503 and refused.headers.get("Retry-After")

    await trainer.update_weights(step_dir(3))  # the next step brings node 1 back with the others
    for proxy, node in zip(proxies, sims):
        assert [state(s).weight_version for s in node] == ["3", "3"]
        assert await chat_versions(proxy) == (200, ["3"])


async def test_the_orchestrators_rank_offsets_give_every_worker_its_own_rank(nodes, monkeypatch):
    """init_nccl_broadcast: node i gets rank_offset i * k of an inference world of 3k; its proxy gives its
    workers SGLang's rank_offset 1 + i * k + j in a world of 1 + 3k (the trainer is rank 0). The join itself
    is recorded, not run (no torch here): tests/fleet/test_per_node_nccl.py runs it on gloo."""
    _, sims, trainer = nodes

    def join(address, port, rank, world_size, group_name, backend, timeout_s):
        return {"port": port, "rank": rank, "world_size": world_size, "backend": backend}

    monkeypatch.setattr(params, "join_group", join)
    statuses = await trainer.init_nccl_broadcast("127.0.0.1", 29501, 5, inference_world_size=NODES * PER_NODE)
    assert statuses == [200] * NODES
    groups = [[s.app[WEIGHTS].groups["weight_update_group"] for s in node] for node in sims]
    assert groups == [[{"port": 29501, "rank": 1 + i * PER_NODE + j, "world_size": 1 + NODES * PER_NODE,
                        "backend": "nccl"} for j in range(PER_NODE)] for i in range(NODES)]


async def test_a_world_too_small_for_a_node_is_that_proxys_400(nodes, monkeypatch):
    """inference_world_size 3 over 3 servers is 1 rank each, but every node has 2 workers: node 2's second
    worker (rank 4) does not fit a world of 4, so its proxy refuses before any worker joins; prime-rl
    swallows the status (only its trainer's join would time out), so the proxy's refusal is the signal."""
    _, sims, trainer = nodes
    monkeypatch.setattr(params, "join_group", lambda *args: object())
    statuses = await trainer.init_nccl_broadcast("127.0.0.1", 29502, 5, inference_world_size=NODES)
    assert statuses == [200, 200, 400]
    assert "weight_update_group" not in sims[2][0].app[WEIGHTS].groups


def test_rank_offsets_follow_prime_rls_rule_and_refuse_an_uneven_world():
    trainer = SGLangBroadcaster(url=["http://a", "http://b", "http://c"], master_address="127.0.0.1",
                                master_port=1, inference_world_size=6)
    assert trainer._rank_offsets() == [1, 3, 5]
    assert SGLangBroadcaster(url="http://a", master_address="h", master_port=1, inference_world_size=4
                             )._rank_offsets() == [1]
    uneven = SGLangBroadcaster(url=["http://a", "http://b"], master_address="h", master_port=1,
                               inference_world_size=3)
    with pytest.raises(BroadcastError, match="inference_world_size 3 is not a multiple of the 2 servers"):
        uneven._rank_offsets()
