"""/health under --workers N is the readiness probe: 200 only when every route can be served, the admin owner
(which serves the admin routes and native /generate's pass-through) connected too (issue 41.6). On d6350dc a
data-plane process answered 200 while the owner still said "not connected to SGLang yet" (for up to 0.6 s)."""

from __future__ import annotations

import warnings

import aiohttp
from aiohttp import web

from token_proxy.routes import OWNER_NOT_READY
from token_proxy.serving.control import owner_ready
from token_proxy.serving.process_app import OwnerReadiness
from token_proxy.state import CONTEXT


async def fake_owner(tmp_path):
    """An owner's control socket whose /_internal/ready says what `answers` holds, in turn."""
    answers = [(503, {"ready": False, "reason": "not connected to SGLang at http://sglang yet"}),
               (200, {"ready": True, "reason": None})]
    calls = []

    async def ready(request):
        status, body = answers[min(len(calls), len(answers) - 1)]
        calls.append(status)
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_get("/_internal/ready", ready)
    runner = web.AppRunner(app)
    await runner.setup()
    path = str(tmp_path / "owner.sock")
    await web.UnixSite(runner, path).start()
    return runner, path, calls


async def test_a_workers_readiness_waits_for_the_owner_then_asks_no_more(tmp_path):
    runner, path, calls = await fake_owner(tmp_path)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as session:
            readiness = OwnerReadiness(session)
            assert await readiness() == ("the proxy's admin process is not ready: not connected to SGLang at "
                                         "http://sglang yet")
            assert await readiness() is None
            assert await readiness() is None
            assert calls == [503, 200]  # once ready, /health asks the owner no more
    finally:
        await runner.cleanup()
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(tmp_path / "gone.sock"))) as session:
        assert (await OwnerReadiness(session)()).startswith("the proxy's admin process does not answer yet (")


async def test_health_is_503_while_the_owner_is_not_ready(make_proxy, sim):
    proxy = await make_proxy(sim)
    assert (await proxy.get("/health")).status == 200
    reasons = ["the proxy's admin process is not ready: not connected to SGLang at http://x yet", None]

    async def owner_not_ready():
        return reasons.pop(0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # set after start-up, as a worker's cleanup ctx does
        proxy.app[OWNER_NOT_READY] = owner_not_ready
    response = await proxy.get("/health")
    body = await response.json()
    assert response.status == 503 and body["error"]["message"] == (
        "the proxy's admin process is not ready: not connected to SGLang at http://x yet")
    assert (await proxy.get("/health")).status == 200


async def test_the_owners_ready_route_says_whether_it_is_connected(make_proxy, sim):
    proxy = await make_proxy(sim)

    class Request:
        app = proxy.app

    reply = await owner_ready(Request())
    assert reply.status == 200 and reply.body == b'{"ready":true,"reason":null}'
    assert proxy.app[CONTEXT].not_ready_reason is None
