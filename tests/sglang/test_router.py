"""A real sglang-router (Rust, on CPU) in front of two simulators, and the proxy in front of the
router: data through the router, admin calls fanned out to the workers the router lists."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import pytest

from tests.support.admin_fixtures import free_port, stop_process
from token_proxy.admin.workers import ADMIN
from token_proxy.simulator import SIM_STATE

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


@pytest.fixture
async def router(make_sim, tokenizer_dir):
    sims = [await make_sim(), await make_sim()]
    urls = [str(s.make_url("")).rstrip("/") for s in sims]
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *urls, "--policy", "round_robin", "--tokenizer-path", str(tokenizer_dir),
           "--log-level", "warn"]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # noqa: ASYNC220
    try:
        await wait_for_workers(f"http://127.0.0.1:{port}", 2, process)
        yield f"http://127.0.0.1:{port}", sims, urls
    finally:
        stop_process(process)


async def test_admin_calls_reach_every_worker_behind_the_router(router, make_proxy, tmp_path):
    url, sims, urls = router
    proxy = await make_proxy(url, context_length=4096)
    assert sorted(await proxy.app[ADMIN].worker_urls()) == sorted(urls)
    assert proxy.app[ADMIN].behind_router is True

    assert await (await proxy.post("/pause")).json() == {"status": "paused"}
    assert [s.app[SIM_STATE].pause_mode for s in sims] == ["retract", "retract"]
    step = tmp_path / "step_2"
    step.mkdir()
    (step / "model.safetensors").write_bytes(b"\0")
    response = await proxy.post("/update_weights", json={"weight_dir": str(step)})
    assert (response.status, await response.json()) == (200, {"status": "ok", "weight_version": "2"})
    assert [s.app[SIM_STATE].weight_version for s in sims] == ["2", "2"]
    assert await (await proxy.post("/resume")).json() == {"status": "resumed"}
    assert [s.app[SIM_STATE].paused for s in sims] == [False, False]

    replies = [await proxy.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
               for _ in range(4)]
    choices = [(await r.json())["choices"][0] for r in replies]
    assert [c["weight_versions"] for c in choices] == [[{"version": "2", "start": 0, "end": 2}]] * 4
    assert all(len(s.app[SIM_STATE].received) == 2 for s in sims)  # round robin over both workers
    liveness = await proxy.get("/liveness")
    assert (liveness.status, await liveness.json()) == (200, {"status": "ok"})
