"""The proxy in front of a live SGLang server: chat, streaming, token-in, and bad input stopped at the proxy.

Run on a GPU host: SGLANG_URL=http://127.0.0.1:30000 pytest tests/e2e -m gpu
"""

from __future__ import annotations

import math

import orjson
import pytest

from token_proxy.simulator.testing import stream_events

USER = [{"role": "user", "content": "What is the capital of France?"}]


async def post(client, path, body):
    resp = await client.post(path, data=orjson.dumps(body), headers={"Content-Type": "application/json"})
    return resp.status, orjson.loads(await resp.read())


async def sse(client, path, body):
    resp = await client.post(path, data=orjson.dumps({**body, "stream": True}))
    assert resp.status == 200, await resp.text()
    return stream_events(await resp.read())


def rendered(tokenizer, messages, **kwargs):
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


async def test_chat_ids_are_the_rendering_and_sglangs_own_output(proxy, sglang, live_tokenizer):
    status, body = await post(proxy, "/v1/chat/completions", {"messages": USER, "max_tokens": 16, "temperature": 0,
                                                              "return_token_ids": True, "logprobs": True,
                                                              "top_logprobs": 2})
    assert status == 200, body
    prompt = rendered(live_tokenizer, USER)
    assert body["prompt_token_ids"] == prompt
    _, direct = await sglang.post("/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 16, "temperature": 0}})
    choice = body["choices"][0]
    assert choice["token_ids"] == direct["output_ids"]
    assert choice["message"]["content"] == direct["text"]
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"]
               for e in choice["logprobs"]["content"])
    assert body["usage"]["prompt_tokens"] == len(prompt)


@pytest.mark.parametrize("extra", [{}, {"n": 2}, {"logprobs": True, "top_logprobs": 1}])
async def test_streaming_concatenation_equals_non_streaming(proxy, extra):
    body = {"messages": USER, "max_tokens": 24, "temperature": 0, "return_token_ids": True, "ignore_eos": True,
            **extra}
    _, plain = await post(proxy, "/v1/chat/completions", body)
    chunks = await sse(proxy, "/v1/chat/completions", body)
    for choice in plain["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == choice["index"]]
        ids = [t for c in mine for t in c.get("token_ids") or []]
        text = "".join(c["delta"].get("content", "") for c in mine)
        assert ids == choice["token_ids"]
        assert text == choice["message"]["content"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"] == "length"
        if extra.get("logprobs"):  # every chunk but the role chunk carries its tokens' logprobs
            content = [c for c in mine if "role" not in c["delta"]]
            assert len([e for c in content for e in c["logprobs"]["content"]]) == len(ids)


@pytest.mark.parametrize("extra", [{}, {"n": 2, "logprobs": True, "top_logprobs": 1}])
async def test_coalesced_streams_send_the_same_chunks(proxy, live_proxy, extra):
    """--stream-coalesce-ms holds SGLang's reads, never its events: every choice gets the same chunks."""
    coalesced = await live_proxy(stream_coalesce_ms=50)
    body = {"messages": USER, "max_tokens": 48, "temperature": 0, "return_token_ids": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, **extra}

    def per_choice(chunks) -> dict:
        # usage's cached_tokens differ: the second request finds the first's prefix in SGLang's cache
        out: dict = {"usage": [{k: v for k, v in c["usage"].items() if k != "prompt_tokens_details"}
                               for c in chunks if c.get("usage")]}
        for c in chunks:
            for choice in c["choices"]:
                out.setdefault(choice["index"], []).append(choice)
        return out

    plain = per_choice(await sse(proxy, "/v1/chat/completions", body))
    held = per_choice(await sse(coalesced, "/v1/chat/completions", body))
    assert len(plain[0]) == 48 + 1  # the role chunk, then one chunk per token
    assert held == plain


async def test_seed_follows_sglangs_deterministic_mode(proxy, sglang):
    """SGLang honours sampling_seed only with --enable-deterministic-inference; the proxy sends a seed it
    would ignore and says so (X-Seed-Honoured: false), and under that mode seeded samples repeat."""
    _, info = await sglang.get("/server_info")
    body = {"messages": USER, "max_tokens": 16, "temperature": 1.0, "seed": 5, "ignore_eos": True,
            "return_token_ids": True}
    if not info.get("enable_deterministic_inference"):
        resp = await proxy.post("/v1/chat/completions", data=orjson.dumps(body))
        assert resp.status == 200 and resp.headers["X-Seed-Honoured"] == "false"
        return
    outs = [(await post(proxy, "/v1/chat/completions", body))[1]["choices"][0]["token_ids"] for _ in range(2)]
    assert outs[0] == outs[1]


async def test_stop_id_stop_string_eos_and_length(proxy, live_tokenizer):
    base = {"messages": USER, "max_tokens": 12, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    _, full = await post(proxy, "/v1/chat/completions", base)
    ids = full["choices"][0]["token_ids"]
    assert full["choices"][0]["finish_reason"] == "length" and len(ids) == 12
    _, body = await post(proxy, "/v1/chat/completions", {**base, "ignore_eos": False, "stop_token_ids": [ids[2]]})
    choice = body["choices"][0]
    assert choice["token_ids"] == ids[: ids.index(ids[2]) + 1]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", ids[2])
    text = full["choices"][0]["message"]["content"]
    stop = text[2:4] if len(text) >= 4 else text[:1]
    if stop.strip() or stop:
        _, body = await post(proxy, "/v1/chat/completions", {**base, "ignore_eos": False, "stop": [stop]})
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
        assert stop not in choice["message"]["content"]
    _, body = await post(proxy, "/v1/chat/completions", {"messages": USER, "max_tokens": 32, "temperature": 0,
                                                         "min_tokens": 3, "logit_bias": {"151645": 100},
                                                         "return_token_ids": True})
    choice = body["choices"][0]
    assert choice["token_ids"][-1] == 151645 and len(choice["token_ids"]) == 4
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    assert "<|im_end|>" not in choice["message"]["content"]


async def test_tools_render_into_the_prompt(proxy, live_tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {}}}}]
    status, body = await post(proxy, "/v1/chat/completions", {"messages": USER, "tools": tools, "max_tokens": 2,
                                                              "tool_choice": "none", "return_token_ids": True})
    assert status == 200
    assert body["prompt_token_ids"] == rendered(live_tokenizer, USER, tools=tools)


async def test_context_errors_use_vllms_words_and_sglang_survives(proxy, sglang):
    status, body = await post(proxy, "/v1/chat/completions", {"messages": [{"role": "user",
                                                                            "content": "hi " * 5000}]})
    assert status == 400 and "maximum context length" in body["error"]["message"]
    status, body = await post(proxy, "/v1/chat/completions", {"messages": USER, "max_tokens": 10_000})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    assert (await sglang.get("/health"))[0] == 200


async def test_token_in_with_the_renderers_client(proxy, sglang, live_tokenizer):
    renderers = pytest.importorskip("renderers")
    from openai import AsyncOpenAI
    from renderers.client import generate

    renderer = renderers.create_renderer(live_tokenizer, renderers.DefaultRendererConfig())
    client = AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="unused", max_retries=0)
    out = await generate(client=client, renderer=renderer, messages=USER, model=await _model(proxy),
                         sampling_params={"max_tokens": 16, "temperature": 0.0})
    prompt = rendered(live_tokenizer, USER)
    assert out["prompt_ids"] == prompt
    _, direct = await sglang.post("/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "stop_token_ids": [151645], "skip_special_tokens": False}})
    assert out["completion_ids"] == direct["output_ids"]
    assert len(out["completion_logprobs"]) == len(out["completion_ids"])
    assert all(math.isfinite(x) for x in out["completion_logprobs"])
    await client.close()


async def test_completions_with_token_prompts_and_tokenize(proxy, sglang, live_tokenizer):
    prompt = live_tokenizer.encode("The quick brown fox")
    status, body = await post(proxy, "/v1/completions", {"prompt": [prompt, prompt[:2]], "max_tokens": 4,
                                                         "temperature": 0, "return_token_ids": True})
    assert status == 200
    assert [c["prompt_token_ids"] for c in body["choices"]] == [prompt, prompt[:2]]
    _, direct = await sglang.post("/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0}})
    assert body["choices"][0]["token_ids"] == direct["output_ids"]
    _, tok = await post(proxy, "/tokenize", {"messages": USER})
    assert tok["tokens"] == rendered(live_tokenizer, USER)


@pytest.mark.parametrize("path,body,param", [
    ("/inference/v1/generate", {"token_ids": [151936]}, "token_ids"),
    ("/inference/v1/generate", {"token_ids": [999999]}, "token_ids"),
    ("/inference/v1/generate", {"token_ids": [-1]}, "token_ids"),
    ("/v1/completions", {"prompt": [10**6]}, "prompt"),
    ("/v1/chat/completions", {"messages": USER, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": USER, "bogus_sampling": 1, "top_k": "x"}, "top_k"),
])
async def test_bad_input_is_stopped_at_the_proxy_and_sglang_stays_healthy(proxy, sglang, path, body, param):
    status, reply = await post(proxy, path, body)
    assert status == 400 and reply["error"]["param"] == param
    status, _ = await sglang.get("/health_generate")
    assert status == 200


async def _model(proxy) -> str:
    resp = await proxy.get("/v1/models")
    return (await resp.json())["data"][0]["id"]


@pytest.mark.parametrize("body,message", [
    # On SGLang 0.5.17 an id >= the vocabulary is a device-side assert that ends the server (shared/golden).
    ({"input_ids": [999999999], "sampling_params": {"max_new_tokens": 2}},
     "input_ids: item 0 (999999999) is out of range"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "temperature": "hot"}}, "sampling_params"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "bogus": 1}}, "sampling_params"),
])
async def test_native_generate_through_the_pass_through_cannot_kill_sglang(proxy, sglang, body, message):
    resp = await proxy.post("/generate", json=body)
    reply = await resp.json()
    assert resp.status == 400 and list(reply) == ["error"] and message in reply["error"]["message"]
    status, _ = await sglang.get("/health_generate")
    assert status == 200
    resp = await proxy.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3,
                                                                                        "temperature": 0}})
    assert resp.status == 200 and len((await resp.json())["output_ids"]) == 3
