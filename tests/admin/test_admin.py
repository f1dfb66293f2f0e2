"""prime-rl's admin plane on SGLang, the native forwarder, the pass-through, and fan-out to workers."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests.support.admin_fixtures import free_port, until
from token_proxy.admin import ADMIN
from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.params import initial_params
from token_proxy.simulator.testing import parse_sse
from token_proxy.simulator.weight_routes import WEIGHTS

USER = [{"role": "user", "content": "Count slowly."}]
LONG = {"messages": USER, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
FOX = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]


def state(server):
    return server.app[SIM_STATE]


def weights_dir(tmp_path, name: str):
    directory = tmp_path / name
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"\0")
    return directory


async def stream_chat(proxy, body: dict) -> list:
    response = await proxy.post("/v1/chat/completions", data=orjson.dumps({**body, "stream": True}))
    assert response.status == 200
    return parse_sse(await response.read())


def final_choice(events: list) -> dict:
    return [e for e in events[:-1] if e["choices"] and e["choices"][0].get("finish_reason")][-1]["choices"][0]


@pytest.fixture
async def slow_sim(make_sim):
    return await make_sim(tpot_s=0.003)


# --- one full update step under load ----------------------------------------------------------


async def test_update_step_under_load_loses_nothing_and_reports_versions(make_proxy, slow_sim, tmp_path):
    proxy = await make_proxy(slow_sim)
    before = await (await proxy.post("/v1/chat/completions", json={**LONG, "max_tokens": 4})).json()
    assert before["choices"][0]["weight_versions"] == [{"version": "default", "start": 0, "end": 4}]
    rollouts = [asyncio.create_task(stream_chat(proxy, LONG)) for _ in range(8)]
    await until(lambda: sum(len(s.output_ids) > 3 for s in state(slow_sim).running.values()) == 8)

    assert await (await proxy.post("/pause", params={"mode": "keep", "clear_cache": "false"})).json() == {
        "status": "paused"}
    assert state(slow_sim).pause_mode == "retract"
    frozen = {rid: len(s.output_ids) for rid, s in state(slow_sim).running.items()}
    response = await proxy.post("/update_weights", json={"weight_dir": str(weights_dir(tmp_path, "ckpt/step_1"))})
    assert (response.status, await response.json()) == (200, {"status": "ok", "weight_version": "1"})
    assert {rid: len(s.output_ids) for rid, s in state(slow_sim).running.items()} == frozen  # still paused
    assert await (await proxy.post("/resume")).json() == {"status": "resumed"}

    results = await asyncio.wait_for(asyncio.gather(*rollouts), timeout=20)
    for events in results:
        assert events[-1] == "[DONE]"
        choice = final_choice(events)
        assert choice["finish_reason"] == "length"
        ids = [t for e in events[:-1] if e["choices"] for t in (e["choices"][0].get("token_ids") or [])]
        assert len(ids) == 60
        (old, new) = choice["weight_versions"]
        assert (old["version"], old["start"], new["version"], new["end"]) == ("default", 0, "1", 60)
        assert 3 < old["end"] == new["start"] < 60
    after = await (await proxy.post("/v1/chat/completions", json={**LONG, "max_tokens": 4})).json()
    assert after["choices"][0]["weight_versions"] == [{"version": "1", "start": 0, "end": 4}]
    assert state(slow_sim).running == {} and state(slow_sim).aborted == []


async def test_a_flushing_update_while_paused_with_requests_crashes_sglang_as_the_real_one_does(slow_sim,
                                                                                                 tmp_path):
    """Seen on SGLang 0.5.17: "AssertionError: Cache flush failed after updating weights" kills it."""
    async with aiohttp.ClientSession() as session:
        stream = asyncio.create_task(session.post(slow_sim.make_url("/generate"), json={
            "input_ids": FOX, "stream": True, "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}))
        await until(lambda: state(slow_sim).running)
        async with session.post(slow_sim.make_url("/pause_generation"), json={"mode": "retract"}) as resp:
            assert resp.status == 200
        async with session.post(slow_sim.make_url("/update_weights_from_disk"),
                                json={"model_path": str(weights_dir(tmp_path, "ckpt"))}) as resp:
            assert resp.status == 500 and state(slow_sim).crashed
        stream.cancel()


@pytest.mark.parametrize("path", ["/update_weights", "/update_weights_from_disk"])
async def test_the_proxy_updates_without_a_flush_that_would_crash_and_flushes_after_resume(
        make_proxy, slow_sim, tmp_path, path):
    proxy = await make_proxy(slow_sim)
    rollouts = [asyncio.create_task(stream_chat(proxy, {**LONG, "max_tokens": 40})) for _ in range(3)]
    await until(lambda: len(state(slow_sim).running) == 3)
    assert (await proxy.post("/pause")).status == 200
    slow_sim.app[SIM_STATE].prefix_cache.insert(FOX)  # something the flush must clear
    key = "weight_dir" if path == "/update_weights" else "model_path"
    response = await proxy.post(path, json={key: str(weights_dir(tmp_path, "ckpt"))})
    assert response.status == 200, await response.text()
    assert not state(slow_sim).crashed
    plane = proxy.app[ADMIN]
    assert plane.owed_flushes == {plane.workers.client.base_url}
    resume = "/resume" if path == "/update_weights" else "/continue_generation"
    assert (await proxy.post(resume)).status == 200
    for events in await asyncio.wait_for(asyncio.gather(*rollouts), timeout=20):
        assert final_choice(events)["finish_reason"] == "length"
    await until(lambda: not plane.owed_flushes)
    assert state(slow_sim).prefix_cache.match(FOX) == 0  # flushed once idle


# --- SGLang refusing an update ----------------------------------------------------------------


async def test_update_from_a_missing_local_dir_is_refused_before_sglang(make_proxy, sim, tmp_path):
    proxy = await make_proxy(sim)
    response = await proxy.post("/update_weights", json={"weight_dir": str(tmp_path / "nope")})
    body = await response.json()
    assert response.status == 400 and body["error"]["param"] == "weight_dir"
    assert body["error"]["message"] == (f"weight_dir '{tmp_path / 'nope'}' is not an existing directory here; "
                                        "refused before SGLang, which would try it as a Hugging Face Hub id")
    native = await proxy.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")})
    assert native.status == 400 and (await native.json())["error"]["param"] == "model_path"
    assert state(sim).weight_version == "default"


async def test_sglang_rejecting_the_path_is_a_clear_error_with_its_message(make_proxy, sim, tmp_path):
    proxy = await make_proxy(sim)
    empty = tmp_path / "empty"
    empty.mkdir()
    response = await proxy.post("/update_weights", json={"weight_dir": str(empty)})
    body = await response.json()
    assert response.status == 400 and body["error"]["type"] == "AdminCallFailed"
    assert body["error"]["message"] == (
        f"update_weights failed on 1 of 1 worker(s): {proxy_backend(proxy)}: Failed to get weights iterator: "
        f"Cannot find any model weights with `{empty}`.")
    native = await proxy.post("/update_weights_from_disk", json={"model_path": str(empty)})
    assert native.status == 400 and await native.json() == {  # SGLang's reply, unchanged
        "success": False, "num_paused_requests": 0,
        "message": f"Failed to get weights iterator: Cannot find any model weights with `{empty}`."}
    assert state(sim).weight_version == "default"


def proxy_backend(proxy) -> str:
    return proxy.app[ADMIN].workers.client.base_url


async def test_update_weights_null_with_a_group_but_no_push_times_out_clearly(make_proxy, sim):
    proxy = await make_proxy(sim, weight_update_timeout_s=0.3)
    proxy.app[ADMIN].push.live_groups.add("weight_update_group")  # joined, but the trainer never pushes
    response = await proxy.post("/update_weights", json={"weight_dir": None})
    body = await response.json()
    assert response.status == 504
    assert body["error"]["message"].startswith("no weight broadcast reached the workers within 0.3 s")


# --- fan-out ---------------------------------------------------------------------------------


async def test_fan_out_reaches_every_worker_and_names_the_one_down(make_sim, make_proxy, tmp_path):
    first, second = await make_sim(), await make_sim()
    urls = [str(s.make_url("")).rstrip("/") for s in (first, second)]
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = await make_proxy(first, workers=(*urls, dead), admin_timeout_s=5.0)
    response = await proxy.post("/pause")
    body = await response.json()
    assert response.status == 503  # worth a retry, as prime-rl does on 5xx
    assert body["error"]["message"].startswith(f"pause failed on 1 of 3 worker(s): {dead}: SGLang at {dead} is "
                                               "unreachable")
    assert body["error"]["message"].endswith("; the workers that paused were resumed (nothing changed)")
    assert not state(first).paused and not state(second).paused  # a partial pause is undone
    assert await (await proxy.get("/is_paused")).json() == {"is_paused": False}
    vllm = await proxy.post("/pause", params={"mode": "abort"})  # vLLM's dialect: the same rule
    assert vllm.status == 503 and not state(first).paused and not state(second).paused
    assert await (await proxy.get("/is_paused")).json() == {"is_paused": False}

    healthy = await make_proxy(first, workers=tuple(urls))
    assert await (await healthy.post("/resume")).json() == {"status": "resumed"}
    assert not state(first).paused and not state(second).paused
    response = await healthy.post("/update_weights", json={"weight_dir": str(weights_dir(tmp_path, "step_7"))})
    assert await response.json() == {"status": "ok", "weight_version": "7"}
    assert state(first).weight_version == state(second).weight_version == "7"
    native = await proxy.post("/update_weight_version", json={"new_version": "8"})
    body = await native.json()
    assert native.status == 503 and body["success"] is False
    assert [(w["url"], w["success"]) for w in body["workers"]] == [(urls[0], True), (urls[1], True), (dead, False)]


async def test_liveness_follows_every_worker(make_sim, make_proxy):
    live = await make_sim()
    url = str(live.make_url("")).rstrip("/")
    proxy = await make_proxy(live)
    response = await proxy.get("/liveness")
    assert (response.status, await response.json()) == (200, {"status": "ok"})
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = await make_proxy(live, workers=(url, dead))
    response = await proxy.get("/liveness")
    body = await response.json()
    assert response.status == 503 and body["status"] == "engine_unresponsive" and dead in body["message"]


# --- protecting the engine ----------------------------------------------------------------------


@pytest.mark.parametrize(("change", "message"), [
    ({"master_port": 0}, "master_port must be an integer port in 1..65535, got 0"),
    ({"master_port": 70000}, "master_port must be an integer port in 1..65535, got 70000"),
    ({"rank_offset": 0}, "rank_offset must be >= 1 (rank 0 is the trainer), got 0"),
    ({"world_size": 1}, "world_size must be an integer >= 2, got 1"),
    ({"rank_offset": 2, "world_size": 2}, ("world_size 2 is too small: the trainer (rank 0) and 1 inference "
                                           "rank(s) starting at rank 2 need at least 3")),
    ({"backend": "mpi"}, "backend must be one of nccl, gloo, got 'mpi'"),
    ({"master_address": ""}, "master_address must be a host name or address, got ''"),
])
async def test_group_joins_that_would_block_sglang_are_refused(proxy, change, message):
    body = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2,
            "group_name": "g", "backend": "nccl", **change}
    response = await proxy.post("/init_weights_update_group", json=body)
    assert (response.status, (await response.json())["error"]["message"]) == (400, message)


async def test_init_broadcaster_converts_prime_rl_ranks_for_each_worker(make_sim, make_proxy):
    first, second = await make_sim(), await make_sim()
    urls = tuple(str(s.make_url("")).rstrip("/") for s in (first, second))
    proxy = await make_proxy(first, workers=urls)
    too_small = {"host": "127.0.0.1", "port": 29500, "timeout": 5, "rank_offset": 0, "inference_world_size": 1}
    response = await proxy.post("/init_broadcaster", json=too_small)
    assert (response.status, (await response.json())["error"]["message"]) == (
        400, ("world_size 2 is too small: the trainer (rank 0) and 2 inference rank(s) starting at rank 1 need "
              "at least 3"))
    quantized = await proxy.post("/init_broadcaster", json={**too_small, "quantize_in_weight_transfer": True})
    assert quantized.status == 400
    from token_proxy.admin.forward import group_bodies

    native = {"master_address": "h", "master_port": 1234, "rank_offset": 3, "world_size": 6}
    bodies = await group_bodies(proxy.app[ADMIN], native, list(urls))
    assert [b["rank_offset"] for b in bodies] == [3, 4]


async def test_update_from_distributed_needs_consistent_specs(proxy):
    body = {"names": ["a", "b"], "dtypes": ["bfloat16"], "shapes": [[2], [2]]}
    response = await proxy.post("/update_weights_from_distributed", json=body)
    assert (response.status, (await response.json())["error"]["message"]) == (
        400, "names, dtypes and shapes differ in length (2, 1, 2)")
    body = {"names": ["a"], "dtypes": ["complex32x"], "shapes": [[2]]}
    assert (await (await proxy.post("/update_weights_from_distributed", json=body)).json())["error"][
        "message"] == "unknown dtype 'complex32x'"


async def test_an_admin_call_that_hangs_is_bounded_and_the_proxy_stays_responsive(sim, make_proxy,
                                                                                   aiohttp_server):
    async def stuck(request):
        await asyncio.sleep(10)

    app = web.Application()
    app.router.add_post("/continue_generation", stuck)
    hung = await aiohttp_server(app)
    hung_url = str(hung.make_url("")).rstrip("/")
    proxy = await make_proxy(sim, workers=(hung_url,), admin_timeout_s=0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    resume = asyncio.create_task(proxy.post("/resume"))
    models = await proxy.get("/v1/models")  # served while the admin call waits
    assert models.status == 200 and not resume.done()
    response = await resume
    assert loop.time() - started < 2
    assert (response.status, (await response.json())["error"]["message"]) == (
        504, (f"resume failed on 1 of 1 worker(s): {hung_url}: SGLang at {hung_url} did not answer "
              "POST /continue_generation within 0.3 s"))


# --- the native forwarder and the pass-through ----------------------------------------------------


async def test_native_endpoints_answer_as_sglang_does(proxy, sim):
    response = await proxy.post("/pause_generation", json={"mode": "sideways"})
    assert response.status == 400 and (await response.json())["type"] == "Bad Request"  # SGLang's own body
    response = await proxy.post("/pause_generation", json={"mode": "in_place"})
    assert await response.json() == {"message": "Generation paused successfully.", "status": "ok"}
    assert await (await proxy.post("/continue_generation", json={})).json() == {
        "message": "Generation continued successfully.", "status": "ok"}
    flushed = await proxy.post("/flush_cache")
    assert flushed.status == 200 and (await flushed.text()).startswith("Cache flushed.")
    version = await proxy.post("/update_weight_version", json={"new_version": "v9"})
    assert await version.json() == {"success": True, "message": "Weight version updated to v9",
                                    "new_version": "v9"}
    assert (await (await proxy.get("/model_info")).json())["weight_version"] == "v9"
    assert (await (await proxy.get("/server_info")).json())["tp_size"] == 1
    released = await proxy.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert (released.status, await released.read()) == (200, b"null")
    assert sim.app[WEIGHTS].released == {"kv_cache"}
    await proxy.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})
    assert sim.app[WEIGHTS].released == set()
    param = await proxy.post("/get_weights_by_name", json={"name": "model.norm.weight"})
    assert await param.json() == initial_params()["model.norm.weight"]


async def test_unowned_routes_pass_through_unchanged(proxy, sim):
    load = await proxy.get("/get_load")
    assert load.status == 200 and (await load.json())[0]["num_reqs"] == 0
    body = {"input_ids": FOX, "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "stream": True}
    response = await proxy.post("/generate", json=body)
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    events = parse_sse(await response.read())
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert state(sim).received[-1] == body
    aborted = await proxy.post("/abort_request", json={"rid": "nothing"})
    assert (aborted.status, await aborted.read()) == (200, b"")
    missing = await proxy.get("/v1/nothing")
    assert missing.status == 404 and (await missing.json())["error"]["type"] == "NotFoundError"


async def test_reload_weights_returns_to_the_starting_weights(proxy, sim, tmp_path):
    await proxy.post("/update_weights", json={"weight_dir": str(weights_dir(tmp_path, "step_3"))})
    assert state(sim).weight_version == "3"
    response = await proxy.post("/reload_weights")
    assert (response.status, await response.json()) == (200, {"status": "ok", "weight_version": "default"})
    assert (state(sim).weight_version, state(sim).weights_path) == ("default", "sim/qwen2-tiny")


@pytest.mark.parametrize("change,param", [({"port": 0}, "port"), ({"port": "29500"}, "port"),
                                          ({"host": ""}, "host"), ({"timeout": "soon"}, "timeout"),
                                          ({"timeout": -1}, "timeout"), ({"rank_offset": -1}, "rank_offset")])
async def test_init_broadcaster_names_prime_rls_own_fields(proxy, sim, change, param):
    body = {"host": "127.0.0.1", "port": 29500, "timeout": 5, "rank_offset": 0, "inference_world_size": 1,
            **change}
    response = await proxy.post("/init_broadcaster", json=body)
    reply = await response.json()
    assert response.status == 400 and reply["error"]["param"] == param
    assert sim.app[WEIGHTS].groups == {}  # SGLang never asked to join


async def test_a_weight_update_logs_one_line_with_version_workers_and_time(make_proxy, sim, tmp_path, caplog):
    """issue 31: a successful update logged nothing (with --disable-log-requests a whole pause, update, resume
    cycle left no trace)."""
    import logging

    proxy = await make_proxy(sim, disable_log_requests=True)
    caplog.set_level(logging.INFO, logger="token_proxy.fleet.plane")
    assert (await proxy.post("/pause")).status == 200
    response = await proxy.post("/update_weights", json={"weight_dir": str(weights_dir(tmp_path, "ckpt/step_3"))})
    assert response.status == 200, await response.text()
    assert (await proxy.post("/resume")).status == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "token_proxy.fleet.plane"]
    (line,) = [line for line in lines if line.startswith("weights updated to version")]
    backend = proxy.app[ADMIN].settings.backend_url
    assert line.startswith(f"weights updated to version 3 on {backend} in ")
    assert line.endswith(" s (was default)")


async def test_a_long_weight_update_says_it_is_still_running(make_proxy, sim, caplog, monkeypatch):
    import logging

    from token_proxy.fleet import plane as workers

    monkeypatch.setattr(workers, "PROGRESS_EVERY_S", 0.05)
    proxy = await make_proxy(sim)
    caplog.set_level(logging.INFO, logger="token_proxy.fleet.plane")
    async with proxy.app[ADMIN].transaction():
        await asyncio.sleep(0.18)
    progress = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    assert len(progress) == 3 and progress[0].startswith("weight update still running after 0 s (fleet at version")
