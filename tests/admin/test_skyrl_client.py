"""SkyRL's remote inference client against the proxy: the control-plane calls it makes to vLLM servers.

Source: PyPI `skyrl` 0.3.0, skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py,
class RemoteInferenceClient. Its control plane is `_call_server` (session.request(method, url, json=json,
params=params); body = resp.json() if resp.content_length; raise_for_status reads body["error"]["message"])
fanned out over server_urls by `_call_all_servers`. Here server_urls is the proxy alone: one URL stands for
every worker. The first test replays those calls verbatim (always runs); the second drives the client module
itself, unmodified, when it is importable (`pip install --no-deps --target DIR skyrl==0.3.0`, then
SKYRL_PATH=DIR): only skyrl/backends/__init__.py needs pydantic, so the package __init__s are bypassed.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
import types
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests.support.admin_fixtures import proxy_url
from tests.support.lora_fixtures import write_adapter
from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.weight_routes import WEIGHTS

META = {"names": ["model.norm.weight"], "dtype_names": ["bfloat16"], "shapes": [[8]]}


@pytest.fixture
async def skyrl_fleet(make_sim, make_proxy):
    sims = [await make_sim(enable_memory_saver=True, enable_weights_cpu_backup=True) for _ in range(2)]
    urls = tuple(str(s.make_url("")).rstrip("/") for s in sims)
    proxy = await make_proxy(sims[0], workers=urls, admin_timeout_s=5.0)
    return proxy, sims


async def call_server(session, server_url, endpoint, json=None, method="POST", params=None):
    """RemoteInferenceClient._call_server, verbatim but for its error type."""
    async with session.request(method, f"{server_url}{endpoint}", json=json, params=params) as resp:
        body = await resp.json() if resp.content_length else None
        return resp.status, body


async def rollout(session, url) -> tuple[list[int], list[int]]:
    """A greedy chat through the proxy: its prompt ids and output ids (bounded: a fleet left asleep holds it)."""
    body = {"messages": [{"role": "user", "content": "Count slowly."}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    async with session.post(f"{url}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=10)) as r:
        reply = await r.json()
        assert r.status == 200, reply
    assert reply["choices"][0]["finish_reason"] == "length"
    return reply["prompt_token_ids"], reply["choices"][0]["token_ids"]


async def worker_greedy(session, sim, prompt_ids: list[int]) -> list[int]:
    """What the worker itself generates from these ids with the weights it holds now."""
    body = {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    async with session.post(str(sim.make_url("/generate")), json=body) as r:
        return (await r.json())["output_ids"]


async def served_with_the_pushed_weights(session, url, sims, before: list[int]) -> None:
    """Awake and serving: the ids are exactly the worker's own with the weights pushed between the wakes."""
    prompt_ids, after = await rollout(session, url)
    assert after == await worker_greedy(session, sims[0], prompt_ids)
    assert after != before and len(after) == 6


async def test_skyrl_control_plane_calls_replayed_verbatim(skyrl_fleet, fake_group):
    proxy, sims = skyrl_fleet
    url = proxy_url(proxy)
    async with aiohttp.ClientSession() as session:
        # pause(): params {"mode": mode.value, "clear_cache": str(clear_cache).lower()}, default KEEP, False
        assert await call_server(session, url, "/pause", params={"mode": "keep", "clear_cache": "false"}) == (
            200, {"status": "paused"})
        assert all(s.app[SIM_STATE].paused for s in sims)
        # resume(): no body
        assert await call_server(session, url, "/resume") == (200, {"status": "resumed"})
        # get_world_size(): GET with json {}
        assert await call_server(session, url, "/get_world_size", {}, method="GET") == (200, {"world_size": 2})
        # init_weight_update_communicator(): {"init_info": BroadcastInitInfo.to_api_payload()} per server
        init = {"master_address": "127.0.0.1", "master_port": 29533, "rank_offset": 1, "world_size": 3}
        assert await call_server(session, url, "/init_weight_transfer_engine", {"init_info": init}) == (
            200, {"message": "Weight transfer initialized"})
        _, before = await rollout(session, url)
        # sleep(level=1) (skyrl_train_backend.py with LoRA; the trainer's default is 2): params {"level": "1"}
        assert await call_server(session, url, "/sleep", params={"level": "1"}) == (
            200, {"status": "sleeping", "level": 1})
        # worker_dispatch.py save_weights_for_sampler(): wake_up(tags=["weights"]) -> broadcast_strategy.py's
        # start_weight_update / update_weights_nccl / finish_weight_update -> wake_up(tags=["kv_cache"])
        assert await call_server(session, url, "/wake_up", params={"tags": ["weights"]}) == (
            200, {"status": "sleeping", "tags": ["weights"]})
        assert await call_server(session, url, "/is_sleeping", method="GET") == (200, {"is_sleeping": True})
        rpc = {"method": "skyrl_start_weight_update", "kwargs": {"is_checkpoint_format": True}}
        assert await call_server(session, url, "/collective_rpc", rpc) == (200, {"results": [None, None]})
        nccl = {"method": "update_weights_nccl", "kwargs": {"update_info": META}}
        assert await call_server(session, url, "/collective_rpc", nccl) == (200, {"results": [None, None]})
        assert await call_server(session, url, "/collective_rpc", {"method": "skyrl_finish_weight_update"}) == (
            200, {"results": [None, None]})
        assert await call_server(session, url, "/wake_up", params={"tags": ["kv_cache"]}) == (
            200, {"status": "awake", "tags": ["kv_cache"]})
        assert await call_server(session, url, "/is_sleeping", method="GET") == (200, {"is_sleeping": False})
        assert all(not s.app[WEIGHTS].released and not s.app[SIM_STATE].paused for s in sims)
        await served_with_the_pushed_weights(session, url, sims, before)
        # reset_prefix_cache(): the flag goes in a JSON body, which vLLM (and the proxy) ignore
        assert await call_server(session, url, "/reset_prefix_cache", {"reset_running_requests": False}) == (
            200, {"success": True})
        # update_named_weights(): {"update_info": update_info}
        assert await call_server(session, url, "/update_weights", {"update_info": META}) == (
            200, {"message": "Weights updated"})
        # broadcast_strategy.py sends {**weight_metadata, "packed": True}: SGLang cannot
        packed = {"method": "update_weights_nccl", "kwargs": {"update_info": {**META, "packed": True}}}
        status, body = await call_server(session, url, "/collective_rpc", packed)
        assert status == 501 and "packed buffers" in body["error"]["message"]
    assert [[u["names"] for u in s.app[WEIGHTS].updates] for s in sims] == [[META["names"]] * 2] * 2


async def load_on_server(session, server_url, lora_name, lora_path):
    """RemoteInferenceClient.load_lora_adapter's _load_on_server, verbatim but for its error type (it reads
    the text of a success; the proxy's is vLLM's JSON, checked here)."""
    url = f"{server_url}/skyrl/v1/load_lora_adapter"
    payload = {"lora_name": lora_name, "lora_path": lora_path}
    async with session.post(url, json=payload) as resp:
        return resp.status, await resp.json()


async def chat_as(session, url, model) -> tuple[int, dict]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.json()


def held_paths(sims) -> list[set[str]]:
    """The adapter paths each worker holds."""
    return [set(s.app[SIM_STATE].lora.loaded.values()) for s in sims]


async def test_skyrl_lora_calls_replayed_verbatim(skyrl_fleet, tmp_path):
    """SkyRL's own LoRA route (issue 39): load, reload in place keeping lora_int_id, a second name, its
    unload through vLLM's /v1/unload_lora_adapter, and finish_session, as RemoteInferenceClient sends them."""
    proxy, sims = skyrl_fleet
    url = proxy_url(proxy)
    step_1, step_2 = str(write_adapter(tmp_path, "step_1")), str(write_adapter(tmp_path, "step_2"))
    async with aiohttp.ClientSession() as session:
        assert await load_on_server(session, url, "policy", step_1) == (
            200, {"status": "ok", "lora_name": "policy", "lora_int_id": 1})
        assert held_paths(sims) == [{step_1}] * 2
        status, reply = await chat_as(session, url, "policy")
        assert (status, reply["model"]) == (200, "policy")
        # update_lora_from_disk every step: the same name, new weights, the same id
        assert await load_on_server(session, url, "policy", step_2) == (
            200, {"status": "ok", "lora_name": "policy", "lora_int_id": 1})
        await asyncio.sleep(0.1)  # the replaced adapter is unloaded once idle (not awaited by the reply)
        assert held_paths(sims) == [{step_2}] * 2
        assert await load_on_server(session, url, "critic", step_1) == (
            200, {"status": "ok", "lora_name": "critic", "lora_int_id": 2})
        status, body = await load_on_server(session, url, "policy", "")
        assert status == 400 and body["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
        assert body["error"]["param"] == "lora_path"
        # unload_lora_adapter(): vLLM's /v1/unload_lora_adapter, plain text on success
        async with session.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "policy"}) as resp:
            assert (resp.status, await resp.text()) == (200, "Success: LoRA adapter 'policy' removed successfully.")
        status, reply = await chat_as(session, url, "policy")
        assert (status, reply["error"]["param"]) == (404, "model")
        assert await load_on_server(session, url, "policy", step_1) == (
            200, {"status": "ok", "lora_name": "policy", "lora_int_id": 3})  # unloaded: a new id, as vLLM
        # finish_session(): query param, body drained; an unknown id is a no-op
        async with session.post(f"{url}/finish_session", params={"session_id": "traj-1"}) as resp:
            assert (resp.status, await resp.json()) == (200, {"session_id": "traj-1", "finished": False})


def load_skyrl_client():
    """remote_inference_client.py as shipped, with the package __init__s (pydantic, torch) skipped."""
    root = os.environ.get("SKYRL_PATH")
    if not root or not (Path(root) / "skyrl").is_dir():
        pytest.skip("SkyRL is not installed here (pip install --no-deps --target DIR skyrl==0.3.0; SKYRL_PATH=DIR)")
    sys.path.insert(0, root)
    for name in ("skyrl", "skyrl.backends", "skyrl.backends.skyrl_train",
                 "skyrl.backends.skyrl_train.inference_servers"):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(Path(root, *name.split(".")))]
            sys.modules[name] = package
    return importlib.import_module("skyrl.backends.skyrl_train.inference_servers.remote_inference_client")


@dataclass
class InitInfo:
    """BroadcastInitInfo's for_servers / to_api_payload (weight_sync/broadcast_strategy.py imports torch)."""

    master_addr: str
    master_port: int
    rank_offset: int
    world_size: int

    def for_servers(self, world_size_per_server, num_servers, dp_size=1):
        out, offset = [], self.rank_offset
        for i in range(num_servers):
            out.append(replace(self, rank_offset=offset))
            if (i + 1) % dp_size == 0:
                offset += world_size_per_server
        return out

    def to_api_payload(self):
        return {"master_address": self.master_addr, "master_port": self.master_port,
                "rank_offset": self.rank_offset, "world_size": self.world_size}


async def test_skyrl_remote_inference_client_unmodified(skyrl_fleet, fake_group, tmp_path, caplog):
    module = load_skyrl_client()
    proxy, sims = skyrl_fleet
    url = proxy_url(proxy)
    client = module.RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1)
    try:
        assert await client.pause() == {url: {"status": 200, "body": {"status": "paused"}}}
        assert await client.resume() == {url: {"status": 200, "body": {"status": "resumed"}}}
        assert await client.get_world_size() == (2, 2)
        init = InitInfo("127.0.0.1", 29534, 1, 3)
        assert (await client.init_weight_update_communicator(init))[url]["body"] == {
            "message": "Weight transfer initialized"}
        assert [j["rank"] for j in fake_group] == [1, 2]
        async with aiohttp.ClientSession() as session:
            _, before = await rollout(session, url)
            assert await client.sleep() == {url: {"status": 200, "body": {"status": "sleeping", "level": 2}}}
            # worker_dispatch.py save_weights_for_sampler(), colocated: weights, the broadcast, kv_cache
            assert (await client.wake_up(tags=["weights"]))[url]["body"] == {"status": "sleeping",
                                                                            "tags": ["weights"]}
            assert (await client.start_weight_update())[url]["body"] == {"results": [None, None]}
            assert (await client.update_weights_nccl(META))[url]["body"] == {"results": [None, None]}
            assert (await client.finish_weight_update())[url]["body"] == {"results": [None, None]}
            assert (await client.wake_up(tags=["kv_cache"]))[url]["body"] == {"status": "awake",
                                                                             "tags": ["kv_cache"]}
            await served_with_the_pushed_weights(session, url, sims, before)
        assert (await client.wake_up())[url]["body"] == {"status": "awake", "tags": None}
        assert (await client.reset_prefix_cache())[url]["body"] == {"success": True}
        assert (await client.update_named_weights(META))[url]["body"] == {"message": "Weights updated"}
        with pytest.raises(aiohttp.ClientResponseError) as refused:
            await client.update_weights_nccl({**META, "packed": True})
        assert refused.value.status == 501 and "packed buffers" in refused.value.message
        path = str(write_adapter(tmp_path, "step_1"))
        loaded = await client.load_lora_adapter("policy", path)
        assert orjson.loads(loaded[url]["body"]) == {"status": "ok", "lora_name": "policy", "lora_int_id": 1}
        assert held_paths(sims) == [{path}] * 2
        reloaded = await client.load_lora_adapter("policy", str(write_adapter(tmp_path, "step_2")))
        assert orjson.loads(reloaded[url]["body"])["lora_int_id"] == 1
        assert (await client.unload_lora_adapter("policy"))[url] == {
            "status": 200, "body": "Success: LoRA adapter 'policy' removed successfully."}
        await client.finish_session("traj-1")  # best effort: it logs a warning on a status >= 400
        assert [r.message for r in caplog.records if "finish_session" in r.message] == []
    finally:
        if client._session is not None:
            await client._session.close()
