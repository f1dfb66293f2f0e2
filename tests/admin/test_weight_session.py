"""SGLang 0.5.21+'s weight-update session (/begin_weight_update ... /end_weight_update, upstream PR #28001):
the simulator enforces it as the released scheduler does, and the proxy brackets every distributed update
it makes (prime-rl's dialect, vLLM's dialect, SGLang's own forwarded route) on the versions that gate,
always closing it; disk updates are never bracketed. Every test runs on every version the simulator knows."""

from __future__ import annotations

import aiohttp
import pytest

from tests.support.admin_fixtures import until
from token_proxy.admin import ADMIN
from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.config import VERSIONS
from token_proxy.simulator.rl_routes import RL_SIM
from token_proxy.simulator.weight_routes import WEIGHTS

GATED = tuple(v for v in VERSIONS if v >= "0.5.21")
NO_SESSION = ("update_weights_from_distributed must run between begin_weight_update() and "
              "end_weight_update()")
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NOTHING_TO_END = "no weight-update session is open; call begin_weight_update() first"
NORM = {"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[8]]}
HEAD = {"names": ["lm_head.weight"], "dtypes": ["bfloat16"], "shapes": [[32, 8]]}
VLLM_INIT = {"master_address": "127.0.0.1", "master_port": 29511, "rank_offset": 1, "world_size": 2}
VLLM_META = {"names": ["model.norm.weight", "lm_head.weight"], "dtype_names": ["bfloat16", "bfloat16"],
             "shapes": [[8], [32, 8]]}


def weights(sim):
    return sim.app[WEIGHTS]


def bracket(version: str, updates: int) -> list[str]:
    """The begin / end calls SGLang must see for `updates` distributed updates on `version`."""
    return ["begin", "end"] * updates if version in GATED else []


async def reply(response) -> tuple[int, object]:
    return response.status, await response.json()


# --- the simulator, as the released source ----------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
async def test_the_simulator_gates_distributed_updates_exactly_where_sglang_does(make_sim, fake_group, version):
    sim = await make_sim(sglang_version=version)
    async with aiohttp.ClientSession(str(sim.make_url(""))) as http:
        join = await http.post("/init_weights_update_group", json=VLLM_INIT)
        assert join.status == 200
        bare = await reply(await http.post("/update_weights_from_distributed", json=NORM))
        begin = await reply(await http.post("/begin_weight_update", json={}))
        if version not in GATED:
            assert bare == (200, {"success": True, "message": "Succeeded to update parameter online."})
            assert begin == (404, {"detail": "Not Found"})
            assert await reply(await http.post("/end_weight_update", json={})) == (404, {"detail": "Not Found"})
            return
        assert bare == (400, {"success": False, "message": NO_SESSION})
        assert weights(sim).updates == []  # refused before any receive
        assert begin == (200, {"success": True, "message": "Success"})
        again = await reply(await http.post("/begin_weight_update", json={"selector": "all"}))
        assert again == (400, {"success": False, "message": SESSION_OPEN})
        inside = await reply(await http.post("/update_weights_from_distributed", json={**NORM, "weight_version": "3"}))
        assert inside == (200, {"success": True,
                                "message": "Succeeded to update parameter online. Weight version updated to 3."})
        assert weights(sim).session == {"selector": "all", "loaded_weights": True}
        assert await reply(await http.post("/end_weight_update", json={})) == (
            200, {"success": True, "message": "Success"})
        assert await reply(await http.post("/end_weight_update", json={})) == (
            400, {"success": False, "message": NOTHING_TO_END})
        assert (await http.get("/begin_weight_update")).status == 405
        # No group: the session check comes first, then the receive's own words (0.5.21+).
        await http.post("/begin_weight_update", json={})
        nogroup = await reply(await http.post("/update_weights_from_distributed", json={**NORM, "group_name": "g"}))
        assert nogroup == (400, {"success": False, "message": "Failed to receive weights: Group g not in "
                                 "['weight_update_group']. Please call `init_weights_update_group` first."})
        await http.post("/end_weight_update", json={})
        assert weights(sim).session_log == ["begin", "begin refused", "end", "end refused", "begin", "end"]


@pytest.mark.parametrize("version", VERSIONS)
async def test_removed_routes_are_gone_from_the_simulator_where_the_release_deleted_them(make_sim, version):
    sim = await make_sim(sglang_version=version)
    async with aiohttp.ClientSession(str(sim.make_url(""))) as http:
        for path in ("/get_load", "/get_weight_version", "/weight_version"):
            response = await http.get(path)
            assert (response.status == 404 and await response.json() == {"detail": "Not Found"}) == (
                version in GATED), path


# --- the proxy: prime-rl's dialect (the trainer's push through the forwarded route) ------------------

@pytest.mark.parametrize("version", VERSIONS)
async def test_prime_rl_nccl_update_is_bracketed_where_gated(make_sim, make_proxy, fake_group, version):
    sim = await make_sim(sglang_version=version)
    proxy = await make_proxy(sim)
    init = {"host": "127.0.0.1", "port": 29512, "rank_offset": 0, "inference_world_size": 1}
    assert await reply(await proxy.post("/init_broadcaster", json=init)) == (200, {"status": "ok"})
    assert await reply(await proxy.post("/pause")) == (200, {"status": "paused"})
    first = await proxy.post("/update_weights_from_distributed", json={**NORM, "flush_cache": False})
    assert await reply(first) == (200, {"success": True, "message": "Succeeded to update parameter online."})
    last = await proxy.post("/update_weights_from_distributed", json={**HEAD, "weight_version": "7"})
    assert (await reply(last))[0] == 200
    assert await reply(await proxy.post("/update_weights", json={"weight_dir": None})) == (
        200, {"status": "ok", "weight_version": "7"})
    assert await reply(await proxy.post("/resume")) == (200, {"status": "resumed"})
    assert [u["names"] for u in weights(sim).updates] == [NORM["names"], HEAD["names"]]
    assert sim.app[SIM_STATE].weight_version == "7"
    assert weights(sim).session_log == bracket(version, 2) and weights(sim).session is None


@pytest.mark.parametrize("version", VERSIONS)
async def test_vllm_nccl_update_is_bracketed_where_gated(make_sim, make_proxy, fake_group, version):
    sim = await make_sim(sglang_version=version)
    proxy = await make_proxy(sim)
    assert (await proxy.post("/init_weight_transfer_engine", json={"init_info": VLLM_INIT})).status == 200
    assert (await proxy.post("/start_weight_update")).status == 200
    assert await reply(await proxy.post("/update_weights", json={"update_info": VLLM_META})) == (
        200, {"message": "Weights updated"})
    rpc = {"method": "update_weights_nccl", "kwargs": {"update_info": VLLM_META}}
    assert await reply(await proxy.post("/collective_rpc", json=rpc)) == (200, {"results": [None]})
    assert await reply(await proxy.post("/finish_weight_update", json={"weight_version": "v1"})) == (
        200, {"message": "Weight update finished"})
    assert [u["names"] for u in weights(sim).updates] == [VLLM_META["names"]] * 2
    assert sim.app[SIM_STATE].weight_version == "v1"
    assert weights(sim).session_log == bracket(version, 2) and weights(sim).session is None


@pytest.mark.parametrize("version", VERSIONS)
async def test_disk_updates_are_never_bracketed(make_sim, make_proxy, tmp_path, version):
    sim = await make_sim(sglang_version=version)
    proxy = await make_proxy(sim)
    for step in ("step_2", "step_3"):
        (tmp_path / step).mkdir()
        (tmp_path / step / "model.safetensors").write_bytes(b"\0")
    assert await reply(await proxy.post("/update_weights", json={"weight_dir": str(tmp_path / "step_2")})) == (
        200, {"status": "ok", "weight_version": "2"})
    native = await proxy.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "step_3"),
                                                                 "weight_version": "3"})
    assert (await reply(native))[1]["success"] is True
    assert await reply(await proxy.post("/reload_weights")) == (200, {"status": "ok", "weight_version": "default"})
    assert weights(sim).session_log == []


# --- the session is always closed ------------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
async def test_a_refused_push_still_closes_the_session_and_the_next_one_lands(make_sim, make_proxy, fake_group,
                                                                              version):
    sim = await make_sim(sglang_version=version)
    proxy = await make_proxy(sim)
    await proxy.post("/init_weight_transfer_engine", json={"init_info": VLLM_INIT})
    sim.app[RL_SIM].faults.append({"kind": "fail", "message": "Failed to receive weights: peer gone"})
    failed = await proxy.post("/update_weights", json={"update_info": VLLM_META})
    assert failed.status == 400 and "peer gone" in (await failed.json())["error"]["message"]
    assert weights(sim).session is None and weights(sim).session_log == bracket(version, 1)
    assert weights(sim).groups == {}  # the failed push's group is destroyed: the same name joins again
    await proxy.post("/init_weight_transfer_engine", json={"init_info": VLLM_INIT})
    native = await proxy.post("/update_weights_from_distributed", json={**NORM, "group_name": "weight_update_group"})
    assert (await reply(native))[0] == 200
    assert weights(sim).session_log == bracket(version, 2) and weights(sim).session is None


@pytest.mark.parametrize("version", GATED)
async def test_a_timed_out_push_is_closed_once_sglang_finishes_it(make_sim, make_proxy, fake_group, version):
    sim = await make_sim(sglang_version=version)
    proxy = await make_proxy(sim, weight_update_timeout_s=0.3)
    proxy.app[ADMIN].push.live_groups.add("weight_update_group")
    await proxy.post("/init_weights_update_group", json=VLLM_INIT)
    sim.app[RL_SIM].faults.append({"kind": "delay", "delay_s": 0.6})
    late = await proxy.post("/update_weights_from_distributed", json=NORM)
    assert late.status == 504
    # The proxy's end queued behind the late update (SGLang takes them in order) and closed the session.
    await until(lambda: weights(sim).session_log == ["begin", "end"])
    assert weights(sim).session is None
    # A new join (the failed push's group was destroyed) and push open a fresh session (a second begin on an
    # open one would be refused).
    assert (await proxy.post("/init_weights_update_group", json=VLLM_INIT)).status == 200
    assert (await proxy.post("/update_weights_from_distributed", json=HEAD)).status == 200
    assert weights(sim).session_log == ["begin", "end", "begin", "end"]


@pytest.mark.parametrize("version", GATED)
async def test_a_session_someone_else_left_open_refuses_the_push_and_stays_theirs(make_sim, make_proxy, fake_group,
                                                                                  version):
    sim = await make_sim(sglang_version=version)
    proxy = await make_proxy(sim)
    await proxy.post("/init_weights_update_group", json=VLLM_INIT)
    async with aiohttp.ClientSession(str(sim.make_url(""))) as direct:  # straight to SGLang, not the proxy
        assert (await direct.post("/begin_weight_update", json={})).status == 200
    refused = await proxy.post("/update_weights_from_distributed", json=NORM)
    status, body = await reply(refused)
    assert (status, body["success"], body["workers"][0]["message"]) == (400, False, SESSION_OPEN)
    assert weights(sim).updates == [] and weights(sim).session is not None  # not sent; their session kept
    assert weights(sim).session_log == ["begin", "begin refused"]


@pytest.mark.parametrize("version", GATED)
async def test_a_clients_own_session_through_the_proxy_is_kept_and_the_proxy_stands_aside(make_sim, make_proxy,
                                                                                          fake_group, version):
    sim = await make_sim(sglang_version=version)
    proxy = await make_proxy(sim)
    await proxy.post("/init_weights_update_group", json=VLLM_INIT)
    assert await reply(await proxy.post("/begin_weight_update", json={})) == (200, {"success": True,
                                                                                   "message": "Success"})
    for body in (NORM, {**HEAD, "weight_version": "9"}):
        assert (await proxy.post("/update_weights_from_distributed", json=body)).status == 200
    assert await reply(await proxy.post("/end_weight_update", json={})) == (200, {"success": True,
                                                                                 "message": "Success"})
    assert weights(sim).session_log == ["begin", "end"] and len(weights(sim).updates) == 2
    assert (await proxy.post("/update_weights_from_distributed", json=NORM)).status == 200  # the proxy's again
    assert weights(sim).session_log == ["begin", "end", "begin", "end"]
