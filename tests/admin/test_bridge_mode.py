"""Bridge mode (--weight-bridge): the proxy answers prime-rl's and vLLM's own weight routes and drives the weight
bridges (a stand-in here that records what the proxy asks and answers as token_proxy/bridge/server.py does; the
bridge itself is tested in tests/bridge/), in front of the simulator: the rank split, one weight-update session
per push, the version and the flush, a refused push held and the next one recovering."""

from __future__ import annotations

import pytest
from aiohttp import web

from token_proxy.admin.bridge_mode import split_group
from token_proxy.errors import InvalidRequest


def url_of(server) -> str:
    return str(server.make_url("")).rstrip("/")


@pytest.fixture
async def bridge_and_proxy(aiohttp_server, make_sim, make_proxy):
    sim = await make_sim()
    sim_url = url_of(sim)
    calls, fail, joined = [], {}, []

    async def info(request):
        return web.json_response({"gpus": [0], "workers": [sim_url], "tp_ranks": 1, "joined": joined, "dialect": ""})

    async def record(request):
        body = await request.json() if request.can_read_body else {}
        calls.append((request.path, body))
        if request.path in ("/bridge/join", "/bridge/leave"):
            joined[:] = [1] if request.path == "/bridge/join" else []
        if request.path == "/bridge/push" and fail:
            torn = fail.pop("torn", False)
            if torn:  # a receiver died: the bridge dropped its group
                joined.clear()
            worker = fail.pop("worker", sim_url)  # another worker's name: this one stopped for it (a 503)
            error = {"worker": worker, "message": fail.pop("message"), **({"torn": True} if torn else {})}
            return web.json_response({"ok": False, "buckets": 3, "tensors": 2, "bytes": 10, "seconds": 0.1,
                                      "errors": [error]}, status=502)
        return web.json_response({"ok": True, "buckets": 3, "tensors": 11, "bytes": 100, "seconds": 0.1, "errors": []})

    app = web.Application()
    app.add_routes([web.get("/bridge/info", info), web.post("/bridge/join", record), web.post("/bridge/push", record),
                    web.post("/bridge/leave", record)])
    bridge = await aiohttp_server(app)
    proxy = await make_proxy(sim, weight_bridges=(url_of(bridge),), check_local_paths=False)
    return proxy, calls, fail, sim_url


async def test_a_torn_push_needs_a_new_init(bridge_and_proxy):
    proxy, _, fail, _ = bridge_and_proxy
    init = {"host": "10.0.0.5", "port": 29501, "rank_offset": 0, "inference_world_size": 1}
    assert (await proxy.post("/init_broadcaster", json=init)).status == 200
    fail.update(torn=True, message="rank 1 (GPU 0) died (exit code -9)")
    r = await proxy.post("/update_weights", json={"weight_dir": "/outputs/broadcasts/step_1"})
    assert r.status == 503  # a dead receiver: the bridge's failure (a new init + push works), not SGLang refusing (400)
    assert "rank 1 (GPU 0) died" in (await r.json())["error"]["message"]
    r = await proxy.post("/update_weights", json={"weight_dir": "/outputs/broadcasts/step_2"})
    assert r.status == 409
    assert "have not joined the trainer's group" in (await r.json())["error"]["message"]
    assert (await proxy.post("/init_broadcaster", json=init)).status == 200  # the trainer's new init recovers
    r = await proxy.post("/update_weights", json={"weight_dir": "/outputs/broadcasts/step_2"})
    assert (r.status, (await r.json())["weight_version"]) == (200, "2")


async def test_primerl_through_the_bridge(bridge_and_proxy):
    proxy, calls, fail, sim_url = bridge_and_proxy
    r = await proxy.post("/init_broadcaster", json={"host": "10.0.0.5", "port": 29501, "rank_offset": 0,
                                                     "inference_world_size": 1, "timeout": 30})
    assert (r.status, await r.json()) == (200, {"status": "ok"})
    assert calls == [("/bridge/join", {"host": "10.0.0.5", "port": 29501, "world_size": 2, "rank_offset": 1,
                                       "ranks": 1, "dialect": "primerl", "timeout_s": 30.0})]
    assert (await proxy.post("/pause")).status == 200
    r = await proxy.post("/update_weights", json={"weight_dir": "/outputs/broadcasts/step_3"})
    assert (r.status, await r.json()) == (200, {"status": "ok", "weight_version": "3"})
    assert calls[-1][0] == "/bridge/push"
    assert calls[-1][1]["dialect"] == "primerl"
    assert "update_info" not in calls[-1][1]
    assert (await (await proxy.get("/weight_info")).json())["weight_version"] == "3"

    fail["message"] = f"{sim_url}: unknown parameter model.layers.0.bogus"
    r = await proxy.post("/update_weights", json={"weight_dir": "/outputs/broadcasts/step_4"})
    body = await r.json()
    assert r.status == 400  # every worker refused the push itself
    assert "unknown parameter model.layers.0.bogus" in body["error"]["message"]
    assert sim_url in body["error"]["message"]
    assert (await proxy.post("/resume")).status == 409  # held
    pushes = len(calls)
    r = await proxy.post("/update_weights", json={"weight_dir": "/outputs/broadcasts/step_4"})
    assert (r.status, len(calls)) == (400, pushes)  # a retry of the failed step: its answer again, no receive
    r = await proxy.post("/update_weights", json={"weight_dir": "/outputs/broadcasts/step_5"})
    assert (r.status, (await r.json())["weight_version"]) == (200, "5")  # the next push recovers, no new init
    assert (await proxy.post("/resume")).status == 200

    fail.update(worker="http://elsewhere:30000", message="http://elsewhere:30000: unknown parameter x")
    r = await proxy.post("/update_weights", json={"weight_dir": "/outputs/broadcasts/step_6"})
    body = await r.json()
    assert r.status == 503  # prime-rl retries a 5xx ...
    assert "the push stopped on weight bridge" in body["error"]["message"]
    pushes = len(calls)
    r = await proxy.post("/update_weights", json={"weight_dir": "/outputs/broadcasts/step_6"})
    assert (r.status, len(calls)) == (503, pushes)  # ... and the retry answers at once, without a new receive


async def test_vllm_through_the_bridge(bridge_and_proxy):
    proxy, calls, _, _ = bridge_and_proxy
    init = {"master_address": "10.0.0.5", "master_port": 29600, "rank_offset": 1, "world_size": 2,
            "packed": True, "packed_buffer_size_bytes": 1024, "packed_num_buffers": 2}
    r = await proxy.post("/init_weight_transfer_engine", json={"init_info": init})
    assert r.status == 200, await r.text()
    assert calls[0] == ("/bridge/join", {"host": "10.0.0.5", "port": 29600, "world_size": 2, "rank_offset": 1,
                                         "ranks": 1, "dialect": "vllm", "timeout_s": 300.0})
    assert (await proxy.post("/start_weight_update")).status == 200
    info = {"names": ["lm_head.weight"], "dtype_names": ["bfloat16"], "shapes": [[32, 8]]}
    r = await proxy.post("/update_weights", json={"update_info": info})
    assert r.status == 200, await r.text()
    assert calls[-1] == ("/bridge/push", {"dialect": "vllm", "packed": True, "buffer_size_bytes": 1024,
                                          "timeout_s": 720.0, "update_info": info})
    r = await proxy.post("/finish_weight_update", json={"weight_version": "v7"})
    assert r.status == 200, await r.text()
    assert (await (await proxy.get("/weight_info")).json())["weight_version"] == "v7"
    assert (await proxy.post("/shutdown_weight_transfer_engine")).status == 200
    assert calls[-1][0] == "/bridge/leave"
    r = await proxy.post("/update_weights", json={"update_info": info})
    assert r.status == 409
    assert "have not joined" in (await r.json())["error"]["message"]


async def test_a_trainer_group_that_does_not_fit_is_refused(bridge_and_proxy):
    proxy, calls, _, _ = bridge_and_proxy
    r = await proxy.post("/init_broadcaster", json={"host": "10.0.0.5", "port": 29501, "inference_world_size": 2})
    body = await r.json()
    assert (r.status, body["error"]["param"]) == (400, "world_size")
    assert "serve 1 SGLang GPU(s) on 1 worker(s): size it to 1" in body["error"]["message"]
    assert calls == []


def test_split_group_across_bridges():
    assert split_group(5, 1, [(2, 1), (2, 1)]) == [(1, 2), (3, 2)]  # one rank per GPU
    assert split_group(3, 1, [(2, 1), (2, 1)]) == [(1, 1), (2, 1)]  # one per worker
    with pytest.raises(InvalidRequest, match="has 2 inference rank\\(s\\).*size it to 3 \\(one rank per GPU\\) or 1"):
        split_group(3, 1, [(2, 1), (1, 0)])
