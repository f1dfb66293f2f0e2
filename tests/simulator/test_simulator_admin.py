"""The simulator's control plane: abort, disconnects, pause/continue, weights, info, routing, startup."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import orjson
import pytest

from token_proxy.simulator import SIM_STATE, SimConfig, create_sim_app, start_simulator
from token_proxy.simulator.testing import parse_sse

FOX = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
LONG = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}
PAUSED_OK = {"message": "Generation paused successfully.", "status": "ok"}
CONTINUED_OK = {"message": "Generation continued successfully.", "status": "ok"}


@pytest.fixture
async def sim(aiohttp_client, tokenizer_dir):
    """A slow server (2 ms per token), so requests are still running when a control call lands."""
    app = create_sim_app(SimConfig(tokenizer_path=str(tokenizer_dir), tpot_s=0.002))
    return await aiohttp_client(app)


def state(client):
    return client.server.app[SIM_STATE]


async def until(predicate, timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never became true"
        await asyncio.sleep(0.005)


async def started(client, count: int = 1) -> None:
    await until(lambda: sum(len(s.output_ids) > 2 for s in state(client).running.values()) >= count)


def post_json(client, path: str, body: dict | None = None):
    return asyncio.create_task(_post(client, path, body))


async def _post(client, path: str, body: dict | None):
    response = await client.post(path, json=body)
    raw = await response.read()
    return response.status, raw


# --- abort ---------------------------------------------------------------------------------


async def test_abort_non_streaming_request_by_rid(sim):
    task = post_json(sim, "/generate", {"rid": "abort-me", "input_ids": FOX, "sampling_params": LONG})
    await started(sim)
    response = await sim.post("/abort_request", json={"rid": "abort-me"})
    assert (response.status, await response.read()) == (200, b"")
    status, raw = await task
    out = orjson.loads(raw)
    assert status == 200 and out["meta_info"]["finish_reason"] == ABORTED
    assert out["meta_info"]["id"] == "abort-me"
    assert 0 < out["meta_info"]["completion_tokens"] == len(out["output_ids"]) < 3000
    assert state(sim).running == {} and state(sim).aborted == ["abort-me"]


async def test_abort_streaming_request_ends_with_abort_event_then_done(sim):
    task = post_json(
        sim, "/generate", {"rid": "s1", "input_ids": FOX, "sampling_params": LONG, "stream": True}
    )
    await started(sim)
    await sim.post("/abort_request", json={"rid": "s1"})
    status, raw = await task
    events = parse_sse(raw)
    assert status == 200 and events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["finish_reason"] == ABORTED
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-2])
    assert events[-2]["output_ids"][: len(events[-3]["output_ids"])] == events[-3]["output_ids"]
    assert state(sim).aborted == ["s1"]


async def test_unknown_rid_is_a_no_op_and_abort_matches_rid_prefixes(sim):
    tasks = [
        post_json(sim, "/generate", {"rid": rid, "input_ids": FOX, "sampling_params": LONG})
        for rid in ("job-1", "job-10", "other")
    ]
    await started(sim, 3)
    await sim.post("/abort_request", json={"rid": "job"})  # no request is called "job": ignored
    await asyncio.sleep(0.02)
    assert sorted(state(sim).running) == ["job-1", "job-10", "other"]
    await sim.post("/abort_request", json={"rid": "job-1"})  # SGLang's scheduler aborts by startswith
    results = [orjson.loads(raw) for _, raw in await asyncio.gather(*tasks[:2])]
    assert [r["meta_info"]["finish_reason"] for r in results] == [ABORTED, ABORTED]
    assert list(state(sim).running) == ["other"]
    await sim.post("/abort_request", json={"abort_all": True})
    _, raw = await tasks[2]
    assert orjson.loads(raw)["meta_info"]["finish_reason"] == ABORTED
    assert sorted(state(sim).aborted) == ["job-1", "job-10", "other"]


async def test_abort_parent_rid_aborts_all_n_children(sim):
    task = post_json(sim, "/generate", {"rid": "par", "input_ids": FOX, "sampling_params": {**LONG, "n": 2}})
    await started(sim, 2)
    await sim.post("/abort_request", json={"rid": "par"})
    _, raw = await task
    outs = orjson.loads(raw)
    assert [o["meta_info"]["finish_reason"] for o in outs] == [ABORTED, ABORTED]
    assert all(rid.startswith("par_") for rid in state(sim).aborted) and len(state(sim).aborted) == 2


# --- client disconnects --------------------------------------------------------------------


async def test_disconnect_of_a_non_streaming_client_stops_generation(sim):
    session = aiohttp.ClientSession()
    request = asyncio.create_task(
        session.post(
            sim.make_url("/generate"), json={"rid": "gone", "input_ids": FOX, "sampling_params": LONG}
        )
    )
    await started(sim)
    request.cancel()
    await session.close()
    await until(lambda: not state(sim).running)
    assert state(sim).aborted == ["gone"]


async def test_disconnect_of_a_streaming_client_stops_generation(sim):
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            sim.make_url("/generate"),
            json={"rid": "gone-s", "input_ids": FOX, "sampling_params": LONG, "stream": True},
        )
        first = await response.content.readuntil(b"\n\n")
        assert orjson.loads(first[len(b"data: ") :])["meta_info"]["completion_tokens"] == 1
        response.close()
    await until(lambda: not state(sim).running)
    generated = state(sim).counters.generation_tokens
    assert state(sim).aborted == ["gone-s"] and generated < 3000
    await asyncio.sleep(0.05)
    assert state(sim).counters.generation_tokens == generated


# --- pause / continue ----------------------------------------------------------------------


async def test_pause_abort_mode_aborts_in_flight_and_holds_new_requests(sim):
    in_flight = post_json(sim, "/generate", {"rid": "old", "input_ids": FOX, "sampling_params": LONG})
    await started(sim)
    response = await sim.post("/pause_generation", json={})
    assert await response.json() == PAUSED_OK
    _, raw = await in_flight
    assert orjson.loads(raw)["meta_info"]["finish_reason"] == ABORTED
    waiting = post_json(
        sim, "/generate", {"rid": "new", "input_ids": FOX, "sampling_params": {"max_new_tokens": 2}}
    )
    await until(lambda: "new" in state(sim).running)  # arrived, held by the pause
    assert not waiting.done()
    load = await (await sim.get("/get_load")).json()
    assert (load[0]["num_reqs"], load[0]["num_waiting_reqs"]) == (1, 1)
    assert (await sim.get("/health_generate")).status == 503
    assert await (await sim.post("/continue_generation", json={})).json() == CONTINUED_OK
    _, raw = await waiting
    assert orjson.loads(raw)["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


@pytest.mark.parametrize(("mode", "retractions"), [("in_place", 0), ("retract", 1)])
async def test_pause_in_place_and_retract_keep_requests(sim, mode, retractions):
    task = post_json(sim, "/generate", {"input_ids": FOX, "sampling_params": {**LONG, "max_new_tokens": 40}})
    await started(sim)
    assert await (await sim.post("/pause_generation", json={"mode": mode})).json() == PAUSED_OK
    (sequence,) = state(sim).running.values()
    frozen = len(sequence.output_ids)
    await asyncio.sleep(0.03)
    assert len(sequence.output_ids) == frozen
    flush = await sim.post("/flush_cache")
    assert (flush.status, await flush.text()) == (400, "Flush cache failed.\n")
    await sim.post("/continue_generation", json={})
    _, raw = await task
    meta = orjson.loads(raw)["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 40}
    assert meta["num_retractions"] == retractions


@pytest.mark.parametrize(("mode", "running", "waiting"), [("in_place", 2, 0), ("retract", 0, 2)])
async def test_a_retract_pause_moves_running_requests_to_the_waiting_queue(sim, mode, running, waiting):
    """As SGLang 0.5.17's Scheduler.pause_generation: retract empties the running batch (every request back
    in the waiting queue, its KV freed), so a client that waits for zero running requests (TorchRL) gets
    there; in_place leaves the batch as it is. /v1/loads, /get_load and /metrics agree (issue 31)."""
    body = {"input_ids": FOX, "sampling_params": {**LONG, "max_new_tokens": 400}}
    tasks = [post_json(sim, "/generate", body) for _ in range(2)]
    await started(sim, 2)
    assert await (await sim.post("/pause_generation", json={"mode": mode})).json() == PAUSED_OK
    (core,) = (await (await sim.get("/v1/loads?include=core")).json())["loads"]
    assert (core["num_running_reqs"], core["num_waiting_reqs"]) == (running, waiting)
    assert (core["num_used_tokens"] == 0) is (mode == "retract")
    (load,) = await (await sim.get("/get_load")).json()
    assert (load["num_reqs"], load["num_waiting_reqs"]) == (2, waiting)
    metrics = await (await sim.get("/metrics")).text()
    assert [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
            if line.startswith(("sglang:num_running_reqs{", "sglang:num_queue_reqs{"))] == [running, waiting]
    await sim.post("/continue_generation", json={})
    for task in tasks:
        _, raw = await task
        assert orjson.loads(raw)["meta_info"]["finish_reason"] == {"type": "length", "length": 400}


async def test_pause_rejects_an_unknown_mode(sim):
    response = await sim.post("/pause_generation", json={"mode": "sideways"})
    body = await response.json()
    assert response.status == 400 and body["type"] == "Bad Request" and "literal_error" in body["message"]


# --- weights -------------------------------------------------------------------------------


async def test_update_weights_from_disk(sim, tmp_path):
    before = orjson.loads(
        await (
            await sim.post(
                "/generate",
                json={"input_ids": FOX, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
            )
        ).read()
    )
    empty_dir = tmp_path / "nothing"
    empty_dir.mkdir()
    failed = await sim.post("/update_weights_from_disk", json={"model_path": str(empty_dir)})
    assert failed.status == 400 and await failed.json() == {
        "success": False,
        "num_paused_requests": 0,
        "message": f"Failed to get weights iterator: Cannot find any model weights with `{empty_dir}`.",
    }
    (tmp_path / "step1").mkdir()
    (tmp_path / "step1" / "model.safetensors").write_bytes(b"\0")
    in_flight = post_json(
        sim, "/generate", {"input_ids": FOX, "sampling_params": {**LONG, "max_new_tokens": 30}}
    )
    await started(sim)
    response = await sim.post(
        "/update_weights_from_disk", json={"model_path": str(tmp_path / "step1"), "weight_version": "v1"}
    )
    assert await response.json() == {
        "success": True,
        "num_paused_requests": 0,
        "message": "Succeeded to update model weights. Weight version updated to v1.",
    }
    assert state(sim).running == {}  # the update waited for the running request to finish...
    _, raw = await in_flight
    assert orjson.loads(raw)["meta_info"]["finish_reason"] == {"type": "length", "length": 30}  # ...unharmed
    after = orjson.loads(
        await (
            await sim.post(
                "/generate",
                json={"input_ids": FOX, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
            )
        ).read()
    )
    assert after["meta_info"]["weight_version"] == "v1" and after["output_ids"] != before["output_ids"]
    assert after["meta_info"]["cached_tokens"] == 0  # loading flushed the prefix cache
    info = await (await sim.get("/model_info")).json()
    assert info["weight_version"] == "v1"


async def test_missing_required_fields_are_validation_errors(sim):
    for path in ("/update_weights_from_disk", "/update_weight_version"):
        response = await sim.post(path, json={})
        body = await response.json()
        assert response.status == 400 and body["object"] == "error" and "'type': 'missing'" in body["message"]


# --- info and routing ----------------------------------------------------------------------


async def test_info_endpoints(aiohttp_client, tokenizer_dir):
    config = SimConfig(
        tokenizer_path=str(tokenizer_dir),
        context_length=2048,
        served_model_name="tiny",
        incremental_streaming_output=True,
        weight_version="w0",
    )
    client = await aiohttp_client(create_sim_app(config))
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 2048
    info = await (await client.get("/server_info")).json()
    assert (info["context_length"], info["max_req_input_len"], info["served_model_name"]) == (
        2048,
        2042,
        "tiny",
    )
    assert info["incremental_streaming_output"] is True and info["port"] == client.port
    model = await (await client.get("/get_model_info")).json()
    assert (model["tokenizer_path"], model["weight_version"], model["model_path"]) == (
        str(tokenizer_dir),
        "w0",
        "sim/qwen2-tiny",
    )
    metrics = await (await client.get("/metrics")).text()
    labels = 'engine_type="unified",model_name="tiny",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    assert f"sglang:num_running_reqs{{{labels}}} 0.0" in metrics


async def test_unknown_routes_answer_like_fastapi(sim):
    missing = await sim.get("/nope")
    assert (missing.status, await missing.json()) == (404, {"detail": "Not Found"})
    wrong = await sim.get("/generate")
    assert (wrong.status, await wrong.json()) == (405, {"detail": "Method Not Allowed"})


async def test_received_bodies_are_recorded_in_order(sim):
    bodies = [{"input_ids": FOX, "sampling_params": {"max_new_tokens": k}} for k in (1, 2)]
    for body in bodies:
        await sim.post("/generate", json=body)
    await sim.post("/generate", data=b"{not json")
    assert state(sim).received == bodies


# --- starting it ---------------------------------------------------------------------------


async def test_start_simulator_binds_a_free_port(tokenizer_dir):
    runner, port = await start_simulator(SimConfig(tokenizer_path=str(tokenizer_dir)), "127.0.0.1", 0)
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/health") as response,
        ):
            assert (response.status, await response.read()) == (200, b"")
    finally:
        await runner.cleanup()


def test_command_line_logs_a_json_ready_line(tokenizer_dir):
    """Through the logger, so --log-format json keeps every line JSON."""
    from tests.support.admin_fixtures import ready_url, stop_process

    process = subprocess.Popen([sys.executable, "-m", "token_proxy.simulator", "--port", "0", "--tokenizer",
                                str(tokenizer_dir), "--tpot-ms", "1", "--incremental-streaming-output",
                                "--log-format", "json"], stderr=subprocess.PIPE, text=True)
    try:
        assert ready_url(process).startswith("http://127.0.0.1:")
    finally:
        stop_process(process)


async def test_max_running_requests_queues_the_rest(aiohttp_client, tokenizer_dir):
    config = SimConfig(tokenizer_path=str(tokenizer_dir), tpot_s=0.002, max_running_requests=1)
    client = await aiohttp_client(create_sim_app(config))
    body = {"input_ids": FOX, "sampling_params": {**LONG, "max_new_tokens": 20}}
    first, second = post_json(client, "/generate", body), post_json(client, "/generate", body)
    await started(client)
    load = (await (await client.get("/get_load")).json())[0]
    assert (load["num_reqs"], load["num_waiting_reqs"]) == (2, 1)
    results = [orjson.loads(raw)["meta_info"] for _, raw in await asyncio.gather(first, second)]
    assert [m["finish_reason"] for m in results] == [{"type": "length", "length": 20}] * 2
    assert results[1]["forward_entry_time"] >= results[0]["request_finished_ts"]


async def test_streamed_wrong_type_cuts_the_connection_after_headers(sim):
    """0.5.17 raises TypeError inside the SSE generator: status 200, then the body breaks off."""
    response = await sim.post(
        "/generate", json={"input_ids": FOX, "stream": True, "sampling_params": {"temperature": "hot"}}
    )
    assert response.status == 200 and response.content_type == "text/event-stream"
    with pytest.raises(aiohttp.ClientPayloadError):
        await response.read()


async def test_a_crash_cuts_in_flight_streams(sim):
    async with aiohttp.ClientSession() as session:
        body = {"rid": "victim", "input_ids": FOX, "sampling_params": LONG, "stream": True}
        response = await session.post(sim.make_url("/generate"), json=body)
        await response.content.readuntil(b"\n\n")
        crash = await sim.post("/generate", json={"input_ids": [999999]})
        assert crash.status == 500
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
    await until(lambda: not state(sim).running)
    assert (await sim.get("/health_generate")).status == 503
