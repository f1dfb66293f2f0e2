"""The pass-through cannot kill the engine: native /generate (and the other native routes that carry
ids or sampling_params) is checked like the proxy's own routes, refused in SGLang's own 400 shape,
and a valid request keeps SGLang's reply byte for byte, streamed too."""

from __future__ import annotations

import json
import time

import aiohttp
import orjson
import pytest

from token_proxy.admin.native_checks import Limits, SGLangRefusal, check_native
from token_proxy.sglang.versions import features_for
from token_proxy.simulator import SIM_STATE

FOX = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]
PARAMS = {"max_new_tokens": 3, "temperature": 0}


def received(sim) -> list:
    return sim.app[SIM_STATE].received


async def assert_healthy(proxy, sim) -> None:
    async with aiohttp.ClientSession() as session, session.get(sim.make_url("/health")) as direct:
        assert direct.status == 200
    assert (await proxy.get("/health")).status == 200
    assert sim.app[SIM_STATE].crashed is False


async def refused(proxy, body=None, raw: bytes | None = None, path: str = "/generate") -> str:
    data = raw if raw is not None else json.dumps(body).encode()  # json: ints past 64 bits too
    response = await proxy.post(path, data=data, headers={"Content-Type": "application/json"})
    reply = await response.json()
    assert response.status == 400, reply
    assert list(reply) == ["error"] and list(reply["error"]) == ["message"]  # SGLang's shape, nothing else
    return reply["error"]["message"]


# --- the two findings of issue 24 (both reach SGLang on main: 500, and the simulator stays down) ---


async def test_an_out_of_range_id_is_refused_and_sglang_stays_healthy(proxy, sim):
    message = await refused(proxy, {"input_ids": [999999999], "sampling_params": {"max_new_tokens": 2}})
    assert message.startswith("input_ids: item 0 (999999999) is out of range: token ids must be in [0, ")
    assert received(sim) == []  # SGLang never saw it
    await assert_healthy(proxy, sim)
    ok = await proxy.post("/generate", json={"input_ids": FOX, "sampling_params": PARAMS})
    assert ok.status == 200 and (await ok.json())["meta_info"]["completion_tokens"] == 3


@pytest.mark.parametrize("params,message", [
    ({"max_new_tokens": 4, "temperature": "hot"}, "sampling_params.temperature: must be a number, got string"),
    ({"max_new_tokens": 4, "bogus_param": 1}, "sampling_params: unknown field `bogus_param`, expected one of "),
])
async def test_a_bad_sampling_param_is_refused_and_sglang_stays_healthy(proxy, sim, params, message):
    reply = await refused(proxy, {"input_ids": FOX, "sampling_params": params})
    assert reply.startswith(message)
    assert received(sim) == []
    await assert_healthy(proxy, sim)


# --- what else is refused, and how it is named -------------------------------------------------------

BIG = 2**64


@pytest.mark.parametrize("body,message", [
    ({"input_ids": [-1]}, "input_ids: item 0 (-1) is out of range"),
    ({"input_ids": [1, True]}, "input_ids: item 1 must be an integer token id, got boolean"),
    ({"input_ids": [1, 2.5]}, "input_ids: item 1 must be an integer token id, got number"),
    ({"input_ids": [1, "2"]}, "input_ids: item 1 must be an integer token id, got string"),
    ({"input_ids": [1, [2]]}, "input_ids: item 1 must be an integer token id, got array"),
    ({"input_ids": [[1, 2], [3, 999999999]]}, "input_ids[1]: item 1 (999999999) is out of range"),
    ({"input_ids": [[1, 2], 3]}, "input_ids[1]: must be an array of token ids, got integer"),
    ({"input_ids": "1 2"}, "input_ids: must be an array of token ids, got string"),
    ({"input_ids": FOX, "return_logprob": True, "token_ids_logprob": [1, 999999]},
     "token_ids_logprob: item 1 (999999) is out of range"),
    ({"input_ids": [FOX, FOX], "token_ids_logprob": [[1], [-5]]}, "token_ids_logprob[1]: item 0 (-5) is out of range"),
    ({"input_ids": FOX, "return_logprob": True, "top_logprobs_num": 10**7}, "top_logprobs_num: must be in [0, "),
    ({"input_ids": FOX, "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num: must be in [0, "),
    ({"input_ids": [FOX, FOX], "top_logprobs_num": [1, "2"]}, "top_logprobs_num[1]: must be an integer, got string"),
    ({"input_ids": [FOX, FOX], "sampling_params": [PARAMS, {"top_k": 1.5}]},
     "sampling_params[1].top_k: must be an integer, got number"),
    ({"input_ids": FOX, "sampling_params": [PARAMS, 3]}, "sampling_params[1]: must be an object, got integer"),
    ({"input_ids": FOX, "sampling_params": "greedy"}, "sampling_params: must be an object, got string"),
    ({"input_ids": FOX, "sampling_params": {"sampling_seed": BIG}},
     f"sampling_params.sampling_seed: must be in [-2**63, 2**63 - 1], got {BIG}"),
    ({"input_ids": FOX, "sampling_params": {"n": 5000}}, "sampling_params.n: must be in [1, 1024], got 5000"),
    ({"input_ids": FOX, "sampling_params": {"stop_token_ids": [1, None]}},
     "sampling_params.stop_token_ids: must be an array of integers, got array"),
    ({"input_ids": FOX, "sampling_params": {"ignore_eos": 1}}, "sampling_params.ignore_eos: must be a boolean"),
    ({"input_ids": FOX, "sampling_params": {"stop": ["a", 1]}},
     "sampling_params.stop: must be a string or an array of strings, got array"),
    ({"input_ids": FOX, "sampling_params": {"logit_bias": {"5": "up"}}},
     "sampling_params.logit_bias: must be an object of numbers, got object"),
    ({"text": "hi", "sampling_params": {"choice": ["a"]}}, "sampling_params: unknown field `choice`"),
])
async def test_native_generate_refusals_name_the_field(proxy, sim, body, message):
    assert (await refused(proxy, body)).startswith(message)
    assert received(sim) == []


@pytest.mark.parametrize("raw,message", [
    # Python's json (SGLang's parser) reads what orjson refuses: the check must read it the same way.
    (b'{"input_ids": [1, 2], "sampling_params": {"logit_bias": {"5": NaN}}}',
     "sampling_params.logit_bias: must be a finite number, got nan"),
    (b'{"input_ids": [1, 2], "sampling_params": {"temperature": Infinity}}',
     "sampling_params.temperature: must be a finite number, got inf"),
    (b'{"input_ids": [1, 100000000000000000000000]}', "input_ids: item 1 (100000000000000000000000) is out of range"),
    ('{"input_ids": [999999999]}'.encode("utf-16"), "input_ids: item 0 (999999999) is out of range"),
    (b'{"input_ids": [1], "sampling_params": {"logit_bias": {"5": 1e39}}}',
     "sampling_params.logit_bias: must be a finite number, got 1e+39"),
])
async def test_bodies_only_sglangs_parser_reads_are_checked_too(proxy, sim, raw, message):
    assert (await refused(proxy, raw=raw)).startswith(message)
    assert received(sim) == []


@pytest.mark.parametrize("path,body,message", [
    ("/encode", {"input_ids": [1, 999999999]}, "input_ids: item 1 (999999999) is out of range"),
    ("/classify", {"input_ids": [[1], [-3]]}, "input_ids[1]: item 0 (-3) is out of range"),
    ("/v1/embeddings", {"input": [[1, 2], [999999999]]}, "input[1]: item 0 (999999999) is out of range"),
    ("/v1/score", {"query": [1, 999999999], "items": ["a"]}, "query: item 1 (999999999) is out of range"),
    ("/v1/score", {"query": "q", "items": [[1], [999999999]]}, "items[1]: item 0 (999999999) is out of range"),
    ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [999999999]},
     "label_token_ids: item 0 (999999999) is out of range"),
    ("/vertex_generate", {"instances": [{"input_ids": [999999999]}]},
     "instances[0].input_ids: item 0 (999999999) is out of range"),
    ("/vertex_generate", {"instances": [{"text": "hi"}], "parameters": {"temperature": "hot"}},
     "parameters.temperature: must be a number, got string"),
    ("/init_weights_send_group_for_remote_instance",
     {"master_address": "10.0.0.1", "ports": "29500,0", "group_rank": 1, "world_size": 2},
     "ports must be an integer port in 1..65535, got 0"),
    ("/init_weights_send_group_for_remote_instance",
     {"master_address": "10.0.0.1", "ports": "29500", "group_rank": 2, "world_size": 2},
     "group_rank 2 must be < world_size 2"),
])
async def test_other_native_routes_that_carry_ids_are_checked(proxy, sim, path, body, message):
    assert (await refused(proxy, body, path=path)).startswith(message)


# --- per SGLang version: the running version's keys -------------------------------------------------


async def test_sampling_keys_follow_the_running_version(make_proxy, make_sim):
    newest = await make_sim(sglang_version="0.5.23")
    proxy = await make_proxy(newest)
    body = {"input_ids": FOX, "sampling_params": {**PARAMS, "beam_width": None, "choice": None}}
    response = await proxy.post("/generate", json=body)
    assert response.status == 200, await response.text()
    oldest = await make_proxy(await make_sim(sglang_version="0.5.17"))
    assert (await refused(oldest, body)).startswith("sampling_params: unknown field `beam_width`, expected one of "
                                                    "`max_new_tokens`, `stop`,")


def test_the_check_is_pure_and_the_one_table_drives_it():
    limits = Limits(100, features_for("0.5.17").sampling_keys)
    check_native("/generate", orjson.dumps({"input_ids": [99], "sampling_params": {"temperature": 1}}), limits)
    check_native("/generate", b"not json", limits)  # SGLang answers that itself
    check_native("/generate", b"[1, 2]", limits)
    check_native("/health_generate", b'{"input_ids": [100]}', limits)  # not a route that takes ids
    with pytest.raises(SGLangRefusal) as refusal:
        check_native("/generate", b'{"input_ids": [100]}', limits)
    assert refusal.value.body() == {
        "error": {"message": "input_ids: item 0 (100) is out of range: token ids must be in [0, 100)"}}


# --- valid requests: SGLang's bytes, unchanged --------------------------------------------------------

VALID = [
    {"input_ids": FOX, "sampling_params": PARAMS, "rid": "one"},
    {"input_ids": FOX, "sampling_params": PARAMS, "rid": "s1", "stream": True},
    {"input_ids": [FOX, FOX[:4]], "sampling_params": [PARAMS, {**PARAMS, "max_new_tokens": 2}], "rid": ["a", "b"]},
    {"input_ids": [FOX, FOX[:4]], "sampling_params": PARAMS, "rid": ["c", "d"], "stream": True},
    {"text": "The quick brown fox", "sampling_params": {**PARAMS, "stop": ["zz"]}, "rid": "t"},
    {"text": ["a", "b"], "sampling_params": PARAMS, "rid": ["t1", "t2"]},
    {"input_ids": FOX, "sampling_params": {**PARAMS, "logit_bias": {"13": 2.5}, "stop_token_ids": [13]},
     "return_logprob": True, "top_logprobs_num": 2, "token_ids_logprob": [13, 279], "logprob_start_len": 0,
     "rid": "lp"},
    {"input_ids": FOX, "sampling_params": {**PARAMS, "temperature": None, "top_k": 1}, "rid": "s2",
     "stream": True, "return_logprob": True},
]


@pytest.mark.parametrize("body", VALID)
async def test_valid_requests_keep_sglangs_bytes(proxy, sim, monkeypatch, body):
    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.0)  # the simulator's timestamps, fixed
    raw = orjson.dumps(body)
    async with aiohttp.ClientSession() as session:
        direct = []
        for _ in range(2):  # the second sees the prefix cache as the proxied one will
            async with session.post(sim.make_url("/generate"), data=raw) as reply:
                direct.append((reply.status, reply.headers["Content-Type"], await reply.read()))
    through = await proxy.post("/generate", data=raw)
    assert (through.status, through.headers["Content-Type"], await through.read()) == direct[1]
    assert direct[1][0] == 200
