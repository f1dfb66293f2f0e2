"""`vllm serve`'s flags as its users type them (issue 39 item 4), each with vLLM 0.33's behaviour and words:
--max-model-len over the engine's context, a prompt over --max-model-len, vLLM's human-readable integers,
several --served-model-name values, and VLLM_API_KEY."""

from __future__ import annotations

import orjson
import pytest

from token_proxy.cli import parse_settings
from token_proxy.sglang.discovery import CONNECTION
from token_proxy.simulator import SIM_STATE

USER = [{"role": "user", "content": "What is the capital of France?"}]


async def post(client, body, path="/v1/chat/completions"):
    resp = await client.post(path, data=orjson.dumps(body), headers={"Content-Type": "application/json"})
    return resp.status, orjson.loads(await resp.read())


async def test_max_model_len_over_sglangs_context_is_a_fatal_configuration_error(make_sim, make_proxy):
    """vLLM refuses to start ("User-specified max_model_len (8192) is greater than the derived max_model_len");
    the proxy, which learns the context from SGLang, stops with the same words and the fix."""
    sim = await make_sim(context_length=4096)
    proxy = await make_proxy(sim, context_length=8192)
    conn = proxy.app[CONNECTION]
    assert conn.connected is None
    url = str(sim.make_url("")).rstrip("/")
    assert conn.fatal == (f"User-specified max_model_len (8192) is greater than the context length of SGLang at {url} "
                          "(4096): pass --max-model-len 4096 or less, or start SGLang with --context-length 8192")
    resp = await proxy.get("/v1/models")
    assert resp.status == 503
    assert "User-specified max_model_len (8192)" in (await resp.json())["error"]["message"]


async def test_max_model_len_under_sglangs_context_is_served(make_sim, make_proxy):
    proxy = await make_proxy(await make_sim(context_length=4096), context_length=2048)
    models = await (await proxy.get("/v1/models")).json()
    assert [card["max_model_len"] for card in models["data"]] == [2048]


async def test_a_prompt_over_max_model_len_gets_vllms_words_not_a_negative_max_tokens(make_sim, make_proxy):
    """--max-model-len 2048 in front of a 4096-token SGLang, a 2,101-token prompt with max_tokens 4."""
    sim = await make_sim(context_length=4096)
    proxy = await make_proxy(sim, context_length=2048)
    status, body = await post(proxy, {"prompt": [9707] * 2101, "max_tokens": 4}, "/v1/completions")
    assert status == 400
    assert body["error"]["param"] == "input_tokens"
    assert body["error"]["message"] == (
        "This model's maximum context length is 2048 tokens. However, your prompt contains 2101 input tokens, "
        "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt.")
    status, body = await post(proxy, {"messages": [{"role": "user", "content": " hello" * 2100}], "max_tokens": 4})
    assert (status, body["error"]["param"]) == (400, "input_tokens")
    assert body["error"]["message"].startswith("This model's maximum context length is 2048 tokens. However, your "
                                               "prompt contains 21")
    assert sim.app[SIM_STATE].received == []
    # a prompt that fills the context exactly leaves no room: vLLM's SamplingParams words
    status, body = await post(proxy, {"prompt": [9707] * 2048}, "/v1/completions")
    assert (status, body["error"]["param"]) == (400, "max_tokens")
    assert body["error"]["message"].startswith("max_tokens must be at least 1, got 0")


@pytest.mark.parametrize("given,expected", [
    ("2048", 2048), ("2k", 2000), ("25.6k", 25600), ("2K", 2048), ("1M", 1 << 20), ("1m", 1_000_000),
    ("auto", None), ("-1", None),
])
def test_max_model_len_takes_vllms_human_readable_integers(given, expected):
    assert parse_settings(["--max-model-len", given], {}).context_length == expected
    assert parse_settings([], {"TOKEN_PROXY_CONTEXT_LENGTH": given}).context_length == expected


def test_a_decimal_with_a_binary_suffix_is_refused_in_vllms_words(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_settings(["--max-model-len", "2.5K"], {})
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "token-proxy: error: argument --context-length/--max-model-len: Decimals are not allowed with binary "
        "suffixes like K. Did you mean to use 2.5k instead? (see token-proxy --help)")


async def test_every_served_model_name_is_listed_and_answers(make_sim, make_proxy):
    settings = parse_settings(["--served-model-name", "alpha", "beta"], {})
    assert (settings.served_model_name, settings.served_model_aliases) == ("alpha", ("beta",))
    proxy = await make_proxy(await make_sim(), served_model_name="alpha", served_model_aliases=("beta",))
    models = await (await proxy.get("/v1/models")).json()
    assert [card["id"] for card in models["data"]] == ["alpha", "beta"]
    assert all(card["max_model_len"] == 4096 for card in models["data"])
    for name in ("alpha", "beta"):
        status, body = await post(proxy, {"model": name, "messages": USER, "max_tokens": 2})
        assert (status, body["model"]) == (200, "alpha")  # vLLM answers with the first name
    status, body = await post(proxy, {"model": "gamma", "messages": USER, "max_tokens": 2})
    assert (status, body["error"]["param"]) == (404, "model")


def test_vllm_api_key_is_honoured_when_no_key_is_given():
    """vllm serve: `args.api_key or [envs.VLLM_API_KEY]` (entrypoints/serve/middleware/register.py)."""
    assert parse_settings([], {"VLLM_API_KEY": "k1"}).api_key == "k1"
    assert parse_settings(["--api-key", "a"], {"VLLM_API_KEY": "k1"}).api_key == "a"
    assert parse_settings([], {"TOKEN_PROXY_API_KEY": "t", "VLLM_API_KEY": "k1"}).api_key == "t"
    assert parse_settings([], {"VLLM_API_KEY": ""}).api_key is None


async def test_vllm_api_key_guards_the_inference_routes(make_sim, make_proxy):
    settings = parse_settings([], {"VLLM_API_KEY": "k1"})
    proxy = await make_proxy(await make_sim(), api_key=settings.api_key)
    assert (await proxy.get("/v1/models")).status == 401
    assert (await proxy.get("/v1/models", headers={"Authorization": "Bearer k1"})).status == 200
