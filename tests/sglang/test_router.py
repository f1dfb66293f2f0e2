"""A real sglang-router (Rust, on CPU) in front of two simulators, and the proxy in front of the
router: data through the router, admin calls fanned out to the workers the router lists."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import aiohttp
import pytest

from tests.support.admin_fixtures import free_port, stop_process, until
from token_proxy.admin import ADMIN
from token_proxy.ops import METRICS
from token_proxy.simulator import SIM_STATE
from token_proxy.simulator.metrics import set_sglang_metrics
from token_proxy.simulator.testing import stream_events
from token_proxy.state import CONTEXT

pytest.importorskip("sglang_router")

USER = [{"role": "user", "content": "hi"}]


async def wait_for_workers(url: str, count: int, process: subprocess.Popen, deadline_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    async with aiohttp.ClientSession() as session:
        while loop.time() < end:
            assert process.poll() is None, "sglang-router exited"
            try:
                async with session.get(f"{url}/workers", timeout=aiohttp.ClientTimeout(total=2)) as response:
                    if response.status == 200:
                        workers = (await response.json())["workers"]
                        if sum(w.get("is_healthy", False) for w in workers) == count:
                            return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.2)
    raise AssertionError(f"sglang-router at {url} never listed {count} healthy workers")


async def metrics_line(proxy, line: str) -> bool:
    return line in (await (await proxy.get("/metrics")).text()).splitlines()


async def until_async(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition never became true")


@pytest.fixture
async def make_router(make_sim, tokenizer_dir):
    """`url, sims, urls = await make_router(*overrides)`: one simulator per SimConfig overrides dict,
    the real sglang-router (round robin) in front of them."""
    processes = []

    async def factory(*overrides: dict):
        sims = [await make_sim(**o) for o in overrides]
        urls = [str(s.make_url("")).rstrip("/") for s in sims]
        port = free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *urls, "--policy", "round_robin", "--tokenizer-path", str(tokenizer_dir),
               "--log-level", "warn", "--prometheus-port", str(free_port())]  # not 29000: routers run side by side
        process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # noqa: ASYNC220
        processes.append(process)
        await wait_for_workers(f"http://127.0.0.1:{port}", len(sims), process)
        return f"http://127.0.0.1:{port}", sims, urls

    yield factory
    for process in processes:
        stop_process(process)


@pytest.fixture
async def router(make_router):
    return await make_router({}, {})


async def test_admin_calls_reach_every_worker_behind_the_router(router, make_proxy, tmp_path):
    url, sims, urls = router
    proxy = await make_proxy(url, context_length=4096)
    assert sorted(await proxy.app[ADMIN].worker_urls()) == sorted(urls)
    assert proxy.app[ADMIN].workers.behind_router is True

    assert await (await proxy.post("/pause")).json() == {"status": "paused"}
    assert [s.app[SIM_STATE].pause_mode for s in sims] == ["retract", "retract"]
    step = tmp_path / "step_2"
    step.mkdir()
    (step / "model.safetensors").write_bytes(b"\0")
    response = await proxy.post("/update_weights", json={"weight_dir": str(step)})
    assert (response.status, await response.json()) == (200, {"status": "ok", "weight_version": "2"})
    assert [s.app[SIM_STATE].weight_version for s in sims] == ["2", "2"]
    # the gauge reads the version back from a worker (the router serves no /model_info)
    await until_async(lambda: metrics_line(proxy, 'token_proxy_weight_version_info{weight_version="2"} 1.0'))
    assert await (await proxy.post("/resume")).json() == {"status": "resumed"}
    assert [s.app[SIM_STATE].paused for s in sims] == [False, False]

    replies = [await proxy.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
               for _ in range(4)]
    choices = [(await r.json())["choices"][0] for r in replies]
    assert [c["weight_versions"] for c in choices] == [[{"version": "2", "start": 0, "end": 2}]] * 4
    assert all(len(s.app[SIM_STATE].received) == 2 for s in sims)  # round robin over both workers
    liveness = await proxy.get("/liveness")
    assert (liveness.status, await liveness.json()) == (200, {"status": "ok"})


# SGLang 0.5.17 with --incremental-streaming-output, as the fleet of issue 28 ran it.
WORKER_0517 = {"sglang_version": "0.5.17", "incremental_streaming_output": True}
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
ENDPOINTS = {  # endpoint -> (path, body)
    "chat": ("/v1/chat/completions", {"messages": USER, "return_token_ids": True, **GREEDY}),
    "completions": ("/v1/completions", {"prompt": "Say something.", "return_token_ids": True, **GREEDY}),
    "generate": ("/inference/v1/generate",
                 {"token_ids": [9707, 11, 1879], "sampling_params": {"temperature": 0, "max_tokens": 12,
                                                                      "ignore_eos": True}}),
}


async def completion_ids(proxy, endpoint: str, stream: bool) -> list[int]:
    path, body = ENDPOINTS[endpoint]
    response = await proxy.post(path, json={**body, **({"stream": True} if stream else {})})
    assert response.status == 200, await response.text()
    if not stream:
        return (await response.json())["choices"][0]["token_ids"]
    events = stream_events(await response.read())
    return [i for event in events for choice in event.get("choices", []) for i in choice.get("token_ids") or []]


async def test_streams_through_the_router_are_whole_on_every_endpoint(make_router, make_proxy, caplog):
    caplog.set_level(logging.INFO, logger="token_proxy.sglang.discovery")
    url, _, urls = await make_router(WORKER_0517, WORKER_0517)
    proxy = await make_proxy(url, context_length=4096)  # as issue 28 ran it (main learnt none from the router)
    for endpoint in ENDPOINTS:
        whole = [await completion_ids(proxy, endpoint, False) for _ in range(2)]
        streamed = [await completion_ids(proxy, endpoint, True) for _ in range(2)]
        assert len(whole[0]) == 12, endpoint
        assert whole == streamed == [whole[0]] * 2, endpoint  # both workers, streamed or not: the same 12 ids
    picture = proxy.app[CONTEXT].picture
    assert sorted(picture.workers) == sorted(urls)
    assert [(w.api.version, w.incremental_stream, w.metrics_enabled, w.max_model_len)
            for w in picture.workers.values()] == [("0.5.17", True, True, 4096)] * 2
    agreed = picture.agreed
    assert (agreed.api.version, agreed.incremental_stream, agreed.max_model_len) == ("0.5.17", True, 4096)
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "cumulatively" in m or "treated as" in m]
    assert any("SGLang 0.5.17" in m and "2 workers behind" in m for m in messages), messages


async def test_the_scrape_reads_the_workers_metrics_not_the_routers(make_router, make_proxy, caplog):
    caplog.set_level(logging.INFO, logger="token_proxy.ops.backend_scrape")
    url, sims, _ = await make_router(WORKER_0517, WORKER_0517)
    set_sglang_metrics(sims[0].app[SIM_STATE], num_running_reqs=3)
    set_sglang_metrics(sims[1].app[SIM_STATE], num_running_reqs=4)
    proxy = await make_proxy(url, backend_metrics_interval_s=0.05)
    await until(lambda: proxy.app[METRICS].backend.up)
    text = await (await proxy.get("/metrics")).text()
    assert 'vllm:num_requests_running{engine="0",model_name="sim/qwen2-tiny"} 7.0' in text
    assert not [r for r in caplog.records if "enable-metrics" in r.getMessage()]


@pytest.mark.parametrize(("differs", "fact", "level"), [
    ({"sglang_version": "0.5.23"}, "version", logging.ERROR),
    ({"context_length": 2048}, "context length", logging.INFO),
    ({"enable_deterministic_inference": False}, "seed honouring", logging.WARNING),
])
async def test_a_worker_that_differs_is_named(make_router, make_proxy, caplog, differs, fact, level):
    caplog.set_level(logging.INFO, logger="token_proxy.sglang.discovery")
    url, _, urls = await make_router(WORKER_0517, {**WORKER_0517, **differs}, WORKER_0517)
    proxy = await make_proxy(url)
    named = [r for r in caplog.records if "differs" in r.getMessage()]
    assert [(r.levelno, r.getMessage().startswith(f"SGLang worker {urls[1]} differs in {fact}: ")) for r in named] == [
        (level, True)]
    agreed = proxy.app[CONTEXT].picture.agreed
    assert (agreed.api.version, agreed.max_model_len, agreed.honours_seed) == {
        "version": ("0.5.17", 4096, True),  # the oldest release's behaviour
        "context length": ("0.5.17", 2048, True),  # the smallest: every worker can take it
        "seed honouring": ("0.5.17", 4096, False),  # honoured only where every worker honours it
    }[fact]
    ids = [await completion_ids(proxy, "chat", stream) for stream in (False, True, True)]
    assert ids == [ids[0]] * 3 and len(ids[0]) == 12


async def test_workers_that_disagree_on_the_stream_mode_are_a_configuration_error(make_router, make_proxy, caplog):
    """The router picks the worker and the proxy cannot tell which answered: read in the wrong mode a
    stream is cut or repeated, so the proxy refuses to serve and names the worker and the fix."""
    caplog.set_level(logging.INFO, logger="token_proxy.sglang.discovery")
    url, _, urls = await make_router(WORKER_0517, {**WORKER_0517, "incremental_streaming_output": False},
                                     WORKER_0517)
    proxy = await make_proxy(url)
    named = [r for r in caplog.records if "differs" in r.getMessage()]
    assert [r.levelno for r in named] == [logging.ERROR]
    where = named[0].getMessage().split(" has ")[0].rsplit(" ", 1)[1]
    assert where in (urls[0], urls[2])
    assert named[0].getMessage() == (
        f"SGLang worker {urls[1]} differs in stream mode: 'cumulative', where {where} has 'incremental'; no "
        "stream through the router can be read right: restart it with --incremental-streaming-output, like "
        "the others")
    response = await proxy.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
    assert response.status == 503
    assert (await response.json())["error"]["message"] == f"The proxy cannot serve: {named[0].getMessage()}"
