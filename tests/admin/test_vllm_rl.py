"""vLLM 0.33's RL admin routes (rl/online/api_router.py, serve/dev/{sleep,cache,rpc}) served by the proxy on
SGLang simulators, in vLLM's exact shapes; the /pause and /update_weights dialect rule; fail-fast NCCL steps."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from tests.support.admin_fixtures import free_port, until
from token_proxy.admin import ADMIN
from token_proxy.sglang import sglang_request
from token_proxy.sglang.client import response_id_of
from token_proxy.sglang.versions import features_for
from token_proxy.simulator import SIM_STATE, params
from token_proxy.simulator.rl_routes import RL_SIM
from token_proxy.simulator.testing import parse_sse
from token_proxy.simulator.weight_routes import WEIGHTS
from token_proxy.state import CONTEXT
from token_proxy.vocabulary import SamplingRequest

FOX = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]
LONG = {"messages": [{"role": "user", "content": "Count slowly."}], "max_tokens": 40, "temperature": 0,
        "ignore_eos": True}
INIT = {"master_address": "127.0.0.1", "master_port": 29511, "rank_offset": 1, "world_size": 3}
META = {"names": ["model.norm.weight", "lm_head.weight"], "dtype_names": ["bfloat16", "bfloat16"],
        "shapes": [[8], [32, 8]]}


def state(server):
    return server.app[SIM_STATE]


def url_of(server) -> str:
    return str(server.make_url("")).rstrip("/")


async def post(proxy, path, expect: int = 200, **kwargs):
    response = await proxy.post(path, **kwargs)
    body = await response.json()
    assert response.status == expect, body
    return body


async def get(proxy, path, expect: int = 200, **kwargs):
    response = await proxy.get(path, **kwargs)
    body = await response.json()
    assert response.status == expect, body
    return body


async def chat_stream(proxy, body: dict) -> list:
    response = await proxy.post("/v1/chat/completions", data=orjson.dumps({**body, "stream": True}))
    return parse_sse(await response.read())


def finish_reason(events: list) -> str:
    return [e for e in events[:-1] if e["choices"] and e["choices"][0].get("finish_reason")][-1][
        "choices"][0]["finish_reason"]


@pytest.fixture
async def fleet2(make_sim, make_proxy):
    """Two workers behind one proxy (data to the first), memory saver on, a little decode delay."""
    sims = [await make_sim(tpot_s=0.003, enable_memory_saver=True, enable_weights_cpu_backup=True)
            for _ in range(2)]
    proxy = await make_proxy(sims[0], workers=tuple(url_of(s) for s in sims), admin_timeout_s=5.0)
    return proxy, sims


# --- /pause: the two dialects -------------------------------------------------------------------

async def test_vllm_pause_abort_aborts_in_flight_and_clears_the_cache(fleet2):
    proxy, sims = fleet2
    rollout = asyncio.create_task(chat_stream(proxy, LONG))
    await until(lambda: any(len(s.output_ids) > 2 for s in state(sims[0]).running.values()))
    state(sims[1]).prefix_cache.insert(FOX)
    assert await post(proxy, "/pause", params={"mode": "abort"}) == {"status": "paused"}
    assert [state(s).pause_mode for s in sims] == ["abort", "abort"]
    assert finish_reason(await asyncio.wait_for(rollout, 10)) == "abort"
    assert state(sims[1]).prefix_cache.match(FOX) == 0  # clear_cache defaults to true in vLLM
    assert await get(proxy, "/is_paused") == {"is_paused": True}
    assert await post(proxy, "/resume") == {"status": "resumed"}
    assert await get(proxy, "/is_paused") == {"is_paused": False}
    assert not any(state(s).paused for s in sims)


async def test_vllm_pause_wait_lets_in_flight_requests_finish_first(fleet2):
    proxy, sims = fleet2
    rollout = asyncio.create_task(chat_stream(proxy, LONG))
    await until(lambda: state(sims[0]).running)
    assert await post(proxy, "/pause", params={"mode": "wait", "clear_cache": "false"}) == {"status": "paused"}
    assert rollout.done() and finish_reason(rollout.result()) == "length"
    assert [state(s).pause_mode for s in sims] == ["in_place", "in_place"]


async def test_bare_pause_is_prime_rls_and_keeps_requests(fleet2):
    proxy, sims = fleet2
    assert await post(proxy, "/pause") == {"status": "paused"}
    assert [state(s).pause_mode for s in sims] == ["retract", "retract"]  # --pause-mode, not vLLM's abort
    assert await post(proxy, "/pause", params={"mode": "keep", "clear_cache": "true"}) == {"status": "paused"}
    assert state(sims[0]).pause_mode == "retract"
    refused = await post(proxy, "/pause", 400, params={"mode": "sideways"})
    assert refused["error"]["param"] == "mode"
    refused = await post(proxy, "/pause", 400, params={"mode": "abort", "clear_cache": "maybe"})
    assert refused["error"]["param"] == "clear_cache"


async def test_abort_requests_all_and_by_id(fleet2):
    proxy, sims = fleet2
    rollouts = [asyncio.create_task(chat_stream(proxy, LONG)) for _ in range(2)]
    await until(lambda: len(state(sims[0]).running) == 2)
    assert await post(proxy, "/abort_requests", json={}) == {"status": "aborted", "aborted": 2}
    assert [finish_reason(r) for r in await asyncio.wait_for(asyncio.gather(*rollouts), 10)] == ["abort"] * 2
    assert await post(proxy, "/abort_requests", json={"request_ids": ["chatcmpl-x"]}) == {
        "status": "aborted", "aborted": 0}  # no such request in flight


async def test_abort_by_id_reaches_every_sample_of_an_n_request(fleet2):
    proxy, sims = fleet2

    async def rollout():
        response = await proxy.post("/v1/chat/completions", headers={"X-Request-Id": "rollout-7"},
                                    data=orjson.dumps({**LONG, "n": 2, "seed": 1, "stream": True}))
        return parse_sse(await response.read())

    task = asyncio.create_task(rollout())
    await until(lambda: sorted(state(sims[0]).running) == ["chatcmpl-rollout-7-0", "chatcmpl-rollout-7-1"])
    assert proxy.app[CONTEXT].in_flight == {"chatcmpl-rollout-7": ["chatcmpl-rollout-7-0", "chatcmpl-rollout-7-1"]}
    assert await post(proxy, "/abort_requests", json={"request_ids": ["chatcmpl-rollout-7", "chatcmpl-gone"]}) == {
        "status": "aborted", "aborted": 1}
    events = await asyncio.wait_for(task, 10)
    finishes = {c["index"]: c["finish_reason"] for e in events[:-1] for c in e["choices"] if c.get("finish_reason")}
    assert finishes == {0: "abort", 1: "abort"}
    assert proxy.app[CONTEXT].in_flight == {}
    assert (await post(proxy, "/abort_requests", 400, json={"request_ids": "x"}))["error"]["param"] == "request_ids"


# --- sleep mode -----------------------------------------------------------------------------------

async def greedy_ids(proxy) -> list[int]:
    reply = await post(proxy, "/v1/chat/completions", json={**LONG, "max_tokens": 6, "return_token_ids": True})
    assert reply["choices"][0]["finish_reason"] == "length"
    return reply["choices"][0]["token_ids"]


@pytest.mark.parametrize("wakes", [
    [[("tags", "weights")], [("tags", "kv_cache")]],  # SkyRL's worker_dispatch.py, an update in between
    [[("tags", "weights"), ("tags", "kv_cache")]],  # both in one call: vLLM's FastAPI reads repeated tags
    [[]],  # no tags: everything
], ids=["weights-then-kv_cache", "both-tags-at-once", "bare"])
async def test_sleep_level_1_then_wake_by_vllms_tags_serves_again(fleet2, wakes):
    """vLLM sleeps `weights` and `kv_cache` and serves once both are back; SGLang's cuda_graph, which vLLM
    does not name, is released and restored with kv_cache."""
    proxy, sims = fleet2
    before = await greedy_ids(proxy)
    assert await post(proxy, "/sleep", params={"level": "1"}) == {"status": "sleeping", "level": 1}
    assert all(s.app[WEIGHTS].released == {"weights", "kv_cache", "cuda_graph"} for s in sims)
    assert all(state(s).paused and not state(s).crashed for s in sims)
    assert await get(proxy, "/is_sleeping") == {"is_sleeping": True}
    for i, tags in enumerate(wakes):
        awake = i == len(wakes) - 1
        named = [tag for _, tag in tags] or None
        assert await post(proxy, "/wake_up", params=tags) == {"status": "awake" if awake else "sleeping",
                                                              "tags": named}
        if not awake:  # weights alone: the trainer pushes into them while the KV cache and graphs stay out
            assert all(s.app[WEIGHTS].released == {"kv_cache", "cuda_graph"} and state(s).paused for s in sims)
            assert await get(proxy, "/is_sleeping") == {"is_sleeping": True}
    assert all(s.app[WEIGHTS].released == set() and not state(s).paused and not state(s).crashed for s in sims)
    assert await get(proxy, "/is_sleeping") == {"is_sleeping": False}
    assert await greedy_ids(proxy) == before


async def test_wake_up_tags_as_vllm_answers_them(fleet2, monkeypatch):
    """A tag already awake wakes nothing more (SGLang's resume of a tag it holds kills its scheduler); a second
    /sleep releases only what is resident (SGLang would pause its regions again); a tag vLLM does not know is
    a 400, not vLLM's silent no-op that leaves the engine asleep."""
    proxy, sims = fleet2
    plane, sent = proxy.app[ADMIN], []
    fan_out = plane.fan_out

    async def recording(method, path, bodies, *args, **kwargs):
        if path.endswith("_memory_occupation"):
            sent.append((path, bodies["tags"]))
        return await fan_out(method, path, bodies, *args, **kwargs)

    monkeypatch.setattr(plane, "fan_out", recording)
    await post(proxy, "/sleep", params={"level": "1"})
    refused = await post(proxy, "/resume", 409)
    assert refused["error"]["message"] == ("memory is released (cuda_graph, kv_cache, weights): POST /wake_up before /resume, "
                                           "or SGLang would run on memory it gave back")
    assert await post(proxy, "/wake_up", params={"tags": "weights"}) == {"status": "sleeping", "tags": ["weights"]}
    assert await post(proxy, "/wake_up", params={"tags": "weights"}) == {"status": "sleeping", "tags": ["weights"]}
    for tag in ("cuda_graph", "kv-cache"):
        refused = await post(proxy, "/wake_up", 400, params=[("tags", "kv_cache"), ("tags", tag)])
        assert refused["error"] == {
            "message": f"tags must be among weights, kv_cache, scheduling, got {tag!r} (SGLang's cuda_graph "
                       "memory comes back with kv_cache)",
            "type": "BadRequestError", "param": "tags", "code": 400}
    assert await post(proxy, "/sleep", params={"level": "1"}) == {"status": "sleeping", "level": 1}
    assert await post(proxy, "/wake_up", params=[("tags", "kv_cache"), ("tags", "weights"), ("tags", "scheduling")]
                      ) == {"status": "awake", "tags": ["kv_cache", "weights", "scheduling"]}
    assert await post(proxy, "/wake_up", params={"tags": "kv_cache"}) == {"status": "awake", "tags": ["kv_cache"]}
    assert sent == [("/release_memory_occupation", ["weights", "kv_cache", "cuda_graph"]),
                    ("/resume_memory_occupation", ["weights"]),
                    ("/release_memory_occupation", ["weights"]),
                    ("/resume_memory_occupation", ["weights", "kv_cache", "cuda_graph"])]
    assert not any(state(s).crashed or state(s).paused or s.app[WEIGHTS].released for s in sims)


async def test_sleep_aborts_in_flight_requests_cleanly_before_releasing(fleet2):
    proxy, sims = fleet2
    rollout = asyncio.create_task(chat_stream(proxy, LONG))
    await until(lambda: state(sims[0]).running)
    assert await post(proxy, "/sleep", params={"level": "2", "mode": "abort"}) == {"status": "sleeping", "level": 2}
    assert finish_reason(await asyncio.wait_for(rollout, 10)) == "abort"
    assert not state(sims[0]).crashed  # SGLang asserts idle on release: the proxy waited for it
    assert await post(proxy, "/wake_up") == {"status": "awake", "tags": None}


async def test_sleep_level_0_pauses_only(fleet2):
    proxy, sims = fleet2
    assert await post(proxy, "/sleep", params={"level": "0"}) == {"status": "sleeping", "level": 0}
    assert all(state(s).paused and not s.app[WEIGHTS].released for s in sims)
    assert await get(proxy, "/is_sleeping") == {"is_sleeping": True}
    assert await post(proxy, "/wake_up", params={"tags": "scheduling"}) == {"status": "awake",
                                                                            "tags": ["scheduling"]}
    assert not any(state(s).paused for s in sims)
    await post(proxy, "/sleep", params={"level": "0"})
    assert await post(proxy, "/resume") == {"status": "resumed"}
    assert await get(proxy, "/is_sleeping") == {"is_sleeping": False}


async def test_sleep_refuses_what_sglang_cannot_do(make_sim, make_proxy):
    plain = await make_sim()
    proxy = await make_proxy(plain)
    refused = await post(proxy, "/sleep", 501)
    assert refused["error"]["message"] == (f"{url_of(plain)} runs without --enable-memory-saver: SGLang's "
                                           "release_memory_occupation would free nothing")
    saver = await make_sim(enable_memory_saver=True)
    proxy = await make_proxy(saver)
    refused = await post(proxy, "/sleep", 501, params={"level": "1"})
    assert "runs without --enable-weights-cpu-backup (SGLang would discard them, which is level 2)" in (
        refused["error"]["message"])
    refused = await post(proxy, "/sleep", 501, params={"level": "2", "mode": "keep"})
    assert refused["error"]["message"].startswith("sleep with mode=keep: SGLang's release_memory_occupation needs")
    assert (await post(proxy, "/sleep", 400, params={"level": "3"}))["error"]["param"] == "level"
    assert not state(saver).paused and not saver.app[WEIGHTS].released  # nothing was done
    assert await post(proxy, "/sleep", params={"level": "2"}) == {"status": "sleeping", "level": 2}


async def test_release_kv_cache_memory_needs_a_completed_pause(fleet2):
    proxy, sims = fleet2
    refused = await post(proxy, "/release_kv_cache_memory", 409)
    assert refused["error"]["message"] == "release_kv_cache_memory() requires a completed pause first"
    await post(proxy, "/pause", params={"mode": "abort"})
    assert await post(proxy, "/release_kv_cache_memory") == {"status": "kv_cache_released"}
    assert all(s.app[WEIGHTS].released == {"kv_cache", "cuda_graph"} for s in sims)
    assert await get(proxy, "/is_sleeping") == {"is_sleeping": True}
    assert await post(proxy, "/wake_up", params={"tags": "kv_cache"}) == {"status": "awake", "tags": ["kv_cache"]}
    assert all(state(s).paused for s in sims)  # the trainer's /pause is the trainer's to end
    assert await post(proxy, "/resume") == {"status": "resumed"}


async def test_a_plain_pause_is_not_sleep_and_wake_up_keeps_it(fleet2):
    proxy, sims = fleet2
    await post(proxy, "/pause", params={"mode": "abort"})
    assert await get(proxy, "/is_sleeping") == {"is_sleeping": False}
    assert await post(proxy, "/wake_up") == {"status": "awake", "tags": None}
    assert all(state(s).paused for s in sims)
    assert await get(proxy, "/is_paused") == {"is_paused": True}


async def test_reset_prefix_cache(fleet2):
    proxy, sims = fleet2
    for sim in sims:
        state(sim).prefix_cache.insert(FOX)
    assert await post(proxy, "/reset_prefix_cache") == {"success": True}
    assert all(state(s).prefix_cache.match(FOX) == 0 for s in sims)
    for sim in sims:
        state(sim).prefix_cache.insert(FOX)
    rollout = asyncio.create_task(chat_stream(proxy, LONG))
    await until(lambda: state(sims[0]).running)
    assert await post(proxy, "/reset_prefix_cache") == {"success": False}  # busy: vLLM says so, callers retry
    assert state(sims[1]).prefix_cache.match(FOX) == 0 and state(sims[0]).prefix_cache.match(FOX) > 0
    refused = await post(proxy, "/reset_prefix_cache", 501, params={"reset_running_requests": "true"})
    assert refused["error"]["type"] == "NotImplementedError"
    await rollout
    await until(lambda: state(sims[0]).prefix_cache.match(FOX) == 0, 5)  # the flush it was owed, once idle


async def test_reset_prefix_cache_names_an_unreachable_worker(make_sim, make_proxy):
    live = await make_sim()
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = await make_proxy(live, workers=(url_of(live), dead))
    refused = await post(proxy, "/reset_prefix_cache", 503)
    assert refused["error"]["message"].startswith(f"reset_prefix_cache failed on 1 of 2 worker(s): {dead}: ")


# --- info -----------------------------------------------------------------------------------------

async def test_get_world_size_counts_every_worker(fleet2):
    proxy, _ = fleet2
    assert await get(proxy, "/get_world_size") == {"world_size": 2}
    assert await get(proxy, "/get_world_size", params={"include_dp": "false"}) == {"world_size": 2}


async def test_weight_info_shows_each_worker(fleet2):
    proxy, sims = fleet2
    urls = [url_of(s) for s in sims]
    assert await get(proxy, "/weight_info") == {
        "weight_version": "default", "consistent": True,
        "workers": [{"url": urls[0], "weight_version": "default"}, {"url": urls[1], "weight_version": "default"}],
        "fenced": [], "joining": []}
    state(sims[1]).weight_version = "7"
    info = await get(proxy, "/weight_info")
    assert (info["weight_version"], info["consistent"]) == (None, False)
    assert info["workers"][1] == {"url": urls[1], "weight_version": "7"}


async def test_weight_checker_checksum_compare_reset(fleet2):
    proxy, sims = fleet2
    first = await post(proxy, "/weight_checker", json={"action": "checksum"})
    assert first["consistent"] is True and sorted(first["checksums"]) == sorted([*params.PARAM_SHAPES, "checkpoint"])
    assert [w["url"] for w in first["workers"]] == [url_of(s) for s in sims]
    baseline = first["checksums"]
    assert await post(proxy, "/weight_checker", json={"action": "compare", "baseline": baseline}) == {
        "match": True, "mismatches": []}
    assert await post(proxy, "/weight_checker", json={"action": "reset"}) == {"status": "reset"}
    changed = await post(proxy, "/weight_checker", json={"action": "compare", "baseline": baseline})
    assert changed == {"match": False, "mismatches": sorted(params.PARAM_SHAPES)}
    refused = await post(proxy, "/weight_checker", 400, json={"action": "compare"})
    assert refused["error"] == {"message": "action='compare' requires a 'baseline' object", "type": "BadRequestError",
                                "param": "baseline", "code": 400}
    assert (await post(proxy, "/weight_checker", 400, json={"action": "x"}))["error"]["param"] == "action"


# --- weight transfer ------------------------------------------------------------------------------

async def test_nccl_weight_transfer_round_on_every_worker(fleet2, fake_group):
    proxy, sims = fleet2
    assert await post(proxy, "/init_weight_transfer_engine", json={"init_info": INIT}) == {
        "message": "Weight transfer initialized"}
    assert [j["rank"] for j in fake_group] == [1, 2]  # each worker its own rank after the trainer's 0
    assert await post(proxy, "/start_weight_update") == {"message": "Weight update started"}
    assert await post(proxy, "/update_weights", json={"update_info": META}) == {"message": "Weights updated"}
    empty = {"names": [], "dtype_names": [], "shapes": []}  # vLLM: reuse the last round's metadata
    assert await post(proxy, "/update_weights", json={"update_info": empty}) == {"message": "Weights updated"}
    assert all([u["names"] for u in s.app[WEIGHTS].updates] == [META["names"]] * 2 for s in sims)
    assert await post(proxy, "/finish_weight_update", json={"weight_version": "v1"}) == {
        "message": "Weight update finished"}
    assert [state(s).weight_version for s in sims] == ["v1", "v1"]
    assert (await get(proxy, "/weight_info"))["weight_version"] == "v1"
    assert await post(proxy, "/update_weight_version", json={"new_version": "v2"}) == {
        "success": True, "message": "Weight version updated to v2", "new_version": "v2"}
    refused = await post(proxy, "/finish_weight_update", 409)  # finished already: no update is open (vLLM errs too)
    assert refused["error"]["message"].startswith("finish_weight_update called without a matching start_weight_update")
    assert await post(proxy, "/start_weight_update") == {"message": "Weight update started"}
    assert await post(proxy, "/finish_weight_update") == {"message": "Weight update finished"}
    assert await post(proxy, "/shutdown_weight_transfer_engine") == {"message": "Weight transfer shut down"}
    assert all(not s.app[WEIGHTS].groups for s in sims)
    assert (await post(proxy, "/update_weights", 409, json={"update_info": META}))["error"]["type"] == "ConflictError"


async def test_nccl_steps_without_a_group_fail_at_once_in_both_dialects(make_proxy, sim):
    proxy = await make_proxy(sim)  # --weight-update-timeout stays 720 s: nothing may wait for it
    started = time.monotonic()
    prime_rl = await post(proxy, "/update_weights", 409, json={})
    assert prime_rl["error"]["message"] == (
        "update_weights: no weight-update group is live, so no NCCL push can reach the workers. Join one first "
        "(prime-rl: POST /init_broadcaster; vLLM: POST /init_weight_transfer_engine; SGLang: POST "
        "/init_weights_update_group), or load a checkpoint from disk (prime-rl: POST /update_weights with "
        "weight_dir)")
    await post(proxy, "/update_weights", 409, json={"weight_dir": None})
    await post(proxy, "/update_weights", 409, json={"update_info": META})
    await post(proxy, "/start_weight_update", 409)
    await post(proxy, "/collective_rpc", 409, json={"method": "update_weights_nccl",
                                                    "kwargs": {"update_info": META}})
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("path,body,words", [
    ("/init_weight_transfer_engine", {"init_info": {**INIT, "nccl_unique_id_b64": "AAAA"}}, "ncclUniqueId"),
    ("/init_weight_transfer_engine", {"init_info": {**INIT, "packed": True}}, "packed buffers"),
    ("/update_weights", {"update_info": {**META, "packed": True}}, "packed buffers"),
    ("/update_weights", {"update_info": {**META, "ipc_handles_pickled": "x"}}, "CUDA IPC handles"),
    ("/start_draft_weight_update", None, "no draft-model target"),
    ("/collective_rpc", {"method": "reset_weights"}, "SGLang has no collective_rpc"),
])
async def test_what_sglang_cannot_honour_is_a_501_naming_it(proxy, sim, path, body, words):
    refused = await post(proxy, path, 501, json=body)
    assert refused["error"]["type"] == "NotImplementedError" and words in refused["error"]["message"]
    assert state(sim).weight_version == "default" and not state(sim).paused


async def test_bad_vllm_bodies_are_400s_naming_the_field(proxy):
    assert (await post(proxy, "/init_weight_transfer_engine", 400, json={}))["error"]["param"] == "init_info"
    assert (await post(proxy, "/init_weight_transfer_engine", 400, json={"init_info": {**INIT, "master_port": 0}})
            )["error"]["param"] == "master_port"
    proxy.app[ADMIN].push.live_groups.add("weight_update_group")
    bad = {**META, "dtype_names": ["bfloat16", "float99"]}
    assert (await post(proxy, "/update_weights", 400, json={"update_info": bad}))["error"]["param"] == "dtypes"
    assert (await post(proxy, "/update_weights", 400, json={"update_info": {"names": []}}))["error"]["param"] == (
        "update_info.names")
    assert (await post(proxy, "/finish_weight_update", 400, json={"weight_version": 3}))["error"]["param"] == (
        "weight_version")


async def test_a_failed_nccl_receive_is_the_fleets_error_body_not_a_500(fleet2, fake_group):
    proxy, sims = fleet2
    await post(proxy, "/init_weight_transfer_engine", json={"init_info": INIT})
    sims[1].app[RL_SIM].faults.append({"kind": "fail", "message": "Failed to receive."})
    body = await post(proxy, "/update_weights", 503, json={"update_info": META})  # one worker: retryable
    assert (body["outcome"], body["weight_version"]) == ("rolled_back", "default")
    assert body["error"]["type"] == "AdminCallFailed" and body["error"]["code"] == 503
    assert body["workers"][1] == {"url": url_of(sims[1]), "success": False, "status": 400,
                                  "message": "Failed to receive.", "weight_version": "default"}
    assert not any(s.app[WEIGHTS].groups for s in sims)  # destroyed: the same name joins again
    await post(proxy, "/init_weight_transfer_engine", json={"init_info": INIT})
    for sim in sims:  # every worker refuses the push itself: retrying it will not help (400)
        sim.app[RL_SIM].faults.append({"kind": "fail"})
    rpc = await post(proxy, "/collective_rpc", 400, json={"method": "update_weights_nccl",
                                                          "kwargs": {"update_info": META}})
    assert rpc["outcome"] == "rolled_back"


async def test_finish_after_a_failed_receive_is_refused_until_the_weights_arrive_everywhere(fleet2, fake_group):
    proxy, sims = fleet2
    proxy.app[ADMIN].weights.loaded_path = None  # the weights came over NCCL: nothing on disk to roll back to
    await post(proxy, "/init_weight_transfer_engine", json={"init_info": INIT})
    sims[1].app[RL_SIM].faults.append({"kind": "fail", "message": "Failed to receive."})
    assert (await post(proxy, "/update_weights", 503, json={"update_info": META}))["outcome"] == "held_paused"
    refused = await post(proxy, "/finish_weight_update", 409, json={"weight_version": "v1"})
    assert refused["error"]["message"].startswith("finish_weight_update: the workers are held paused after a failed")
    assert [state(s).weight_version for s in sims] == ["default", "default"]  # no version set on a lie
    assert (await post(proxy, "/resume", 409))["error"]["type"] == "ConflictError"
    await post(proxy, "/init_weight_transfer_engine", json={"init_info": INIT})  # the group was destroyed
    assert await post(proxy, "/update_weights", json={"update_info": META}) == {"message": "Weights updated"}
    assert await post(proxy, "/finish_weight_update", json={"weight_version": "v1"}) == {
        "message": "Weight update finished"}
    assert [state(s).weight_version for s in sims] == ["v1", "v1"]
    assert await post(proxy, "/resume") == {"status": "resumed"}
    assert not any(state(s).paused for s in sims)


@pytest.mark.parametrize("prompts,n,seed,version", [
    (1, 1, None, "0.5.17"), (1, 3, 5, "0.5.17"), (1, 12, None, "0.5.23"), (2, 1, None, "0.5.17"),
    (3, 2, 7, "0.5.17"), (11, 2, None, "0.5.23")])
def test_every_payload_shape_maps_its_rids_back_to_the_response_id(prompts, n, seed, version):
    call = sglang_request([FOX] * prompts, SamplingRequest(n=n, seed=seed), [4] * prompts,
                          rid="chatcmpl-a-1-0", stream=False, api=features_for(version))
    assert response_id_of(call.rids) == "chatcmpl-a-1-0"
