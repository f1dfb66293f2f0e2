"""`seed` against SGLang's rule: honoured only under --enable-deterministic-inference."""

from __future__ import annotations

import orjson

from token_proxy.simulator import SIM_STATE

USER = [{"role": "user", "content": "hi"}]


async def test_seed_is_refused_with_require_honoured_seed(make_sim, make_proxy):
    sim = await make_sim(enable_deterministic_inference=False)
    proxy = await make_proxy(sim, require_honoured_seed=True)
    for path, body in (("/v1/chat/completions", {"messages": USER, "seed": 1}),
                       ("/v1/completions", {"prompt": "hi", "seed": 1}),
                       ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"seed": 1}})):
        resp = await proxy.post(path, data=orjson.dumps(body))
        reply = await resp.json()
        assert resp.status == 400, reply
        assert reply["error"]["param"] == "seed"
        assert "--enable-deterministic-inference" in reply["error"]["message"]
        assert "--require-honoured-seed" in reply["error"]["message"]
    assert sim.app[SIM_STATE].received == []
    resp = await proxy.post("/v1/chat/completions", data=orjson.dumps({"messages": USER, "max_tokens": 2}))
    assert resp.status == 200  # unseeded requests are unaffected


async def test_unhonoured_seed_is_sent_and_reported_by_default(make_sim, make_proxy, caplog):
    """vLLM clients (SkyRL: seed + temperature > 0) run unmodified; the response says the seed had no effect."""
    sim = await make_sim(enable_deterministic_inference=False)
    proxy = await make_proxy(sim)
    body = {"messages": USER, "seed": 7, "temperature": 1.0, "max_tokens": 16, "ignore_eos": True,
            "return_token_ids": True}
    outs = []
    with caplog.at_level("WARNING", logger="token_proxy.ops.metrics"):
        for _ in range(2):
            resp = await proxy.post("/v1/chat/completions", data=orjson.dumps(body))
            assert resp.status == 200
            assert resp.headers["X-Seed-Honoured"] == "false"
            outs.append((await resp.json())["choices"][0]["token_ids"])
        assert sim.app[SIM_STATE].received[-1]["sampling_params"]["sampling_seed"] == 7
        assert outs[0] != outs[1]  # as on a real SGLang without deterministic inference
        resp = await proxy.post("/v1/chat/completions", data=orjson.dumps({**body, "stream": True}))
        assert resp.status == 200 and resp.headers["X-Seed-Honoured"] == "false"  # set before the stream
        await resp.read()
        resp = await proxy.post("/v1/completions", data=orjson.dumps({"prompt": "hi", "seed": 1, "max_tokens": 2}))
        assert resp.headers["X-Seed-Honoured"] == "false"
    warnings = [r for r in caplog.records if "seed SGLang ignores" in r.getMessage()]
    assert len(warnings) == 1  # four requests within 60 s: one line
    assert "--require-honoured-seed" in warnings[0].getMessage()
    metrics = await (await proxy.get("/metrics")).text()
    assert 'token_proxy_unhonoured_seed_requests_total{endpoint="/v1/chat/completions"} 3.0' in metrics
    assert 'token_proxy_unhonoured_seed_requests_total{endpoint="/v1/completions"} 1.0' in metrics
    unseeded = await proxy.post("/v1/chat/completions", data=orjson.dumps({"messages": USER, "max_tokens": 2}))
    assert "X-Seed-Honoured" not in unseeded.headers


async def test_seed_is_honoured_under_deterministic_inference(make_sim, make_proxy):
    sim = await make_sim(enable_deterministic_inference=True)
    proxy = await make_proxy(sim)
    body = orjson.dumps({"messages": USER, "seed": 7, "temperature": 1.0, "max_tokens": 16, "ignore_eos": True,
                         "return_token_ids": True})
    outs = [(await (await proxy.post("/v1/chat/completions", data=body)).json())["choices"][0]["token_ids"]
            for _ in range(2)]
    assert outs[0] == outs[1]


async def test_seed_with_greedy_decoding_is_accepted_everywhere_but_sampled_stays_refused(make_sim, make_proxy):
    """vLLM and SGLang ignore seeds under greedy decoding: a seed cannot change a temperature-0 output."""
    sim = await make_sim(enable_deterministic_inference=False)
    proxy = await make_proxy(sim, require_honoured_seed=True)
    for path, body in (("/v1/chat/completions", {"messages": USER, "seed": 1, "temperature": 0, "max_tokens": 3}),
                       ("/v1/completions", {"prompt": "hi", "seed": 1, "temperature": 0.0, "max_tokens": 3}),
                       ("/inference/v1/generate", {"token_ids": [1, 2],
                                                   "sampling_params": {"seed": 1, "temperature": 0,
                                                                       "max_tokens": 3}})):
        resp = await proxy.post(path, data=orjson.dumps(body))
        assert resp.status == 200, await resp.text()
        assert "X-Seed-Honoured" not in resp.headers  # nothing to honour
        assert "sampling_seed" not in sim.app[SIM_STATE].received[-1]["sampling_params"]  # nothing to honour
        sampled = dict(body, temperature=0.7) if "sampling_params" not in body else dict(
            body, sampling_params=dict(body["sampling_params"], temperature=0.7))
        resp = await proxy.post(path, data=orjson.dumps(sampled))
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "seed"


def test_allow_unhonoured_seed_is_a_deprecated_alias():
    from token_proxy.cli import parse_settings

    assert parse_settings([]).require_honoured_seed is False
    assert parse_settings(["--require-honoured-seed"]).require_honoured_seed is True
    assert parse_settings(["--allow-unhonoured-seed", "true"]).require_honoured_seed is False
    assert parse_settings(["--allow-unhonoured-seed", "false"]).require_honoured_seed is True
    assert parse_settings([], {"TOKEN_PROXY_ALLOW_UNHONOURED_SEED": "false"}).require_honoured_seed is True
