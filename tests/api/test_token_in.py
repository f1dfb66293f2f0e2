"""Token in, token out: POST /inference/v1/generate with the unmodified `renderers` client and raw bodies."""

from __future__ import annotations

import math

import orjson
import pytest

from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.testing import stream_events

USER = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = [151644, 872, 198, 3838, 374, 279, 6722, 315, 9625, 30, 151645, 198, 151644, 77091, 198]
MODEL = "sim/qwen2-tiny"


async def post(client, body, path="/inference/v1/generate"):
    resp = await client.post(path, data=orjson.dumps(body), headers={"Content-Type": "application/json"})
    return resp.status, orjson.loads(await resp.read())


@pytest.fixture
def renderer(hf_tokenizer):
    renderers = pytest.importorskip("renderers")
    return renderers.create_renderer(hf_tokenizer, renderers.DefaultRendererConfig())


async def test_renderers_client_round_trips_ids_logprobs_and_finish(proxy, sim, renderer):
    from openai import AsyncOpenAI
    from renderers.client import generate

    client = AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="unused", max_retries=0)
    out = await generate(client=client, renderer=renderer, messages=USER, model=MODEL,
                         sampling_params={"max_tokens": 12, "temperature": 0.0})
    sent = sim.app[SIM_STATE].received[-1]
    assert sent["input_ids"] == PROMPT == out["prompt_ids"]
    assert sent["sampling_params"]["stop_token_ids"] == [151645]  # the renderer's stop ids reach SGLang
    assert sent["sampling_params"]["skip_special_tokens"] is False
    assert sent["return_logprob"] is True and sent["top_logprobs_num"] == 1
    ids = out["completion_ids"]
    assert 1 <= len(ids) <= 12
    assert len(out["completion_logprobs"]) == len(ids)
    assert all(math.isfinite(lp) and lp != -9999.0 for lp in out["completion_logprobs"])
    want_finish = "stop" if ids[-1] == 151645 else "length"
    assert out["finish_reason"] == want_finish
    assert out["request_id"].startswith("generate-tokens-")
    # the engine's own answer for the same ids
    status, body = await post(proxy, {"model": MODEL, "token_ids": PROMPT,
                                      "sampling_params": {"max_tokens": 12, "temperature": 0.0,
                                                          "stop_token_ids": [151645], "logprobs": 1,
                                                          "skip_special_tokens": False}})
    assert status == 200
    assert body["choices"][0]["token_ids"] == ids
    assert [e["logprob"] for e in body["choices"][0]["logprobs"]["content"]] == out["completion_logprobs"]
    await client.close()


async def test_response_has_vllms_keys_and_both_logprob_spellings(proxy):
    status, body = await post(proxy, {"model": MODEL, "token_ids": PROMPT, "request_id": "abc",
                                      "sampling_params": {"max_tokens": 4, "temperature": 0, "logprobs": 2,
                                                          "ignore_eos": True}})
    assert status == 200
    assert list(body) == ["request_id", "model", "created", "usage", "prompt_logprobs", "prompt_token_id_logprobs",
                          "prompt_token_ids", "mm_placeholders", "metrics", "kv_transfer_params",
                          "ec_transfer_params", "output_mode", "choices"]
    assert body["request_id"] == "generate-tokens-abc"
    assert body["prompt_token_ids"] == PROMPT
    (choice,) = body["choices"]
    assert list(choice) == ["index", "finish_reason", "stop_reason", "token_ids", "routed_experts", "sampling_mask",
                            "weight_versions", "logprobs"]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 4
    for token_id, entry in zip(choice["token_ids"], choice["logprobs"]["content"]):
        assert entry["token_id"] == token_id and entry["token"] == f"token_id:{token_id}"
        assert entry["top_logprobs"][0]["token_id"] == token_id
        assert 2 <= len(entry["top_logprobs"]) <= 3
        assert entry["rank"] in (1, 2, None)
    assert body["usage"]["prompt_tokens"] == 15 and body["usage"]["completion_tokens"] == 4


async def test_absent_max_tokens_is_the_rest_of_the_context(proxy, sim):
    status, _ = await post(proxy, {"token_ids": PROMPT, "sampling_params": {"temperature": 0,
                                                                           "logit_bias": {"151645": 100}}})
    assert status == 200
    assert sim.app[SIM_STATE].received[-1]["sampling_params"]["max_new_tokens"] == 4096 - len(PROMPT)


@pytest.mark.parametrize("token_ids", [[], [-1], [151665], [999999], ["a"], [1.5], [True], "1 2 3", None,
                                       [[1, 2]]])
async def test_bad_token_ids_are_400_and_never_reach_sglang(proxy, sim, token_ids):
    status, body = await post(proxy, {"model": MODEL, "token_ids": token_ids})
    assert status == 400, body
    assert body["error"]["param"] == "token_ids"
    assert body["error"]["code"] == 400
    state = sim.app[SIM_STATE]
    assert state.received == [] and state.crashed is False


@pytest.mark.parametrize("params,param", [
    ({"temperature": "hot"}, "sampling_params.temperature"), ({"max_tokens": -1}, "sampling_params.max_tokens"),
    ({"logprobs": 99}, "sampling_params.logprobs"), ({"stop_token_ids": [10**7]}, "sampling_params.stop_token_ids"),
    ({"n": 0}, "sampling_params.n"), ("greedy", "sampling_params"),
])
async def test_bad_sampling_params_name_the_nested_field(proxy, sim, params, param):
    status, body = await post(proxy, {"token_ids": PROMPT, "sampling_params": params})
    assert status == 400, body
    assert body["error"]["param"] == param
    assert sim.app[SIM_STATE].received == []


async def test_overlong_prompt_gets_the_context_error(proxy, sim):
    status, body = await post(proxy, {"token_ids": [100] * 5000})
    assert status == 400
    assert "maximum context length is 4096 tokens" in body["error"]["message"]
    assert sim.app[SIM_STATE].received == []


async def test_cache_salt_and_priority_reach_sglang(proxy, sim):
    status, _ = await post(proxy, {"token_ids": PROMPT, "cache_salt": "run-7", "priority": 3,
                                   "sampling_params": {"max_tokens": 1}})
    assert status == 200
    sent = sim.app[SIM_STATE].received[-1]
    assert sent["extra_key"] == "run-7" and sent["priority"] == 3
    assert "cache_salt" not in sent  # SGLang 0.5.17's /generate would silently drop it


async def test_streaming_generate_matches_non_streaming(proxy):
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 10, "temperature": 1.0, "seed": 3,
                                                     "logprobs": 0, "ignore_eos": True},
            "stream": True, "stream_options": {"include_usage": True}}
    resp = await proxy.post("/inference/v1/generate", data=orjson.dumps(body))
    chunks = stream_events(await resp.read())
    assert chunks[0]["prompt_token_ids"] == PROMPT
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    ids = [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]]
    lps = [e for c in chunks if c["choices"] for e in c["choices"][0]["logprobs"]["content"]]
    _, plain = await post(proxy, {**body, "stream": False, "stream_options": None})
    assert ids == plain["choices"][0]["token_ids"] and len(ids) == 10
    assert len(lps) == 10
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 10
