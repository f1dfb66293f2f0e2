"""SGLang API generations: version detection, what the proxy sends per version, and the proxy's core
paths against the simulator in 0.5.23 mode (behaviour read from 0.5.18-0.5.23 source, README
"SGLang versions"); 0.5.17 stays the default everywhere else."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson
import pytest

from tests.support.admin_fixtures import until
from token_proxy.admin import ADMIN
from token_proxy.fleet import flush
from token_proxy.sglang import sglang_request
from token_proxy.sglang.payload import sampling_params
from token_proxy.sglang.sampling import FIRST, keys_for
from token_proxy.sglang.versions import SAMPLING_KEYS_0517, features_for
from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.config import VERSIONS
from token_proxy.simulator.testing import parse_sse
from token_proxy.state import CONTEXT
from token_proxy.vocabulary import SamplingRequest

USER = [{"role": "user", "content": "Count slowly."}]
FOX = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]
NEWEST = "0.5.23"


def state(server):
    return server.app[SIM_STATE]


# --- version -> features --------------------------------------------------------------------------

@pytest.mark.parametrize(("version", "assumed", "exact"), [
    ("0.5.17", (0, 5, 17), True), ("0.5.18", (0, 5, 18), True), ("0.5.23", (0, 5, 23), True),
    ("0.5.22.post1", (0, 5, 22), True), ("0.5.24rc1", (0, 5, 23), False), ("0.6.0", (0, 5, 23), False),
    ("0.0.0.dev0", (0, 5, 23), False), (None, (0, 5, 23), False), ("nightly", (0, 5, 23), False),
    ("0.5.9", (0, 5, 17), False),
])
def test_versions_map_onto_a_known_generation(version, assumed, exact):
    features = features_for(version)
    assert (features.assumed, features.exact) == (assumed, exact)
    assert features.verified == (assumed == (0, 5, 17))


def test_each_change_switches_at_the_release_that_made_it():
    def flags(version):
        f = features_for(version)
        return (f.abort_reaches_n_samples, f.native_cache_salt, f.weight_version_spans, f.has_ready,
                f.has_get_load, f.update_selector, f.seed_range_checked, f.strict_sampling_keys,
                f.flush_refusal_is_reply, f.weight_update_session)

    assert flags("0.5.17") == (True, False, False, False, True, False, False, False, False, False)
    assert flags("0.5.18") == (False, True, False, False, True, False, False, False, False, False)
    assert flags("0.5.19") == (False, True, True, False, True, False, False, False, False, False)
    assert flags("0.5.20") == (False, True, True, True, True, False, False, False, False, False)
    assert flags("0.5.21") == (False, True, True, True, False, True, True, False, False, True)
    assert flags("0.5.22") == (False, True, True, True, False, True, True, True, True, True)
    assert flags("0.5.23") == flags("0.5.22")
    assert features_for("0.5.20").removed_routes == frozenset()
    assert features_for("0.5.21").removed_routes == {
        "/get_load", "/get_weight_version", "/weight_version", "/clear_hicache_storage_backend"}
    assert features_for("0.5.23").sampling_keys - SAMPLING_KEYS_0517 == {"beam_width", "watermark", "choice"}


def test_describe_says_what_was_verified_and_what_was_assumed():
    assert features_for("0.5.17").describe() == "SGLang 0.5.17 (verified against a real 0.5.17 server)"
    assert features_for("0.0.0.dev0").describe() == (
        "SGLang 0.0.0.dev0: treated as 0.5.23 (behaviour read from SGLang's released source, not run)")


# --- what the proxy sends ---------------------------------------------------------------------------

EVERYTHING = SamplingRequest(
    n=2, max_tokens=8, min_tokens=1, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, frequency_penalty=0.1,
    presence_penalty=0.1, repetition_penalty=1.1, stop=("x",), stop_token_ids=(13,), include_stop_str_in_output=True,
    seed=2**64 - 1, logit_bias={"13": 1.0}, skip_special_tokens=False, spaces_between_special_tokens=False,
    constraint=("json_schema", "{}"), logprobs=True, top_logprobs=2, prompt_logprobs=1)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("sampling", [EVERYTHING, SamplingRequest(ignore_eos=True, stop_token_ids=(13,))])
def test_the_proxy_never_sends_a_sampling_key_the_version_does_not_know(version, sampling):
    params = sampling_params(sampling, 8)
    assert set(params) <= features_for(version).sampling_keys
    assert set(params) <= set(keys_for(FIRST))  # the strict simulator's list, from 0.5.22's wire contract
    assert params.get("sampling_seed") == (None if sampling.seed is None else 2**63 - 1)  # reduced into int64


def test_unseeded_n_stays_sglangs_own_on_0_5_17_and_becomes_per_sample_items_from_0_5_18():
    sampling = SamplingRequest(n=3, temperature=1.0)
    old = sglang_request([FOX], sampling, [4], rid="chatcmpl-1", stream=True, api=features_for("0.5.17"))
    assert (old.rids, old.body["rid"], old.body["sampling_params"]["n"]) == (["chatcmpl-1"], "chatcmpl-1", 3)
    new = sglang_request([FOX], sampling, [4], rid="chatcmpl-1", stream=True, api=features_for("0.5.18"))
    assert new.rids == new.body["rid"] == ["chatcmpl-1-0", "chatcmpl-1-1", "chatcmpl-1-2"]
    assert new.body["input_ids"] == [FOX] * 3 and [p["n"] for p in new.body["sampling_params"]] == [1, 1, 1]
    two = sglang_request([FOX, FOX[:3]], sampling, [4, 4], rid="cmpl-2", stream=False, api=features_for(NEWEST))
    assert two.rids == [f"cmpl-2-{p}-{i}" for p in range(2) for i in range(3)]


def test_cache_salt_is_extra_key_on_0_5_17_and_cache_salt_from_0_5_18():
    sampling = SamplingRequest()
    old = sglang_request([FOX], sampling, [4], rid="r", stream=False, cache_salt="s", api=features_for("0.5.17"))
    new = sglang_request([FOX], sampling, [4], rid="r", stream=False, cache_salt="s", api=features_for("0.5.18"))
    assert (old.body.get("extra_key"), "cache_salt" in old.body) == ("s", False)
    assert (new.body.get("cache_salt"), "extra_key" in new.body) == ("s", False)
    guess = sglang_request([FOX], sampling, [4], rid="r", stream=False, cache_salt="s", api=features_for("0.0.0.dev0"))
    assert (guess.body.get("cache_salt"), guess.body.get("extra_key")) == ("s", "s")


# --- the simulator's modes ----------------------------------------------------------------------------

async def test_simulator_0_5_23_reports_its_version_and_drops_get_load(make_sim):
    sim = await make_sim(sglang_version=NEWEST)
    async with aiohttp.ClientSession(str(sim.make_url(""))) as http:
        assert (await (await http.get("/server_info")).json())["version"] == NEWEST
        gone = await http.get("/get_load")
        assert (gone.status, await gone.json()) == (404, {"detail": "Not Found"})
        loads = await (await http.get("/v1/loads?include=core")).json()
        assert loads["version"] == NEWEST and loads["loads"][0]["num_running_reqs"] == 0
        bad = await http.post("/generate", json={"input_ids": FOX, "sampling_params": {"max_new_tokens": 1,
                                                                                      "sampling_seed": 2**63}})
        assert (bad.status, await bad.json()) == (
            400, {"error": {"message": f"sampling_seed must be in [-2**63, 2**63 - 1], got {2**63}."}})


@pytest.mark.parametrize(("version", "stopped"), [("0.5.17", 2), ("0.5.18", 0), (NEWEST, 0)])
async def test_from_0_5_18_an_abort_of_an_n_request_rid_stops_none_of_its_samples(make_sim, version, stopped):
    sim = await make_sim(sglang_version=version, tpot_s=0.01)
    async with aiohttp.ClientSession(str(sim.make_url(""))) as http:
        body = {"input_ids": FOX, "rid": "logical", "stream": True,
                "sampling_params": {"n": 2, "max_new_tokens": 200, "ignore_eos": True}}
        task = asyncio.create_task(http.post("/generate", json=body))
        await until(lambda: sum(s.started for s in state(sim).running.values()) == 2)
        assert state(sim).abort("logical") == stopped
        state(sim).abort(abort_all=True)
        await (await task).read()


# --- the proxy against SGLang 0.5.23 (the simulator's mode) ---------------------------------------------

@pytest.fixture
async def new_sim(make_sim):
    return await make_sim(sglang_version=NEWEST, tpot_s=0.002)


@pytest.fixture
async def new_proxy(make_proxy, new_sim):
    return await make_proxy(new_sim)


async def test_the_proxy_detects_the_version_at_connect_and_logs_it(make_sim, make_proxy, caplog):
    caplog.set_level(logging.INFO, logger="token_proxy.sglang.discovery")
    proxy = await make_proxy(await make_sim(sglang_version="0.5.21"))
    assert proxy.app[CONTEXT].backend.api.generation == "0.5.21"
    assert "SGLang 0.5.21 (behaviour read from SGLang's released source, not run)" in caplog.text
    proxy = await make_proxy(await make_sim())
    assert proxy.app[CONTEXT].backend.api.verified


async def test_core_paths_on_0_5_23(new_proxy, new_sim):
    chat = {"messages": USER, "max_tokens": 5, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
            "frequency_penalty": 0.1, "presence_penalty": 0.1, "repetition_penalty": 1.05, "min_tokens": 1,
            "stop": ["zz"], "seed": 2**64 - 1, "logit_bias": {"13": 0.5}, "logprobs": True, "top_logprobs": 2,
            "return_token_ids": True, "cache_salt": "run-1", "response_format": {"type": "json_object"}}
    resp = await new_proxy.post("/v1/chat/completions", json=chat)
    assert resp.status == 200, await resp.text()  # every key above reached a strict (0.5.22+) server
    sent = state(new_sim).received[-1]
    assert sent["cache_salt"] == "run-1" and "extra_key" not in sent
    assert sent["sampling_params"]["sampling_seed"] == (2**64 - 1) % 2**63

    resp = await new_proxy.post("/v1/completions", json={"prompt": "The fox", "max_tokens": 4, "n": 2})
    body = await resp.json()
    assert resp.status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    assert state(new_sim).received[-1]["rid"] == [f"{body['id']}-0", f"{body['id']}-1"]

    resp = await new_proxy.post("/inference/v1/generate", json={"token_ids": FOX, "sampling_params": {
        "max_tokens": 3, "n": 2, "temperature": 1.0}})
    out = await resp.json()
    assert resp.status == 200 and [len(c["token_ids"]) for c in out["choices"]] == [3, 3]

    resp = await new_proxy.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, "n": 2,
                                                              "stream": True, "ignore_eos": True})
    events = parse_sse(await resp.read())
    assert resp.status == 200 and events[-1] == "[DONE]"
    finals = {c["index"]: c["finish_reason"] for e in events[:-1] for c in e["choices"] if c.get("finish_reason")}
    assert finals == {0: "length", 1: "length"}


async def test_n_samples_are_aborted_by_their_own_rids_when_the_client_leaves(new_proxy, new_sim, monkeypatch):
    ctx = new_proxy.app[CONTEXT]
    aborted = []
    original = ctx.client.abort

    async def record(rid):
        aborted.append(rid)
        return await original(rid)

    monkeypatch.setattr(ctx.client, "abort", record)
    body = {"messages": USER, "max_tokens": 2000, "n": 2, "stream": True, "ignore_eos": True,
            "request_id": "leaver"}
    response = await new_proxy.post("/v1/chat/completions", data=orjson.dumps(body))
    assert response.status == 200
    await until(lambda: sum(s.started for s in state(new_sim).running.values()) == 2)
    response.close()  # the client leaves mid-stream
    await until(lambda: not state(new_sim).running)
    await until(lambda: len(aborted) == 2)
    assert sorted(aborted) == ["chatcmpl-leaver-0", "chatcmpl-leaver-1"]


async def test_liveness_and_a_paused_update_with_rollouts_in_flight_on_0_5_23(new_proxy, new_sim, tmp_path):
    assert (await new_proxy.get("/liveness")).status == 200
    idle = tmp_path / "step_2"
    idle.mkdir()
    (idle / "model.safetensors").write_bytes(b"\0")
    assert (await new_proxy.post("/update_weights", json={"weight_dir": str(idle)})).status == 200
    assert not new_proxy.app[ADMIN].owed_flushes  # /v1/loads read the idle worker: flushed at once
    rollouts = [asyncio.create_task(new_proxy.post("/v1/chat/completions", json={
        "messages": USER, "max_tokens": 60, "ignore_eos": True, "stream": True})) for _ in range(2)]
    await until(lambda: sum(s.started for s in state(new_sim).running.values()) == 2)
    assert (await new_proxy.post("/pause", json={"mode": "retract"})).status == 200
    ckpt = tmp_path / "step_3"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"\0")
    resp = await new_proxy.post("/update_weights", json={"weight_dir": str(ckpt)})
    assert (resp.status, await resp.json()) == (200, {"status": "ok", "weight_version": "3"})
    plane = new_proxy.app[ADMIN]
    assert plane.owed_flushes == {plane.workers.client.base_url} and not state(new_sim).crashed
    assert (await new_proxy.post("/resume")).status == 200
    for response in await asyncio.gather(*rollouts):
        assert response.status == 200 and parse_sse(await response.read())[-1] == "[DONE]"
    await until(lambda: not plane.owed_flushes)


async def test_an_update_whose_flush_0_5_23_refuses_still_counts_and_owes_the_flush(
        new_proxy, new_sim, tmp_path, monkeypatch):
    monkeypatch.setattr(flush, "pending", lambda reply: 0)  # the load read missed the running requests
    rollout = asyncio.create_task(new_proxy.post("/v1/chat/completions", json={
        "messages": USER, "max_tokens": 60, "ignore_eos": True}))
    await until(lambda: any(s.started for s in state(new_sim).running.values()))
    assert (await new_proxy.post("/pause", json={"mode": "in_place"})).status == 200
    ckpt = tmp_path / "step_4"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"\0")
    resp = await new_proxy.post("/update_weights", json={"weight_dir": str(ckpt)})
    assert (resp.status, await resp.json()) == (200, {"status": "ok", "weight_version": "4"})
    assert state(new_sim).weight_version == "4" and state(new_sim).weights_path == str(ckpt)
    plane = new_proxy.app[ADMIN]
    assert plane.owed_flushes == {plane.workers.client.base_url}
    assert (await new_proxy.post("/resume")).status == 200
    assert (await rollout).status == 200
    await until(lambda: not plane.owed_flushes)


def test_the_strict_simulator_lists_what_0_5_23_lists():
    assert [key for key in keys_for((0, 5, 23)) if key not in keys_for(FIRST)] == ["beam_width", "watermark", "choice"]
    assert set(keys_for(FIRST)) == SAMPLING_KEYS_0517


def test_ebnf_full_assistant_is_a_sampling_key_of_0_5_20_and_0_5_21_only():
    # bench/SGLANG_VERSIONS.md: SamplingParams took it in 0.5.20; 0.5.22's wire contract does not list it.
    accepting = [v for v in ("0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
                 if "ebnf_full_assistant" in features_for(v).sampling_keys]
    assert accepting == ["0.5.20", "0.5.21"]


async def test_non_streaming_weight_versions_are_sglangs_exact_spans_from_0_5_19(new_proxy, new_sim):
    request = asyncio.create_task(new_proxy.post("/v1/chat/completions", json={
        "messages": USER, "max_tokens": 40, "ignore_eos": True}))
    await until(lambda: any(len(s.output_ids) >= 5 for s in state(new_sim).running.values()))
    new_proxy.app[ADMIN].record_version("v2")  # the fleet's update, as the proxy records it ...
    state(new_sim).weight_version = "v2"  # ... and what it does between two decode steps
    response = await request
    spans = (await response.json())["choices"][0]["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "v2"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] >= 5 and spans[1]["end"] == 40


def _comparable(value):
    """A response without what differs per call (ids, clocks)."""
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items() if k not in ("id", "created", "request_id")}
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    return value


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 6, "n": 3, "temperature": 0, "logprobs": True,
                              "top_logprobs": 2, "return_token_ids": True, "stop": ["zz"]}),
    ("/v1/completions", {"prompt": ["The fox", "A cat"], "max_tokens": 5, "n": 2, "temperature": 0,
                         "logprobs": 1, "echo": False}),
    ("/inference/v1/generate", {"token_ids": FOX, "sampling_params": {"max_tokens": 4, "n": 2, "temperature": 0,
                                                                     "logprobs": 1}}),
])
async def test_every_endpoint_answers_the_same_on_0_5_17_and_0_5_23(make_sim, make_proxy, path, body, stream):
    """n > 1 is SGLang's own `n` on 0.5.17 and per-sample items on 0.5.23: clients see no difference."""
    replies = []
    for version in ("0.5.17", NEWEST):
        proxy = await make_proxy(await make_sim(sglang_version=version))
        response = await proxy.post(path, json={**body, "stream": stream})
        raw = await response.read()
        assert response.status == 200, raw[:300]
        replies.append(_by_choice(parse_sse(raw)) if stream else _comparable(orjson.loads(raw)))
    assert replies[0] == replies[1]


def _by_choice(events: list) -> dict:
    """A stream's chunks per choice index (samples interleave in whatever order they are produced)."""
    out: dict = {"other": []}
    for event in events[:-1]:
        choices = event.get("choices") or []
        rest = _comparable({k: v for k, v in event.items() if k != "choices"})
        if not choices:
            out["other"].append(rest)
        for choice in choices:
            out.setdefault(choice["index"], []).append((rest, _comparable(choice)))
    return out
