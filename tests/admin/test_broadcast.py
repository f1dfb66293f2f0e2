"""The trainer-side broadcaster against the simulator, which joins the group and receives for real
(torch.distributed, gloo on CPU), through the proxy."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import aiohttp
import pytest
from aiohttp import web

torch = pytest.importorskip("torch")

from tests.support.admin_fixtures import free_port, proxy_url, sim_process, until
from token_proxy.admin import ADMIN
from token_proxy.broadcast import BroadcastError, SGLangBroadcaster, nccl_env
from token_proxy.broadcast import broadcaster as broadcaster_module
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
    assert proxy.app[ADMIN].push.live_groups == set()
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


# NCCL's setting and bounded, cleaned-up failures (issue 28). These run on CPU with gloo: they prove the
# broadcaster's bounding and clean-up logic (which thread waits, what is cancelled and aborted, that the
# group name is free again), not NCCL itself; tests/e2e/test_live_weights.py runs the NCCL path on GPUs.

CUMEM_TOO_LATE = (
    "NCCL is already in use in this process (torch.distributed group(s) default on nccl) without "
    "NCCL_CUMEM_ENABLE=0, which SGLang needs and NCCL reads only once: start the trainer with "
    "NCCL_CUMEM_ENABLE=0 in its environment (as SGLang runs), e.g. `NCCL_CUMEM_ENABLE=0 torchrun ...`")
PARTIAL = ("Failed to update parameter online: NCCL error in: transport/p2p.cc. The full weights of the "
           "ModelRunner are partially updated. Please discard the whole weights.")


def recording_join(monkeypatch) -> list:
    """join_group replaced by one that records NCCL_CUMEM_ENABLE as NCCL would first read it, then fails
    (CPU torch has no NCCL to join with)."""
    seen = []

    def join(*args):
        seen.append(os.environ.get("NCCL_CUMEM_ENABLE"))
        raise RuntimeError("no NCCL on this host")

    monkeypatch.setattr(broadcaster_module, "join_group", join)
    return seen


def test_nccl_cumem_is_set_to_sglangs_value_before_the_group_is_created(monkeypatch):
    """On CPU (gloo): join_group is a recorder; what is proved is the order, env first, then the group."""
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    seen = recording_join(monkeypatch)
    broadcaster = SGLangBroadcaster(url="http://127.0.0.1:9", master_address="127.0.0.1", master_port=free_port(),
                                    backend="nccl", timeout_s=5.0)
    with pytest.raises(BroadcastError, match="no NCCL on this host"):
        broadcaster.init(announce=False)
    assert seen == ["0"]
    assert os.environ["NCCL_CUMEM_ENABLE"] == "0"


@pytest.mark.parametrize(("preset", "in_use", "message"), [
    (None, ["default"], CUMEM_TOO_LATE),
    ("1", [], ("NCCL_CUMEM_ENABLE=1 is set, but SGLang runs with NCCL_CUMEM_ENABLE=0 and NCCL cannot connect "
              "the two (transport/p2p.cc): unset it or set NCCL_CUMEM_ENABLE=0")),
])
def test_nccl_started_another_way_is_one_line_naming_the_setting(monkeypatch, preset, in_use, message):
    """On CPU: torch.distributed's NCCL groups are simulated by a monkeypatched detector (CPU torch has no
    NCCL); nothing is joined and the environment is left as it was."""
    if preset is None:
        monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    else:
        monkeypatch.setenv("NCCL_CUMEM_ENABLE", preset)
    monkeypatch.setattr(nccl_env, "nccl_groups", lambda: in_use)
    seen = recording_join(monkeypatch)
    broadcaster = SGLangBroadcaster(url="http://127.0.0.1:9", master_address="127.0.0.1", master_port=free_port())
    with pytest.raises(BroadcastError) as refused:
        broadcaster.init()
    assert str(refused.value) == message
    assert "\n" not in message
    assert seen == []
    assert os.environ.get("NCCL_CUMEM_ENABLE") == preset


def test_the_detector_sees_no_nccl_in_a_process_without_it():
    assert nccl_env.nccl_groups() == []


class Front:
    """An HTTP server in front of the simulator: joins and leaves go through, and each push is answered
    as `mode` says: "forward" (the simulator receives), "refuse" (400 at once, nothing received: SGLang's
    reply when its NCCL transport failed), "drop" (the connection closes: the server died) or "hang"
    (never answered: the server stopped)."""

    def __init__(self, sim_url: str):
        self.sim_url, self.mode, self.seen = sim_url, "forward", []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/{path}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.match_info["path"]
        self.seen.append(path)
        if path == "update_weights_from_distributed" and self.mode != "forward":
            if self.mode == "refuse":
                return web.json_response({"success": False, "message": PARTIAL}, status=400)
            if self.mode == "drop":
                request.transport.close()
                return web.Response()
            await asyncio.Event().wait()
        async with aiohttp.ClientSession() as session, session.post(
                f"{self.sim_url}/{path}", data=await request.read(),
                headers={"Content-Type": "application/json"}) as reply:
            return web.Response(body=await reply.read(), status=reply.status, content_type="application/json")


@pytest.fixture
async def front(aiohttp_server, sim_url):
    front = Front(sim_url)
    front.url = proxy_url(await aiohttp_server(front.app()))
    return front


def group_names() -> list:
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_names.values())


async def joined(front: Front, timeout_s: float) -> SGLangBroadcaster:
    """A broadcaster in the group with the simulator, whose pushes are bounded by `timeout_s` (the join
    may take longer: the simulator imports torch at its first one)."""
    broadcaster = SGLangBroadcaster(url=front.url, master_address="127.0.0.1", master_port=free_port(),
                                    backend="gloo", timeout_s=30.0)
    await asyncio.to_thread(broadcaster.init)
    broadcaster.timeout_s = timeout_s
    return broadcaster


async def retry_lands(front: Front, broadcaster: SGLangBroadcaster, sim_url: str) -> None:
    """The group is gone on both sides: init again with the same name (and port) and a push lands."""
    assert broadcaster.group_name not in group_names()
    front.mode, broadcaster.timeout_s = "forward", 30.0
    await asyncio.to_thread(broadcaster.init)
    weights = new_weights(step=7)
    assert await asyncio.to_thread(broadcaster.update, weights.items(), "v7") == 1
    async with aiohttp.ClientSession() as session, session.post(
            f"{sim_url}/get_weights_by_name", json={"name": "lm_head.weight", "truncate_size": 1000}) as reply:
        assert await reply.json() == weights["lm_head.weight"].float().tolist()
    await asyncio.to_thread(broadcaster.close)


@pytest.mark.parametrize(("mode", "reason"), [
    ("refuse", f"update_weights_from_distributed failed (400): {PARTIAL}"),
    ("drop", ("update_weights_from_distributed failed (0): {url}/update_weights_from_distributed is unreachable: "
             "Remote end closed connection without response")),
])
async def test_a_refusing_or_dying_server_ends_the_push_at_once_and_leaves_no_group(front, sim_url, mode, reason):
    """On CPU with gloo: the trainer's broadcast is still waiting for a receiver that will never come when
    the answer arrives; it is aborted, SGLang is asked to leave the group, and the same name works again."""
    broadcaster = await joined(front, timeout_s=5.0)
    front.mode = mode
    started = time.monotonic()
    with pytest.raises(BroadcastError) as failed:
        await asyncio.to_thread(broadcaster.update, new_weights(step=2).items(), "v2")
    assert time.monotonic() - started < 2.5  # the answer, not timeout_s, ends it
    assert broadcaster.group_name not in group_names()
    assert str(failed.value) == reason.format(url=front.url)
    await retry_lands(front, broadcaster, sim_url)
    assert front.seen == ["init_weights_update_group", "update_weights_from_distributed",
                          "destroy_weights_update_group", "init_weights_update_group",
                          "update_weights_from_distributed", "destroy_weights_update_group"]


async def test_a_server_that_stops_answering_mid_push_is_a_broadcast_error_within_timeout_s(front, sim_url):
    """On CPU with gloo: neither the broadcast nor the HTTP call ever finishes; at timeout_s the call is
    cancelled (its thread ends) and the group aborted, and the same name works again."""
    broadcaster = await joined(front, timeout_s=2.0)
    front.mode = "hang"
    started = time.monotonic()
    with pytest.raises(BroadcastError) as late:
        await asyncio.to_thread(broadcaster.update, new_weights(step=2).items(), "v2")
    assert 2.0 <= time.monotonic() - started < 2.0 + 1.5
    assert str(late.value) == "the broadcast of 5 tensor(s) did not complete within 2 s"
    await until(lambda: not any(t.name == "broadcaster-http" for t in threading.enumerate()))
    await retry_lands(front, broadcaster, sim_url)


async def test_a_collective_that_blocks_its_caller_cannot_hang_the_push(front, sim_url, monkeypatch):
    """NCCL starts its communicator inside the first broadcast, and that call blocks until every rank has
    connected: when SGLang's side failed there (issue 28: transport/p2p.cc, then a 400), it blocks for good.
    On CPU with gloo, a broadcast that blocks like that is simulated; the refusal must still end the push
    at once (on the old code it hung until the blocked call returned), and a new group cannot take the
    stuck one's port until it ends."""
    import torch.distributed as dist

    broadcaster = await joined(front, timeout_s=5.0)
    released = threading.Event()
    threading.Timer(15, released.set).start()  # so that the old code fails instead of hanging

    def blocked(*args, **kwargs):
        released.wait()
        raise RuntimeError("NCCL communicator was aborted")

    monkeypatch.setattr(dist, "broadcast", blocked)
    front.mode = "refuse"
    started = time.monotonic()
    with pytest.raises(BroadcastError) as refused:
        await asyncio.to_thread(broadcaster.update, new_weights(step=2).items(), "v2")
    assert time.monotonic() - started < 2.5
    assert str(refused.value) == f"update_weights_from_distributed failed (400): {PARTIAL}"
    with pytest.raises(BroadcastError) as held:  # torch would hand the stuck group's store to a new one
        await asyncio.to_thread(broadcaster.init)
    assert str(held.value) == (
        f"the aborted push's broadcast is still blocked in NCCL and holds the rendezvous at port "
        f"{broadcaster.master_port}: init() with another master_port, or restart the trainer")
    released.set()
    await until(lambda: not any(t.name == "broadcaster-broadcast" for t in threading.enumerate()))
    monkeypatch.undo()
    await retry_lands(front, broadcaster, sim_url)
