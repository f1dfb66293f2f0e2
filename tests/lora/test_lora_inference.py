"""Sampling from a LoRA adapter by name: every inference endpoint, streamed and not, sends SGLang the
adapter's lora_path; /v1/models lists it as vLLM does; an unknown name is vLLM's 404; a reload in place
never pulls the adapter from under a running request; prime-rl's loader, then rollouts by adapter name."""

from __future__ import annotations

import asyncio
import logging

import httpx
import orjson
import pytest
from openai import AsyncOpenAI

from tests.lora.test_lora import load_lora_adapter, sim_adapters, unload_lora_adapter
from tests.support.admin_fixtures import proxy_url, until
from tests.support.lora_fixtures import write_adapter
from token_proxy.ops.access_log import ACCESS_LOGGER
from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.testing import stream_events

BASE = "sim/qwen2-tiny"
MESSAGES = [{"role": "user", "content": "Say something."}]
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}

# endpoint -> (path, body without model, where the completion ids are in a non-streaming reply)
ENDPOINTS = {
    "chat": ("/v1/chat/completions", {"messages": MESSAGES, "return_token_ids": True, **GREEDY}),
    "chat/tokens": ("/v1/chat/completions/tokens",
                    {"messages": MESSAGES, "tokens": [9707, 11, 1879], "return_token_ids": True, **GREEDY}),
    "completions": ("/v1/completions", {"prompt": "Say something.", "return_token_ids": True, **GREEDY}),
    "generate": ("/inference/v1/generate",
                 {"token_ids": [9707, 11, 1879], "sampling_params": {"temperature": 0, "max_tokens": 12,
                                                                      "ignore_eos": True}}),
}


async def load(proxy, name: str, path, inplace: bool = False) -> None:
    body = {"lora_name": name, "lora_path": str(path), "load_inplace": inplace}
    response = await proxy.post("/v1/load_lora_adapter", json=body)
    assert response.status == 200, await response.text()


async def completion_ids(proxy, endpoint: str, model: str | None, stream: bool = False) -> tuple[str, list[int]]:
    """(the response's model, the first choice's completion ids) for one request."""
    path, body = ENDPOINTS[endpoint]
    body = {**body, **({"model": model} if model else {}), **({"stream": True} if stream else {})}
    response = await proxy.post(path, json=body)
    assert response.status == 200, await response.text()
    if not stream:
        reply = await response.json()
        return reply.get("model"), reply["choices"][0]["token_ids"]
    events = stream_events(await response.read())
    ids = [i for event in events for choice in event.get("choices", []) for i in choice.get("token_ids") or []]
    return events[0].get("model"), ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
async def test_every_endpoint_samples_the_adapter_named_in_model(proxy, sim, tmp_path, endpoint, stream):
    await load(proxy, "policy", write_adapter(tmp_path, "step_1"))
    base_model, base_ids = await completion_ids(proxy, endpoint, None, stream)
    model, adapter_ids = await completion_ids(proxy, endpoint, "policy", stream)
    assert len(adapter_ids) == len(base_ids) == 12
    assert adapter_ids != base_ids  # the simulator's adapters change greedy output, as a real one does
    assert sim.app[SIM_STATE].received[-1]["lora_path"] == "policy@v1"
    assert "lora_path" not in sim.app[SIM_STATE].received[-2]
    if endpoint != "generate":  # vLLM's generate reply carries no model
        assert (base_model, model) == (BASE, "policy")
    again = await completion_ids(proxy, endpoint, "policy", stream)
    assert again == (model, adapter_ids)  # deterministic: the same adapter, the same ids


async def test_models_list_adapters_and_unknown_names_are_vllms_404(proxy, tmp_path):
    one = write_adapter(tmp_path, "step_1")
    await load(proxy, "policy", one)
    cards = (await (await proxy.get("/v1/models")).json())["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        (BASE, cards[0]["root"], None), ("policy", str(one), BASE)]
    response = await proxy.post("/v1/chat/completions", json={"model": "nope", "messages": MESSAGES})
    assert response.status == 404
    assert (await response.json())["error"] == {"message": "The model `nope` does not exist.",
                                                "type": "NotFoundError", "param": "model", "code": 404}
    assert (await proxy.post("/v1/unload_lora_adapter", json={"lora_name": "policy"})).status == 200
    gone = await proxy.post("/v1/completions", json={"model": "policy", "prompt": "x", "max_tokens": 2})
    assert gone.status == 404 and (await gone.json())["error"]["param"] == "model"


async def test_the_access_log_names_the_adapter(proxy, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    await load(proxy, "policy", write_adapter(tmp_path, "step_1"))
    await completion_ids(proxy, "chat", "policy")
    await completion_ids(proxy, "chat", None)
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]
    assert [line["adapter"] for line in lines if line["endpoint"] == "/v1/chat/completions"] == ["policy", None]


async def test_base_and_two_adapters_in_flight_together(proxy, sim, tmp_path):
    await load(proxy, "a", write_adapter(tmp_path, "a"))
    await load(proxy, "b", write_adapter(tmp_path, "b"))
    results = await asyncio.gather(*(completion_ids(proxy, "chat", m) for m in (None, "a", "b") * 4))
    by_model = {}
    for model, ids in results:
        by_model.setdefault(model, set()).add(tuple(ids))
    assert sorted(by_model) == sorted([BASE, "a", "b"])
    assert all(len(v) == 1 for v in by_model.values())  # each model: one deterministic output
    assert len({next(iter(v)) for v in by_model.values()}) == 3  # and the three differ


async def test_a_reload_in_place_waits_for_the_requests_still_on_the_old_version(make_sim, make_proxy, tmp_path):
    sim = await make_sim(tpot_s=0.02)
    proxy = await make_proxy(sim)
    await load(proxy, "policy", write_adapter(tmp_path, "step_1"))
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": 30, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    running = asyncio.ensure_future(proxy.post("/v1/chat/completions", json=body))
    await until(lambda: sim.app[SIM_STATE].received and sim.app[SIM_STATE].received[-1].get("lora_path"))
    await load(proxy, "policy", write_adapter(tmp_path, "step_2"), inplace=True)
    assert set(sim_adapters(sim)) == {"policy@v1", "policy@v2"}  # v1 stays while its stream runs
    events = stream_events(await (await running).read())
    finishes = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    assert finishes == ["length"] and "error" not in events[-1]  # finished on v1, 30 tokens, no error
    await until(lambda: set(sim_adapters(sim)) == {"policy@v2"})  # then it is unloaded
    _, ids = await completion_ids(proxy, "chat", "policy")
    assert sim.app[SIM_STATE].received[-1]["lora_path"] == "policy@v2" and len(ids) == 12


async def test_prime_rl_loads_then_samples_rollouts_by_adapter_name(proxy, sim, tmp_path):
    """prime-rl's own loader (copied verbatim in test_lora.py), then the openai client as verifiers uses it."""
    step = write_adapter(tmp_path / "broadcasts", "step_1")
    async with httpx.AsyncClient(base_url=proxy_url(proxy)) as admin:
        await load_lora_adapter([admin], "policy-lora", step)
    client = AsyncOpenAI(base_url=proxy_url(proxy) + "/v1", api_key="unused")
    models = [m.id for m in (await client.models.list()).data]
    assert models == [BASE, "policy-lora"]
    reply = await client.chat.completions.create(model="policy-lora", messages=MESSAGES, max_tokens=8,
                                                 temperature=0,
                                                 extra_body={"return_token_ids": True, "ignore_eos": True})
    assert reply.model == "policy-lora" and len(reply.choices[0].model_extra["token_ids"]) == 8
    assert reply.choices[0].finish_reason == "length"
    assert sim.app[SIM_STATE].received[-1]["lora_path"] == "policy-lora@v1"
    async with httpx.AsyncClient(base_url=proxy_url(proxy)) as admin:
        await unload_lora_adapter([admin], "policy-lora")
    await until(lambda: sim_adapters(sim) == {})
    await client.close()
