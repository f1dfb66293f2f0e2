"""Keys and SGLang (issue 32.5): a client's credentials never reach SGLang, whatever route they came by
(chat, whole and streamed; the pass-through; an admin fan-out), and with --sglang-api-key every call the
proxy makes to SGLang carries that key: discovery, health, /generate (pool and relayed stream), aborts,
admin calls, the pass-through and the /metrics scrape."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiohttp import web

from token_proxy.simulator import SimConfig, create_sim_app

USER = [{"role": "user", "content": "What is the capital of France?"}]
API_KEY, ADMIN_KEY, SGLANG_KEY = "client-api-key", "client-admin-key", "sglang-own-key"


@pytest.fixture
def recording_sim(aiohttp_server, tokenizer_dir):
    """The simulator behind a middleware that records (method, path, Authorization, X-API-Key) of every call."""
    async def factory():
        seen: list[tuple[str, str, str | None, str | None]] = []

        @web.middleware
        async def record(request, handler):
            seen.append((request.method, request.path, request.headers.get("Authorization"),
                         request.headers.get("X-API-Key")))
            return await handler(request)

        app = create_sim_app(SimConfig(tokenizer_path=str(tokenizer_dir), enable_deterministic_inference=True))
        app.middlewares.insert(0, record)
        return await aiohttp_server(app), seen

    return factory


async def client_calls(proxy) -> None:
    """Chat (whole, streamed, one the client leaves), a native route through the pass-through, an admin
    call: each with the client's keys in Authorization and X-API-Key."""
    user = {"Authorization": f"Bearer {API_KEY}", "X-API-Key": API_KEY}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}", "X-API-Key": ADMIN_KEY}
    for stream in (False, True):
        resp = await proxy.post("/v1/chat/completions", headers=user, data=orjson.dumps(
            {"messages": USER, "max_tokens": 3, "stream": stream}))
        assert resp.status == 200
        await resp.read()
    resp = await proxy.post("/generate", headers=admin, json={"input_ids": [785, 3974], "sampling_params":
                                                              {"max_new_tokens": 2, "temperature": 0}})
    assert resp.status == 200 and (await resp.json())["meta_info"]["completion_tokens"] == 2
    resp = await proxy.post("/flush_cache", headers=admin)
    assert resp.status == 200
    resp = await proxy.post("/v1/chat/completions", headers=user, data=orjson.dumps(
        {"messages": USER, "max_tokens": 2000, "ignore_eos": True, "stream": True}))
    assert resp.status == 200
    await resp.content.readany()
    resp.close()  # the client leaves: the proxy aborts the SGLang request


async def wait_for(seen, path: str) -> None:
    for _ in range(200):
        if any(p == path for _, p, _, _ in seen):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"SGLang never got {path}: {sorted({p for _, p, _, _ in seen})}")


async def test_no_client_key_reaches_sglang(recording_sim, make_proxy):
    sim, seen = await recording_sim()
    proxy = await make_proxy(sim, api_key=API_KEY, admin_key=ADMIN_KEY)
    await client_calls(proxy)
    await wait_for(seen, "/abort_request")
    assert {path for _, path, _, _ in seen} >= {"/generate", "/flush_cache", "/abort_request"}
    assert [call for call in seen if call[2] is not None or call[3] is not None] == []


async def test_every_call_to_sglang_carries_its_own_key(recording_sim, make_proxy):
    sim, seen = await recording_sim()
    proxy = await make_proxy(sim, api_key=API_KEY, admin_key=ADMIN_KEY, sglang_api_key=SGLANG_KEY,
                             backend_metrics_interval_s=0.05)
    await client_calls(proxy)
    await wait_for(seen, "/abort_request")
    await wait_for(seen, "/metrics")
    paths = {path for _, path, _, _ in seen}
    assert paths >= {"/health", "/generate", "/flush_cache", "/abort_request", "/metrics"}
    assert len([p for _, p, _, _ in seen if p == "/generate"]) == 4  # pooled, relayed, pass-through, left
    assert {(auth, key) for _, _, auth, key in seen} == {(f"Bearer {SGLANG_KEY}", None)}


def test_the_flag_and_its_environment_variable():
    from token_proxy.cli import parse_settings

    assert parse_settings(["--sglang-api-key", "k1"], {}).sglang_api_key == "k1"
    assert parse_settings([], {"TOKEN_PROXY_SGLANG_API_KEY": "k2"}).sglang_api_key == "k2"
    assert "k2" not in repr(parse_settings([], {"TOKEN_PROXY_SGLANG_API_KEY": "k2"}))


async def test_a_sessions_turns_carry_its_routing_key_to_sglang(aiohttp_server, tokenizer_dir, make_proxy):
    """issue 31: behind a router that routes by key (sglang-router's / SMG's consistent_hashing reads
    X-SMG-Routing-Key), a session's turns (X-Session-ID) reach one worker and keep its prefix cache."""
    seen: list[tuple[str, str | None]] = []

    @web.middleware
    async def record(request, handler):
        if request.path == "/generate":
            seen.append((request.method, request.headers.get("X-SMG-Routing-Key")))
        return await handler(request)

    app = create_sim_app(SimConfig(tokenizer_path=str(tokenizer_dir), enable_deterministic_inference=True,
                                   incremental_streaming_output=True))
    app.middlewares.insert(0, record)
    proxy = await make_proxy(await aiohttp_server(app))
    for stream in (False, True):
        for headers in ({"X-Session-ID": "rollout-7"}, {}):
            resp = await proxy.post("/v1/chat/completions", headers=headers, data=orjson.dumps(
                {"messages": USER, "max_tokens": 2, "stream": stream}))
            assert resp.status == 200
            await resp.read()
    assert seen == [("POST", "rollout-7"), ("POST", None), ("POST", "rollout-7"), ("POST", None)]


# Every credential header in common use (issue 41.5): none may reach SGLang through the pass-through, the only
# route that forwards a client's headers (an allow-list, sglang/headers.py). Cookie and Api-Key reached
# SGLang on d6350dc (only Authorization and X-API-Key were dropped).
CREDENTIALS = {"Authorization": f"Bearer {ADMIN_KEY}", "Proxy-Authorization": "Basic dXNlcjpwYXNz",
               "Cookie": "session=abc123", "Api-Key": "k1", "X-Api-Key": "k2", "X-Auth-Token": "t1",
               "X-Access-Token": "t2", "X-Amz-Security-Token": "t3", "X-Goog-Api-Key": "k3",
               "Ocp-Apim-Subscription-Key": "k4", "X-Csrf-Token": "c1", "X-Forwarded-Authorization": "Bearer f",
               "Authentication": "Bearer a", "X-Session-Token": "s1", "X-Amz-Date": "20261128T000000Z"}
KEPT = {"X-Request-Id": "req-41", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "X-Data-Parallel-Rank": "0", "X-Override-Priority": "1"}


@pytest.fixture
def header_sim(aiohttp_server, tokenizer_dir):
    async def factory():
        seen: list[tuple[str, dict]] = []

        @web.middleware
        async def record(request, handler):
            seen.append((request.path, {k.lower(): v for k, v in request.headers.items()}))
            return await handler(request)

        app = create_sim_app(SimConfig(tokenizer_path=str(tokenizer_dir)))
        app.middlewares.insert(0, record)
        return await aiohttp_server(app), seen

    return factory


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/generate", {"input_ids": [785, 3974], "sampling_params": {"max_new_tokens": 2}}),
    ("POST", "/generate", {"input_ids": [785, 3974], "sampling_params": {"max_new_tokens": 2}, "stream": True}),
    ("GET", "/health_generate", None),
    ("GET", "/ping", None),
])
async def test_no_credential_header_reaches_sglang_through_the_pass_through(header_sim, make_proxy, method, path,
                                                                            body):
    sim, seen = await header_sim()
    proxy = await make_proxy(sim)
    seen.clear()
    resp = await proxy.request(method, path, headers={**CREDENTIALS, **KEPT}, json=body)
    assert resp.status == 200
    await resp.read()
    upstream = [headers for p, headers in seen if p == path]
    assert len(upstream) == 1
    assert sorted(name for name in (h.lower() for h in CREDENTIALS) if name in upstream[0]) == []
    assert {k.lower(): v for k, v in KEPT.items()}.items() <= upstream[0].items()
