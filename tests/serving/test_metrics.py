"""The proxy's own /metrics: exact counter deltas and histogram counts after known traffic."""

from __future__ import annotations

import asyncio
import sys

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from token_proxy.admin import ADMIN
from token_proxy.ops import METRICS
from token_proxy.ops.metrics import UNMATCHED
from token_proxy.pipeline import stats_of
from token_proxy.simulator import SIM_STATE

CHAT = "/v1/chat/completions"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def parse(text: str) -> dict[tuple, float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def scrape(client) -> dict[tuple, float]:
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return parse(await resp.text())


def val(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: dict, after: dict, name: str, **labels) -> float:
    return val(after, name, **labels) - val(before, name, **labels)


async def until(predicate, timeout_s: float = 3.0):
    """Poll a coroutine-returning predicate until it is truthy (bounded)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = await predicate()
        if result or asyncio.get_running_loop().time() > deadline:
            return result
        await asyncio.sleep(0.02)


@pytest.fixture
def make_app_client(aiohttp_client, shared_tokenizer, tokenizer_dir):
    """A proxy whose app the test may extend before it starts (extra routes, metrics knobs)."""
    from token_proxy.app import create_app
    from token_proxy.settings import Settings
    from token_proxy.sglang.discovery import wait_until_connected

    async def factory(sim, routes=(), weight_routes=None, **overrides):
        url = str(sim.make_url("")).rstrip("/")
        app = create_app(Settings(backend_url=url, tokenizer=str(tokenizer_dir), backend_wait_s=5.0, **overrides))
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        if weight_routes is not None:
            app[METRICS].weight_update_routes = frozenset(weight_routes)
        client = await aiohttp_client(app)
        await wait_until_connected(client.app, 5.0)
        return client

    return factory


async def test_counters_and_histograms_after_known_traffic(proxy):
    before = await scrape(proxy)
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    for _ in range(2):  # the same prompt twice: one render, one prompt-cache hit
        resp = await proxy.post(CHAT, json={"messages": user("Count to three."), "max_tokens": 4,
                                            "ignore_eos": True})
        body = await resp.json()
        assert resp.status == 200, body
        for key in usage:
            usage[key] += body["usage"][key]
    resp = await proxy.post(CHAT, json={"messages": user("Name a colour."), "max_tokens": 6, "ignore_eos": True,
                                        "stream": True, "stream_options": {"include_usage": True}})
    assert resp.status == 200
    frames = [line[6:] for line in (await resp.text()).split("\n\n") if line.startswith("data: {")]
    stream_usage = orjson.loads(frames[-1])["usage"]
    for key in usage:
        usage[key] += stream_usage[key]
    bad = await proxy.post(CHAT, data=b"{not json", headers={"Content-Type": "application/json"})
    assert bad.status == 400
    assert (await proxy.get("/nope")).status == 404
    after = await scrape(proxy)

    requests = "token_proxy_requests_total"
    assert delta(before, after, requests, endpoint=CHAT, status="200", stream="false") == 2
    assert delta(before, after, requests, endpoint=CHAT, status="200", stream="true") == 1
    assert delta(before, after, requests, endpoint=CHAT, status="400", stream="false") == 1
    not_found = {dict(labels)["endpoint"]: after[(name, labels)] - before.get((name, labels), 0.0)
                 for name, labels in after if name == requests and dict(labels)["status"] == "404"}
    assert sum(not_found.values()) == 1 and "/nope" not in not_found  # "unmatched" or the pass-through route
    latency = "token_proxy_request_duration_seconds"
    assert delta(before, after, latency + "_count", endpoint=CHAT, stream="false") == 3  # 2 OK + the 400
    assert delta(before, after, latency + "_count", endpoint=CHAT, stream="true") == 1
    assert val(after, latency + "_bucket", endpoint=CHAT, stream="true", le="+Inf") == 1
    assert val(after, latency + "_bucket", endpoint=CHAT, stream="true", le="1200.0") == 1
    ttft = "token_proxy_time_to_first_token_seconds_count"
    assert delta(before, after, ttft, endpoint=CHAT, stream="false") == 2  # not the 400: no output
    assert delta(before, after, ttft, endpoint=CHAT, stream="true") == 1
    assert delta(before, after, "token_proxy_time_per_output_token_seconds_count", endpoint=CHAT,
                 stream="true") == 1
    assert delta(before, after, "token_proxy_prompt_tokens_total", endpoint=CHAT) == usage["prompt_tokens"]
    assert delta(before, after, "token_proxy_completion_tokens_total", endpoint=CHAT) == usage["completion_tokens"]
    assert usage["completion_tokens"] == 4 + 4 + 6
    assert delta(before, after, "token_proxy_prompt_cache_lookups_total", result="miss") == 2
    assert delta(before, after, "token_proxy_prompt_cache_lookups_total", result="hit") == 1
    assert delta(before, after, "token_proxy_render_duration_seconds_count") == 2
    assert val(after, "token_proxy_requests_in_flight", endpoint=CHAT) == 0
    assert val(after, "token_proxy_weight_version_info", weight_version="default") == 1


async def test_endpoint_label_is_the_route_never_the_raw_path(proxy):
    for path in ("/nope/1", "/nope/2", "/v1/nope?x=1"):
        await proxy.get(path)
    await proxy.post("/tokenize", json={"prompt": "hi"})
    samples = await scrape(proxy)
    canonical = {resource.canonical for resource in proxy.app.router.resources()} | {UNMATCHED}
    endpoints = {dict(labels)["endpoint"] for name, labels in samples if name == "token_proxy_requests_total"}
    assert "/tokenize" in endpoints
    assert endpoints <= canonical
    assert not any("nope" in endpoint for endpoint in endpoints)


async def test_sglang_failures_count_by_kind(make_sim, make_proxy):
    sim = await make_sim(ttft_s=5.0)
    proxy = await make_proxy(sim, request_timeout_s=0.2)
    before = await scrape(proxy)
    assert (await proxy.post(CHAT, json={"messages": user("hi"), "max_tokens": 2})).status == 504
    sim.app[SIM_STATE].crashed = True
    unavailable = await proxy.post(CHAT, json={"messages": user("hi"), "max_tokens": 2})
    assert (unavailable.status, unavailable.headers.get("Retry-After")) == (503, "1")  # retrying helps
    after = await scrape(proxy)
    assert delta(before, after, "token_proxy_overload_rejections_total", endpoint=CHAT) == 0
    errors = "token_proxy_backend_errors_total"
    assert delta(before, after, errors, endpoint=CHAT, kind="timeout") == 1
    assert delta(before, after, errors, endpoint=CHAT, kind="unavailable") == 1
    assert delta(before, after, "token_proxy_requests_total", endpoint=CHAT, status="504", stream="false") == 1


async def test_the_proxys_own_503_with_retry_after_is_not_an_sglang_error(sim, make_app_client):
    async def refuse(request: web.Request) -> web.Response:  # as admission refuses: marked on the stats
        stats_of(request).overloaded = True
        return web.json_response({"error": {}}, status=503, headers={"Retry-After": "1"})

    proxy = await make_app_client(sim, routes=[("POST", "/test/refuse", refuse)])
    before = await scrape(proxy)
    assert (await proxy.post("/test/refuse")).status == 503
    after = await scrape(proxy)
    assert delta(before, after, "token_proxy_overload_rejections_total", endpoint="/test/refuse") == 1
    assert delta(before, after, "token_proxy_backend_errors_total", endpoint="/test/refuse", kind="unavailable") == 0


async def test_client_disconnect_is_a_499_and_counted(make_sim, make_proxy):
    sim = await make_sim(tpot_s=0.05)
    proxy = await make_proxy(sim)
    url = proxy.make_url("/metrics")
    body = {"messages": user("hi"), "max_tokens": 200, "ignore_eos": True, "stream": True}
    resp = await proxy.post(CHAT, json=body)
    await resp.content.readany()
    resp.close()
    await proxy.session.close()

    async with aiohttp.ClientSession() as session:
        async def counted():
            async with session.get(url) as metrics:
                samples = parse(await metrics.text())
            return samples if val(samples, "token_proxy_client_disconnects_total", endpoint=CHAT) else None

        samples = await until(counted)
    assert samples, "the disconnect was never counted"
    assert val(samples, "token_proxy_requests_total", endpoint=CHAT, status="499", stream="true") == 1
    assert val(samples, "token_proxy_requests_in_flight", endpoint=CHAT) == 0


async def test_weight_updates_count_time_and_follow_the_version(sim, make_app_client):
    state = sim.app[SIM_STATE]

    async def fake_update(request: web.Request) -> web.Response:  # admin routes are another module's
        body = await request.json()
        if not body["ok"]:
            return web.json_response({"success": False, "message": "bad path"}, status=400)
        state.weight_version = body["version"]
        request.app[ADMIN].record_version(None)  # as every admin route that updates weights does
        return web.json_response({"success": True, "message": ""})

    # The fake route changes versions behind the admin plane's back: its fence and stale-reply check
    # (fleet/fence.py) would undo and refuse them; both off here.
    proxy = await make_app_client(sim, routes=[("POST", "/test/update_weights", fake_update)],
                                  weight_routes={"/test/update_weights"}, fence_interval_s=0, stale_reply_tries=0)
    before = await scrape(proxy)
    assert (await proxy.post("/test/update_weights", json={"ok": False})).status == 400
    assert (await proxy.post("/test/update_weights", json={"ok": True, "version": "7"})).status == 200

    async def refreshed():
        samples = await scrape(proxy)
        return samples if val(samples, "token_proxy_weight_version") == 7 else None

    after = await until(refreshed)
    assert after, "the weight version was not refreshed from /model_info"
    updates = "token_proxy_weight_updates_total"
    assert delta(before, after, updates, endpoint="/test/update_weights", result="success") == 1
    assert delta(before, after, updates, endpoint="/test/update_weights", result="failure") == 1
    assert delta(before, after, "token_proxy_weight_update_duration_seconds_count",
                 endpoint="/test/update_weights") == 2
    assert val(after, "token_proxy_weight_version_info", weight_version="7") == 1
    assert val(after, "token_proxy_weight_version_info", weight_version="default") == 0  # one series only
    assert val(after, "token_proxy_last_weight_update_timestamp_seconds") > 0

    state.weight_version = "8"  # a version seen in a reply is taken up as well
    assert (await proxy.post(CHAT, json={"messages": user("hi"), "max_tokens": 1})).status == 200
    assert val(await scrape(proxy), "token_proxy_weight_version") == 8


async def test_middleware_costs_microseconds(proxy):
    """A budget, not a benchmark: the middleware's own work stays far below a millisecond."""
    import time

    from token_proxy.pipeline import RequestStats

    metrics = proxy.app[METRICS]
    stats = RequestStats(endpoint=CHAT, stream=True, prompt_tokens=10, completion_tokens=20, prompt_cache_hit=True,
                         first_token_at=time.perf_counter(), finished_at=time.perf_counter() + 0.1)
    metrics.observe(CHAT, 200, stats, 0.1)
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        metrics.observe(CHAT, 200, stats, 0.1)
    per_call = (time.perf_counter() - start) / n
    assert per_call < 200e-6, per_call


async def test_real_weight_update_route_through_the_proxy(sim, proxy):
    """End to end through the admin forwarder to the simulator."""
    model_path = sim.app[SIM_STATE].config.model_path
    before = await scrape(proxy)
    ok = await proxy.post("/update_weights_from_disk", json={"model_path": model_path, "weight_version": "42"})
    assert ok.status == 200, await ok.text()
    bad = await proxy.post("/update_weights_from_disk", json={"model_path": "no/such/weights"})
    assert bad.status >= 400

    async def refreshed():
        samples = await scrape(proxy)
        return samples if val(samples, "token_proxy_weight_version") == 42 else None

    after = await until(refreshed)
    assert after, "the weight version did not follow the update"
    updates = "token_proxy_weight_updates_total"
    assert delta(before, after, updates, endpoint="/update_weights_from_disk", result="success") == 1
    assert delta(before, after, updates, endpoint="/update_weights_from_disk", result="failure") == 1


async def test_a_stream_that_fails_after_its_200_counts_as_a_backend_error(make_sim, make_proxy):
    sim = await make_sim(tpot_s=3.0)
    proxy = await make_proxy(sim, stream_idle_timeout_s=0.2)
    resp = await proxy.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 20, "ignore_eos": True, "stream": True})
    assert resp.status == 200 and b'"code":504' in await resp.read()
    text = await (await proxy.get("/metrics")).text()
    assert 'token_proxy_backend_errors_total{endpoint="/v1/chat/completions",kind="timeout"} 1.0' in text


async def test_labelled_counters_start_at_zero(proxy):
    """Every known label combination exists before its first event, so rate() sees the first one."""
    samples = await scrape(proxy)
    for endpoint in ("/update_weights", "/update_weights_from_disk", "/reload_weights"):
        for result in ("success", "failure"):
            key = ("token_proxy_weight_updates_total", frozenset({"endpoint": endpoint, "result": result}.items()))
            assert samples[key] == 0.0, key
    for kind in ("error", "unavailable", "timeout"):
        key = ("token_proxy_backend_errors_total", frozenset({"endpoint": CHAT, "kind": kind}.items()))
        assert samples[key] == 0.0
    key = ("token_proxy_requests_total", frozenset({"endpoint": "/inference/v1/generate", "status": "200",
                                                     "stream": "false"}.items()))
    assert samples[key] == 0.0
    assert samples[("token_proxy_prompt_cache_lookups_total", frozenset({"result": "hit"}.items()))] == 0.0


async def test_standard_process_and_python_collector_names(proxy):
    names = {name for name, _ in await scrape(proxy)}
    assert "python_info" in names and "python_gc_objects_collected_total" in names
    if sys.platform == "linux":
        assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds"} <= names
    assert not any(name.startswith("token_proxy_process_") for name in names)


async def test_weight_version_is_read_again_when_sglang_comes_back(make_sim, make_proxy):
    """SGLang restarts with other weights: the gauge follows without waiting for a request."""
    sim = await make_sim(weight_version="a")
    state = sim.app[SIM_STATE]
    proxy = await make_proxy(sim, backend_metrics_interval_s=0.02, backend_metrics_stale_s=0.25)

    async def version_is(version):
        samples = await scrape(proxy)
        return val(samples, "token_proxy_weight_version_info", weight_version=version) == 1

    assert await until(lambda: version_is("a"))
    state.crashed = True  # every route answers 503: the scrape fails
    assert await until(lambda: _scrape_down(proxy))
    state.weight_version, state.crashed = "b", False
    assert await until(lambda: version_is("b"))


async def _scrape_down(proxy) -> bool:
    return val(await scrape(proxy), "token_proxy_backend_metrics_up") == 0


async def test_the_proxys_histograms_are_at_zero_from_start_up(proxy):
    """issue 39: the token_proxy_* histograms appeared only at their first observation, so rate() missed the first
    weight update. Labelless ones and those of the table's inference and weight routes exist at 0 from start-up;
    a probe's or a 404's appear on first use (tests/serving/test_metrics_series.py)."""
    samples = await scrape(proxy)

    def count(name: str, **labels) -> float:
        return samples[(name + "_count", frozenset(labels.items()))]

    for endpoint in ("/update_weights", "/update_weights_from_disk", "/reload_weights"):
        assert count("token_proxy_weight_update_duration_seconds", endpoint=endpoint) == 0.0, endpoint
    for endpoint in (CHAT, "/v1/completions", "/inference/v1/generate"):
        for stream in ("false", "true"):
            assert count("token_proxy_request_duration_seconds", endpoint=endpoint, stream=stream) == 0.0
            assert count("token_proxy_time_to_first_token_seconds", endpoint=endpoint, stream=stream) == 0.0
        assert count("token_proxy_time_per_output_token_seconds", endpoint=endpoint, stream="true") == 0.0
    assert count("token_proxy_render_duration_seconds") == 0.0
    assert ("token_proxy_time_to_first_token_seconds_count",
            frozenset({"endpoint": "/health", "stream": "false"}.items())) not in samples
