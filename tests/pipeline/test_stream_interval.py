"""vLLM's per-request `stream_interval` reaches SGLang's sampling_params.stream_interval (honoured
per request by SGLang 0.5.17's output streamer): fewer, larger chunks, the same tokens."""

from __future__ import annotations

import orjson
import pytest

from token_proxy.api import parse_sampling
from token_proxy.sglang.payload import sampling_params
from token_proxy.simulator.testing import stream_events

USER = [{"role": "user", "content": "What is the capital of France?"}]


def test_the_payload_carries_stream_interval_only_when_asked():
    assert sampling_params(parse_sampling({"stream_interval": 4}, 1000), 16)["stream_interval"] == 4
    assert "stream_interval" not in sampling_params(parse_sampling({}, 1000), 16)


async def test_a_stream_with_stream_interval_4_batches_the_tokens(make_sim, make_proxy):
    sim = await make_sim(incremental_streaming_output=True)
    proxy = await make_proxy(sim)
    resp = await proxy.post("/v1/chat/completions", data=orjson.dumps(
        {"messages": USER, "max_tokens": 16, "ignore_eos": True, "stream": True, "stream_interval": 4,
         "return_token_ids": True}))
    assert resp.status == 200
    chunks = [c for c in stream_events(await resp.read()) if c["choices"] and "token_ids" in c["choices"][0]]
    # SGLang's rule: the first token at once, then every 4th (tokens 5, 9, 13), and the last one.
    assert [len(c["choices"][0]["token_ids"]) for c in chunks] == [1, 4, 4, 4, 3]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("value", [0, -1, "4", 1.5])
async def test_a_bad_stream_interval_is_a_400_naming_it(proxy, value):
    resp = await proxy.post("/v1/chat/completions", data=orjson.dumps(
        {"messages": USER, "max_tokens": 4, "stream": True, "stream_interval": value}))
    body = orjson.loads(await resp.read())
    assert resp.status == 400 and body["error"]["param"] == "stream_interval"
