"""The trainer-side broadcaster against the simulator, which joins the group and receives for real
(torch.distributed, gloo on CPU), through the proxy."""

from __future__ import annotations

import asyncio
import time

import pytest

torch = pytest.importorskip("torch")

from tests.support.admin_fixtures import free_port, proxy_url, sim_process
from token_proxy.admin.workers import ADMIN
from token_proxy.broadcast import BroadcastError, SGLangBroadcaster
from token_proxy.simulator.params import PARAM_SHAPES


def new_weights(step: int) -> dict:
    """Distinct, exactly representable values per tensor and step (bf16 keeps 8 bits of mantissa)."""
    weights = {}
    for k, (name, shape) in enumerate(PARAM_SHAPES.items()):
        count = torch.Size(shape).numel()
        values = (torch.arange(count, dtype=torch.float32) % 31 - 15) / 8 + step + k
        weights[name] = values.reshape(shape).to(torch.bfloat16)
    return weights


@pytest.fixture(scope="module")
def sim_url(tokenizer_dir):
    """One simulator process for the module (starting one takes a second or two); each test
    leaves no group behind."""
    with sim_process(tokenizer_dir) as url:
        yield url


def caster(proxy, **overrides) -> SGLangBroadcaster:
    options = {"url": proxy_url(proxy), "master_address": "127.0.0.1", "master_port": free_port(),
               "inference_world_size": 1, "backend": "gloo", "timeout_s": 10.0}
    return SGLangBroadcaster(**{**options, **overrides})


async def read_param(proxy, name: str) -> list:
    response = await proxy.post("/get_weights_by_name", json={"name": name, "truncate_size": 1000})
    assert response.status == 200
    return await response.json()


async def test_push_in_buckets_lands_every_value_and_the_version(make_proxy, sim_url):
    proxy = await make_proxy(sim_url)
    broadcaster = caster(proxy, bucket_bytes=600)  # ~3 tensors per bucket -> several buckets
    await asyncio.to_thread(broadcaster.init)
    weights = new_weights(step=3)
    buckets = await asyncio.to_thread(broadcaster.update, weights.items(), "v3")
    assert buckets == 3
    for name, tensor in weights.items():
        assert await read_param(proxy, name) == tensor.float().tolist()
    info = await (await proxy.get("/model_info")).json()
    assert info["weight_version"] == "v3"
    chat = await proxy.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 3})
    choice = (await chat.json())["choices"][0]
    assert choice["weight_versions"] == [{"version": "v3", "start": 0, "end": 3}]
    await asyncio.to_thread(broadcaster.close)
    destroyed = await proxy.post("/destroy_weights_update_group", json={"group_name": "weight_update_group"})
    assert (destroyed.status, (await destroyed.json())["message"]) == (
        400, "The group to be destroyed does not exist.")


async def test_shape_mismatch_is_sglangs_error_and_the_same_group_name_joins_again(make_proxy, sim_url):
    """A failed push leaves no group behind: the proxy destroys it on every worker, so the trainer's next
    init with the same name works (SGLang would refuse a name still registered)."""
    proxy = await make_proxy(sim_url)
    broadcaster = caster(proxy)
    await asyncio.to_thread(broadcaster.init)
    wrong = {"model.layers.0.self_attn.q_proj.weight": torch.ones(4, 4, dtype=torch.bfloat16)}
    with pytest.raises(BroadcastError) as refused:
        await asyncio.to_thread(broadcaster.update, wrong.items(), "bad")
    assert str(refused.value).startswith(
        "update_weights_from_distributed failed (400): /update_weights_from_distributed failed on 1 of 1 worker(s): "
        f"{proxy.app[ADMIN].settings.backend_url}: Failed to update parameter online: Attempted to load weight "
        "(torch.Size([4, 4])) into parameter (torch.Size([8, 8])). The full weights of the ModelRunner are "
        "partially updated. Please discard the whole weights.; the weight-update group 'weight_update_group' was "
        "destroyed on every worker: join again (the same name works) and push again")
    assert proxy.app[ADMIN].live_groups == set()
    await asyncio.to_thread(broadcaster.close, False)  # the trainer's side of the group
    broadcaster = caster(proxy)  # the same group name
    await asyncio.to_thread(broadcaster.init)
    weights = new_weights(step=1)
    assert await asyncio.to_thread(broadcaster.update, weights.items(), "v1") == 1
    assert await read_param(proxy, "model.norm.weight") == weights["model.norm.weight"].float().tolist()
    assert (await (await proxy.get("/model_info")).json())["weight_version"] == "v1"
    await asyncio.to_thread(broadcaster.close)


async def test_a_peer_that_never_joins_is_a_bounded_clear_error(make_proxy, sim_url):
    proxy = await make_proxy(sim_url)
    broadcaster = caster(proxy, timeout_s=1.5)
    started = time.monotonic()
    with pytest.raises(BroadcastError) as late:
        await asyncio.to_thread(broadcaster.init, False)  # nobody asks the engine to join
    assert time.monotonic() - started < 6
    assert str(late.value).startswith(
        f"the inference engine did not join the weight-update group at tcp://127.0.0.1:{broadcaster.master_port}"
        " (world size 2) within 1.5 s")


async def test_the_proxy_refuses_a_bad_group_before_sglang_and_the_trainer_stops_at_once(make_proxy, sim_url):
    proxy = await make_proxy(sim_url)
    broadcaster = caster(proxy, inference_world_size=0)  # world size 1: no room for SGLang's rank
    started = time.monotonic()
    with pytest.raises(BroadcastError) as refused:
        await asyncio.to_thread(broadcaster.init)
    assert time.monotonic() - started < 3
    assert str(refused.value).endswith("(400): world_size must be an integer >= 2, got 1")


async def test_prime_rl_nccl_step_through_init_broadcaster_and_update_weights_null(make_proxy, sim_url):
    """The orchestrator drives the admin plane; the trainer (this broadcaster) joins and pushes."""
    proxy = await make_proxy(sim_url)
    broadcaster = caster(proxy)
    joined = asyncio.create_task(asyncio.to_thread(broadcaster.init, False))
    response = await proxy.post("/init_broadcaster", json={
        "host": "127.0.0.1", "port": broadcaster.master_port, "timeout": 10, "rank_offset": 0,
        "inference_world_size": 1, "backend": "gloo"})
    assert (response.status, await response.json()) == (200, {"status": "ok"})
    await joined
    assert await (await proxy.post("/pause")).json() == {"status": "paused"}
    update = asyncio.create_task(proxy.post("/update_weights", json={"weight_dir": None}))
    await asyncio.sleep(0.05)
    assert not update.done()  # waits for the push
    weights = new_weights(step=5)
    await asyncio.to_thread(broadcaster.update, weights.items(), "5")
    response = await update
    assert (response.status, await response.json()) == (200, {"status": "ok", "weight_version": "5"})
    assert await (await proxy.post("/resume")).json() == {"status": "resumed"}
    assert await read_param(proxy, "lm_head.weight") == weights["lm_head.weight"].float().tolist()
    await asyncio.to_thread(broadcaster.close)
