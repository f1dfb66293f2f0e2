"""POST /v1/chat/completions through the proxy, in front of the simulator, with a real BPE tokenizer."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.testing import stream_events

EOS = 151645
USER = [{"role": "user", "content": "What is the capital of France?"}]
# The rendering real SGLang 0.5.17 saw for USER (../shared/golden/generate_nonstream.json).
GOLDEN_PROMPT_IDS = [151644, 872, 198, 3838, 374, 279, 6722, 315, 9625, 30, 151645, 198, 151644, 77091, 198]
# vLLM 0.33's keys, in its order.
TOP_KEYS = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
            "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics"]
CHOICE_KEYS = ["index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts",
               "weight_versions"]
MESSAGE_KEYS = ["role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"]


async def post(client, body, path="/v1/chat/completions"):
    resp = await client.post(path, data=orjson.dumps(body), headers={"Content-Type": "application/json"})
    return resp.status, orjson.loads(await resp.read())


async def sse(client, body):
    resp = await client.post("/v1/chat/completions", data=orjson.dumps({**body, "stream": True}))
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    return stream_events(await resp.read())


async def sim_generate(sim, payload):
    async with aiohttp.ClientSession() as session, session.post(sim.make_url("/generate"), json=payload) as resp:
        return await resp.json()


async def test_prompt_ids_are_the_template_rendering_and_token_ids_the_engines(proxy, sim, hf_tokenizer):
    status, body = await post(proxy, {"model": "sim/qwen2-tiny", "messages": USER, "max_tokens": 8,
                                      "temperature": 0, "return_token_ids": True})
    assert status == 200, body
    assert list(body) == TOP_KEYS
    assert body["prompt_token_ids"] == GOLDEN_PROMPT_IDS
    text = hf_tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert body["prompt_token_ids"] == hf_tokenizer.encode(text, add_special_tokens=False)
    sent = sim.app[SIM_STATE].received[-1]
    assert sent["input_ids"] == GOLDEN_PROMPT_IDS
    assert sent["sampling_params"] == {"max_new_tokens": 8, "n": 1, "skip_special_tokens": True,
                                       "spaces_between_special_tokens": True, "temperature": 0.0}
    direct = await sim_generate(sim, {"input_ids": GOLDEN_PROMPT_IDS,
                                      "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    (choice,) = body["choices"]
    assert list(choice) == CHOICE_KEYS
    assert list(choice["message"]) == MESSAGE_KEYS
    assert choice["token_ids"] == direct["output_ids"]
    assert choice["message"]["content"] == hf_tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert choice["message"]["role"] == "assistant"
    assert choice["logprobs"] is None
    assert body["usage"]["prompt_tokens"] == 15
    assert body["usage"]["completion_tokens"] == len(choice["token_ids"])
    assert body["usage"]["total_tokens"] == 15 + len(choice["token_ids"])
    assert list(body["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
                                   "completion_tokens_details"]
    assert set(body["usage"]["prompt_tokens_details"]) == {"cached_tokens"}
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")


async def test_fields_not_requested_are_null(proxy):
    status, body = await post(proxy, {"messages": USER, "max_tokens": 2})
    assert status == 200
    assert body["prompt_token_ids"] is None
    assert body["choices"][0]["token_ids"] is None
    assert body["choices"][0]["logprobs"] is None
    assert body["prompt_logprobs"] is None


async def test_absent_max_tokens_asks_sglang_for_the_rest_of_the_context(proxy, sim):
    status, _ = await post(proxy, {"messages": USER, "logit_bias": {str(EOS): 100}, "min_tokens": 1})
    assert status == 200
    assert sim.app[SIM_STATE].received[-1]["sampling_params"]["max_new_tokens"] == 4096 - 15


async def test_eos_is_in_token_ids_not_in_text_and_stop_reason_is_null(proxy, hf_tokenizer):
    status, body = await post(proxy, {"messages": USER, "max_tokens": 32, "temperature": 0, "min_tokens": 3,
                                      "logit_bias": {str(EOS): 100}, "return_token_ids": True})
    assert status == 200
    (choice,) = body["choices"]
    assert choice["token_ids"][-1] == EOS and len(choice["token_ids"]) == 4
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    assert choice["message"]["content"] == hf_tokenizer.decode(choice["token_ids"][:-1])


async def test_length_finish_and_stop_token_id(proxy):
    status, body = await post(proxy, {"messages": USER, "max_tokens": 5, "temperature": 0,
                                      "return_token_ids": True})
    assert status == 200
    first = body["choices"][0]
    assert first["finish_reason"] == "length" and len(first["token_ids"]) == 5
    stop_id = first["token_ids"][2]
    status, body = await post(proxy, {"messages": USER, "max_tokens": 5, "temperature": 0,
                                      "return_token_ids": True, "stop_token_ids": [stop_id]})
    choice = body["choices"][0]
    assert choice["token_ids"] == first["token_ids"][: first["token_ids"].index(stop_id) + 1]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id


async def test_ignore_eos_keeps_stop_token_ids_working_as_in_vllm(proxy, sim, hf_tokenizer):
    """SGLang's ignore_eos also disables stop_token_ids; vLLM's does not, so the proxy enforces them."""
    base = {"messages": USER, "max_tokens": 8, "temperature": 0, "return_token_ids": True, "ignore_eos": True,
            "logprobs": True}
    _, full = await post(proxy, base)
    ids = full["choices"][0]["token_ids"]
    stop_id = ids[3]
    want = ids[: ids.index(stop_id) + 1]
    _, body = await post(proxy, {**base, "stop_token_ids": [stop_id]})
    choice = body["choices"][0]
    assert sim.app[SIM_STATE].received[-1]["sampling_params"]["ignore_eos"] is True
    assert choice["token_ids"] == want
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id)
    assert choice["message"]["content"] == hf_tokenizer.decode(want[:-1])
    assert len(choice["logprobs"]["content"]) == len(want)
    assert body["usage"]["completion_tokens"] == len(want)
    chunks = await sse(proxy, {**base, "stop_token_ids": [stop_id]})
    streamed = [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]]
    assert streamed == want
    assert chunks[-1]["choices"][0]["stop_reason"] == stop_id
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:]) == choice["message"]["content"]


async def test_stop_string_is_reported_and_trimmed(proxy, hf_tokenizer):
    status, body = await post(proxy, {"messages": USER, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                      "return_token_ids": True})
    assert status == 200
    full = body["choices"][0]["message"]["content"]
    stop = full[3:5]
    assert stop and stop in full
    _, body = await post(proxy, {"messages": USER, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                 "return_token_ids": True, "stop": [stop]})
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["message"]["content"] == full[: full.index(stop)]
    assert stop in hf_tokenizer.decode(choice["token_ids"])


async def test_logprobs_line_up_with_token_ids(proxy):
    status, body = await post(proxy, {"messages": USER, "max_tokens": 6, "temperature": 0, "logprobs": True,
                                      "top_logprobs": 3, "return_token_ids": True,
                                      "return_tokens_as_token_ids": True})
    assert status == 200
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
        assert -9999.0 <= entry["logprob"] <= 0.0


async def test_n_choices(proxy, sim):
    status, body = await post(proxy, {"messages": USER, "max_tokens": 4, "n": 3, "temperature": 1.0,
                                      "return_token_ids": True, "ignore_eos": True})
    assert status == 200
    assert sim.app[SIM_STATE].received[-1]["sampling_params"]["n"] == 3
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"]) == 12


@pytest.mark.parametrize("stream", [False, True])
async def test_seeded_n_samples_differ_and_repeat(proxy, sim, stream):
    """SGLang would give n identical samples for one seed; vLLM gives n different ones, reproducibly."""
    body = {"messages": USER, "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 5, "return_token_ids": True,
            "ignore_eos": True}

    async def samples():
        if not stream:
            _, out = await post(proxy, body)
            return [c["token_ids"] for c in out["choices"]]
        chunks = await sse(proxy, body)
        return [[t for c in chunks if c["choices"] and c["choices"][0]["index"] == i
                 for t in c["choices"][0].get("token_ids") or []] for i in range(3)]

    first = await samples()
    sent = sim.app[SIM_STATE].received[-1]
    assert [p["sampling_seed"] for p in sent["sampling_params"]] == [5, 6, 7]
    assert len(sent["input_ids"]) == 3 and sent["input_ids"][0] == GOLDEN_PROMPT_IDS
    assert len({tuple(s) for s in first}) == 3 and all(len(s) == 6 for s in first)
    assert await samples() == first


async def test_tools_and_template_kwargs_reach_the_rendering(proxy, hf_tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                               "parameters": {"type": "object", "properties": {}}}}]
    # vLLM: tools without tool_choice mean "auto", refused without --enable-auto-tool-choice;
    # "none" still renders the tools (vLLM 0.33, unless --exclude-tools-when-tool-choice-none).
    status, body = await post(proxy, {"messages": USER, "tools": tools, "max_tokens": 1})
    assert (status, body["error"]["param"]) == (400, "tool_choice")
    assert body["error"]["message"] == ('"auto" tool choice requires --enable-auto-tool-choice and '
                                        '--tool-call-parser to be set')
    status, body = await post(proxy, {"messages": USER, "tools": tools, "tool_choice": "none", "max_tokens": 1,
                                      "return_token_ids": True})
    assert status == 200
    expected = hf_tokenizer.apply_chat_template(USER, tools=tools, add_generation_prompt=True, tokenize=False)
    assert body["prompt_token_ids"] == hf_tokenizer.encode(expected, add_special_tokens=False)
    assert "get_weather" in hf_tokenizer.decode(body["prompt_token_ids"])


async def test_continue_final_message(proxy, hf_tokenizer):
    msgs = USER + [{"role": "assistant", "content": "The capital is"}]
    status, body = await post(proxy, {"messages": msgs, "add_generation_prompt": False,
                                      "continue_final_message": True, "max_tokens": 1, "return_token_ids": True})
    assert status == 200
    assert hf_tokenizer.decode(body["prompt_token_ids"]).endswith("<|im_start|>assistant\nThe capital is")


async def test_prompt_cache_serves_repeats(proxy):
    from token_proxy.state import upstream_of

    renderer = upstream_of(proxy.server.app).renderer
    before = renderer.hits
    for _ in range(3):
        status, _ = await post(proxy, {"messages": USER, "max_tokens": 1})
        assert status == 200
    assert renderer.hits - before >= 2


async def test_streaming_matches_non_streaming(proxy, hf_tokenizer):
    body = {"messages": USER, "max_tokens": 24, "temperature": 1.0, "seed": 11, "return_token_ids": True,
            "logprobs": True, "stream_options": {"include_usage": True}}
    _, plain = await post(proxy, {k: v for k, v in body.items() if k != "stream_options"})
    chunks = await sse(proxy, body)
    first = chunks[0]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["prompt_token_ids"] == GOLDEN_PROMPT_IDS
    content = [c for c in chunks[1:] if c["choices"]]
    ids = [t for c in content for t in c["choices"][0]["token_ids"]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert ids == plain["choices"][0]["token_ids"]
    assert text == plain["choices"][0]["message"]["content"]
    assert "\ufffd" not in text or "\ufffd" in plain["choices"][0]["message"]["content"]
    lps = [e for c in content for e in c["choices"][0]["logprobs"]["content"]]
    assert len(lps) == len(ids)
    assert content[-1]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(ids)


async def test_streaming_with_incremental_sglang(make_sim, make_proxy):
    sim = await make_sim(incremental_streaming_output=True)
    proxy = await make_proxy(sim)
    body = {"messages": USER, "max_tokens": 16, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    _, plain = await post(proxy, body)
    chunks = await sse(proxy, body)
    ids = [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:])
    assert ids == plain["choices"][0]["token_ids"] and len(ids) == 16
    assert text == plain["choices"][0]["message"]["content"]


async def test_streaming_n2_each_choice_finishes(proxy):
    chunks = await sse(proxy, {"messages": USER, "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 1,
                               "return_token_ids": True})
    roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert [c["choices"][0]["index"] for c in roles] == [0, 1]
    finished = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]}
    assert finished == {0: "length", 1: "length"}
    for index in (0, 1):
        ids = [t for c in chunks[2:] if c["choices"][0]["index"] == index for t in c["choices"][0]["token_ids"]]
        assert len(ids) == 3


async def test_openai_client_happy_paths(proxy):
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="unused", max_retries=0)
    models = await client.models.list()
    assert models.data[0].id == "sim/qwen2-tiny"
    assert models.data[0].model_extra["max_model_len"] == 4096
    r = await client.chat.completions.create(model="sim/qwen2-tiny", messages=USER, max_tokens=5, temperature=0,
                                             extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.model_extra["prompt_token_ids"] == GOLDEN_PROMPT_IDS
    assert len(r.choices[0].model_extra["token_ids"]) == 5
    assert r.choices[0].finish_reason == "length"
    stream = await client.chat.completions.create(model="sim/qwen2-tiny", messages=USER, max_tokens=5,
                                                  temperature=0, stream=True,
                                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = []
    async for chunk in stream:
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
    assert ids == r.choices[0].model_extra["token_ids"]
    await client.close()


async def test_stream_never_splits_a_multibyte_character(proxy, hf_tokenizer):
    """Byte-level tokens split CJK characters; their ids go out at once, their text only when complete."""
    for seed in range(30):
        body = {"messages": USER, "max_tokens": 32, "temperature": 1.0, "seed": seed, "ignore_eos": True,
                "return_token_ids": True}
        chunks = await sse(proxy, body)
        content = [c["choices"][0] for c in chunks[1:] if c["choices"]]
        held = [c for c in content if c["token_ids"] and c["delta"].get("content") == ""]
        partial = [t for c in content for t in c["token_ids"] if "\ufffd" in hf_tokenizer.decode([t])]
        if held and partial:
            break
    else:
        raise AssertionError("no sampled stream had a token that splits a character")
    ids = [t for c in content for t in c["token_ids"]]
    text = "".join(c["delta"].get("content", "") for c in content)
    assert all("\ufffd" not in c["delta"].get("content", "") for c in content)
    assert text == hf_tokenizer.decode(ids)
    _, plain = await post(proxy, body)
    assert plain["choices"][0]["token_ids"] == ids and plain["choices"][0]["message"]["content"] == text


async def test_prompt_logprobs(proxy):
    status, body = await post(proxy, {"messages": USER, "max_tokens": 1, "prompt_logprobs": 2})
    assert status == 200
    plps = body["prompt_logprobs"]
    assert len(plps) == len(GOLDEN_PROMPT_IDS) and plps[0] is None
    for token_id, entry in zip(GOLDEN_PROMPT_IDS[1:], plps[1:]):
        assert str(token_id) in entry
        assert set(entry[str(token_id)]) == {"logprob", "rank", "decoded_token"}
        assert 1 <= len(entry) <= 3
    status, body = await post(proxy, {"messages": USER, "prompt_logprobs": 2, "stream": True})
    assert status == 400 and body["error"]["param"] == "prompt_logprobs"


async def test_openai_client_completions(proxy):
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="unused", max_retries=0)
    r = await client.completions.create(model="sim/qwen2-tiny", prompt=GOLDEN_PROMPT_IDS, max_tokens=4,
                                        temperature=0, logprobs=1,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = r.choices[0]
    assert choice.model_extra["prompt_token_ids"] == GOLDEN_PROMPT_IDS
    assert len(choice.model_extra["token_ids"]) == 4 and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == 4
    await client.close()
