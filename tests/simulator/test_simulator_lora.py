"""The simulator's LoRA adapters behave as SGLang 0.5.17's (replies, messages, lora_path on /generate)."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.lora_fixtures import FOX, greedy, write_adapter
from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.testing import parse_sse


async def load(client, name: str, path) -> tuple[int, dict]:
    response = await client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
    return response.status, await response.json()


async def output_ids(client, **extra) -> list[int]:
    response = await client.post("/generate", json=greedy(**extra))
    assert response.status == 200, await response.text()
    return (await response.json())["output_ids"]


@pytest.fixture
async def sim_client(make_sim, aiohttp_client):
    return await aiohttp_client(await make_sim())


async def test_load_and_unload_reply_like_sglang(sim_client, tmp_path):
    one, two = write_adapter(tmp_path, "a"), write_adapter(tmp_path, "b")
    assert await load(sim_client, "a", one) == (200, {
        "success": True, "error_message": "", "loaded_adapters": {"a": str(one)}})
    assert await load(sim_client, "b", two) == (200, {
        "success": True, "error_message": "", "loaded_adapters": {"a": str(one), "b": str(two)}})
    assert await load(sim_client, "a", two) == (400, {
        "success": False, "error_message": "Failed to load LoRA adapter a because it is already loaded",
        "loaded_adapters": {"a": str(one), "b": str(two)}})
    response = await sim_client.post("/unload_lora_adapter", json={"lora_name": "a"})
    assert (response.status, await response.json()) == (200, {
        "success": True, "error_message": "", "loaded_adapters": {"b": str(two)}})
    response = await sim_client.post("/unload_lora_adapter", json={"lora_name": "a"})
    assert (response.status, await response.json()) == (400, {
        "success": False, "error_message": "LoRA with name a does not exist. Loaded LoRAs: odict_keys(['b'])",
        "loaded_adapters": None})


async def test_load_refusals_name_sglangs_reason(make_sim, aiohttp_client, tmp_path):
    client = await aiohttp_client(await make_sim(max_lora_rank=8, lora_target_modules=("q_proj", "k_proj", "v_proj")))
    empty = tmp_path / "empty"
    empty.mkdir()
    status, body = await load(client, "x", empty)
    assert (status, body["error_message"]) == (400, f"[Errno 2] No such file or directory: '{empty}/adapter_config.json'")
    status, body = await load(client, "x", tmp_path / "nowhere")
    assert status == 400 and body["error_message"].startswith("Repo id must be in the form")
    status, body = await load(client, "x", write_adapter(tmp_path, "big", rank=16))
    assert status == 400 and body["error_message"].startswith("LoRA adapter x with rank 16 is incompatible")
    status, body = await load(client, "x", write_adapter(tmp_path, "mlp", targets=("gate_proj",)))
    assert status == 400 and "`--lora-target-modules`" in body["error_message"]
    assert (await load(client, "x", write_adapter(tmp_path, "ok", targets=("q_proj", "k_proj"))))[0] == 200
    info = await (await client.get("/server_info")).json()
    assert (info["enable_lora"], info["max_lora_rank"], info["lora_target_modules"]) == (
        True, 8, ["q_proj", "k_proj", "v_proj"])


async def test_lora_disabled_refuses_loads_and_requests(make_sim, aiohttp_client, tmp_path):
    client = await aiohttp_client(await make_sim(enable_lora=False))
    assert await load(client, "a", write_adapter(tmp_path)) == (400, {
        "success": False, "error_message": "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.",
        "loaded_adapters": None})
    response = await client.post("/generate", json=greedy(lora_path="a"))
    assert response.status == 400
    assert (await response.json())["error"]["message"].startswith(
        "LoRA adapter 'a' was requested, but LoRA is not enabled.")


async def test_an_adapter_changes_the_output_deterministically(sim_client, tmp_path):
    await load(sim_client, "a", write_adapter(tmp_path, "a"))
    await load(sim_client, "b", write_adapter(tmp_path, "b"))
    base, with_a, with_b = await output_ids(sim_client), await output_ids(sim_client, lora_path="a"), \
        await output_ids(sim_client, lora_path="b")
    assert len({tuple(base), tuple(with_a), tuple(with_b)}) == 3
    assert await output_ids(sim_client, lora_path="a") == with_a
    # A batch mixes base and adapters, one lora_path per item.
    response = await sim_client.post("/generate", json={
        "input_ids": [FOX, FOX, FOX], "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        "lora_path": [None, "a", "b"]})
    assert [r["output_ids"] for r in await response.json()] == [base, with_a, with_b]


async def test_unknown_adapter_is_sglangs_400_json_and_stream(sim_client, tmp_path):
    await load(sim_client, "a", write_adapter(tmp_path, "a"))
    message = "Got LoRA adapter that has never been loaded: nope\nAll loaded adapters: dict_keys(['a'])."
    response = await sim_client.post("/generate", json=greedy(lora_path="nope"))
    assert (response.status, await response.json()) == (400, {"error": {"message": message}})
    response = await sim_client.post("/generate", json=greedy(lora_path="nope", stream=True))
    events = parse_sse(await response.read())
    assert response.status == 200 and events[0]["error"]["message"] == message and events[-1] == "[DONE]"


async def test_an_unloaded_name_is_reloaded_implicitly_like_sglang(sim_client, tmp_path):
    path = write_adapter(tmp_path, "a")
    await load(sim_client, "a", path)
    first = await output_ids(sim_client, lora_path="a")
    await sim_client.post("/unload_lora_adapter", json={"lora_name": "a"})
    assert await output_ids(sim_client, lora_path="a") == first  # SGLang's lora_ref_cache
    assert sim_client.server.app[SIM_STATE].lora.loaded == {"a": str(path)}


async def test_unload_waits_for_running_requests(make_sim, aiohttp_client, tmp_path):
    sim = await make_sim(tpot_s=0.01)
    client = await aiohttp_client(sim)
    await load(client, "a", write_adapter(tmp_path, "a"))
    request = greedy(30, lora_path="a")  # its greedy ids depend on the adapter's path: EOS may come early
    request["sampling_params"]["ignore_eos"] = True
    running = asyncio.create_task(client.post("/generate", json=request))
    while not sim.app[SIM_STATE].running:
        await asyncio.sleep(0.005)
    unload = await client.post("/unload_lora_adapter", json={"lora_name": "a"})
    assert unload.status == 200 and not sim.app[SIM_STATE].running  # it answered once the request ended
    finished = await running
    assert len((await finished.json())["output_ids"]) == 30


async def test_v1_models_lists_adapters(sim_client, tmp_path):
    path = write_adapter(tmp_path, "a")
    await load(sim_client, "a", path)
    cards = (await (await sim_client.get("/v1/models")).json())["data"]
    assert [c["id"] for c in cards] == ["sim/qwen2-tiny", "a"]
    assert {k: cards[1][k] for k in ("root", "parent", "max_model_len", "owned_by")} == {
        "root": str(path), "parent": "sim/qwen2-tiny", "max_model_len": None, "owned_by": "sglang"}
