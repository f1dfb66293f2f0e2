"""POST /v1/completions, /v1/chat/completions/tokens, /tokenize and /detokenize."""

from __future__ import annotations

import orjson
import pytest

from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.testing import stream_events

PROMPT = [151644, 872, 198, 3838, 374, 279, 6722, 315, 9625, 30, 151645, 198, 151644, 77091, 198]
FOX = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]  # "The quick brown fox jumps over the lazy dog."
CHOICE_KEYS = ["index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs",
               "prompt_token_ids", "routed_experts", "weight_versions"]


async def post(client, path, body):
    resp = await client.post(path, data=orjson.dumps(body), headers={"Content-Type": "application/json"})
    return resp.status, orjson.loads(await resp.read())


async def sse(client, path, body):
    resp = await client.post(path, data=orjson.dumps({**body, "stream": True}))
    assert resp.status == 200
    return stream_events(await resp.read())


async def test_text_prompt_defaults_to_16_tokens_and_returns_ids_per_choice(proxy, sim, hf_tokenizer):
    status, body = await post(proxy, "/v1/completions", {"prompt": "The quick brown fox", "temperature": 0,
                                                         "ignore_eos": True, "return_token_ids": True})
    assert status == 200, body
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert list(choice) == CHOICE_KEYS
    assert choice["prompt_token_ids"] == hf_tokenizer.encode("The quick brown fox") == [785, 3974, 13876, 38835]
    assert len(choice["token_ids"]) == 16 and choice["finish_reason"] == "length"
    assert choice["text"] == hf_tokenizer.decode(choice["token_ids"])
    assert "prompt_token_ids" not in body
    assert sim.app[SIM_STATE].received[-1]["input_ids"] == [785, 3974, 13876, 38835]


async def test_token_prompts_are_sent_verbatim_and_batched(proxy, sim):
    status, body = await post(proxy, "/v1/completions", {"prompt": [PROMPT, FOX], "max_tokens": 3, "n": 2,
                                                         "temperature": 1.0, "ignore_eos": True,
                                                         "return_token_ids": True})
    assert status == 200, body
    sent = sim.app[SIM_STATE].received[-1]
    assert sent["input_ids"] == [PROMPT, FOX]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in body["choices"]] == [PROMPT, PROMPT, FOX, FOX]
    assert body["usage"]["prompt_tokens"] == len(PROMPT) + len(FOX)
    assert body["usage"]["completion_tokens"] == 12


async def test_single_token_prompt_and_seeded_batch(proxy, sim):
    status, body = await post(proxy, "/v1/completions", {"prompt": FOX, "max_tokens": 4, "n": 2, "seed": 9,
                                                         "temperature": 1.0, "ignore_eos": True,
                                                         "return_token_ids": True})
    assert status == 200
    sent = sim.app[SIM_STATE].received[-1]
    assert [p["sampling_seed"] for p in sent["sampling_params"]] == [9, 10]
    assert body["choices"][0]["token_ids"] != body["choices"][1]["token_ids"]


async def test_logprobs_and_echo(proxy, hf_tokenizer):
    status, body = await post(proxy, "/v1/completions", {"prompt": FOX, "max_tokens": 3, "temperature": 0,
                                                         "ignore_eos": True, "logprobs": 2, "echo": True})
    assert status == 200, body
    choice = body["choices"][0]
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(FOX) + 3
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lps["token_logprobs"][1:])
    assert all(1 <= len(t) <= 3 for t in lps["top_logprobs"][1:])
    assert lps["text_offset"][0] == 0
    assert lps["text_offset"][1] == len(lps["tokens"][0])
    assert choice["text"].startswith("The quick brown fox jumps over the lazy dog.")
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(FOX)


async def test_streaming_completions_match(proxy):
    body = {"prompt": FOX, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    _, plain = await post(proxy, "/v1/completions", {k: v for k, v in body.items() if k != "stream_options"})
    chunks = await sse(proxy, "/v1/completions", body)
    content = [c for c in chunks if c["choices"]]
    assert content[0]["choices"][0]["prompt_token_ids"] == FOX
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in content[1:])
    assert [t for c in content for t in c["choices"][0]["token_ids"]] == plain["choices"][0]["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in content) == plain["choices"][0]["text"]
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("prompt", [None, "", [], [[]], [-1], [10**6], ["a", 1], {"x": 1}])
async def test_bad_prompts_are_400(proxy, sim, prompt):
    status, body = await post(proxy, "/v1/completions", {"prompt": prompt})
    assert status == 400, body
    assert body["error"]["param"] == "prompt"
    assert sim.app[SIM_STATE].received == []


async def test_chat_completions_tokens_uses_the_given_ids(proxy, sim):
    tokens = PROMPT[:-3] + [151644, 77091, 198]
    status, body = await post(proxy, "/v1/chat/completions/tokens", {
        "messages": [{"role": "user", "content": "ignored for the prompt"}], "tokens": tokens, "max_tokens": 2,
        "return_token_ids": True})
    assert status == 200, body
    assert body["prompt_token_ids"] == tokens
    assert sim.app[SIM_STATE].received[-1]["input_ids"] == tokens
    status, body = await post(proxy, "/v1/chat/completions/tokens", {"messages": [], "tokens": [-5]})
    assert status == 400 and body["error"]["param"] == "tokens"


async def test_tokenize_chat_and_plain_and_detokenize(proxy, hf_tokenizer):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    for path in ("/tokenize", "/v1/tokenize"):
        status, body = await post(proxy, path, {"messages": msgs, "return_token_strs": True})
        assert status == 200
        assert list(body) == ["count", "max_model_len", "tokens", "token_strs"]
        assert body["tokens"] == PROMPT and body["count"] == 15 and body["max_model_len"] == 4096
        assert body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(PROMPT)
    status, body = await post(proxy, "/tokenize", {"prompt": "The quick brown fox"})
    assert body == {"count": 4, "max_model_len": 4096, "tokens": [785, 3974, 13876, 38835], "token_strs": None}
    status, body = await post(proxy, "/detokenize", {"tokens": PROMPT})
    assert body == {"prompt": hf_tokenizer.decode(PROMPT)}
    status, body = await post(proxy, "/detokenize", {"tokens": [10**7]})
    assert status == 400 and body["error"]["param"] == "tokens"
    status, body = await post(proxy, "/tokenize", {"prompt": 5})
    assert status == 400 and body["error"]["param"] == "prompt"


async def test_completions_and_generate_carry_weight_versions(proxy):
    status, body = await post(proxy, "/v1/completions", {"prompt": FOX, "max_tokens": 3, "ignore_eos": True})
    assert status == 200
    assert body["choices"][0]["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]
    chunks = await sse(proxy, "/v1/completions", {"prompt": FOX, "max_tokens": 3, "ignore_eos": True})
    last = [c for c in chunks if c["choices"]][-1]["choices"][0]
    assert last["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]
    _, body = await post(proxy, "/inference/v1/generate", {"token_ids": FOX,
                                                           "sampling_params": {"max_tokens": 2, "ignore_eos": True}})
    assert body["choices"][0]["weight_versions"] == [{"version": "default", "start": 0, "end": 2}]
