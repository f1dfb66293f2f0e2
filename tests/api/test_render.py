"""POST /v1/chat/completions/render: vLLM 0.33's answer (a GenerateRequest) from the chat pipeline's
own parse and render steps, without calling SGLang; errors in vLLM's words."""

from __future__ import annotations

import orjson

from token_proxy.api.chat.render import vllm_sampling_params
from token_proxy.simulator import SIM_STATE
from token_proxy.vocabulary import SamplingRequest

USER = [{"role": "user", "content": "What is the capital of France?"}]
# The rendering real SGLang 0.5.17 saw for USER (tests/api/test_proxy_chat.py: GOLDEN_PROMPT_IDS).
GOLDEN_PROMPT_IDS = [151644, 872, 198, 3838, 374, 279, 6722, 315, 9625, 30, 151645, 198, 151644, 77091, 198]
# vLLM 0.33's GenerateRequest fields, in its order (scale_out/token_in_token_out/protocol.py).
KEYS = ["request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params", "model",
        "reasoning_ended", "reasoning_parser_kwargs", "return_token_ids", "output_mode", "parse_context", "stream",
        "stream_options", "cache_salt", "priority", "kv_transfer_params", "ec_transfer_params"]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


async def render(client, body, headers=None):
    resp = await client.post("/v1/chat/completions/render", data=orjson.dumps(body), headers=headers or {})
    return resp.status, orjson.loads(await resp.read())


async def test_render_is_vllms_generate_request_with_the_chat_prompt_ids(proxy, sim):
    sent_before = len(sim.app[SIM_STATE].received)
    status, body = await render(proxy, {"model": "sim/qwen2-tiny", "messages": USER, "max_tokens": 8,
                                        "temperature": 0, "request_id": "abc"})
    assert status == 200, body
    assert list(body) == KEYS
    assert body == {
        "request_id": "chatcmpl-abc", "token_ids": GOLDEN_PROMPT_IDS, "token_offsets": None, "features": None,
        "content_parts": None,
        "sampling_params": {"temperature": 0.0, "stop": [], "stop_token_ids": [], "max_tokens": 8, "output_kind": 2,
                            "skip_clone": True, "bad_words": [], "skip_reading_prefix_cache": False},
        "model": "sim/qwen2-tiny", "reasoning_ended": None, "reasoning_parser_kwargs": None,
        "return_token_ids": None, "output_mode": "tokens",
        "parse_context": {"tools": None, "tool_choice": "none", "parallel_tool_calls": True,
                          "include_reasoning": True, "chat_template_kwargs": {}, "history_tool_call_cnt": 0},
        "stream": False, "stream_options": None, "cache_salt": None, "priority": 0,
        "kv_transfer_params": None, "ec_transfer_params": None}
    assert len(sim.app[SIM_STATE].received) == sent_before  # rendered only: SGLang was not called


async def test_render_ids_equal_what_chat_sends_to_sglang(make_proxy, sim):
    proxy = await make_proxy(sim, tool_call_parser="hermes", enable_auto_tool_choice=True)
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    status, body = await render(proxy, {"messages": messages, "tools": [TOOL], "stream": True,
                                        "stream_options": {"include_usage": True}})
    assert status == 200, body
    resp = await proxy.post("/v1/chat/completions", json={"messages": messages, "tools": [TOOL], "max_tokens": 2})
    assert resp.status == 200
    assert body["token_ids"] == sim.app[SIM_STATE].received[-1]["input_ids"]
    # absent max_tokens: the rest of the context (4096), as vLLM's get_max_tokens
    assert body["sampling_params"]["max_tokens"] == 4096 - len(body["token_ids"])
    assert body["sampling_params"]["output_kind"] == 1  # DELTA for a stream
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    assert body["model"] is None
    assert body["parse_context"]["tools"] == [TOOL]
    assert body["parse_context"]["tool_choice"] == "auto"


async def test_render_takes_the_request_id_header(proxy):
    status, body = await render(proxy, {"messages": USER}, headers={"X-Request-Id": "from-header"})
    assert (status, body["request_id"]) == (200, "chatcmpl-from-header")


async def test_render_errors_in_vllms_words(proxy):
    status, body = await render(proxy, {"model": "nope", "messages": USER})
    assert (status, body["error"]["type"], body["error"]["param"]) == (404, "NotFoundError", "model")
    assert body["error"]["message"].startswith("The model `nope` does not exist.")
    status, body = await render(proxy, {"messages": USER, "use_beam_search": True})
    assert (status, body["error"]) == (400, {"message": "Beam search is not supported by the render endpoint",
                                             "type": "BadRequestError", "param": None, "code": 400})
    status, body = await render(proxy, {"messages": []})
    assert (status, body["error"]["param"]) == (400, "messages")
    status, body = await render(proxy, {"messages": USER, "max_tokens": 5000})
    assert (status, body["error"]["param"]) == (400, "max_tokens")
    resp = await proxy.get("/v1/chat/completions/render")
    assert (resp.status, resp.headers["Allow"]) == (405, "POST")


async def test_render_is_in_the_openapi_description(proxy):
    spec = await (await proxy.get("/openapi.json")).json()
    schema = spec["paths"]["/v1/chat/completions/render"]["post"]["responses"]["200"]["content"][
        "application/json"]["schema"]
    assert schema["required"] == KEYS


def test_sampling_params_are_vllms_non_default_fields():
    sampling = SamplingRequest(n=2, temperature=0.005, top_p=0.9, top_k=20, stop=("ab", "abcd"), seed=-1,
                               stop_token_ids=(7, 7, 9), logprobs=True, top_logprobs=3, prompt_logprobs=1,
                               constraint=("regex", "a|b"), logit_bias={"5": 1.0})
    assert vllm_sampling_params(sampling, 16, stream=False) == {
        "n": 2, "temperature": 0.01, "top_p": 0.9, "top_k": 20, "stop": ["ab", "abcd"], "stop_token_ids": [7, 9],
        "logprobs": 3, "prompt_logprobs": 1, "output_kind": 2, "skip_clone": True, "output_text_buffer_length": 3,
        "structured_outputs": {"json": None, "regex": "a|b", "choice": None, "grammar": None, "json_object": None,
                               "disable_any_whitespace": False, "disable_additional_properties": False,
                               "whitespace_pattern": None, "structural_tag": None},
        "logit_bias": {"5": 1.0}, "bad_words": [], "skip_reading_prefix_cache": True}


async def test_render_with_logit_bias_answers_json(proxy):
    """schemathesis found a 500: the render's logit_bias kept int keys, which JSON cannot write."""
    response = await proxy.post("/v1/chat/completions/render", json={
        "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"151277": -5.0, "7": 1.5}})
    body = await response.json()
    assert response.status == 200, body
    assert body["sampling_params"]["logit_bias"] == {"151277": -5.0, "7": 1.5}


async def test_derender_gives_back_the_chat_response_for_the_same_ids(proxy):
    """vLLM's /v1/chat/completions/derender (issue 31): the ids a chat generated, derendered with its request,
    are that chat's response: text, finish and stop reasons, token ids, usage."""
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12, "temperature": 0,
            "return_token_ids": True}
    sent = await (await proxy.post("/v1/chat/completions", json=chat)).json()
    choice = sent["choices"][0]
    response = await proxy.post("/v1/chat/completions/derender", json={
        "generate_response": {"request_id": "r-1", "choices": [
            {"index": 0, "token_ids": choice["token_ids"], "finish_reason": choice["finish_reason"]}]},
        "prompt_token_ids": sent["prompt_token_ids"], "chat_request": chat})
    body = await response.json()
    assert response.status == 200, body
    (got,) = body["choices"]
    assert got["message"] == choice["message"]
    assert (got["finish_reason"], got["stop_reason"], got["token_ids"]) == (
        choice["finish_reason"], choice["stop_reason"], choice["token_ids"])
    assert body["usage"] == sent["usage"] and body["prompt_token_ids"] == sent["prompt_token_ids"]
    assert body["id"] == "chatcmpl-r-1" and body["object"] == "chat.completion"


async def test_derender_parses_tool_calls_for_the_chat_request(make_sim, make_proxy):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    sim = await make_sim(scripted_output=call)
    proxy = await make_proxy(sim, tool_call_parser="hermes", enable_auto_tool_choice=True)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    chat = {"messages": [{"role": "user", "content": "Weather?"}], "tools": tools, "max_tokens": 64,
            "return_token_ids": True}
    sent = await (await proxy.post("/v1/chat/completions", json=chat)).json()
    choice = sent["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    body = await (await proxy.post("/v1/chat/completions/derender", json={
        "generate_response": {"choices": [{"index": 0, "token_ids": choice["token_ids"], "finish_reason": "stop"}]},
        "chat_request": chat})).json()
    got = body["choices"][0]
    assert got["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got["message"]["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')]


async def test_derender_refuses_what_it_cannot_take(proxy):
    for body, param in (({"generate_response": {"choices": []}}, "generate_response"),
                        ({"generate_response": {"choices": [{"token_ids": [1]}]}, "stream": True}, "stream"),
                        ({"generate_response": {"choices": [{"token_ids": [10**9]}]}},
                         "generate_response.choices[0].token_ids")):
        response = await proxy.post("/v1/chat/completions/derender", json=body)
        assert (response.status, (await response.json())["error"]["param"]) == (400, param)
