"""Issue 37, finding 3: under load, a disk transaction crashed SGLang 0.5.17 (a worker left producing nothing).
A request that reaches a paused worker after the proxy read its load (0 pending) is pending when the
update's own cache flush runs, and 0.5.17's scheduler dies on that assert. The fleet round's findings-2-3
phase hit it on the simulator; here the load read is made to miss the request, deterministically."""

from __future__ import annotations

import asyncio

from tests.admin.test_fleet import state, url_of, weights_dir
from tests.support.admin_fixtures import until
from token_proxy.fleet import ADMIN, flush

CHAT = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 8, "ignore_eos": True}


async def test_a_request_reaching_a_paused_worker_after_its_load_was_read_cannot_crash_it(
        make_sim, make_proxy, tmp_path, monkeypatch):
    sims = [await make_sim(tpot_s=0.001) for _ in range(2)]
    proxy = await make_proxy(sims[0], workers=tuple(url_of(s) for s in sims), admin_timeout_s=5.0,
                             weight_update_timeout_s=5.0)
    monkeypatch.setattr(flush, "pending", lambda reply: 0)  # the read came before the request
    assert (await proxy.post("/pause", json={"mode": "retract"})).status == 200
    chat = asyncio.create_task(proxy.post("/v1/chat/completions", json=CHAT))  # queues on the paused worker
    await until(lambda: bool(state(sims[0]).running), timeout=5)
    response = await proxy.post("/update_weights", json={"weight_dir": weights_dir(tmp_path, "step_1")})
    assert (response.status, await response.json()) == (200, {"status": "ok", "weight_version": "1"})
    assert not any(state(s).crashed for s in sims)
    assert proxy.app[ADMIN].owed_flushes == {url_of(sims[0])}  # its flush waits for /resume
    assert (await proxy.post("/resume")).status == 200
    reply = await asyncio.wait_for(chat, 10)
    assert reply.status == 200
    assert {v["version"] for v in (await reply.json())["choices"][0]["weight_versions"]} == {"1"}
    await until(lambda: not proxy.app[ADMIN].owed_flushes, timeout=10)
