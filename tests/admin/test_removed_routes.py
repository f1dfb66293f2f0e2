"""Routes SGLang 0.5.21 deleted, answered by the proxy in 0.5.17's shape (admin/removed_routes.py), and
TorchRL 0.14.1's weight-sync HTTP calls (torchrl/weight_update/llm/sglang_nccl.py, read from its wheel)
replayed through the proxy on every simulated SGLang release."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from tests.support.admin_fixtures import until
from token_proxy.admin.removed_routes import get_load_items
from token_proxy.simulator import SIM_STATE, info, params
from token_proxy.simulator.config import VERSIONS
from token_proxy.simulator.weight_routes import WEIGHTS

USER = [{"role": "user", "content": "Count slowly."}]
LOAD_KEYS = ["dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "num_pending_tokens", "ts_tic"]


def without_clock(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k != "ts_tic"} for item in items]


# --- /get_load -----------------------------------------------------------------------------------------

def test_get_load_items_is_0_5_17s_projection_of_v1_loads():
    loads = {"loads": [{"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 1, "num_used_tokens": 40,
                        "num_total_tokens": 52}, {"dp_rank": 1, "num_running_reqs": 0, "num_waiting_reqs": 0,
                                                  "num_used_tokens": 0, "num_total_tokens": 0}]}
    assert get_load_items(loads, 7.5) == [
        {"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 52, "num_pending_tokens": 12,
         "ts_tic": 7.5},
        {"dp_rank": 1, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0, "num_pending_tokens": 0,
         "ts_tic": 7.5}]
    with pytest.raises(TypeError, match="no `loads` list"):
        get_load_items({"detail": "x"}, 0.0)


@pytest.mark.parametrize("version", VERSIONS)
async def test_get_load_answers_on_every_version_with_what_0_5_17_said(make_sim, make_proxy, version):
    sim = await make_sim(sglang_version=version, tpot_s=0.004)
    proxy = await make_proxy(sim)
    rollout = asyncio.create_task(proxy.post("/v1/chat/completions", json={
        "messages": USER, "max_tokens": 80, "ignore_eos": True}))
    await until(lambda: any(s.started and len(s.output_ids) > 2 for s in sim.app[SIM_STATE].running.values()))
    sim.app[SIM_STATE].paused = True  # hold the counts still while both are read
    response = await proxy.get("/get_load")
    assert response.status == 200 and response.headers["Content-Type"] == "application/json"
    body = await response.json()
    assert [list(item) for item in body] == [LOAD_KEYS]
    assert without_clock(body) == without_clock(info.load(sim.app[SIM_STATE]))  # the simulator's own 0.5.17 shim
    (seq,) = sim.app[SIM_STATE].running.values()  # independent of the formula both sides share: the one request
    assert (body[0]["num_reqs"], body[0]["num_waiting_reqs"], body[0]["num_tokens"], body[0]["num_pending_tokens"]) \
        == (1, 0, len(seq.spec.prompt) + len(seq.output_ids), 0)
    sim.app[SIM_STATE].paused = False
    sim.app[SIM_STATE].notify()
    assert (await rollout).status == 200


@pytest.mark.parametrize("version", ["0.5.17", "0.5.23"])
async def test_the_weight_version_stubs_answer_0_5_17s_404_on_every_version(make_sim, make_proxy, version):
    proxy = await make_proxy(await make_sim(sglang_version=version))
    for path in ("/get_weight_version", "/weight_version"):
        response = await proxy.get(path)
        assert (response.status, await response.json()) == (404, {
            "object": "error", "message": "Endpoint '/get_weight_version' or '/weight_version' is deprecated. "
            "Please use '/model_info' instead.", "type": "404", "param": None, "code": 404})


# --- TorchRL 0.14.1's weight sync, replayed --------------------------------------------------------------

@pytest.mark.parametrize("mode", ["retract", "abort"])
@pytest.mark.parametrize("version", VERSIONS)
async def test_torchrl_weight_sync_calls_pass_through_the_proxy(make_sim, make_proxy, fake_group, version, mode):
    """SGLangWeightSyncScheme's sender: init_all_workers_group, then send_weights (pause, poll /get_load until
    nothing runs, one /update_weights_from_distributed for every tensor, continue), then flush_cache. Each check
    below is TorchRL's own (status >= 400 raises, `success` must be true, the /get_load arithmetic)."""
    sim = await make_sim(sglang_version=version)
    proxy = await make_proxy(sim)
    group = "weight_update_group_0badc0de"
    init = await proxy.post("/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": 29513, "rank_offset": 1, "world_size": 2, "group_name": group})
    init.raise_for_status()
    assert (await init.json())["success"] is True

    paused = await proxy.post("/pause_generation", json={"mode": mode})
    assert paused.status < 400, await paused.text()
    load = await proxy.get("/get_load")
    assert load.status < 400, await load.text()
    running = 0
    for item in await load.json():  # _running_generation_requests
        running += (int(item["num_running_reqs"]) if "num_running_reqs" in item
                    else max(0, int(item.get("num_reqs", 0)) - int(item.get("num_waiting_reqs", 0))))
    assert running == 0

    names = list(params.PARAM_SHAPES)
    update = await proxy.post("/update_weights_from_distributed", data=orjson.dumps({
        "names": names, "dtypes": ["bfloat16"] * len(names), "shapes": [list(s) for s in params.PARAM_SHAPES.values()],
        "group_name": group, "flush_cache": mode == "abort", "abort_all_requests": False}),
        headers={"Content-Type": "application/json"})
    update.raise_for_status()
    result = await update.json()
    assert result["success"] is True, result

    resumed = await proxy.post("/continue_generation", json={"torch_empty_cache": True})
    assert resumed.status < 400, await resumed.text()
    flushed = await proxy.post("/flush_cache")
    assert flushed.status == 200

    assert [u["names"] for u in sim.app[WEIGHTS].updates] == [names]
    assert not sim.app[SIM_STATE].paused and sim.app[WEIGHTS].session is None
    assert sim.app[WEIGHTS].session_log == (["begin", "end"] if version >= "0.5.21" else [])
